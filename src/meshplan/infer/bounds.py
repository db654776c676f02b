"""The book's ideal inference bounds (ch.7 'Inference', ch.8 'Serving LLaMA 3-70B'), on plain numbers.

These are rooflines with perfect kernels: the realistic model in `step.py` reduces to them when every
efficiency is 1 and every overhead 0. All bytes and FLOPs are totals; `n_chips` share them evenly.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from meshplan.errors import MeshplanError
from meshplan.math.transformer import dtype_bytes

# The decode critical batch lives in meshplan.cost.roofline.critical_batch (one function for ch.1 and ch.7):
# B_crit = (C / W_hbm) x (weight bytes / 2), C at the precision the FLOPs run at. The book's ch.7 form
# beta x alpha_hbm (beta = weight bits / activation bits) equals it only when alpha_hbm is the *bf16* C/W;
# taking alpha at the int8 peak as well (as a former `bounds.critical_batch` did) double-counts int8: 480
# instead of the book's 240 on v5e.


def _positive(**values: float) -> None:
    for k, v in values.items():
        if v is None or v <= 0:
            raise MeshplanError(f"{k} must be positive, got {v}")


def weight_bytes(params: float, dtype: str = "bf16") -> float:
    """Bytes of `params` weights stored as `dtype` (book ch.7 §memory: bf16 2 bytes, int8 1, int4 0.5)."""
    return params * dtype_bytes(dtype)


def activation_bytes(tokens: float, d_model: int, dtype: str = "bf16") -> float:
    """One [tokens, D] activation (book ch.7: an 8k prefill of LLaMA-2-13B is 8192*5120*2 = 80 MB)."""
    return tokens * d_model * dtype_bytes(dtype)


def kv_bytes_per_sequence(kv_bytes_per_token: float, context_len: float) -> float:
    """KV cache of one sequence: bytes per token x context (book ch.7 pop quiz: 100 kB x 8192)."""
    return kv_bytes_per_token * context_len


def min_decode_latency(param_bytes: float, n_chips: int, hbm_bandwidth: float) -> float:
    """Decode latency floor: stream every weight once, P_bytes/(N W_hbm) (book ch.7 §latency bounds)."""
    _positive(n_chips=n_chips, hbm_bandwidth=hbm_bandwidth)
    return param_bytes / (n_chips * hbm_bandwidth)


def ideal_decode_step(param_bytes: float, kv_bytes_per_seq: float, batch: float, n_chips: int,
                      hbm_bandwidth: float, peak_flops: float | None = None, params: float | None = None) -> float:
    """Book ch.7 §8.3: T = B*KV/(N W) + max(2 B P/(N C), P_bytes/(N W)). Without `peak_flops` only the
    memory-bound form (B*KV + P_bytes)/(N W) is used. `params` (FLOP count basis) defaults to the bytes, as
    in ch.8's int8 code (flops_time = 2 P_bytes B/(N C))."""
    _positive(n_chips=n_chips, hbm_bandwidth=hbm_bandwidth)
    total_bw = n_chips * hbm_bandwidth
    kv_time = batch * kv_bytes_per_seq / total_bw
    param_time = param_bytes / total_bw
    if peak_flops is None:
        return kv_time + param_time
    flops_time = 2.0 * batch * (params if params is not None else param_bytes) / (n_chips * peak_flops)
    return kv_time + max(flops_time, param_time)


def decode_tokens_per_s(batch: float, step_s: float) -> float:
    """Tokens per second of a batch advancing one token per step (book ch.7: B / T_step)."""
    _positive(step_s=step_s)
    return batch / step_s


def max_model_parallel_memory_bound(d_ff: int, batch: float, hbm_over_ici: float) -> float:
    """Book ch.7 §8.5: memory-bound generation turns ICI-bound only past Y = F/(B * W_hbm/W_ici)."""
    _positive(batch=batch, hbm_over_ici=hbm_over_ici)
    return d_ff / (batch * hbm_over_ici)


def max_model_parallel_compute_bound(d_ff: int, alpha: float, n_axes: int = 1) -> float:
    """Book ch.5/ch.8: compute-bound model parallelism stays under Y = M_Y * F / alpha (alpha = C/W_ici)."""
    _positive(alpha=alpha, n_axes=n_axes)
    return n_axes * d_ff / alpha


def latency_bound_threshold_bytes(n_shards: int, link_bandwidth: float, hop_latency_s: float) -> float:
    """Book ch.7 App. C: a collective is latency-bound while bytes/n_shards/W < one hop: bytes < n W t_hop."""
    return n_shards * link_bandwidth * hop_latency_s


def min_chips_for_bytes(total_bytes: float, hbm_bytes: float, power_of_two: bool = False) -> int:
    """Fewest chips whose HBM holds `total_bytes` (book ch.8); TPU slices come in powers of two
    (ch.8 code: min_topology = 2^ceil(log2(bytes/16e9)))."""
    _positive(hbm_bytes=hbm_bytes)
    n = max(math.ceil(total_bytes / hbm_bytes - 1e-9), 1)
    return 2 ** math.ceil(math.log2(n)) if power_of_two else n


def flops_per_dollar(peak_flops: float, price_per_chip_hour: float) -> float:
    """Book ch.8 hardware table: FLOPs per dollar = C * 3600 / ($ per chip-hour)."""
    _positive(price_per_chip_hour=price_per_chip_hour)
    return peak_flops * 3600.0 / price_per_chip_hour


def cost_per_million_tokens(price_per_chip_hour: float, tokens_per_s_per_chip: float) -> float:
    """Dollars per million tokens: price / 3600 / (tokens/s/chip) x 1e6 (book ch.8, derived)."""
    _positive(tokens_per_s_per_chip=tokens_per_s_per_chip)
    return price_per_chip_hour / 3600.0 / tokens_per_s_per_chip * 1e6


def kv_eviction_per_step(batch: float, prefill_len: float, decode_len: float) -> tuple[float, float]:
    """Book ch.8: each step B/G sequences finish, freeing B(P+G)/G KV tokens. Returns (sequences, tokens)."""
    _positive(decode_len=decode_len)
    return batch / decode_len, batch * (prefill_len + decode_len) / decode_len


def disaggregation_ratio(prefill_s: float, step_s: float, batch: float, decode_len: float) -> float:
    """Book ch.8: prefill servers per generate server so both stay busy. A generate server finishes
    B/(T_step G) requests per second; one prefill server handles 1/T_prefill of them."""
    _positive(step_s=step_s, decode_len=decode_len)
    return prefill_s * batch / (step_s * decode_len)


# --- ch.7 / ch.8: the ideal serving answers (memory, batch, queries per second, 2D weight-stationary) -------

def ideal_max_decode_batch(hbm_bytes_total: float, param_bytes: float, kv_bytes_per_seq: float) -> int:
    """Book ch.8 ('smallest topology' table): the largest decode batch whose KV caches fit in the HBM the
    weights leave free, floor((N x HBM - param bytes) / KV bytes per sequence); no activations, no
    fragmentation, no runtime reserve (the ideal answer; `infer.memory.max_batch_per_replica` is the
    realistic one). 0 when the weights alone do not fit. LLaMA-3-70B bf16 on a v5e 4x4:
    (16 x 16e9 - 140e9) / (8192 x 324e3) = 116e9 / 2.654e9 = 43."""
    _positive(hbm_bytes_total=hbm_bytes_total, kv_bytes_per_seq=kv_bytes_per_seq)
    free = hbm_bytes_total - param_bytes
    return max(math.floor(free / kv_bytes_per_seq + 1e-9), 0)


def queries_per_s_per_chip(batch: float, step_s: float, decode_len: float, n_chips: int) -> float:
    """Book ch.8 (throughput per chip): each request takes `decode_len` steps, so a replica of N chips
    finishes B / (T_step x G) queries per second: QPS/chip = B / (T_step x G x N). 43 / (0.019 x 512 x 16)
    = 0.28 for LLaMA-3-70B bf16 on a v5e 4x4."""
    _positive(step_s=step_s, decode_len=decode_len, n_chips=n_chips)
    return batch / (step_s * decode_len * n_chips)


def max_batch_for_step(step_target_s: float, param_bytes: float, kv_bytes_per_seq: float, n_chips: int,
                       hbm_bandwidth: float, peak_flops: float, params: float) -> int:
    """Largest batch whose ideal decode step (`ideal_decode_step`, book ch.7 §8.3) stays within a latency
    target. T(B) = B KV/(N W) + max(2 B P/(N C), P_bytes/(N W)) <= t holds iff both
    B <= (t N W - P_bytes)/KV and B <= t / (KV/(N W) + 2P/(N C)); -1 when even B = 0 misses the target."""
    _positive(step_target_s=step_target_s, n_chips=n_chips, hbm_bandwidth=hbm_bandwidth, peak_flops=peak_flops)
    bw, flops = n_chips * hbm_bandwidth, n_chips * peak_flops
    if param_bytes / bw > step_target_s:
        return -1
    per_seq_mem = kv_bytes_per_seq / bw
    per_seq = per_seq_mem + 2.0 * params / flops
    if per_seq <= 0:
        raise MeshplanError("with no KV cache and no FLOPs per sequence the batch is unbounded")
    mem = (step_target_s - param_bytes / bw) / per_seq_mem if per_seq_mem else math.inf
    return math.floor(min(mem, step_target_s / per_seq) + 1e-9)


@dataclass(frozen=True)
class ServingPoint:
    """One row of the book's ch.8 serving tables: a weight dtype on a topology at a batch."""

    weight_dtype: str
    chips: int
    param_bytes: float
    free_bytes: float
    max_batch: int
    batch: int
    step_s: float
    tokens_per_s_per_chip: float
    queries_per_s_per_chip: float

    def as_dict(self) -> dict:
        return asdict(self)


def ideal_serving_point(params: float, weight_dtype: str, kv_bytes_per_token: float, context_len: float,
                        decode_len: float, hbm_bytes: float, hbm_bandwidth: float, peak_flops: float, *,
                        chips: int | None = None, batch: int | None = None,
                        step_target_s: float | None = None, active_params: float | None = None) -> ServingPoint:
    """Book ch.8 worked answers on one topology: smallest power-of-two slice holding the weights
    (`min_chips_for_bytes`) unless `chips` is given, the largest batch the free HBM holds
    (`ideal_max_decode_batch`), optionally capped by a step latency target (`max_batch_for_step`), its
    ideal step (`ideal_decode_step`, FLOPs at 2 P B/(N C), P the parameters a token multiplies by: `active_params`,
    an MoE's active ones (book ch.4), else all) and QPS per chip."""
    _positive(params=params, context_len=context_len, decode_len=decode_len, hbm_bytes=hbm_bytes)
    pbytes = weight_bytes(params, weight_dtype)
    n = chips or min_chips_for_bytes(pbytes, hbm_bytes, power_of_two=True)
    kv_seq = kv_bytes_per_sequence(kv_bytes_per_token, context_len)
    cap = ideal_max_decode_batch(n * hbm_bytes, pbytes, kv_seq)
    b = cap if batch is None else batch
    flop_params = params if active_params is None else active_params
    if step_target_s is not None:
        b = min(b, max(max_batch_for_step(step_target_s, pbytes, kv_seq, n, hbm_bandwidth, peak_flops, flop_params),
                       0))
    step = ideal_decode_step(pbytes, kv_seq, b, n, hbm_bandwidth, peak_flops, flop_params)
    return ServingPoint(weight_dtype, n, pbytes, n * hbm_bytes - pbytes, cap, b, step, b / (step * n),
                        queries_per_s_per_chip(b, step, decode_len, n))


@dataclass(frozen=True)
class WeightStationary:
    """Book ch.7 Q7 / App. B: 2D weight-stationary (ESTI) against 1D model parallelism for one MLP."""

    n_chips: int
    x: float  # ways W_in's D is sharded (AllReduce axis)
    yz: float  # ways F is sharded (AllGather / ReduceScatter axes)
    t_math_s: float
    t_comms_2d_s: float
    t_comms_1d_s: float
    crossover_chips: float  # 2D's comms beat 1D's above this many chips
    better: str  # "2d" | "1d"

    def as_dict(self) -> dict:
        return asdict(self)


def weight_stationary_2d(batch: float, d_model: float, d_ff: float, n_chips: int, ici_bandwidth: float,
                         peak_flops: float, *, x: float | None = None, axes_1d: int = 3) -> WeightStationary:
    """Book ch.7 Q7: In[B, D_X] = AllGather_YZ, AllReduce_X after W_in, ReduceScatter_YZ after W_out:
    T_math = 4BDF/(N C); T_2D = 2BD/(X W) + 4BF/(YZ W), YZ = N/X, W = bidirectional ICI per axis.
    dT/dX = 0 gives X = sqrt(D N / (2F)) (= sqrt(N/8) for F = 4D) and T_2D = (B/W) sqrt(32 D F / N).
    1D (Megatron over `axes_1d` axes): T_1D = 4BD/(axes_1d W). 2D wins iff N > 32 (F/D) (axes_1d/4)^2
    (= 128 (3/4)^2 = 72 for F = 4D; the book's text prints 81)."""
    _positive(batch=batch, d_model=d_model, d_ff=d_ff, n_chips=n_chips, ici_bandwidth=ici_bandwidth,
              peak_flops=peak_flops, axes_1d=axes_1d)
    B, D, F, N, W = batch, d_model, d_ff, n_chips, ici_bandwidth
    X = x if x is not None else math.sqrt(D * N / (2.0 * F))
    if not 0 < X <= N:
        raise MeshplanError(f"X must lie in (0, {N}], got {X}")
    yz = N / X
    t2 = 2 * B * D / (X * W) + 4 * B * F / (yz * W)
    t1 = 4 * B * D / (axes_1d * W)
    crossover = 32.0 * (F / D) * (axes_1d / 4.0) ** 2
    return WeightStationary(N, X, yz, 4 * B * D * F / (N * peak_flops), t2, t1, crossover,
                            "2d" if t2 < t1 else "1d")
