"""Facts derived from a chip spec: the size of a TPU slice (hosts, TensorCores, total FLOP/s and HBM) and
vector-unit (VPU / CUDA-core) throughput from ALU counts and clock (book ch.2 and ch.12).

Nothing here is a new datasheet number except `TENSORCORES_PER_CHIP`, which carries its source.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.errors import MeshplanError
from meshplan.specs.hardware import Chip

# TensorCores per TPU chip. Book ch.2 §TPU chip: v4 and v5p have two cores that share HBM and act as one
# device ("megacore"); v5e has one. v6e: one TensorCore per chip (Google Cloud TPU v6e docs; the book's
# ch.2 prose groups v6e with the two-core chips).
TENSORCORES_PER_CHIP: dict[str, int] = {"tpu-v4": 2, "tpu-v5p": 2, "tpu-v5e": 1, "tpu-v6e": 1}


@dataclass(frozen=True)
class PodSummary:
    """A TPU slice of `shape` chips: its hosts, TensorCores and aggregate compute and memory."""

    chip: str
    shape: tuple[int, ...]
    chips: int
    hosts: int
    tensorcores: int
    flops_per_s: float  # chips × peak(dtype)
    hbm_bytes: float  # chips × HBM per chip
    hbm_bandwidth_bytes_per_s: float  # chips × HBM bandwidth per chip


def parse_shape(text: str) -> tuple[int, ...]:
    """`16x20x28` → (16, 20, 28); every axis a positive integer."""
    parts = str(text).lower().replace("×", "x").split("x")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise MeshplanError(f"bad slice shape '{text}': write it as AxB or AxBxC, e.g. 16x16") from None
    if not shape or any(s <= 0 for s in shape):
        raise MeshplanError(f"bad slice shape '{text}': every axis must be a positive integer")
    return shape


def chip_tensorcores(chip: Chip) -> int:
    """TensorCores on one TPU chip (from `TENSORCORES_PER_CHIP`); an error for GPUs or unknown TPUs."""
    if chip.kind != "tpu":
        raise MeshplanError(f"{chip.name} is a {chip.kind}, not a TPU: it has no TensorCores in the TPU sense")
    if chip.name not in TENSORCORES_PER_CHIP:
        raise MeshplanError(f"TensorCores per chip of '{chip.name}' are unknown; pass tensorcores_per_chip")
    return TENSORCORES_PER_CHIP[chip.name]


def pod_summary(chip: Chip, shape: tuple[int, ...] | None = None, *, dtype: str = "bf16",
                chips_per_host: int | None = None, tensorcores_per_chip: int | None = None) -> PodSummary:
    """Hosts, TensorCores, FLOP/s and HBM of a TPU slice (book ch.2 Q2): chips = Π shape,
    hosts = ⌈chips / chips per host⌉, cores = chips × cores per chip, FLOP/s = chips × C, HBM = chips × HBM.

    `shape` defaults to the chip's full pod (`links.max_slice_shape`)."""
    if chip.kind != "tpu":
        raise MeshplanError(f"{chip.name} is a {chip.kind}; pod_summary describes TPU slices")
    shape = tuple(shape) if shape is not None else chip.links.max_slice_shape
    if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in shape):
        raise MeshplanError(f"slice shape must be positive integers, got {shape!r}")
    per_host = chips_per_host if chips_per_host is not None else chip.links.chips_per_host
    cores = tensorcores_per_chip if tensorcores_per_chip is not None else chip_tensorcores(chip)
    if per_host <= 0 or cores <= 0:
        raise MeshplanError("chips per host and TensorCores per chip must be positive")
    chips = 1
    for s in shape:
        chips *= s
    return PodSummary(
        chip=chip.name, shape=shape, chips=chips, hosts=-(-chips // per_host), tensorcores=chips * cores,
        flops_per_s=chips * chip.peak(dtype), hbm_bytes=chips * chip.hbm_bytes,
        hbm_bandwidth_bytes_per_s=chips * chip.hbm_bandwidth_bytes_per_s,
    )


# --- vector units ---------------------------------------------------------------------------------

def _positive(**values: float) -> None:
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
            raise MeshplanError(f"{k} must be positive, got {v!r}")


def tpu_vpu_alus(cores: int = 1, *, sublanes: int = 8, lanes: int = 128, alus_per_slot: int = 4) -> int:
    """fp32 VPU ALUs: cores × sublanes × lanes × ALUs per (sublane, lane) slot
    (book ch.2 App. A: a v5p core has 8 × 128 × 4 = 4096; ch.12 Q1: 8192 per 2-core chip)."""
    _positive(cores=cores, sublanes=sublanes, lanes=lanes, alus_per_slot=alus_per_slot)
    return cores * sublanes * lanes * alus_per_slot


def gpu_cuda_cores(sms: int, *, subpartitions: int = 4, lanes: int = 32) -> int:
    """fp32 CUDA cores: SMs × 4 subpartitions × 32 lanes (book ch.12 Q1: H100 132 SMs → 16,896)."""
    _positive(sms=sms, subpartitions=subpartitions, lanes=lanes)
    return sms * subpartitions * lanes


def vector_flops_per_s(alus: int, clock_hz: float, *, ops_per_alu_per_cycle: float = 1.0) -> float:
    """Vector (non-matmul) FLOP/s = ALUs × clock × ops per ALU per cycle (book ch.2 App. A, ch.12 Q2: one op
    per cycle; spec sheets count an FMA as 2 and quote twice this)."""
    _positive(alus=alus, clock_hz=clock_hz, ops_per_alu_per_cycle=ops_per_alu_per_cycle)
    return alus * clock_hz * ops_per_alu_per_cycle
