"""Rooflines (book ch.1 and ch.12): an op's FLOPs and bytes against a chip's compute and memory bandwidth.

T_math = FLOPs / C, T_mem = bytes / W. With perfect overlap the op takes max(T_math, T_mem) (lower
bound); with none it takes T_math + T_mem (upper bound). An op is compute-bound when its arithmetic
intensity FLOPs/bytes exceeds the chip's critical intensity C/W.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from meshplan.cost.efficiency import Efficiency, attention_tile_factor
from meshplan.errors import MeshplanError
from meshplan.math.transformer import (
    attention_pair_width,
    dtype_bytes,
    kv_cached_tokens,
    masked_tile_share,
    mean_attended_keys,
    newest_query_keys,
    touched_experts,
)
from meshplan.specs.hardware import Chip
from meshplan.specs.model import ModelConfig


@dataclass(frozen=True)
class Op:
    """An operation reduced to what a roofline needs: FLOPs and bytes moved to and from memory."""

    name: str
    flops: float
    bytes: float
    kind: str = "matmul"  # matmul | attention | elementwise
    dtype: str = "bf16"  # the precision the FLOPs run at
    # matmul (rows, contracting, cols) for the shape-dependent efficiency; attention (keys per query, masked share of a
    # tile) for the fused kernel's tile factor (efficiency.attention_tile_factor)
    dims: tuple[float, ...] = ()

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")


@dataclass(frozen=True)
class Roofline:
    name: str
    kind: str
    flops: float
    bytes: float
    intensity: float
    critical_intensity: float
    t_math_s: float
    t_mem_s: float
    t_lower_s: float
    t_upper_s: float
    bound: str  # "compute" | "memory"

    def as_dict(self) -> dict:
        return asdict(self)


def _check_positive(**dims: float) -> None:
    for k, v in dims.items():
        if v is None or v <= 0:
            raise MeshplanError(f"{k} must be positive, got {v}")


def matmul(B: float, D: float, F: float, *, lhs_dtype: str = "bf16", rhs_dtype: str = "bf16",
           out_dtype: str | None = None, compute_dtype: str | None = None, name: str = "matmul") -> Op:
    """X[B,D]·W[D,F] → Y[B,F]: 2BDF FLOPs; bytes B·D·x + D·F·w + B·F·y (book ch.1)."""
    _check_positive(B=B, D=D, F=F)
    out_dtype = out_dtype or lhs_dtype
    nbytes = B * D * dtype_bytes(lhs_dtype) + D * F * dtype_bytes(rhs_dtype) + B * F * dtype_bytes(out_dtype)
    return Op(name, 2.0 * B * D * F, nbytes, "matmul", compute_dtype or lhs_dtype, (B, D, F))


def batched_matmul(batch: float, B: float, D: float, F: float, *, per_example_weights: bool = True,
                   dtype: str = "bf16", name: str = "batched_matmul") -> Op:
    """`batch` independent [B,D]·[D,F] products. With per-example weights (book ch.1 Q: int8[B,D,F])
    every weight is read once per example, so intensity stays near 1 whatever the batch."""
    _check_positive(batch=batch, B=B, D=D, F=F)
    w = batch * D * F if per_example_weights else D * F
    nbytes = (batch * B * D + w + batch * B * F) * dtype_bytes(dtype)
    return Op(name, 2.0 * batch * B * D * F, nbytes, "matmul", dtype)


def attention(B: float, T: float, S: float, N: int, K: int, H: int, *, causal: bool = False,
              dtype: str = "bf16", kv_dtype: str | None = None, name: str = "attention",
              keys_per_query: float | None = None, tile_mask: float | None = None) -> Op:
    """Fused (flash) attention of B sequences, T queries over S keys. FLOPs 4·B·T·S·N·H (QKᵀ and AV;
    halved by a causal mask when T = S; `keys_per_query` in place of S where the mask leaves each query another
    mean count, e.g. the newest T queries of an S-token context); bytes read Q and write O (B·T·N·H each) and read
    K and V (B·S·K·H each) — book ch.4 (GQA intensity) and ch.7 §attention. `tile_mask`: the key tiles per query
    tile a tiled kernel visits beyond the attended keys (efficiency.attention_tile_factor's `diagonal`; default 1/2
    causal, 0 unmasked)."""
    _check_positive(B=B, T=T, S=S, N=N, K=K, H=H)
    keys = keys_per_query if keys_per_query is not None else S * (0.5 if causal and T == S else 1.0)
    flops = 4.0 * B * T * keys * N * H
    kvb = dtype_bytes(kv_dtype or dtype)
    nbytes = 2 * B * T * N * H * dtype_bytes(dtype) + 2 * B * S * K * H * kvb
    mask = tile_mask if tile_mask is not None else (0.5 if causal else 0.0)
    return Op(name, flops, nbytes, "attention", dtype, dims=(keys, mask, 2.0 * H))


def elementwise(n_elements: float, *, flops_per_element: float = 1.0, n_inputs: int = 1, n_outputs: int = 1,
                dtype: str = "bf16", name: str = "elementwise") -> Op:
    """A pointwise op: reads n_inputs arrays and writes n_outputs, each of n_elements."""
    _check_positive(n_elements=n_elements)
    return Op(name, flops_per_element * n_elements, (n_inputs + n_outputs) * n_elements * dtype_bytes(dtype),
              "elementwise", "fp32")


def dot_product(N: float, dtype: str = "bf16") -> Op:
    """x·y of two length-N vectors: 2N−1 FLOPs, reads 2N elements and writes 1 (book ch.1)."""
    _check_positive(N=N)
    return Op("dot", 2.0 * N - 1, (2 * N + 1) * dtype_bytes(dtype), "elementwise", dtype)


def roofline(op: Op, chip: Chip | None = None, *, peak_flops_per_s: float | None = None,
             bandwidth_bytes_per_s: float | None = None) -> Roofline:
    """Time bounds of `op` on a chip (or on explicit C and W, e.g. PCIe or ICI instead of HBM)."""
    if chip is None and (peak_flops_per_s is None or bandwidth_bytes_per_s is None):
        raise MeshplanError("roofline needs a chip or both peak_flops_per_s and bandwidth_bytes_per_s")
    if peak_flops_per_s is None:
        if op.kind == "elementwise" and chip.kind == "gpu" and "fp32" in chip.peak_flops_per_s:
            peak_flops_per_s = chip.peak_flops_per_s["fp32"]  # CUDA cores, not tensor cores
        else:
            # a low-precision matmul runs on its own unit or not at all (an error, as `matmul --dtype` and
            # `roofline --dtype` give; session 23, QA finding: fp8 on TPU v5e was timed at the bf16 peak); wider
            # floats (fp32) without a unit of their own are timed at the bf16 peak
            low = op.dtype in ("fp8", "int8", "int4", "e4m3", "float8")
            peak_flops_per_s = chip.peak(op.dtype if low or op.dtype in chip.peak_flops_per_s else "bf16")
    W = bandwidth_bytes_per_s if bandwidth_bytes_per_s is not None else chip.hbm_bandwidth_bytes_per_s
    _check_positive(peak_flops_per_s=peak_flops_per_s, bandwidth_bytes_per_s=W)
    t_math, t_mem = op.flops / peak_flops_per_s, op.bytes / W
    return Roofline(op.name, op.kind, op.flops, op.bytes, op.intensity, peak_flops_per_s / W, t_math, t_mem,
                    max(t_math, t_mem), t_math + t_mem, "compute" if t_math >= t_mem else "memory")


def realistic_time_s(op: Op, chip: Chip, eff: Efficiency) -> float:
    """meshplan's realistic time of one op beside the book's ideal `roofline` (DESIGN.md accuracy source 2):
    FLOPs at the peak times the kernel's efficiency (matmul: shape-dependent `eff.matmul`, a low-precision format
    scaled to its own large-GEMM fraction, `eff.dtype_scale`; attention: the fused forward kernel's fraction at its
    keys per query, `efficiency.attention_tile_factor`), bytes
    at W_hbm x hbm_fraction, overlapped (max), plus one kernel launch."""
    r = roofline(op, chip)
    frac = 1.0
    if op.kind == "matmul":
        # the planner's own GEMM rate: eff.matmul at the bf16 large-GEMM fraction, scaled to the format's own
        # (session 28: fp8 was multiplied by fp8_peak_fraction on top of matmul_peak_fraction, 0.80 x 0.62 of the
        # FP8 peak where train and serve use 0.62)
        frac = float(eff.matmul(*op.dims)) if op.dims else eff.matmul_peak_fraction
        frac *= eff.dtype_scale(op.dtype)
    elif op.kind == "attention":
        # the fused kernel's rate at its keys per query and mask, as the planner's ledger times it
        frac = eff.attention_fwd_fraction / (attention_tile_factor(eff, "fwd", op.dims[0], op.dims[1], width=op.dims[2])
                                             if op.dims else 1.0)
    return max(r.t_math_s / frac, r.t_mem_s / eff.hbm_fraction) + eff.kernel_overhead_s


def critical_batch(peak_flops_per_s: float, bandwidth_bytes_per_s: float, weight_bytes: float = 2.0) -> float:
    """Tokens per replica above which X[B,D]·W[D,F] is compute-bound, for B ≪ D, F (book ch.1, ch.7 §8.1):
    FLOPs 2BDF over weight bytes D·F·w gives intensity 2B/w, so B_crit = (C/W)·w/2, with C the peak at the
    precision the FLOPs run at. The one critical batch of meshplan: ch.7's β·α_hbm (β = weight bits /
    activation bits) is the same number when α is the bf16 C/W. v5e: bf16 240, int8 weights + bf16 FLOPs
    120, int8 weights + int8 FLOPs 3.94e14/8.2e11·1/2 = 240 (not 480)."""
    _check_positive(peak_flops_per_s=peak_flops_per_s, bandwidth_bytes_per_s=bandwidth_bytes_per_s)
    return peak_flops_per_s / bandwidth_bytes_per_s * weight_bytes / 2.0


def chip_critical_batches(chip: Chip) -> dict[str, float]:
    """`critical_batch` for the weight/FLOP precision pairs of book ch.7 §8.1 that the chip has units for:
    'bf16' (bf16 weights and FLOPs), 'int8_weights_bf16_flops', 'int8' and 'fp8' (weights and FLOPs)."""
    W = chip.hbm_bandwidth_bytes_per_s
    out = {"bf16": critical_batch(chip.peak("bf16"), W, dtype_bytes("bf16")),
           "int8_weights_bf16_flops": critical_batch(chip.peak("bf16"), W, dtype_bytes("int8"))}
    for d in ("int8", "fp8"):
        if d in chip.peak_flops_per_s:
            out[d] = critical_batch(chip.peak(d), W, dtype_bytes(d))
    return out


def layer_ops(m: ModelConfig, tokens: float, seq_len: int, *, dtype: str = "bf16", causal: bool = True,
              include_unembedding: bool = True) -> list[Op]:
    """The forward ops of one transformer layer on `tokens` tokens (book ch.4 per-layer table), plus the
    output projection. `tokens` = sequences × seq_len on this chip."""
    _check_positive(tokens=tokens, seq_len=seq_len)
    D, F = m.d_model, m.d_ff
    seqs = tokens / seq_len
    # keys per query: seq_len (halved by the causal mask) or, with sliding-window/chunked layers, their mean over
    # the layers (math/transformer.mean_attended_keys), timed as that many keys unmasked
    keys, masked = (mean_attended_keys(m, seq_len, causal), False) if m.has_windows else (seq_len, causal)
    q_seqs, q_len, per_query = seqs, seq_len, None
    if tokens < seq_len:
        # fewer tokens than one sequence (a prompt chunk, decode steps): they are the newest `tokens` queries of one
        # sequence, whose cached keys and values are all read (book ch.7: decode attention reads the cache; session
        # 21, QA finding: counting the keys of only `tokens` positions made 64 queries over a 4,096-token context look
        # compute-bound). Causal, each attends its own prefix: S − T/2 keys on average for full attention
        # (`newest_query_keys`; session 23, QA finding: all S counted for every query, +33% at T = S/2)
        q_seqs, q_len, masked = 1.0, tokens, False
        keys = kv_cached_tokens(m, seq_len)
        per_query = newest_query_keys(m, tokens, seq_len) if causal else keys
    tile_mask = masked_tile_share(m, seq_len) if causal else 0.0  # as the training ledger's attention core
    ops = [elementwise(tokens * D, flops_per_element=4, name="norm/attn", dtype=dtype)]
    if m.is_mla:
        # DeepSeek-V2 §2.1: latent down-projections, per-head up-projections (keys and values up-projected as in
        # training and prefill), attention over head_dim + RoPE for QKᵀ (timed at the mean of the QK and V widths)
        N = m.n_heads
        if m.q_lora_rank:
            ops.append(matmul(tokens, D, m.q_lora_rank, name="attn/q_down", lhs_dtype=dtype, rhs_dtype=dtype))
        ops += [matmul(tokens, m.q_lora_rank or D, N * m.qk_head_dim, name="attn/q_up", lhs_dtype=dtype,
                       rhs_dtype=dtype),
                matmul(tokens, D, m.kv_lora_rank + m.qk_rope_head_dim, name="attn/kv_down", lhs_dtype=dtype,
                       rhs_dtype=dtype),
                matmul(tokens, m.kv_lora_rank, N * (m.head_dim + m.v_dim), name="attn/kv_up", lhs_dtype=dtype,
                       rhs_dtype=dtype),
                attention(q_seqs, q_len, keys, N, N, max(1, round(attention_pair_width(m) / 2)),
                          causal=masked, dtype=dtype, name="attn/core", keys_per_query=per_query, tile_mask=tile_mask),
                matmul(tokens, N * m.v_dim, D, name="attn/o_proj", lhs_dtype=dtype, rhs_dtype=dtype)]
    else:
        ops += [matmul(tokens, D, m.q_dim + 2 * m.kv_dim, name="attn/qkv", lhs_dtype=dtype, rhs_dtype=dtype),
                attention(q_seqs, q_len, keys, m.n_heads, m.n_kv_heads, m.head_dim, causal=masked,
                          dtype=dtype, name="attn/core", keys_per_query=per_query, tile_mask=tile_mask),
                matmul(tokens, m.q_dim, D, name="attn/o_proj", lhs_dtype=dtype, rhs_dtype=dtype)]
    ops.append(elementwise(tokens * D, flops_per_element=4, name="norm/mlp", dtype=dtype))
    experts = m.experts_per_token if m.is_moe else 1
    # With k of E experts active each expert sees tokens·k/E tokens (balanced routing): the FLOPs and activations
    # of E such GEMMs, and the weights of only the experts some token routes to, E·(1 − (1 − k/E)^tokens)
    # (`touched_experts`; all E once tokens ≫ E/k, about k per token at decode: book ch.7 MoE decode; session 23,
    # QA finding: all E counted at one token, 4x Mixtral's MLP bytes)
    mlp_tokens = tokens * experts / m.n_experts if m.is_moe else tokens
    n_mats = m.n_experts if m.is_moe else 1
    read = touched_experts(m, tokens) if m.is_moe else 1.0
    wdt = dtype_bytes(dtype)
    for name, d_in, d_out in (("mlp/up", D, F * (2 if m.gated else 1)), ("mlp/down", F, D)):
        one = matmul(mlp_tokens, d_in, d_out, name=name, lhs_dtype=dtype, rhs_dtype=dtype)
        weights = d_in * d_out * wdt
        ops.append(Op(name, one.flops * n_mats, (one.bytes - weights) * n_mats + weights * read, "matmul", dtype,
                      () if m.is_moe else one.dims))  # E expert GEMMs: the large-GEMM fraction, as before
        if name == "mlp/up":
            ops.append(elementwise(tokens * F * experts, flops_per_element=5, n_inputs=2 if m.gated else 1,
                                   name="mlp/act", dtype=dtype))
    if m.is_moe and m.n_shared_experts:
        # shared experts (DeepSeek, Qwen-MoE, Llama 4) see every token
        sF = m.n_shared_experts * (m.shared_expert_d_ff or F)
        ops += [matmul(tokens, D, sF * (2 if m.gated else 1), name="mlp/shared_up", lhs_dtype=dtype, rhs_dtype=dtype),
                matmul(tokens, sF, D, name="mlp/shared_down", lhs_dtype=dtype, rhs_dtype=dtype)]
    if include_unembedding:
        ops.append(matmul(tokens, D, m.vocab_size, name="unembed", lhs_dtype=dtype, rhs_dtype=dtype))
    return ops


def model_roofline(m: ModelConfig, chip: Chip, tokens_per_chip: float, seq_len: int | None = None,
                   dtype: str = "bf16", causal: bool = True) -> list[Roofline]:
    """The per-layer roofline of a model at `tokens_per_chip` (forward), one row per op."""
    return [roofline(op, chip) for op in model_ops(m, tokens_per_chip, seq_len, dtype=dtype, causal=causal)]


def model_ops(m: ModelConfig, tokens_per_chip: float, seq_len: int | None = None, dtype: str = "bf16",
              causal: bool = True) -> list[Op]:
    """`layer_ops` at `tokens_per_chip`, sequence length defaulting to min(the model's, tokens)."""
    S = seq_len or min(m.max_seq_len, int(tokens_per_chip)) or 1
    return layer_ops(m, tokens_per_chip, S, dtype=dtype, causal=causal)


# --- helpers for the book's single-chip questions (ch.1, ch.2, ch.4, ch.9) ---------------------------

def memory_read(n_bytes: float, *, chips: int = 1, name: str = "read") -> Op:
    """Streaming `n_bytes` split evenly over `chips`, no FLOPs: each chip moves n_bytes/chips, so its
    roofline time is n_bytes/(chips·W) on whichever link W is (HBM, PCIe, ICI). Book ch.2 Q1: the decode
    latency lower bound is parameter bytes/(chips·W_hbm); ch.2 Q6: the PCIe and HBM stages."""
    _check_positive(n_bytes=n_bytes, chips=chips)
    return Op(name, 0.0, n_bytes / chips, "memory", "bf16")


def matmul_balance_batch(D: float, F: float, peak_flops_per_s: float, bandwidth_bytes_per_s: float, *,
                         lhs_dtype: str = "bf16", rhs_dtype: str = "bf16", out_dtype: str | None = None) -> float:
    """The batch B at which X[B,D]·W[D,F] turns compute-bound, solved exactly (no B ≪ D, F approximation):
    2BDF/C = (B·D·x + D·F·w + B·F·y)/W  ⇒  B = α·D·F·w / (2DF − α·(D·x + F·y)), α = C/W (book ch.2 Q4).
    `inf` when the matmul stays memory-bound at any batch."""
    _check_positive(D=D, F=F, peak_flops_per_s=peak_flops_per_s, bandwidth_bytes_per_s=bandwidth_bytes_per_s)
    x, w, y = dtype_bytes(lhs_dtype), dtype_bytes(rhs_dtype), dtype_bytes(out_dtype or lhs_dtype)
    alpha = peak_flops_per_s / bandwidth_bytes_per_s
    denom = 2.0 * D * F - alpha * (D * x + F * y)
    return alpha * D * F * w / denom if denom > 0 else float("inf")


def moe_critical_batch(peak_flops_per_s: float, bandwidth_bytes_per_s: float, n_experts: int,
                       experts_per_token: int, weight_bytes: float = 2.0) -> float:
    """Tokens per replica above which an MoE MLP is compute-bound (book ch.4 Q8, ch.7): all E experts'
    weights are read (E·D·F·w bytes) but each token uses k of them (2·k·B·D·F FLOPs), so
    B_crit = (C/W)·(w/2)·E/k. v5e, int8 weights, bf16 FLOPs, DeepSeek E=256, k=8 → 120·32 = 3840."""
    _check_positive(n_experts=n_experts, experts_per_token=experts_per_token, weight_bytes=weight_bytes)
    if experts_per_token > n_experts:
        raise MeshplanError(f"experts per token ({experts_per_token}) exceed the number of experts ({n_experts})")
    return critical_batch(peak_flops_per_s, bandwidth_bytes_per_s, weight_bytes) * n_experts / experts_per_token


def padded_shape(shape: tuple[int, ...], tile: tuple[int, ...]) -> tuple[int, ...]:
    """Physical shape of an array stored with tiling T(tile) (book ch.9, XLA layouts): the last len(tile)
    dims are each rounded up to a multiple of their tile; f32[3,5] with T(2,2) → [4,6]."""
    shape, tile = tuple(shape), tuple(tile)
    if len(tile) > len(shape):
        raise MeshplanError(f"tile {tile} has more dims than shape {shape}")
    if any(s <= 0 for s in shape) or any(t <= 0 for t in tile):
        raise MeshplanError(f"shape {shape} and tile {tile} must be positive")
    lead = len(shape) - len(tile)
    return shape[:lead] + tuple(-(-s // t) * t for s, t in zip(shape[lead:], tile, strict=True))


def padding_overhead(shape: tuple[int, ...], tile: tuple[int, ...]) -> float:
    """Memory blow-up of tiled storage: padded elements / logical elements (book ch.9: f32[3,5], T(2,2)
    → 24/15 = 1.6×). Bytes moved by a memory-bound op scale by the same factor."""
    padded, logical = 1, 1
    for p, s in zip(padded_shape(shape, tile), shape, strict=True):
        padded, logical = padded * p, logical * s
    return padded / logical
