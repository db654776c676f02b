"""Disaggregated serving: separate prefill and decode pools (book ch.8; DistServe, Zhong et al. OSDI'24).

A prefill instance turns prompts into KV caches back to back; a decode instance generates for B sequences.
Book ch.8: keep both saturated with prefill servers per generate server = T_prefill * B / (T_step * G).
The KV cache of each prompt (I * 2*L*K*H*bytes) crosses the scale-out network: every prefill chip sends its
shard through its own NIC, so T_kv = bytes / (chips * W_nic * efficiency) + one network latency.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.cost.efficiency import Efficiency
from meshplan.errors import InfeasibleError
from meshplan.infer.bounds import disaggregation_ratio
from meshplan.infer.config import ServeConfig, Workload, frontend_first_token_s, serving_constant
from meshplan.infer.memory import max_batch_per_replica
from meshplan.infer.step import decode_step, prefill_step
from meshplan.math.transformer import kv_cache_bytes_per_sequence
from meshplan.specs.hardware import Chip
from meshplan.specs.model import ModelConfig


@dataclass(frozen=True)
class DisaggPlan:
    prefill_instances: int
    decode_instances: int
    prefill_config: ServeConfig
    decode_config: ServeConfig
    decode_batch: int
    ratio: float  # prefill instances needed per decode instance (book ch.8)
    prefill_s: float
    kv_transfer_s: float
    ttft_s: float
    tpot_s: float
    throughput_tokens_per_s: float

    def as_dict(self) -> dict:
        return {
            "prefill_instances": self.prefill_instances, "decode_instances": self.decode_instances,
            "prefill_chips": self.prefill_instances * self.prefill_config.chips_per_replica,
            "decode_chips": self.decode_instances * self.decode_config.chips_per_replica,
            "prefill_config": self.prefill_config.as_dict(), "decode_config": self.decode_config.as_dict(),
            "decode_batch": self.decode_batch, "prefill_per_decode_ratio": self.ratio,
            "prefill_s": self.prefill_s, "kv_transfer_s": self.kv_transfer_s, "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s, "throughput_tokens_per_s": self.throughput_tokens_per_s,
        }


def kv_transfer_s(m: ModelConfig, chip: Chip, cfg: ServeConfig, prompt_len: int) -> float:
    """Time to ship one prompt's KV cache from a prefill instance to a decode instance over the NICs."""
    nbytes = kv_cache_bytes_per_sequence(m, prompt_len, cfg.kv_dtype)  # windowed layers ship at most their window
    bw = cfg.chips_per_replica * chip.links.scale_out_bandwidth_bytes_per_s * serving_constant(
        "kv_transfer_efficiency", chip)
    return nbytes / bw + chip.links.scale_out_hop_latency_s


def _split(n_chips: int, cp: int, cd: int, rate_p: float, rate_d: float) -> tuple[int, int]:
    """Instances (n_p, n_d) with n_p*cp + n_d*cd <= n_chips maximising min(n_p*rate_p, n_d*rate_d)."""
    best, best_rate = (0, 0), -1.0
    for nd in range(1, n_chips // cd + 1):
        npf = (n_chips - nd * cd) // cp
        if npf >= 1 and min(npf * rate_p, nd * rate_d) > best_rate:
            best, best_rate = (npf, nd), min(npf * rate_p, nd * rate_d)
    return best


def disaggregate(m: ModelConfig, chip: Chip, n_chips: int, prefill_cfg: ServeConfig, decode_cfg: ServeConfig,
                 eff: Efficiency, w: Workload, decode_batch: int | None = None) -> DisaggPlan:
    """Size the two pools for `n_chips`; the decode batch defaults to the largest that fits."""
    mb = max_batch_per_replica(m, chip, decode_cfg, eff, w)
    B = min(decode_batch or mb, mb)
    if B < 1 or n_chips < prefill_cfg.chips_per_replica + decode_cfg.chips_per_replica:
        raise InfeasibleError(f"disaggregated serving of {m.name} needs at least one prefill and one decode "
                              f"instance that fit on {n_chips} x {chip.name}")
    t_pre = prefill_step(m, chip, prefill_cfg, eff, 1, w.input_len).time_s
    t_dec = decode_step(m, chip, decode_cfg, eff, B, w.mean_decode_context).time_s
    ratio = disaggregation_ratio(t_pre, t_dec, B, w.output_len)
    n_p, n_d = _split(n_chips, prefill_cfg.chips_per_replica, decode_cfg.chips_per_replica, 1.0 / t_pre,
                      B / (t_dec * w.output_len))
    if n_p == 0:
        raise InfeasibleError(f"{n_chips} chips cannot hold one prefill and one decode instance")
    t_kv = kv_transfer_s(m, chip, prefill_cfg, w.input_len)
    req_rate = min(n_p / t_pre, n_d * B / (t_dec * w.output_len))
    # the client's TTFT also counts the server path (config.frontend_first_token_s), as in metrics.evaluate
    ttft = t_pre + t_kv + frontend_first_token_s(prefill_cfg, chip)
    return DisaggPlan(n_p, n_d, prefill_cfg, decode_cfg, B, ratio, t_pre, t_kv, ttft, t_dec, req_rate * w.output_len)
