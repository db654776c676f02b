"""The closed-form training rules of "How to Scale Your Model", chapters 5 and 6 (training parallelism;
training LLaMA 3 on TPU v5p).

These are the book's back-of-the-envelope rooflines, not the planner's cost model (`costmodel.py`): they
ignore efficiency, latency, overlap limits and everything but the MLP matmuls, and are what the book's
worked answers are computed with. Notation (book ch.5, spec §1): B = batch in tokens, D = d_model,
F = d_ff, X = FSDP/DP degree, Y = TP degree, N = chips, C = peak FLOP/s per chip, M_X / M_Y = number of
hardware mesh axes a strategy spans, and

    α = C / W_ici,  W_ici = the *bidirectional* per-axis ICI bandwidth = 2 × one-way per-link bandwidth

(v5p: 4.59e14 / (2 × 9e10) = 2550). On a GPU the book's ch.12 uses W_collective = the GPU's one-way NVLink
egress instead (H100: 9.89e14 / 4.5e11 ≈ 2200).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from meshplan.errors import MeshplanError
from meshplan.specs.hardware import Chip

Edition = Literal["latest", "feb2025"]
Strategy = Literal["dp", "fsdp", "tp", "fsdp+tp"]

SECONDS_PER_DAY = 86_400.0
SECONDS_PER_YEAR = 365.0 * SECONDS_PER_DAY  # the book's "435 years on one v5p" uses 365-day years


def _positive(**values: float) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise MeshplanError(f"{name} must be a positive number, got {v!r}")


# --- arithmetic intensities -------------------------------------------------------------------------


def ici_bandwidth(chip: Chip) -> float:
    """W_ici in bytes/s. Book ch.5 notation: bidirectional per mesh axis, 2 × the one-way link bandwidth
    (v5p: 2 × 9e10 = 1.8e11). GPUs (book ch.12 §LLM rooflines): the one-way NVLink egress W_gpu."""
    if chip.links.is_torus:
        return 2.0 * chip.links.ici_bandwidth_per_link_bytes_per_s
    return chip.links.nvlink_bandwidth_bytes_per_s


def ici_alpha(chip: Chip, dtype: str = "bf16") -> float:
    """α = C / W_ici, the ICI arithmetic intensity in FLOPs per byte (book ch.5; v5p ≈ 2550)."""
    return chip.peak(dtype) / ici_bandwidth(chip)


# --- data parallelism and FSDP (book ch.5 §DP, §FSDP) -----------------------------------------------


def dp_min_batch_per_chip(chip: Chip, axes: int = 1, dtype: str = "bf16") -> float:
    """Tokens per chip above which DP/FSDP is compute-bound: B/X > C / W_ici / M_X (book ch.5).

    DP backward: T_math = 8BDF/(X·C) vs T_comms = 8DF/(M_X·W); FSDP forward: 4BDF/(X·C) vs 4DF/(M_X·W).
    v5p: 2550 on one axis, 850 over all three."""
    _positive(axes=axes)
    return ici_alpha(chip, dtype) / axes


def dp_min_global_batch(chips: float, chip: Chip, axes: int = 1, dtype: str = "bf16") -> float:
    """Smallest global batch (tokens) that keeps `chips`-way DP/FSDP compute-bound: N · α / M_X (book ch.5 Q3)."""
    _positive(chips=chips)
    return chips * dp_min_batch_per_chip(chip, axes, dtype)


def fsdp_max_chips(batch_tokens: float, chip: Chip, axes: int = 3, dtype: str = "bf16") -> float:
    """Most chips pure FSDP/DP can use before turning ICI-bound: B / (α / M_X) (book ch.5: LLaMA-3-70B with a
    16M batch → 16e6 / 850 ≈ 18,800 v5p chips)."""
    _positive(batch_tokens=batch_tokens)
    return batch_tokens / dp_min_batch_per_chip(chip, axes, dtype)


def batch_per_chip(batch_tokens: float, chips: float) -> float:
    """B / N: tokens each chip processes per step (the quantity every ch.5 rule compares)."""
    _positive(batch_tokens=batch_tokens, chips=chips)
    return batch_tokens / chips


def dcn_min_batch_per_slice(chip: Chip, dtype: str = "bf16") -> float:
    """Pure DP across ICI slices over DCN is compute-bound when the batch per slice exceeds C / W_dcn
    (book ch.5 §across pods: T_math = 8BDF/(N·C), T_comms = 8DF/(M·W_dcn); v5p: 4.59e14 / 6.25e9 = 73,440)."""
    return chip.peak(dtype) / chip.links.scale_out_bandwidth_bytes_per_s


# --- tensor parallelism (book ch.5 §TP) -------------------------------------------------------------


def tp_max_degree(d_ff: float, chip: Chip, axes: int = 1, dtype: str = "bf16") -> float:
    """TP stays compute-bound while Y < M_Y · F / α (book ch.5: T_math = 4BDF/(Y·C), T_comms = 4BD/W;
    v5p: F / 2550 per axis, ≈ 11.8 for F = 30,000)."""
    _positive(d_ff=d_ff, axes=axes)
    return axes * d_ff / ici_alpha(chip, dtype)


def tp_min_d_ff(degree: float, chip: Chip, axes: int = 1, dtype: str = "bf16") -> float:
    """The MLP width F that `degree`-way TP needs to stay compute-bound: Y · α / M_Y (book ch.5: 8-way → 20,400)."""
    _positive(degree=degree, axes=axes)
    return degree * ici_alpha(chip, dtype) / axes


# --- FSDP + TP (book ch.5 §combining FSDP and TP) ---------------------------------------------------


def fsdp_tp_optimal_fsdp(batch_tokens: float, d_ff: float, chips: float, fsdp_axes: int = 2,
                         tp_axes: int = 1) -> float:
    """X_opt = sqrt((B/F) · (M_X/M_Y) · N), the FSDP degree that equalises the FSDP and TP comm terms
    T_FSDP = 4DF/(Y·W·M_X) and T_TP = 4BD/(X·W·M_Y) with X·Y = N (book ch.5; N=64, B=48k, F=32k → 13.7)."""
    _positive(batch_tokens=batch_tokens, d_ff=d_ff, chips=chips, fsdp_axes=fsdp_axes, tp_axes=tp_axes)
    return math.sqrt(batch_tokens / d_ff * fsdp_axes / tp_axes * chips)


def fsdp_tp_min_batch_per_chip(d_ff: float, chip: Chip, fsdp_axes: int = 2, tp_axes: int = 1,
                               edition: Edition = "latest", dtype: str = "bf16") -> float:
    """Per-chip batch floor of mixed FSDP+TP at X = X_opt (book ch.5):

    * latest edition (FSDP and TP comms overlap, T_comms = max): B/N > α² / (M_X · M_Y · F)
      (v5p 3D mesh, M_X·M_Y = 2: 2550²/(2F) ≈ 100 for F = 32k, 113 for LLaMA-3-70B);
    * feb2025 edition (comms summed, via a discriminant): B/N > 4α² / (M_X · M_Y · F) (≈ 400, 453)."""
    _positive(d_ff=d_ff, fsdp_axes=fsdp_axes, tp_axes=tp_axes)
    factor = {"latest": 1.0, "feb2025": 4.0}.get(edition)
    if factor is None:
        raise MeshplanError(f"unknown book edition '{edition}' (known: latest, feb2025)")
    return factor * ici_alpha(chip, dtype) ** 2 / (fsdp_axes * tp_axes * d_ff)


def fsdp_tp_max_chips(batch_tokens: float, d_ff: float, chip: Chip, fsdp_axes: int = 2, tp_axes: int = 1,
                      edition: Edition = "latest", dtype: str = "bf16") -> float:
    """Most chips FSDP+TP can use compute-bound: B / floor (book ch.5: 2M batch, F = 30k → ≈ 18,000 v5p)."""
    _positive(batch_tokens=batch_tokens)
    return batch_tokens / fsdp_tp_min_batch_per_chip(d_ff, chip, fsdp_axes, tp_axes, edition, dtype)


def fsdp_tp_compute_comm_ratio(batch_tokens: float, d_ff: float, chips: float, chip: Chip, fsdp_axes: int = 2,
                               tp_axes: int = 1, dtype: str = "bf16") -> float:
    """T_math / T_comms at X = X_opt: sqrt(B · F · M_X · M_Y) / (α · sqrt(N)) (book ch.5)."""
    _positive(batch_tokens=batch_tokens, d_ff=d_ff, chips=chips)
    return math.sqrt(batch_tokens * d_ff * fsdp_axes * tp_axes) / (ici_alpha(chip, dtype) * math.sqrt(chips))


# --- the per-layer table (book ch.5 §6.2) -----------------------------------------------------------


@dataclass(frozen=True)
class LayerCost:
    """FLOPs per chip and bytes on the wire for one MLP layer In[B,D]·W_in[D,F]·W_out[F,D] (gating
    ignored, bf16), forward and backward. Weight traffic (FSDP/DP) runs over the X axis, activation
    traffic (TP) over the Y axis; bytes are the book's V (a collective over a wrapped axis takes V / W)."""

    flops_fwd: float
    flops_bwd: float
    weight_bytes_fwd: float
    weight_bytes_bwd: float
    activation_bytes_fwd: float
    activation_bytes_bwd: float

    @property
    def comm_bytes_fwd(self) -> float:
        return self.weight_bytes_fwd + self.activation_bytes_fwd

    @property
    def comm_bytes_bwd(self) -> float:
        return self.weight_bytes_bwd + self.activation_bytes_bwd

    def times(self, chip: Chip, direction: Literal["fwd", "bwd"] = "fwd", fsdp_axes: int = 1, tp_axes: int = 1,
              edition: Edition = "latest", dtype: str = "bf16") -> tuple[float, float]:
        """(T_math, T_comms) in seconds: FLOPs / C and bytes / (W_ici · axes) per axis kind; the two comm
        kinds overlap (max) in the latest edition and add in feb2025 (book ch.5 §FSDP+TP)."""
        flops, w, a = ((self.flops_fwd, self.weight_bytes_fwd, self.activation_bytes_fwd) if direction == "fwd"
                       else (self.flops_bwd, self.weight_bytes_bwd, self.activation_bytes_bwd))
        bw = ici_bandwidth(chip)
        t_w, t_a = w / (bw * fsdp_axes), a / (bw * tp_axes)
        return flops / chip.peak(dtype), (max(t_w, t_a) if edition == "latest" else t_w + t_a)


def layer_cost(strategy: Strategy, batch_tokens: float, d_model: float, d_ff: float, fsdp: float = 1,
               tp: float = 1) -> LayerCost:
    """Book ch.5 §6.2 table, X = `fsdp` (the DP/FSDP degree), Y = `tp`:

    | strategy | compute (fwd + bwd)      | comms (fwd + bwd)                 |
    | DP       | 4BDF/X + 8BDF/X          | 0 + 8DF                           |
    | FSDP     | 4BDF/X + 8BDF/X          | 4DF + 8DF                         |
    | TP       | 4BDF/Y + 8BDF/Y          | 4BD + 4BD                         |
    | FSDP+TP  | 4BDF/(XY) + 8BDF/(XY)    | (4BD/X + 4DF/Y) + (8BD/X + 8DF/Y) |
    """
    _positive(batch_tokens=batch_tokens, d_model=d_model, d_ff=d_ff, fsdp=fsdp, tp=tp)
    B, D, F, X, Y = batch_tokens, d_model, d_ff, fsdp, tp
    if strategy == "dp":
        return LayerCost(4 * B * D * F / X, 8 * B * D * F / X, 0.0, 8 * D * F, 0.0, 0.0)
    if strategy == "fsdp":
        return LayerCost(4 * B * D * F / X, 8 * B * D * F / X, 4 * D * F, 8 * D * F, 0.0, 0.0)
    if strategy == "tp":
        return LayerCost(4 * B * D * F / Y, 8 * B * D * F / Y, 0.0, 0.0, 4 * B * D, 4 * B * D)
    if strategy == "fsdp+tp":
        n = X * Y
        return LayerCost(4 * B * D * F / n, 8 * B * D * F / n, 4 * D * F / Y, 8 * D * F / Y, 4 * B * D / X,
                         8 * B * D / X)
    raise MeshplanError(f"unknown strategy '{strategy}' (known: dp, fsdp, tp, fsdp+tp)")


# --- memory (book ch.5 §memory, ch.6 §memory) -------------------------------------------------------


def activation_checkpoint_bytes(batch_tokens: float, n_layers: int, saved_widths: tuple[float, ...],
                                act_bytes: float = 2.0) -> float:
    """Saved activations: act_bytes · B · L · Σ widths, one [B, width] array per checkpoint per layer
    (book ch.5 Q2: after the 3 MLP matmuls, widths (D, F, F) → 2·L·B·(D + 2F); ch.6: 2 ckpts of [B, D])."""
    _positive(batch_tokens=batch_tokens, n_layers=n_layers)
    if not saved_widths or any(w <= 0 for w in saved_widths):
        raise MeshplanError("saved_widths must list the positive width of each checkpointed array")
    return act_bytes * batch_tokens * n_layers * float(sum(saved_widths))


@dataclass(frozen=True)
class TrainingMemory:
    """Total training memory over all chips (bytes), by part."""

    params: float
    optimizer: float
    grads: float
    activations: float

    @property
    def total(self) -> float:
        return self.params + self.optimizer + self.grads + self.activations

    @property
    def state(self) -> float:
        """Parameters, gradients and optimizer state: what FSDP/ZeRO shards."""
        return self.params + self.optimizer + self.grads

    def per_chip(self, chips: float) -> float:
        """Evenly spread over `chips` (book ch.6: 11.2 TB on 8960 v5p ≈ 1.25 GB per chip)."""
        _positive(chips=chips)
        return self.total / chips

    def min_chips(self, chip: Chip) -> float:
        """Chips whose HBM holds the total (book ch.6: 11.2 TB / 96 GB ≈ 117 v5p), not rounded up."""
        return self.total / chip.hbm_bytes


def training_memory(params: float, batch_tokens: float, n_layers: int, saved_widths: tuple[float, ...],
                    param_bytes: float = 2.0, optimizer_bytes: float = 8.0, grad_bytes: float = 0.0,
                    act_bytes: float = 2.0) -> TrainingMemory:
    """Book ch.5/ch.6 training memory: bf16 parameters (2 bytes), Adam's two fp32 moments (8 bytes; the book's
    "2 + 4 + 4 = 10 bytes per parameter"), gradients only when kept (`grad_bytes`, 0 in the book's
    answers), and the checkpointed activations of `activation_checkpoint_bytes`."""
    _positive(params=params)
    return TrainingMemory(param_bytes * params, optimizer_bytes * params, grad_bytes * params,
                          activation_checkpoint_bytes(batch_tokens, n_layers, saved_widths, act_bytes))


# --- time (book ch.4 §FLOPs, ch.6 §training time) ---------------------------------------------------


def training_flops(params: float, tokens: float) -> float:
    """6 · P · tokens: forward 2PT plus backward 4PT (book ch.4; ch.6: LLaMA-3-70B on 15T tokens = 6.3e24)."""
    _positive(params=params, tokens=tokens)
    return 6.0 * params * tokens


def training_time_s(flops: float, chips: float, chip: Chip, mfu: float, dtype: str = "bf16") -> float:
    """Wall-clock seconds: FLOPs / (chips · C · MFU) (book ch.6: 6.3e24 on 8960 v5p at 40% → 44 days)."""
    _positive(flops=flops, chips=chips, mfu=mfu)
    if mfu > 1:
        raise MeshplanError(f"MFU is a fraction of peak in (0, 1], got {mfu}")
    return flops / (chips * chip.peak(dtype) * mfu)
