"""Where the measurements run: the JAX multi-process runtime, the local device, the catalog chip it is, and
the versions and driver to record beside every number (STYLE.md §10, results carry provenance).

`init_distributed` must run before anything else touches JAX's backends: it calls
`jax.distributed.initialize` from flags, or from the usual environment of a Slurm job, a TPU pod, an MPI
launch or `JAX_COORDINATOR_ADDRESS`/`JAX_NUM_PROCESSES`/`JAX_PROCESS_ID`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from meshplan.errors import MeshplanError
from meshplan.specs.hardware import preset_chips

# device_kind substring(s) → catalog chip, most specific first (jax.Device.device_kind strings).
DEVICE_KIND_CHIPS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("gb300",), "gb300-nvl72"),
    (("b300",), "b300"),
    (("gb200",), "gb200-nvl72"),
    (("b200",), "b200"),
    (("gh200", "144"), "gh200"),  # the catalog's GH200 is the 144 GB HBM3e part
    (("gh200",), ""),  # the 96 GB HBM3 GH200: not in the catalog
    (("h200",), "h200"),
    (("h800",), "h800"),
    (("h100", "96gb"), "h100-sxm-96gb"),
    (("h100", "pcie"), "h100-pcie"),
    (("h100", "nvl"), ""),  # no H100 NVL (94 GB) in the catalog: needs --hardware
    (("l40s",), "l40s"),
    (("mi325x",), "mi325x"),
    (("mi300x",), "mi300x"),
    (("h100",), "h100-sxm"),
    (("a100", "80gb"), "a100-80gb"),
    (("a100",), "a100-40gb"),
    (("v100",), "v100-32gb"),
    (("tpu v6 lite",), "tpu-v6e"),
    (("tpu v6e",), "tpu-v6e"),
    (("tpu v5 lite",), "tpu-v5e"),
    (("tpu v5e",), "tpu-v5e"),
    (("tpu v5p",), "tpu-v5p"),
    (("tpu v5",), "tpu-v5p"),
    (("tpu v4",), "tpu-v4"),
)


def chip_for_device_kind(kind: str) -> str | None:
    """The catalog chip name for a JAX device_kind, or None when the catalog has no such chip."""
    low = kind.lower()
    for parts, chip in DEVICE_KIND_CHIPS:
        if all(p in low for p in parts):
            return chip or None
    return None


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    return int(v) if v and v.strip().isdigit() else None


def cluster_env_detected() -> bool:
    """A launcher that runs one process per host/GPU set the environment (JAX can read it)."""
    env = os.environ
    if (_env_int("SLURM_NTASKS") or 1) > 1 and "SLURM_JOB_ID" in env:
        return True
    if (_env_int("OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return True
    return "," in env.get("TPU_WORKER_HOSTNAMES", "") or "MEGASCALE_COORDINATOR_ADDRESS" in env


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> bool:
    """Start JAX's multi-process runtime when flags or the environment ask for it; True if started."""
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num_processes = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
    if coordinator is None and not cluster_env_detected():
        if num_processes not in (None, 1) or process_id not in (None, 0):
            raise MeshplanError("--num-processes/--process-id need --coordinator HOST:PORT")
        return False
    import jax

    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id)
    except (ValueError, RuntimeError) as exc:
        raise MeshplanError(f"jax.distributed.initialize failed: {str(exc).splitlines()[0]}") from None
    return True


def local_device_summary() -> dict[str, Any]:
    """Platform, device kind and counts of the JAX runtime (all processes)."""
    import jax

    dev = jax.local_devices()[0]
    return {"platform": dev.platform, "device_kind": dev.device_kind, "local_devices": jax.local_device_count(),
            "devices": jax.device_count(), "processes": jax.process_count(), "process_index": jax.process_index()}


def resolve_chip_name(hardware: str | None, device_kind: str, platform_name: str) -> str:
    """The chip to label the measurements with: --hardware if given, else the device kind's catalog chip.
    On the CPU, --hardware is required: CPU numbers must never pass as a GPU or TPU profile by default."""
    if hardware:
        return hardware
    if platform_name == "cpu":
        raise MeshplanError(
            "no accelerator found (JAX sees only the CPU): CPU numbers say nothing about GPUs or TPUs; give "
            "--hardware H explicitly to write a CPU-only profile labelled for chip H (e.g. for CI)")
    chip = chip_for_device_kind(device_kind)
    if chip is None:
        raise MeshplanError(f"device kind '{device_kind}' is not in meshplan's catalog; give --hardware "
                            f"(presets: {', '.join(preset_chips())}) or a hardware YAML")
    return chip


def nvidia_driver() -> str | None:
    """The NVIDIA driver version from nvidia-smi, when present."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def versions() -> dict[str, Any]:
    """jax, jaxlib, meshplan, Python, the host, the driver, and when (UTC)."""
    import jax
    import jax.extend.backend
    import jaxlib

    from meshplan import __version__ as meshplan_version

    backend = jax.extend.backend.get_backend()
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "meshplan": meshplan_version,
            "python": platform.python_version(), "host": platform.node(),
            "platform_version": getattr(backend, "platform_version", None),
            "nvidia_driver": nvidia_driver()}


def now_utc() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send file descriptor 1 to stderr for the duration: native libraries (Gloo, NCCL, XLA) print status
    lines on stdout, which would corrupt `--json` output."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
