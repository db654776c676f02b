"""Facts derived from a chip spec: the size of a TPU slice (hosts, TensorCores, total FLOP/s and HBM) and
vector-unit (VPU / CUDA-core) throughput from ALU counts and clock (book ch.2 and ch.12).

Nothing here is a new datasheet number except `TENSORCORES_PER_CHIP`, which carries its source.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.errors import MeshplanError
from meshplan.specs.hardware import SUPERPOD_KEYS, Chip

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


@dataclass(frozen=True)
class FabricLevel:
    """One level of a GPU cluster's network (book ch.12 SuperPod table)."""

    name: str  # node | leaf | spine
    gpus: int  # GPUs under one unit of this level
    switches: int  # switches in one unit (node: NVSwitches; leaf: per SU; spine: all)
    unit_bandwidth_bytes_per_s: float  # bandwidth into one unit from below
    per_gpu_bytes_per_s: float  # that bandwidth per GPU under the unit


@dataclass(frozen=True)
class SuperPod:
    """The vendor reference cluster of a GPU (book ch.12 §networking): scalable units (SUs) of nodes under
    leaf switches, SUs joined by spine switches, a fat tree with full bisection."""

    chip: str
    gpus: int
    nodes: int
    su_count: int
    nodes_per_su: int
    total_switches: int
    node_egress_bytes_per_s: float
    levels: tuple[FabricLevel, ...]

    def as_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def superpod(chip: Chip) -> SuperPod:
    """Derive the SuperPod structure from the chip's `superpod` spec (book ch.12): node = NVLink domain,
    unit bandwidth domain x GPU egress; leaf (one SU) = leaf switches x ports x port bandwidth / 2 (half the
    ports face the nodes); spine = spine switches x ports x port bandwidth (all face the leaves). DGX H100:
    node 8 x 450 GB/s = 3.6 TB/s; leaf 8 x 64 x 50 GB/s / 2 = 12.8 TB/s (50 GB/s per GPU); spine
    16 x 64 x 50 GB/s = 51.2 TB/s; switches 128 x 4 + 4 x 8 + 16 = 560."""
    sp = chip.superpod
    if chip.links.is_torus or not sp:
        raise MeshplanError(f"{chip.name} has no SuperPod structure in its spec (GPU presets h100-sxm, b200 do)")
    missing = [k for k in SUPERPOD_KEYS if k not in sp]
    if missing:  # a user's YAML with part of the section
        raise MeshplanError(f"{chip.name}: field 'superpod' lacks {', '.join(missing)} (needs all of "
                            f"{', '.join(SUPERPOD_KEYS)})")
    g = chip.links.nvlink_domain_size
    su, nps = int(sp["su_count"]), int(sp["nodes_per_su"])
    nodes = su * nps
    port = sp["switch_ports"] * sp["port_bandwidth_bytes_per_s"]
    leaf_sw, spine_sw, nvsw = int(sp["leaf_switches_per_su"]), int(sp["spine_switches"]), int(sp["nvswitches_per_node"])
    leaf_bw, spine_bw = leaf_sw * port / 2, spine_sw * port
    levels = (
        FabricLevel("node", g, nvsw, g * chip.links.nvlink_bandwidth_bytes_per_s, chip.links.nvlink_bandwidth_bytes_per_s),
        FabricLevel("leaf", g * nps, leaf_sw, leaf_bw, leaf_bw / (g * nps)),
        FabricLevel("spine", g * nodes, spine_sw, spine_bw, spine_bw / (g * nodes)),
    )
    return SuperPod(chip.name, g * nodes, nodes, su, nps, nodes * nvsw + su * leaf_sw + spine_sw,
                    g * chip.links.scale_out_bandwidth_bytes_per_s, levels)
