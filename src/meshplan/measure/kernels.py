"""Where a measured step's device time goes, by the ledger's kinds of work: one step run under JAX's profiler
(`jax.profiler.trace`), its device plane read back with `jax.profiler.ProfileData` (no TensorBoard needed), each
kernel's time attributed to the HLO instruction that launched it, and the instructions sorted by what they are in
the compiled module (`hlo.parse_module`):

  gemm        cuBLAS GEMM custom calls and Triton GEMM fusions (the ledger's matmul FLOPs)
  attention   cuDNN fused attention custom calls (the ledger's attention core)
  collective  all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute (and their async halves)
  copy        copies, dynamic-slice / dynamic-update-slice outside a fusion, transposes (data movement alone)
  pointwise   every other fusion (norms, activations, the optimizer update, the loss: the ledger's HBM bytes)
  other       what the module does not name (runtime kernels, memsets)

On a backend whose profile has no device plane (the CPU) the breakdown is empty: the step's time is all host time.
"""

from __future__ import annotations

import glob
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshplan.measure.hlo import COLLECTIVES, Instr, is_gemm_call, parse_module

KINDS = ("gemm", "attention", "collective", "copy", "pointwise", "other")
# instructions whose kernels belong to what they call (their own event would count the callees twice)
CONTAINERS = {"while", "call", "conditional", "tuple", "get-tuple-element", "parameter", "constant", "bitcast"}
COPIES = {"copy", "copy-start", "copy-done", "dynamic-slice", "dynamic-update-slice", "transpose", "slice",
          "concatenate", "pad"}


def op_kind(ins: Instr | None) -> str | None:
    """The ledger's kind of one HLO instruction (module docstring); None for a container."""
    if ins is None:
        return "other"
    if ins.op in CONTAINERS:
        return None
    base = ins.op.removesuffix("-start").removesuffix("-done")
    if base in COLLECTIVES:
        return "collective"
    if is_gemm_call(ins):
        return "gemm"
    if ins.op == "custom-call":
        return "attention" if "__cudnn$fmha" in ins.rest or "__cudnn$flash" in ins.rest else "other"
    if ins.op == "fusion":
        gemm = re.search(r'"kind":"__triton(_nested)?_gemm', ins.rest) or re.search(r"calls=%gemm_fusion", ins.rest)
        return "gemm" if gemm else "pointwise"
    if ins.op in COPIES:
        return "copy"
    if ins.op in ("dot", "convolution"):
        return "gemm"
    return "pointwise"


_HLO_OP = re.compile(r"hlo_op=([\w.\-]+)")


def _event_op(stats: dict[str, Any]) -> str | None:
    """The HLO instruction of one kernel event: its `hlo_op` statistic, else an `hlo_op=NAME` inside any annotation
    statistic (XLA's GPU runtime annotates each launch as "NAME:#hlo_op=NAME,hlo_module=...#")."""
    op = stats.get("hlo_op")
    if op:
        return str(op)
    for v in stats.values():
        m = _HLO_OP.search(v) if isinstance(v, str) else None
        if m:
            return m.group(1)
    return None


def device_op_times(xplane: str | Path) -> dict[str, float]:
    """Seconds of device time per HLO instruction name in one profile (`*.xplane.pb`): the device planes' kernel
    events (lines "Stream ..."), each attributed to the instruction that launched it (`_event_op`); where no kernel
    names one, the plane's "XLA Ops" line (events named by instruction). {} where the profile has no device plane."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(str(xplane))
    kernels: dict[str, float] = {}
    ops_line: dict[str, float] = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            for ev in line.events:
                seconds = ev.duration_ns * 1e-9
                if line.name.startswith("Stream"):
                    op = _event_op(dict(ev.stats))
                    if op:
                        kernels[op] = kernels.get(op, 0.0) + seconds
                elif line.name == "XLA Ops":
                    ops_line[ev.name] = ops_line.get(ev.name, 0.0) + seconds
    return kernels or ops_line


def breakdown(op_times: dict[str, float], hlo_text: str, top: int = 12) -> dict[str, Any]:
    """{kind: seconds} over KINDS, the total, and the `top` instructions by time (name, kind, seconds)."""
    instrs = parse_module(hlo_text)
    by_kind = dict.fromkeys(KINDS, 0.0)
    rows = []
    for name, t in op_times.items():
        kind = op_kind(instrs.get(name))
        if kind is None:
            continue
        by_kind[kind] += t
        rows.append((name, kind, t))
    rows.sort(key=lambda r: -r[2])
    return {"kernel_time_s": by_kind, "kernel_total_s": sum(by_kind.values()),
            "top_ops": [{"op": n, "kind": k, "time_s": t} for n, k, t in rows[:top]]}


def profile_step(run_once: Callable[[], Any], hlo_text: str, top: int = 12) -> dict[str, Any]:
    """Run `run_once()` (one step, blocking) under the profiler and return its `breakdown`; {} where the backend's
    profile has no device kernels (the CPU)."""
    import jax

    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            run_once()
        files = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        times = device_op_times(files[0]) if files else {}
    return breakdown(times, hlo_text, top) if times else {}
