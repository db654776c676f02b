"""The book's ideal inference bounds (ch.7 'Inference', ch.8 'Serving LLaMA 3-70B'), on plain numbers.

These are rooflines with perfect kernels: the realistic model in `step.py` reduces to them when every
efficiency is 1 and every overhead 0. All bytes and FLOPs are totals; `n_chips` share them evenly.
"""

from __future__ import annotations

import math

from meshplan.errors import MeshplanError
from meshplan.math.transformer import dtype_bytes


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


def critical_batch(peak_flops: float, hbm_bandwidth: float, weight_bits: float = 16, act_bits: float = 16) -> float:
    """Book ch.7 §8.1: B_crit = beta * C/W_hbm with beta = weight bits / activation bits."""
    _positive(peak_flops=peak_flops, hbm_bandwidth=hbm_bandwidth)
    return (weight_bits / act_bits) * peak_flops / hbm_bandwidth


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
