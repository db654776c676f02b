"""Serving memory per chip: one copy of the (quantized) weights, the KV cache, activation workspace.

Book ch.7 §memory: inference keeps no gradients or optimizer state; activations are small next to weights
and KV. The KV cache of a sequence is 2*L*K*H*bytes per token (ch.4); under TP each chip holds K/tp heads
(one replicated head when tp > K) and under PP only its L/pp layers. Under attention data parallelism
(ServeConfig.attention_dp) each chip holds the whole attention and the K heads of only its own requests' tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshplan.cost.efficiency import Efficiency
from meshplan.errors import InfeasibleError
from meshplan.infer.config import (
    ServeConfig,
    Workload,
    engine_max_num_seqs,
    kv_cache_free_fraction,
    kv_heads_per_chip,
    kv_reserved_per_sequence,
    memory_utilization,
    replica_token_budget,
    serving_constant,
)
from meshplan.math.transformer import expert_params, kv_cache_elements_per_layer, kv_cached_tokens, param_counts
from meshplan.specs.hardware import Chip
from meshplan.specs.model import ModelConfig
from meshplan.units import fmt_bytes


@dataclass(frozen=True)
class MemoryBreakdown:
    weights: float
    kv_cache: float
    activations: float
    reserved: float
    budget: float  # usable HBM per chip (HBM x memory utilization)

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.activations + self.reserved

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def as_dict(self) -> dict[str, float]:
        return {"weights": self.weights, "kv_cache": self.kv_cache, "activations": self.activations,
                "reserved": self.reserved, "total": self.total, "budget": self.budget}


def layers_per_stage(m: ModelConfig, pp: int) -> int:
    """The largest pipeline stage's layer count (ceil(L/pp))."""
    return math.ceil(m.n_layers / pp)


def moe_layer_share(m: ModelConfig, pp: int = 1) -> float:
    """Share of MoE layers in the largest pipeline stage of a model with dense layers among its MoE layers: their
    mean share without PP or when they are interleaved (Llama 4); 1 with PP when the dense layers lead (DeepSeek's
    first_k_dense_replace: the later stages hold MoE layers only)."""
    if not m.first_dense_layers:
        return 1.0
    if pp == 1 or m.moe_interleave:
        return 1.0 - m.first_dense_layers / m.n_layers
    return 1.0


def layer_weight_params_per_chip(m: ModelConfig, tp: int, pp: int = 1, attention_dp: bool = False) -> float:
    """One (mean) layer's parameters on one TP chip: Q/O and MLP split tp ways (Megatron sharding, book ch.5),
    K/V projections split over KV heads (replicated when tp > K), norms replicated; MoE and dense MLPs in the
    proportion of `moe_layer_share`. Under attention DP the attention is whole on every chip and only the routed
    experts split tp ways (E/ep experts of F/(tp/ep) each); the router, the shared experts and the dense-MLP layers
    run data parallel beside the attention, whole (TensorRT-LLM modeling_deepseekv3.py: _compute_mlp_tp_size and
    _compute_shared_expert_tp_size return 1 'if using attention DP'; Qwen3Gate is an unsplit weight)."""
    pc = param_counts(m)
    share = moe_layer_share(m, pp)
    if attention_dp:
        routed = m.n_experts * expert_params(m)
        shared = pc.per_layer_mlp - routed
        whole = share * (shared + pc.per_layer_router) + (1.0 - share) * pc.per_dense_layer_mlp
        return attention_params_per_chip(m, 1) + share * routed / tp + whole + pc.per_layer_norms
    mlp = share * (pc.per_layer_mlp + pc.per_layer_router) + (1.0 - share) * pc.per_dense_layer_mlp
    return attention_params_per_chip(m, tp) + mlp / tp + pc.per_layer_norms


def attention_params_per_chip(m: ModelConfig, tp: int) -> float:
    """One layer's attention weights on one TP chip. MLA (DeepSeek-V2 §2.1): the latent down-projections and
    their norms are whole on every chip, the per-head up-projections and the output projection split tp ways."""
    pc = param_counts(m)
    if m.is_mla:
        w = m.mla_weights()
        return (w["q_up"] + w["kv_up"] + w["o"]) / tp + w["q_down"] + w["kv_down"] + m.q_lora_rank + m.kv_lora_rank
    D, H = m.d_model, m.head_dim
    q_o = 2 * D * m.q_dim / tp
    k_v = 2 * D * H * kv_heads_per_chip(m, tp)
    other_attn = pc.per_layer_attention - 2 * D * m.q_dim - 2 * D * m.kv_dim  # biases
    return q_o + k_v + other_attn / tp


def embedding_params_per_chip(m: ModelConfig, cfg: ServeConfig) -> float:
    """Embedding and output projection, vocab-sharded over TP; with PP the first stage holds one and the last
    the other, so the largest stage holds max(embed, unembed)."""
    pc = param_counts(m)
    embed = pc.embedding + pc.position
    unembed = pc.unembedding
    held = embed + unembed if cfg.pp == 1 else max(embed, unembed)
    # attention DP: both whole on every rank (TensorRT-LLM modeling_qwen3_moe.py: 'When attention_dp is enabled ...
    # we don't do parallelism here' for embed_tokens; the LM head unsplit unless enable_lm_head_tp_in_adp, default
    # False in llm_args.py)
    return held / cfg.attention_tp + pc.final_norm


def routed_expert_params_per_chip(m: ModelConfig, tp: int, pp: int = 1) -> float:
    """One (mean) layer's routed-expert parameters on one chip: E experts of 3·D·F split tp ways (E/ep whole experts
    of F/(tp/ep) each under EP; the same count), in the stage's MoE share of layers."""
    return moe_layer_share(m, pp) * m.n_experts * expert_params(m) / tp if m.is_moe else 0.0


def weight_bytes_per_chip(m: ModelConfig, cfg: ServeConfig) -> float:
    """Weights on the most loaded chip of a replica; the routed experts at their own format
    (ServeConfig.expert_weight_bytes: MXFP4 in gpt-oss's checkpoint)."""
    n = layers_per_stage(m, cfg.pp)
    routed = n * routed_expert_params_per_chip(m, cfg.tp, cfg.pp)
    layers = n * layer_weight_params_per_chip(m, cfg.tp, cfg.pp, cfg.attention_dp)
    return (layers - routed + embedding_params_per_chip(m, cfg)) * cfg.weight_bytes + routed * cfg.expert_weight_bytes


def kv_bytes_per_token_per_chip(m: ModelConfig, cfg: ServeConfig) -> float:
    """KV cache bytes one token adds to one chip: 2 * (L/pp) * (K/tp heads) * H * bytes (book ch.4, ch.7).
    MLA caches one latent per token that every TP chip needs whole (it is shared by the heads):
    (L/pp) * (kv_lora_rank + qk_rope_head_dim) * bytes (DeepSeek-V2 §2.1.2).
    Under attention DP a token's KV lives on its own request's rank only, all K heads once (no head replication):
    2 * (L/pp) * K * H * bytes per token of that rank (kv_sequences_per_chip counts the rank's sequences)."""
    if m.is_mla:
        return layers_per_stage(m, cfg.pp) * kv_cache_elements_per_layer(m) * cfg.kv_bytes
    return 2.0 * layers_per_stage(m, cfg.pp) * kv_heads_per_chip(m, cfg.attention_tp) * m.head_dim * cfg.kv_bytes


def kv_sequences_per_chip(cfg: ServeConfig, batch: float) -> float:
    """Sequences whose KV one chip holds: every sequence of the replica under TP (each chip its heads of all), the
    rank's share batch / tp under attention DP (balanced: the engines hand requests to ranks by load)."""
    return batch / cfg.attention_dp_size


def activation_bytes_per_chip(m: ModelConfig, chip: Chip, cfg: ServeConfig, batch: int) -> float:
    """Step workspace: the step token budget (max_num_batched_tokens) of live activations (a few D-wide tensors and the 2F/tp MLP
    hidden) plus fp32 logits for the decode batch (vocab-sharded). vLLM profile_run reserves the same."""
    tokens = replica_token_budget(chip, cfg)
    dp = cfg.attention_dp_size
    width = serving_constant("activation_workspace_factor", chip) * m.d_model
    f = m.d_ff * (m.experts_per_token if m.is_moe else 1)
    # attention DP: a rank's own tokens (replica budget / ranks) through the attention-side tensors, the MoE hidden
    # 2F·k/tp of every rank's tokens (gathered before the experts: AllGatherReduceScatter.dispatch)
    logits = kv_sequences_per_chip(cfg, batch) * m.vocab_size / cfg.attention_tp * 4.0
    return (tokens / dp * width + tokens * 2 * f / cfg.tp) * cfg.act_bytes + logits


def memory_per_chip(m: ModelConfig, chip: Chip, cfg: ServeConfig, eff: Efficiency, batch: int,
                    context_len: float) -> MemoryBreakdown:
    """Per-chip memory of a replica serving `batch` sequences of up to `context_len` tokens each. With PP
    each stage holds the KV of every sequence for its own layers. Sliding-window and chunked layers keep at most
    their window (`kv_cached_tokens`, the mean over the model's layers)."""
    weights, acts = weight_bytes_per_chip(m, cfg), activation_bytes_per_chip(m, chip, cfg, batch)
    fixed = weights + acts + eff.memory_reserved_bytes
    return MemoryBreakdown(
        weights=weights,
        kv_cache=kv_sequences_per_chip(cfg, batch) * kv_cached_tokens(m, context_len) * kv_bytes_per_token_per_chip(m, cfg),
        activations=acts,
        reserved=eff.memory_reserved_bytes,
        budget=memory_budget_bytes(chip, cfg, fixed),
    )


def memory_budget_bytes(chip: Chip, cfg: ServeConfig, fixed_bytes: float) -> float:
    """Usable bytes per chip for a replica whose non-KV memory (weights, activations, runtime) is `fixed_bytes`:
    memory_utilization of the device (vLLM, SGLang), or for engines with a free-memory rule (TensorRT-LLM) the fixed
    bytes plus that fraction of what they leave free (`kv_cache_free_fraction`)."""
    frac = kv_cache_free_fraction(cfg, chip)
    if frac is None:
        return chip.usable_hbm_bytes * memory_utilization(cfg, chip)
    return fixed_bytes + frac * max(chip.usable_hbm_bytes - fixed_bytes, 0.0)


def max_batch_per_replica(m: ModelConfig, chip: Chip, cfg: ServeConfig, eff: Efficiency, w: Workload) -> int:
    """Most sequences one replica holds, each with the KV its engine keeps for it (`kv_reserved_per_sequence`: the
    full input+output under TensorRT-LLM's default guaranteed-no-evict scheduling and meshplan's default; the mean
    context for engines that allocate on demand), capped by the engine's max_num_seqs. 0 when even the weights do
    not fit."""
    held = kv_reserved_per_sequence(cfg, chip, w)
    empty = memory_per_chip(m, chip, cfg, eff, 0, held)
    # per chip and per sequence it holds: under attention DP a rank holds its own sequences (the replica's batch is
    # ranks x the rank's: kv_sequences_per_chip), each with its logits row
    dp = cfg.attention_dp_size
    kv_seq = kv_cached_tokens(m, held) * kv_bytes_per_token_per_chip(m, cfg)
    act_seq = activation_bytes_per_chip(m, chip, cfg, dp) - activation_bytes_per_chip(m, chip, cfg, 0)
    frac = kv_cache_free_fraction(cfg, chip)
    # free-memory rule: B·kv_seq <= frac·(usable - fixed(0) - B·act_seq), each sequence's activations also shrink
    # the free part; device rule: B·(kv_seq + act_seq) <= budget - fixed(0)
    per_seq = kv_seq + (act_seq if frac is None else frac * act_seq)
    free = empty.budget - empty.total
    fit = dp * max(int(free // per_seq), 0) if free > 0 else 0
    cap = engine_max_num_seqs(cfg, chip)  # the engine's own cap on sequences in flight (vLLM max_num_seqs)
    return fit if cap is None else min(fit, cap)


def require_fit(m: ModelConfig, chip: Chip, cfg: ServeConfig, eff: Efficiency, w: Workload, batch: int) -> None:
    """Raise a one-line error saying what a batch needs per chip against what the chip offers."""
    mem = memory_per_chip(m, chip, cfg, eff, batch, kv_reserved_per_sequence(cfg, chip, w))
    if mem.fits:
        return
    raise InfeasibleError(
        f"batch {batch} does not fit: it needs {fmt_bytes(mem.total)} per chip (weights {fmt_bytes(mem.weights)}, "
        f"KV cache {fmt_bytes(mem.kv_cache)}, activations+reserve {fmt_bytes(mem.activations + mem.reserved)}) "
        f"but {chip.name} offers {fmt_bytes(mem.budget)} usable; largest batch that fits per replica is "
        f"{max_batch_per_replica(m, chip, cfg, eff, w)}")
