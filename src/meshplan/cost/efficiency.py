"""Kernel efficiency: how far real kernels fall short of the datasheet (DESIGN.md, source 2 of accuracy).

Defaults come from `data/efficiency.yaml` (each number with its public source). A calibrated profile from
`meshplan calibrate` (JSON, schema `meshplan-profile/1`) replaces them for the device it was measured on.
Every function here is numpy-vectorised so the layout search can call it on arrays of layouts.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from meshplan.errors import MeshplanError
from meshplan.specs.hardware import Chip

EFFICIENCY_FILE = Path(__file__).parent / "data" / "efficiency.yaml"
# formats whose GEMMs run on the low-precision tensor-core / MXU path (efficiency.yaml fp8_peak_fraction)
LOW_PRECISION_DTYPES = ("fp8", "int8", "int4", "e4m3", "float8")
PROFILE_SCHEMA = "meshplan-profile/1"
MOE_OVERLAP_FILE = Path(__file__).parent / "data" / "moe_overlap.yaml"
HOST_OVERHEAD_FILE = Path(__file__).parent / "data" / "host_overhead.yaml"


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of peak. `matmul(m, n, k)` etc. give the efficiency of one kernel."""

    matmul_peak_fraction: float
    matmul_half_dim: float
    matmul_rows_half: float
    fp8_peak_fraction: float
    attention_fwd_fraction: float
    attention_bwd_fraction: float
    attention_fa2_fwd_fraction: float
    attention_fa2_bwd_fraction: float
    attention_sdpa_fwd_fraction: float
    attention_sdpa_bwd_fraction: float
    hbm_fraction: float
    kernel_overhead_s: float
    step_overhead_s: float
    memory_reserved_bytes: float
    attention_bwd_flops_ratio: float
    unfused_elementwise_factor: float
    comm_compute_interference: float
    grouped_matmul_peak_fraction: float
    torch_grouped_matmul_peak_fraction: float
    attention_tile_fwd: float
    attention_tile_bwd: float
    attention_cudnn910_fwd_fraction: float
    attention_cudnn910_bwd_fraction: float
    attention_cudnn910_tile_fwd: float
    attention_cudnn910_tile_bwd: float
    origin: str = "defaults"
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def matmul(self, m: Any, n: Any, k: Any) -> Any:
        """Fraction of peak for an [m,k]·[k,n] GEMM: the large-GEMM fraction times a thin-dimension
        penalty d/(d + d_half) for the smallest dimension (tile/wave quantization, book ch.12)."""
        d = np.minimum(np.minimum(m, n), k)
        return self.matmul_peak_fraction * d / (d + self.matmul_half_dim)

    def grouped_matmul(self, m: Any, n: Any, k: Any, torch_kernel: bool = False) -> Any:
        """Fraction of peak for one expert's [m,k]·[k,n] problem (m rows, weights k x n) of a MoE layer's grouped GEMM
        (TensorRT-LLM's MoE plugin, vLLM fused_moe, TE GroupedLinear / MegaBlocks): `matmul`'s fraction, kept under
        the grouped kernel's own large-problem ceiling (efficiency.yaml grouped_matmul_peak_fraction, where a kernel
        measurement puts it below the dense GEMM's) times the penalty of the narrower weight dimension. Equal to
        `matmul` where the chip has no grouped measurement of its own. `torch_kernel`: PyTorch's
        `torch._grouped_mm` (torchtitan's experts), under its own ceiling (torch_grouped_matmul_peak_fraction)."""
        return np.minimum(self.matmul(m, n, k), self.grouped_ceiling(np.minimum(n, k), torch_kernel))

    def grouped_ceiling(self, weight_dim: Any, torch_kernel: bool = False) -> Any:
        """The grouped kernel's large-problem ceiling for experts whose narrower weight dimension is `weight_dim`:
        grouped_matmul_peak_fraction (torch_grouped_matmul_peak_fraction for `torch._grouped_mm`) x d/(d +
        matmul_half_dim) (an unbounded dimension: no penalty)."""
        d = np.asarray(weight_dim, dtype=float)
        with np.errstate(invalid="ignore"):  # inf / inf where the dimension is unbounded, replaced by 1
            thin = np.where(np.isinf(d), 1.0, d / (d + self.matmul_half_dim))
        top = self.torch_grouped_matmul_peak_fraction if torch_kernel else self.grouped_matmul_peak_fraction
        out = top * thin
        return float(out) if out.ndim == 0 else out

    def dtype_scale(self, dtype: str) -> float:
        """What a GEMM in `dtype` reaches of its own peak, relative to what `matmul` gives at the bf16 peak: the
        low-precision large-GEMM fraction over the bf16 one (fp8_peak_fraction / matmul_peak_fraction) for fp8/int8
        formats, 1 for the rest. The planner's FP8 GEMM rate (train/costmodel.py mm_peak), the serving step's
        (infer/step.py _matmul_fraction) and `roofline`'s realistic time all take it from here."""
        return self.fp8_peak_fraction / self.matmul_peak_fraction if dtype in LOW_PRECISION_DTYPES else 1.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("sources")
        return d


_FIELDS = ("matmul_peak_fraction", "matmul_half_dim", "matmul_rows_half", "fp8_peak_fraction",
           "attention_fwd_fraction", "attention_bwd_fraction", "attention_fa2_fwd_fraction",
           "attention_fa2_bwd_fraction", "attention_sdpa_fwd_fraction", "attention_sdpa_bwd_fraction",
           "hbm_fraction", "kernel_overhead_s", "step_overhead_s",
           "memory_reserved_bytes", "attention_bwd_flops_ratio", "unfused_elementwise_factor",
           "comm_compute_interference", "grouped_matmul_peak_fraction", "torch_grouped_matmul_peak_fraction",
           "attention_tile_fwd", "attention_tile_bwd", "attention_cudnn910_fwd_fraction",
           "attention_cudnn910_bwd_fraction", "attention_cudnn910_tile_fwd", "attention_cudnn910_tile_bwd")
# fields a chip may leave out of efficiency.yaml: it then takes the named field's value (no separate measurement;
# an older cuDNN release not measured on a chip is taken as fast as the current one there)
_FALLBACK_FIELDS = {"grouped_matmul_peak_fraction": "matmul_peak_fraction",
                    "torch_grouped_matmul_peak_fraction": "grouped_matmul_peak_fraction",
                    "attention_cudnn910_fwd_fraction": "attention_fwd_fraction",
                    "attention_cudnn910_bwd_fraction": "attention_bwd_fraction",
                    "attention_cudnn910_tile_fwd": "attention_tile_fwd",
                    "attention_cudnn910_tile_bwd": "attention_tile_bwd"}
# The fused-attention kernels whose time follows the tile law (attention_tile_factor), each with its efficiency.yaml
# tile constants: cuDNN as the current stacks ship it ("fused"), and cuDNN 9.10 (mid-2025: "cudnn-9.10")
ATTENTION_TILE_FIELDS = {"fused": ("attention_tile_fwd", "attention_tile_bwd"),
                         "cudnn-9.10": ("attention_cudnn910_tile_fwd", "attention_cudnn910_tile_bwd")}


@lru_cache(maxsize=1)
def _table() -> dict[str, Any]:
    return yaml.safe_load(EFFICIENCY_FILE.read_text())


@lru_cache(maxsize=1)
def _moe_overlap_table() -> dict[str, Any]:
    return yaml.safe_load(MOE_OVERLAP_FILE.read_text())


def moe_constant(name: str) -> float:
    """A fine-grained-MoE constant from `data/moe_overlap.yaml` (routing kernels, load imbalance, grouped GEMM)."""
    return float(_moe_overlap_table()["moe"][name]["value"])


@lru_cache(maxsize=1)
def _host_table() -> dict[str, Any]:
    return yaml.safe_load(HOST_OVERHEAD_FILE.read_text())


def host_constant(name: str, chip: Chip) -> float:
    """A host-side (CPU issue) constant from `data/host_overhead.yaml`, by chip name then kind."""
    table = _host_table()[name]
    return float((table.get(chip.name) or table[chip.kind])["value"])


def overlap_constant(name: str, chip: Chip) -> float:
    """A compute/communication-overlap constant from `data/moe_overlap.yaml`, by chip name then kind ('gpu');
    None of them apply to TPUs (ICI transfers run on DMA engines, not on compute cores): 0 there."""
    table = _moe_overlap_table()["overlap"][name]
    entry = table.get(chip.name) or table.get(chip.kind)
    return 0.0 if entry is None else float(entry["value"])


def bare_loop(eff: Efficiency) -> Efficiency:
    """The efficiency of a bare training loop (`meshplan measure`'s and the GPU suite's reference steps: each
    iteration runs the step on a batch placed beforehand and waits for it, nothing else), so without the per-step
    framework work that `step_overhead_s` stands for (data loading, logging, grad-norm: efficiency.yaml)."""
    return replace(eff, step_overhead_s=0.0)


def _table_entry(field_name: str, chip: Chip) -> dict | None:
    """efficiency.yaml's entry of `field_name` for the chip, by name then kind; None where it has none."""
    rows = _table().get(field_name) or {}
    return rows.get(chip.name) or rows.get(chip.kind)


def default_efficiency(chip: Chip) -> Efficiency:
    """Look up each efficiency for the chip by name, then by kind ('gpu'/'tpu')."""
    values: dict[str, float] = {}
    sources: dict[str, str] = {}
    for f in _FIELDS:
        entry = _table_entry(f, chip)
        if entry is None and f in _FALLBACK_FIELDS:
            values[f] = values[_FALLBACK_FIELDS[f]]
            sources[f] = f"as {_FALLBACK_FIELDS[f]}: no measurement of its own for {chip.name}"
            continue
        if entry is None:
            raise MeshplanError(f"no default efficiency '{f}' for {chip.name} ({chip.kind}); give --profile")
        values[f] = float(entry["value"])
        sources[f] = entry["source"]
    sm_slowdown = nccl_sm_slowdown(chip)
    if sm_slowdown is not None:
        values["comm_compute_interference"] = sm_slowdown
        sources["comm_compute_interference"] = ("NCCL channels' SMs: nccl_channels / (sm_count - nccl_channels), "
                                                "moe_overlap.yaml and the chip's sm_count")
    return Efficiency(**values, origin="defaults", sources=sources)


def attention_head_dim_rate(chip: Chip, head_dim: float, kernel: str = "fused", direction: str = "fwd") -> float:
    """A GPU attention kernel's FLOP rate at `head_dim` relative to head dim 128 (efficiency.yaml
    attention_head_dim_rate, by kernel, `fused` cuDNN or `fa2`, and pass, `fwd` or `bwd`): linear between the
    published points, the narrowest point's rate below them and the widest's above them (a chip's own points for a
    kernel and pass, else the GPU-wide ones). E.g. fused forward, head dim 64: 0.670; 96: (0.670 + 1.0) / 2 = 0.835
    (the training ledger takes the fused forward's only where the chip has no forward tile constant:
    attention_tile_factor's `width` carries it there); GB200's fused backward at MLA's mean width 160: 0.838. 1 on
    TPUs (their MXU fill is modelled in train/costmodel.py) and for a chip or kernel without points."""
    table = _table()["attention_head_dim_rate"]
    key = f"{kernel}_{direction}"
    points = (table.get(chip.name) or {}).get(key) or (table.get(chip.kind) or {}).get(key)  # the chip's own first
    if chip.kind != "gpu" or not points:
        return 1.0
    dims = sorted(float(d) for d in points)
    rates = [float(points[int(d)]) for d in dims]
    return float(np.interp(head_dim, dims, rates))


# A fused attention kernel's query and key tile (FlashAttention-2, Dao 2023 §3.1; FlashAttention-3, Shah et al. 2024
# §3: 128 x 128 at head dim 128; cuDNN's sm90/sm100 kernels name 128-row tiles too, e.g. `..._64x128x128_...`)
ATTENTION_TILE = 128
# The shape every attention_*_fraction of a chip with tile constants is read at: causal attention over 8,192 tokens,
# a mean of 4,096 keys per query (efficiency.yaml attention_tile_fwd)
ATTENTION_ANCHOR_KEYS = 4096.0
# The most keys per query among the rows the tile constants are fitted to (16,384-token unmasked and 32,768-token
# causal rows): past it the tables gain nothing more (GB200 causal forward 1,708 TFLOP/s at 16K, 1,622 at 32K; H200 674
# and 688), so a kernel is never taken faster per FLOP than there
ATTENTION_FIT_MAX_KEYS = 16384.0
# The anchor rows' per-head width d_qk + d_v (Llama 3.1's 128 + 128), which the tile constants are fitted at. A
# forward kernel's fixed work per query tile is a fixed time, not a share of the head width (cuDNN 9.22 on GB200 and
# GB300, NVIDIA/cudnn-frontend benchmark/sdpa_benchmark_training: fitted on the Llama rows, it times the 192/128 (DeepSeek-V3,
# Kimi K2.6) and 256/256 (Qwen3.5) full-attention rows to a median 2.6% / 2.1% against 3.7% / 3.6% with the work
# scaled by the width, and gpt-oss's 64/64 128-token window within 3% on GB200 against -40%): k is
# k x ATTENTION_ANCHOR_WIDTH / width in tile visits of the narrower head. The backward's per-tile work (its outer loop
# over key tiles loads K and V and writes dK and dV, FlashAttention-2 §3.1.2 Algorithm 2) scales with the width
ATTENTION_ANCHOR_WIDTH = 256.0


def attention_tile_factor(eff: Efficiency, direction: str, keys: Any, diagonal: Any = 0.5, calls: Any = 1.0,
                          width: float = ATTENTION_ANCHOR_WIDTH, kernel: str = "fused") -> Any:
    """How much longer a tiled fused attention kernel takes per counted FLOP than at the anchor shape (causal, 8,192
    tokens), for queries that attend `keys` keys on average. Its time is c·V + a·Q (efficiency.yaml
    attention_tile_fwd/_bwd): V the (query tile, key tile) pairs it visits, Q the query tiles, each of which also
    pays a fixed cost of `k` = a/c tile visits (loading Q, the softmax epilogue, writing O and its statistics).
    Per query row that is keys/B + diagonal + k·calls tile-widths against keys/B counted: the factor is
    1 + (diagonal + k·calls)·B/keys, over its anchor value 1 + (1/2 + k)·B/4096. `diagonal` is the partly masked tiles'
    waste: 1/2 for causal full or chunked attention (the diagonal tile), 1 for a sliding window (its span w + B − 1
    straddles one more tile), 0 unmasked; `calls` the kernel launches each query row goes through (one per ring step
    of context parallelism). E.g. forward on GB200 (k 4.67): 2,048 tokens, 1 + 5.17/8 = 1.646 over 1 + 5.17/32 =
    1.162: 1.417; a 128-token sliding window, 1 + 5.67 = 6.67 over 1.162: 5.742. 1 where the chip has no tile
    constant (k = 0 and no diagonal: TPUs, which model their block grid in train/costmodel.py, and unmeasured GPUs).
    Never below its value at ATTENTION_FIT_MAX_KEYS keys in one launch: the tables end there (no extrapolation to
    longer contexts, where they show no further gain). `width`: the head's d_qk + d_v (math/transformer
    attention_pair_width); the forward's fixed work is a fixed time, k·256/width visits of a narrower head's tiles
    (ATTENTION_ANCHOR_WIDTH), e.g. gpt-oss's 64 + 64 window layer: 1 + 1 + 9.34 = 11.34 over 1.162: 9.76. `kernel`:
    whose tile constants (ATTENTION_TILE_FIELDS: the current cuDNN's, or cuDNN 9.10's)."""
    k_fwd, k_bwd = (getattr(eff, f) for f in ATTENTION_TILE_FIELDS[kernel])
    if direction == "fwd":
        return tile_factor(k_fwd, keys, diagonal, calls, width=width)
    return tile_factor(k_bwd, keys, diagonal, calls)


def tile_factor(k: float, keys: Any, diagonal: Any = 0.5, calls: Any = 1.0,
                width: float = ATTENTION_ANCHOR_WIDTH) -> Any:
    """attention_tile_factor for a kernel whose fixed work per query tile is `k` key-tile visits at the anchor's
    head width (a chip's efficiency.yaml attention_tile_fwd/_bwd, or a serving engine's own kernel:
    config.engine_context_attention); `width` another head's d_qk + d_v, whose tiles are that much narrower (a fixed
    time per query tile: attention_tile_factor)."""
    if not k:
        return 1.0 if np.ndim(keys) == 0 and np.ndim(calls) == 0 else np.ones(np.broadcast(keys, calls).shape)
    if width <= 0:
        raise ValueError(f"attention head width must be positive, got {width}")
    k_own = k * ATTENTION_ANCHOR_WIDTH / width
    diag = np.asarray(diagonal, dtype=float)
    own = 1.0 + (diag + k_own * np.asarray(calls, dtype=float)) * ATTENTION_TILE / np.maximum(
        np.asarray(keys, dtype=float), 1.0)
    own = np.maximum(own, 1.0 + (diag + k_own) * ATTENTION_TILE / ATTENTION_FIT_MAX_KEYS)  # no gain past the measured range
    out = own / anchor_tile_factor(k)
    return float(out) if np.ndim(out) == 0 else out


def anchor_tile_factor(k: float) -> float:
    """A tiled kernel's time per counted FLOP at the anchor shape (causal, ATTENTION_ANCHOR_KEYS keys per query, one
    launch) over its rate per visited tile: 1 + (1/2 + k)·B/4096. A fraction of peak read at the anchor is the
    per-tile rate over this."""
    return 1.0 + (0.5 + k) * ATTENTION_TILE / ATTENTION_ANCHOR_KEYS


def nccl_sm_slowdown(chip: Chip) -> float | None:
    """Fractional slow-down of a GPU's compute while an NCCL collective runs beside it: NCCL runs one CTA per
    channel, each on an SM of its own (NVIDIA/nccl#689), so the compute keeps sm_count - channels SMs and takes
    sm_count / (sm_count - channels) times as long: a slow-down of channels / (sm_count - channels).
    E.g. H100: 16 channels of 132 SMs -> 16 / 116 = 0.138. None where the chip has no SM count (TPUs)."""
    return sm_slowdown(overlap_constant("nccl_channels", chip), chip)


def sm_slowdown(sms_taken: float, chip: Chip) -> float | None:
    """Fractional slow-down of a GPU's compute while a communication kernel holds `sms_taken` SMs beside it: the
    compute keeps sm_count - sms_taken SMs, a slow-down of sms_taken / (sm_count - sms_taken) (NVIDIA/nccl#689:
    communication CTAs hold their SMs). None where the chip has no SM count (TPUs) or nothing is taken."""
    sms = chip.on_chip_memory.get("sm_count")
    if chip.kind != "gpu" or not sms or not sms_taken:
        return None
    return sms_taken / (sms - sms_taken)


def dispatcher_sm_slowdown(dispatcher: str, chip: Chip) -> float | None:
    """The slow-down of compute beside a flex MoE dispatcher's own all-to-all kernels (DeepEP/HybridEP hold the SM
    count `dispatcher_sms` gives, not NCCL's channels): sm_slowdown of that count. E.g. HybridEP on H100: 32 of 132
    SMs -> 32 / 100 = 0.32. None for a dispatcher without an entry (NCCL's all-to-all) or a chip without SMs."""
    entry = _moe_overlap_table()["overlap"]["dispatcher_sms"].get(dispatcher)
    return None if entry is None else sm_slowdown(float(entry["value"]), chip)


def comm_hbm_share(chip: Chip) -> float:
    """Fraction of a GPU's HBM bandwidth an NVLink collective running at full link speed takes: it stores what
    arrives, reads it back and reads/writes the user buffers, `hbm_bytes_per_link_byte` (moe_overlap.yaml) HBM
    bytes per link byte. E.g. H100: 3 x 450 GB/s / 3.35 TB/s = 0.403. 0 on TPUs (ICI DMA; no entry)."""
    factor = overlap_constant("hbm_bytes_per_link_byte", chip)
    link = chip.links.nvlink_bandwidth_bytes_per_s
    return min(factor * link / chip.hbm_bandwidth_bytes_per_s, 1.0) if chip.kind == "gpu" else 0.0


def read_profile_json(path: str | Path) -> Any:
    """The parsed JSON of a profile file, or a MeshplanError naming what is wrong with the file (read as every user
    file is, specs/_load.read_text: a regular file of bounded size, so /dev/zero is refused, not read forever)."""
    from meshplan.specs._load import read_text

    if not str(path).strip():  # Path('') would read as '.', the folder
        raise MeshplanError(f"cannot read profile '{path}': the path is empty")
    text = read_text(Path(path), "profile", "a meshplan-profile/1 JSON file")
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise MeshplanError(f"malformed profile '{path}': {exc}") from None


def profile_rules() -> dict[str, Any]:
    """The bound of every profile efficiency field (validate.py: one table of bounds for every input): fractions of
    the datasheet peak (session 23, QA finding: matmul_peak_fraction 5.0 gave MFU 1.49), the rest by name."""
    from meshplan.validate import PROFILE_FRACTION, PROFILE_RULES

    return {f: PROFILE_FRACTION if f.endswith("_fraction") else PROFILE_RULES[f] for f in _FIELDS}


def load_profile(path: str | Path, chip: Chip) -> Efficiency:
    """Read a calibrated profile; refuse one measured on another device kind (exit 2 at the CLI)."""
    return profile_efficiency(read_profile_json(path), chip, str(path), f"profile {Path(path).name}")


def profile_efficiency(data: Any, chip: Chip, path: str, origin: str) -> Efficiency:
    """The Efficiency of a meshplan-profile/1 object (read from `path`, named in errors); fields it lacks keep the
    chip's defaults."""
    if not isinstance(data, dict) or data.get("schema") != PROFILE_SCHEMA:
        raise MeshplanError(f"profile '{path}' is not a {PROFILE_SCHEMA} file")
    measured_on = data.get("chip")
    if measured_on != chip.name:
        raise MeshplanError(
            f"profile '{path}' was measured on '{measured_on}' ({data.get('device_kind', '?')}), "
            f"not on {chip.name}; calibrate on {chip.name} or drop --profile")
    base = default_efficiency(chip)
    eff = data.get("efficiency", {})
    if not isinstance(eff, dict):
        raise MeshplanError(f"profile '{path}': efficiency must be an object of fields (as `meshplan calibrate` "
                            f"writes), got {json.dumps(eff)[:40]}")
    unknown = sorted(set(map(str, eff)) - set(_FIELDS))
    if unknown:
        raise MeshplanError(f"profile '{path}': unknown efficiency field(s) {', '.join(unknown[:5])} "
                            f"(known: {', '.join(_FIELDS)})")
    rules = profile_rules()
    changes = {f: float(rules[f].check(eff[f], f"profile '{path}': efficiency.{f}")) for f in _FIELDS if f in eff}
    for f, twin in _FALLBACK_FIELDS.items():
        # a field the chip's defaults take from its twin follows a calibrated twin unless the profile gives it
        if f not in changes and twin in changes and _table_entry(f, chip) is None:
            changes[f] = changes[twin]
    for direction in ("fwd", "bwd"):
        # a measured attention rate is the device's at the calibration's own lengths, not at the defaults' 8K causal
        # anchor: without tile constants of its own the profile's rate holds flat (no tile factor on top of it)
        if f"attention_{direction}_fraction" in changes and f"attention_tile_{direction}" not in changes:
            changes[f"attention_tile_{direction}"] = 0.0
    return replace(base, **changes, origin=origin)


ALLOW_CPU_PROFILE_ENV = "MESHPLAN_ALLOW_CPU_PROFILE"


def resolve_efficiency(chip: Chip, profile: str | None) -> Efficiency:
    """The efficiency a plan uses: a calibrated profile, else the chip's defaults. A profile measured on a CPU
    (`cpu_only`, written by `calibrate --hardware H` on a machine without H) is refused for planning: its
    efficiencies are a CPU's fraction of the chip's peak (issue #18: the best plan went from 1.4 s to 8,523 s at 0.0%
    MFU). Setting MESHPLAN_ALLOW_CPU_PROFILE=1 overrides this (pipeline tests that need some profile)."""
    if not profile:
        return default_efficiency(chip)
    eff = load_profile(profile, chip)
    if os.environ.get(ALLOW_CPU_PROFILE_ENV) != "1" and _is_cpu_only(profile):
        raise MeshplanError(f"profile '{profile}' was measured on a CPU (cpu_only): its efficiencies are a CPU's "
                            f"fraction of the {chip.name}'s peak and would make every plan hundreds of times slower; "
                            f"calibrate on a {chip.name} or set {ALLOW_CPU_PROFILE_ENV}=1 to use it anyway")
    return eff


def _is_cpu_only(path: str | Path) -> bool:
    data = json.loads(Path(path).read_text())  # load_profile has read and checked it
    return bool(data.get("cpu_only")) or data.get("device_kind") == "cpu"
