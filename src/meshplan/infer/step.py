"""One engine step of a replica: decode tokens of `decode_seqs` sequences plus `prefill_tokens` prompt tokens.

Per chip and per pipeline stage (book ch.7 §8.3, extended with efficiencies and latency terms):
  T_stage = max(T_weights, T_matmul) + max(T_kv, T_attention) + T_collectives + T_kernels
  T_weights   = weight bytes read / (W_hbm * hbm_fraction)          (every weight once per micro-batch)
  T_matmul    = sum over the GEMMs of 2 * rows * weights / (C * efficiency(rows, narrower weight width after TP)):
                the layer's dense GEMMs at the step's tokens, the output projection at the sampled rows, MoE routed
                experts at tokens * k / E rows (each expert's grouped-GEMM problem); efficiency = large-GEMM fraction
                times the penalty of the most constraining dimension (`_matmul_fraction`)
  T_kv        = KV bytes read / (W_hbm * hbm_fraction)              (decode attention is HBM-bound, ch.7 §8.2;
                a dense cache, ServeConfig.dense_kv_cache, is read over its whole length)
  T_attention = 2 * tokens * context * N * (QK + AV widths, 2H; MLA decode: 2*kv_lora + rope) / (C * attention_fwd_fraction)
                (a prompt's part times the fused kernel's tile factor, or on the engine's own measured prompt-attention
                op: serving.yaml engine_context_attention, a fixed cost per layer and its own rate and tiles)
  T_collectives: 2 all-reduces of tokens*D per layer over TP (Megatron, ch.5), MoE all-to-alls over EP,
                 with latency terms (small-batch decode is latency-bound, ch.7 App. C)
  T_kernels   = layers * kernels per layer * per-kernel overhead (launch/ramp, serving.yaml, efficiency.yaml)
  T_moe_permute = layers * 2 * tokens * D * (k + 1) * act bytes / (W_hbm * hbm_fraction)  (MoE expand + finalize)
  T_pointwise = layers * tokens * pointwise elements per token * act bytes / (W_hbm * hbm_fraction)  (norms,
                residual adds, RoPE, activation: the training ledger's pointwise tensors, HBM-bound; 8·D instead of
                10·D for the adds and norms where the engine fuses each add into the next RMSNorm)
The output projection runs only for the rows that sample a token: every decode sequence and the last position of
each prompt chunk (vLLM LogitsProcessor over logits_indices; TensorRT-LLM gather_context_logits off by default).
With PP the batch splits into m = min(pp, sequences) micro-batches; a token step visits every stage, so
  T_step = pp * T_stage(batch / m) + pp * T_p2p + step overhead + streamed tokens * per-token host cost of the
  server path (serving.yaml frontend_token_s; in series for a serial engine loop, its excess for one a step ahead).
Attention data parallelism (ServeConfig.attention_dp, `_rank_load`): each of the tp ranks runs the attention side of
the layer (whole attention weights, its own sequences' KV, norms, dense MLP and shared experts, LM head) for its own
tokens, the busiest rank setting the step (the ranks meet at the MoE); the MoE sees every rank's tokens, gathered
by an all-gather before the experts and returned by a reduce-scatter after them instead of the TP all-reduces
(TensorRT-LLM fused_moe/communication/allgather_reducescatter.py: dispatch = allgather of the post-quant hidden
states, routing ids and scales; combine = reducescatter).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from meshplan.cost.efficiency import Efficiency, attention_tile_factor, default_efficiency, tile_factor
from meshplan.errors import InfeasibleError
from meshplan.infer.config import (
    ServeConfig,
    custom_allreduce,
    decode_attention_kv_rate,
    engine_context_attention,
    engine_grouped_kernel,
    engine_host_step_s,
    expert_gemm_format,
    frontend_token_s,
    fused_add_norm,
    kv_heads_per_chip,
    schedules_ahead,
    serving_constant,
)
from meshplan.infer.memory import (
    attention_params_per_chip,
    expert_params,
    kv_bytes_per_token_per_chip,
    layers_per_stage,
    moe_layer_share,
)
from meshplan.math.transformer import (
    attention_pair_width,
    dtype_bytes,
    kv_cached_tokens,
    masked_tile_share,
    mean_attended_keys,
    param_counts,
    pointwise_elements_per_token,
    touched_experts,
)
from meshplan.specs.hardware import Chip
from meshplan.specs.model import ModelConfig


@dataclass(frozen=True)
class StepCost:
    time_s: float
    parts: dict[str, float]  # seconds per step, by term (summing to time_s)
    bound: str  # the largest term

    def as_dict(self) -> dict:
        return {"time_s": self.time_s, "parts": dict(self.parts), "bound": self.bound}


@dataclass(frozen=True)
class _LayerParams:
    """One layer's parameters on one TP chip."""

    dense: float  # attention, norms, router, shared experts (always read)
    routed_expert: float  # one routed expert's share on this chip (0 for dense models)
    n_routed: int  # E (0 for dense)
    active: float  # parameters a token multiplies by (FLOP basis)


@lru_cache(maxsize=256)
def _layer_params(m: ModelConfig, tp: int, pp: int = 1, attention_dp: bool = False) -> _LayerParams:
    """Under attention DP the attention, router, shared experts and dense MLPs are whole on each rank (memory.py
    layer_weight_params_per_chip) and only the routed experts split tp ways."""
    pc = param_counts(m)
    atp = 1 if attention_dp else tp  # the TP degree of everything but the routed experts
    attn = attention_params_per_chip(m, atp) + pc.per_layer_norms
    if not m.is_moe:
        mlp = pc.per_layer_mlp / tp
        return _LayerParams(attn + mlp, 0.0, 0, attn + mlp)
    expert = expert_params(m)  # book ch.4 MoE: E experts of 3DF
    shared = pc.per_layer_mlp - m.n_experts * expert
    # the mean layer of the stage: MoE layers in the share moe_layer_share, dense MLPs (DeepSeek, Llama 4) the rest
    share = moe_layer_share(m, pp)
    dense_mlp = (1.0 - share) * pc.per_dense_layer_mlp / atp
    dense = attn + share * (shared + pc.per_layer_router) / atp + dense_mlp
    active_shared = pc.per_layer_mlp_active - m.experts_per_token * expert
    active = attn + share * (active_shared + pc.per_layer_router) / atp + share * m.experts_per_token * expert / tp \
        + dense_mlp
    return _LayerParams(dense, share * expert / tp, m.n_experts, active)


def tokens_per_expert(m: ModelConfig, tokens: float) -> float:
    """Rows of each routed expert's GEMM when `tokens` tokens each pick k of E experts, balanced routing:
    tokens * k / E (GShard/Switch load-balanced routing; dropless engines give each expert its share)."""
    return tokens * m.experts_per_token / m.n_experts if m.is_moe else tokens


def moe_permute_bytes(tokens: float, d_model: int, copies: float, act_bytes: float) -> float:
    """HBM bytes one MoE layer's permutation moves: each token's D-vector read once and written `copies` times
    (TensorRT-LLM expandInputRows), then the copies read and one sum written (finalizeMoeRouting): 2 x tokens x D x
    (copies + 1) elements."""
    return 2.0 * tokens * d_model * (copies + 1) * act_bytes


def rows_per_touched_expert(m: ModelConfig, tokens: float) -> float:
    """Rows of each routed expert's GEMM that the step runs: the tokens x k routed rows over the experts they touch
    (`touched_experts`, uniform routing). Where every expert is touched (tokens x k >> E) this is tokens_per_expert;
    at a decode batch of a fine-grained MoE (4 tokens x top-4 of gpt-oss's 128 experts) about 15 experts run about one
    row each and the other 113 run nothing, where the balanced share tokens x k / E = 0.125 would price all 128 as
    skinny GEMMs (session 25: gpt-oss-120b on one H200 read 43 ms a token against 7 ms measured)."""
    if not m.is_moe:
        return tokens
    touched = touched_experts(m, tokens)
    return tokens * m.experts_per_token / touched if touched > 0 else 0.0


def _matmul_fraction(eff: Efficiency, compute_dtype: str, tokens: float, weight_dim: float = float("inf"),
                     grouped: bool = False, engine_kernel: tuple[float, float, float] | None = None) -> float:
    """Large-GEMM fraction (fp8 or bf16) times the penalty of the GEMM's most constraining dimension: the skinny-GEMM
    row penalty m/(m + rows_half) of its `tokens` rows, or the thin-dimension penalty d/(d + half_dim) of its
    narrower weight dimension `weight_dim` (tile and wave quantization: the penalty `Efficiency.matmul` applies to
    the smallest of a GEMM's dimensions and training applies to every GEMM, book ch.12; efficiency.yaml
    matmul_half_dim). `grouped`: one expert's problem of a MoE layer's grouped GEMM, which also stays under the
    grouped kernel's own large-problem ceiling (efficiency.yaml grouped_matmul_peak_fraction, times the thin-dimension
    penalty): the row penalty is the tiles', the ceiling the kernel's main loop (`Efficiency.grouped_matmul`).
    `engine_kernel`: the serving engine's own MoE kernel's curve where it is measured (config.engine_grouped_kernel:
    fraction x rows / (rows + rows_half) x d / (d + half_dim) of the compute dtype's peak, both penalties measured with
    the kernel), which then times each expert problem in place of the generic rate and the chip's grouped ceiling."""
    scale = eff.dtype_scale(compute_dtype)
    rows = tokens / (tokens + eff.matmul_rows_half)
    thin = weight_dim / (weight_dim + eff.matmul_half_dim) if weight_dim < float("inf") else 1.0
    frac = eff.matmul_peak_fraction * scale * min(rows, thin)
    if not grouped:
        return frac
    if engine_kernel is not None:
        fraction, rows_half, half_dim = engine_kernel
        engine_thin = weight_dim / (weight_dim + half_dim) if weight_dim < float("inf") else 1.0
        return fraction * engine_thin * tokens / (tokens + rows_half)
    return min(frac, eff.grouped_ceiling(weight_dim) * scale)


def routed_expert_gemm_s(m: ModelConfig, chip: Chip, cfg: ServeConfig, eff: Efficiency, tokens: float,
                         fmt: str | None = None) -> float:
    """One MoE layer's routed-expert GEMMs (gate/up and down) for `tokens` tokens of the replica on one chip: 2 x
    tokens x k x (the expert's weights on the chip) FLOPs at the step's GEMM rate, each touched expert a problem of
    `rows_per_touched_expert` rows whose narrower weight dimension is min(D, F / (tp / ep)) (each expert's F splits
    over the tp/ep chips sharing it; vLLM fused_moe, TensorRT-LLM's MoE plugin, Megablocks: one grouped GEMM).
    stage_parts adds it to the layer's GEMM term; benchmarks/kernel_check.py times measured MoE layers with it.
    The engine's own MoE kernel curve times each problem where serving.yaml engine_grouped_matmul_peak_fraction measures
    it for the experts' format (`fmt`, default config.expert_gemm_format: bf16, per-tensor fp8, block-scaled fp8, mxfp4)."""
    if not m.is_moe or tokens <= 0:
        return 0.0
    lp = _layer_params(m, cfg.tp, cfg.pp, cfg.attention_dp)
    cdt = cfg.compute_dtype(chip)
    expert_ff = m.d_ff / max(cfg.tp // cfg.ep, 1)
    flops = 2.0 * tokens * m.experts_per_token * lp.routed_expert
    kernel = engine_grouped_kernel(cfg, chip, fmt or expert_gemm_format(m, cfg, chip))
    return flops / (chip.peak(cdt) * _matmul_fraction(eff, cdt, rows_per_touched_expert(m, tokens),
                                                      min(m.d_model, expert_ff), grouped=True,
                                                      engine_kernel=kernel))


@lru_cache(maxsize=256)
def _dense_gemms(m: ModelConfig, tp: int, pp: int = 1, attention_dp: bool = False) -> tuple[tuple[float, float], ...]:
    """(weights on one TP chip, narrower weight dimension) of each non-routed GEMM of the mean layer; the weights
    add up to `_LayerParams.active` less the routed experts. Attention as the engines run it: one fused QKV GEMM
    (vLLM QKVParallelLinear, TensorRT-LLM's fused QKV) and the output projection, or MLA's five projections
    (DeepSeek-V2 §2.1, as training times them); biases and norms ride with the first. The rest (dense MLP, shared
    experts, router) at the MLP's F/tp, as training times it (train/costmodel.py _matmul_term). Under attention DP
    all of them are whole on the rank (tp 1 here), run at the rank's own tokens."""
    lp = _layer_params(m, tp, pp, attention_dp)
    D = m.d_model
    routed = m.experts_per_token * lp.routed_expert if m.is_moe else 0.0
    tp = 1 if attention_dp else tp
    attn = attention_params_per_chip(m, tp)
    if m.is_mla:
        w, N = m.mla_weights(), m.n_heads
        q_in = m.q_lora_rank or D
        parts = [(w["kv_down"], m.kv_lora_rank + m.qk_rope_head_dim), (w["q_down"], m.q_lora_rank),
                 (w["q_up"] / tp, min(q_in, N * m.qk_head_dim / tp)),
                 (w["kv_up"] / tp, min(m.kv_lora_rank, N * (m.head_dim + m.v_dim) / tp)),
                 (w["o"] / tp, min(D, N * m.v_dim / tp))]
        parts = [(p, d) for p, d in parts if p > 0]
    else:
        qkv_width = m.q_dim / tp + 2 * m.head_dim * kv_heads_per_chip(m, tp)
        parts = [(D * qkv_width, min(D, qkv_width)), (D * m.q_dim / tp, min(D, m.q_dim / tp))]
    extra = attn - sum(p for p, _ in parts)  # biases, MLA's latent norms
    parts[0] = (parts[0][0] + extra, parts[0][1])
    parts.append((lp.active - routed - attn, min(D, m.d_ff / tp)))
    return tuple((p, d) for p, d in parts if p > 0)


def _allreduce_s(chip: Chip, cfg: ServeConfig, nbytes: float, group: int,
                 hbm_bytes_per_s: float | None = None) -> float:
    """All-reduce over `group` TP chips. On GPUs inside one NVLink domain, a message up to custom_allreduce_max_bytes
    goes to the engine's own kernel whenever it is eligible, not to NCCL (vLLM GroupCoordinator.all_reduce tries
    CustomAllreduce.should_custom_ar before pynccl; TensorRT-LLM AllReduceStrategy.AUTO), where the engine has one
    (serving.yaml engine_custom_allreduce: LMDeploy TurboMind v0.1 reduces with NCCL only). The kernel is one-shot
    (each GPU reads group-1 peer buffers over NVLink, one synchronisation) or, for large messages, two-shot
    (reduce-scatter then all-gather: 2(group-1)/group of the bytes over NVLink, two synchronisations; NVIDIA blog
    '3x Faster AllReduce with NVSwitch and TensorRT-LLM MultiShot', 2024; vLLM custom_all_reduce.cuh 1stage/2stage),
    whichever is faster. Otherwise the collectives model (ring/SHARP/torus with hop latency); on a TPU the merges of
    its reduce-scatter half run on the TensorCore in series (`_tpu_merges_s`)."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    if chip.kind == "gpu" and group <= chip.links.nvlink_domain_size and custom_allreduce(cfg, chip) \
            and custom_allreduce_fabric(chip, group) and nbytes <= serving_constant("custom_allreduce_max_bytes", chip):
        lat = serving_constant("custom_allreduce_latency_s", chip)
        if chip.links.fast_domain == "nvswitch":
            W = chip.links.nvlink_bandwidth_bytes_per_s * serving_constant("custom_allreduce_nvlink_fraction", chip)
        else:  # the peers' buffers over PCIe or the group's Infinity Fabric links, at the fabric's collective rate
            from meshplan.cost.collectives import efficiency

            W = chip.links.group_bandwidth_bytes_per_s(group) * efficiency(chip.links.fast_link, nbytes, chip.name, group)
        one_shot = lat + nbytes * (group - 1) / W
        two_shot = 2 * lat + 2 * nbytes * (group - 1) / group / W
        return min(one_shot, two_shot)
    from meshplan.cost.collectives import group_collective
    from meshplan.cost.topology import make_cluster

    return (group_collective("allreduce", nbytes, make_cluster(chip, group), group).time_s
            + _tpu_merges_s(chip, nbytes, group, hbm_bytes_per_s))


def _tpu_merges_s(chip: Chip, nbytes: float, group: int, hbm_bytes_per_s: float | None) -> float:
    """TensorCore seconds of a TPU reduce-scatter's (or all-reduce's) merges over `group` chips of an `nbytes` array
    per chip (collectives.tpu_reduction_s, the training ledger's term): every received chunk is added to the local
    partial through HBM, which the serving engines' XLA collectives do on the TensorCore (libtpu's default; the
    SparseCore offload flags appear only in tpu-inference's autotune sweeps, .buildkite/xla_autotune/flags.txt).
    `hbm_bytes_per_s`: the step's HBM rate (default: the chip's at its default efficiency). 0 on GPUs."""
    if chip.kind != "tpu" or group <= 1:
        return 0.0
    from meshplan.cost.collectives import tpu_reduction_s

    if hbm_bytes_per_s is None:
        hbm_bytes_per_s = chip.hbm_bandwidth_bytes_per_s * default_efficiency(chip).hbm_fraction
    return float(tpu_reduction_s(nbytes, group, hbm_bytes_per_s))


def custom_allreduce_fabric(chip: Chip, group: int) -> bool:
    """Whether the node fabric lets the engines' one-shot all-reduce kernel (each GPU reading its peers' buffers)
    run for a TP group of `group` GPUs: an NVLink domain, or AMD's fully connected Infinity Fabric, always; GPUs on
    PCIe only in pairs (vLLM vllm/distributed/device_communicators/custom_all_reduce.py: 'Custom allreduce is
    disabled because it's not supported on more than two PCIe-only GPUs'; the other engines taken alike)."""
    return chip.links.fast_domain != "pcie" or group <= 2


def _alltoall_s(chip: Chip, nbytes: float, group: int) -> float:
    if group <= 1 or nbytes <= 0:
        return 0.0
    from meshplan.cost.collectives import group_collective
    from meshplan.cost.topology import make_cluster

    return group_collective("alltoall", nbytes, make_cluster(chip, group), group).time_s


def _p2p_s(chip: Chip, cfg: ServeConfig, nbytes: float) -> float:
    """Send one micro-batch's activations to the next stage (permute, book ch.3)."""
    if cfg.pp <= 1 or nbytes <= 0:
        return 0.0
    from meshplan.cost.collectives import group_collective
    from meshplan.cost.topology import make_cluster

    n = cfg.tp * cfg.pp
    try:
        return group_collective("permute", nbytes / cfg.tp, make_cluster(chip, n), cfg.pp, cfg.tp).time_s
    except InfeasibleError:
        if not chip.links.is_torus:
            raise
    # the default slice does not line the stages up (12 v5e chips as 3x4, stride 4): allocate the replica as a
    # tp x pp rectangle, TP along one torus axis and the stages along the next
    cluster = make_cluster(chip, n, (cfg.tp, cfg.pp))
    return group_collective("permute", nbytes / cfg.tp, cluster, cfg.pp, cfg.tp).time_s


def _gather_s(chip: Chip, kind: str, nbytes: float, group: int, hbm_bytes_per_s: float | None = None) -> float:
    """All-gather or reduce-scatter of a `nbytes` gathered array over `group` chips (collectives model); a TPU
    reduce-scatter adds its TensorCore merges (`_tpu_merges_s`)."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    from meshplan.cost.collectives import group_collective
    from meshplan.cost.topology import make_cluster

    merges = _tpu_merges_s(chip, nbytes, group, hbm_bytes_per_s) if kind == "reducescatter" else 0.0
    return group_collective(kind, nbytes, make_cluster(chip, group), group).time_s + merges


def attention_dp_moe_bytes(m: ModelConfig, chip: Chip, cfg: ServeConfig, tokens: float) -> tuple[float, float]:
    """(dispatch, combine) bytes of one MoE layer under attention DP, the whole gathered array of the replica's
    `tokens`: the all-gather carries each token's hidden state after quantization (fp8: 1 byte per element where the
    GEMMs run fp8, else the activation bytes) with its k routing ids (int32, 4 bytes) and k scales (fp32); the reduce-scatter
    the experts' activation-dtype outputs (TensorRT-LLM AllGatherReduceScatter.dispatch 'always post-quant dispatch'
    of [hidden_states, hidden_states_sf, token_selected_slots, token_final_scales]; combine: reducescatter)."""
    k = m.experts_per_token
    hidden = dtype_bytes("fp8") if cfg.compute_dtype(chip) == "fp8" else cfg.act_bytes
    dispatch = tokens * (m.d_model * hidden + 2 * k * dtype_bytes("fp32"))
    return dispatch, tokens * m.d_model * cfg.act_bytes


def _layer_comm_s(m: ModelConfig, chip: Chip, cfg: ServeConfig, tokens: float,
                  hbm_bytes_per_s: float | None = None) -> float:
    """Collectives of one layer: attention-out all-reduce; MLP-out all-reduce, or for MoE with ep > 1 the
    dispatch and combine all-to-alls (k copies of each token, DeepSpeed-MoE/GShard) plus an all-reduce
    over the tp/ep chips sharing each expert. Under attention DP (`tokens`: the replica's) no attention all-reduce;
    each MoE layer an all-gather and a reduce-scatter over the tp ranks (attention_dp_moe_bytes), the dense-MLP
    layers none (they run data parallel): the mean layer carries moe_layer_share of them."""
    if cfg.attention_dp:
        dispatch, combine = attention_dp_moe_bytes(m, chip, cfg, tokens)
        share = moe_layer_share(m, cfg.pp)
        return share * (_gather_s(chip, "allgather", dispatch, cfg.tp)
                        + _gather_s(chip, "reducescatter", combine, cfg.tp, hbm_bytes_per_s))
    act = tokens * m.d_model * cfg.act_bytes
    t = _allreduce_s(chip, cfg, act, cfg.tp, hbm_bytes_per_s)
    if m.is_moe and cfg.ep > 1:
        t += 2 * _alltoall_s(chip, act * m.experts_per_token, cfg.ep)
        t += _allreduce_s(chip, cfg, act, cfg.tp // cfg.ep, hbm_bytes_per_s)
    else:
        t += _allreduce_s(chip, cfg, act, cfg.tp, hbm_bytes_per_s)
    return t


def stage_parts(m: ModelConfig, chip: Chip, cfg: ServeConfig, eff: Efficiency, decode_seqs: float,
                decode_ctx: float, prefill_tokens: float, prefill_ctx: float,
                prefill_seqs: float | None = None) -> dict[str, float]:
    """Seconds of each term for one micro-batch through one pipeline stage. `prefill_seqs`: prompt chunks in the
    step (each samples from its last position; default one when there are prefill tokens)."""
    Ls = layers_per_stage(m, cfg.pp)
    lp = _layer_params(m, cfg.tp, cfg.pp, cfg.attention_dp)
    atp = cfg.attention_tp
    tokens = decode_seqs + prefill_tokens  # the replica's: what the MoE layers see
    if prefill_seqs is None:
        prefill_seqs = 1.0 if prefill_tokens > 0 else 0.0
    # the busiest rank's share of the step (all of it without attention DP)
    decode_seqs, prefill_tokens, prefill_seqs = _rank_load(cfg, decode_seqs, prefill_tokens, prefill_seqs)
    rank_tokens = decode_seqs + prefill_tokens
    W = chip.hbm_bandwidth_bytes_per_s * eff.hbm_fraction
    cdt = cfg.compute_dtype(chip)
    # weights streamed: every layer (routed experts only where hit by the replica's tokens) and the vocab-sharded
    # output projection (whole under attention DP); the embedding table is a gather of a few rows, not a read
    dense_weights = Ls * lp.dense + m.d_model * m.vocab_size / atp
    routed_weights = Ls * lp.routed_expert * touched_experts(m, tokens)
    # windowed layers read at most their window of cached keys; a prompt's queries attend the keys of
    # `mean_attended_keys` (prefill_ctx is the causal mean T/2 of a T-token prompt)
    # a dense cache: decode attention reads every slot of the sequence's cache, written or not
    # (ServeConfig.dense_kv_cache; JetStream-PyTorch jetstream_pt/layers.py)
    decode_ctx = kv_cached_tokens(m, decode_ctx) if cfg.dense_kv_cache is None else float(cfg.dense_kv_cache)
    prompt_len = 2.0 * prefill_ctx
    prefill_ctx = mean_attended_keys(m, prompt_len) if prefill_ctx else 0.0
    kv_per_token = kv_bytes_per_token_per_chip(m, cfg)
    kv_bytes = kv_per_token * (decode_seqs * decode_ctx + prefill_tokens)
    # logits only for the sampled rows: each decode sequence and the last position of each prompt chunk
    logit_rows = decode_seqs + min(prefill_seqs, prefill_tokens)
    # per head and (query, cached token) pair: QKᵀ + AV widths. MLA decodes in the latent space with the
    # up-projections absorbed (DeepSeek-V2 §2.1.2): scores over kv_lora_rank + RoPE, values over kv_lora_rank;
    # its prefill up-projects K and V as training does
    decode_pair = attention_pair_width(m, absorbed=True)
    decode_attn_flops = 2.0 * Ls * m.n_heads / atp * decode_pair * decode_seqs * decode_ctx
    prefill_attn_flops = 2.0 * Ls * m.n_heads / atp * attention_pair_width(m) * prefill_tokens * prefill_ctx
    # the routed experts at their own format (ServeConfig.expert_weight_bytes: gpt-oss's MXFP4), the rest at weight_bytes
    t_w = (dense_weights * cfg.weight_bytes + routed_weights * cfg.expert_weight_bytes) / W
    t_mm = 0.0
    if tokens > 0:
        # every GEMM at its own shape (efficiency.py): the layer's dense GEMMs at the step's rows (the rank's under
        # attention DP) and their weight widths, the output projection at the sampled rows (d_model x vocab/tp),
        # each routed expert at its rows (of the replica's tokens)
        peak = chip.peak(cdt)
        t_mm = sum(2.0 * rank_tokens * Ls * p / (peak * _matmul_fraction(eff, cdt, rank_tokens, d))
                   for p, d in _dense_gemms(m, cfg.tp, cfg.pp, cfg.attention_dp)) if rank_tokens > 0 else 0.0
        if logit_rows > 0:
            vocab = m.vocab_size / atp
            t_mm += 2.0 * logit_rows * m.d_model * vocab / (
                peak * _matmul_fraction(eff, cdt, logit_rows, min(m.d_model, vocab)))
        # the routed experts as one grouped GEMM of a problem per touched expert (0 for a dense model)
        t_mm += Ls * routed_expert_gemm_s(m, chip, cfg, eff, tokens)
    t_kv = kv_bytes / W
    # the decodes' KV read at the rate the engine's decode attention kernel reaches with this many (sequence, KV head)
    # units, where it is measured and slower than the HBM stream (serving.yaml engine_decode_attention_kv_rate: few
    # units leave SMs idle); MLA's latent cache is read by other kernels (FlashMLA) and keeps the HBM stream
    rate = decode_attention_kv_rate(cfg, chip, decode_seqs * kv_heads_per_chip(m, atp)) \
        if decode_seqs > 0 and not m.is_mla else None
    if rate is not None and rate < W:
        t_kv = kv_per_token * (decode_seqs * decode_ctx / rate + prefill_tokens / W)
    # a prompt's attention at the fused kernel's rate for its keys per query, window and tiles (the training
    # ledger's rule, efficiency.attention_tile_factor: 1 where the chip has no tile constant), or on the engine's own
    # measured prompt-attention op (config.engine_context_attention: a fixed cost per layer, less the launch the
    # kernel count below already charges, and its own rate and tiles)
    peak_bf16 = chip.peak("bf16")
    t_attn = decode_attn_flops / (peak_bf16 * eff.attention_fwd_fraction)
    if prefill_attn_flops > 0:
        mask = masked_tile_share(m, prompt_len)
        width = attention_pair_width(m)  # the head's d_qk + d_v: a narrower head pays its fixed work per tile whole
        ctx = engine_context_attention(cfg, chip)
        if ctx is None:
            t_attn += prefill_attn_flops * attention_tile_factor(eff, "fwd", prefill_ctx, mask, width=width) / (
                peak_bf16 * eff.attention_fwd_fraction)
        else:
            fixed_s, frac, k = ctx
            t_attn += Ls * max(fixed_s - eff.kernel_overhead_s, 0.0) \
                + prefill_attn_flops * tile_factor(k, prefill_ctx, mask, width=width) / (peak_bf16 * frac)
    kernels = Ls * serving_constant("decode_kernels_per_layer", chip) * eff.kernel_overhead_s
    permute = 0.0
    if m.is_moe:  # routing kernels around the expert GEMMs (serving.yaml moe_routing_kernels_per_layer)
        kernels += Ls * serving_constant("moe_routing_kernels_per_layer", chip) * eff.kernel_overhead_s
        # TensorRT-LLM expandInputRows reads each token's D-vector once and writes k copies; finalizeMoeRouting
        # reads the k expert outputs and writes one: 2 * tokens * D * (k + 1) elements per layer. With TP alone
        # every chip permutes every token (the TP split is inside each expert's F dimension). Under attention DP a rank
        # expands only the rows of its own experts, k/ep per token of the replica, and finalizes every token of the
        # replica before the reduce-scatter
        copies = m.experts_per_token / cfg.ep if cfg.attention_dp else m.experts_per_token
        permute = Ls * moe_permute_bytes(tokens, m.d_model, copies, cfg.act_bytes) / W
    # engines that fuse each residual add into the next RMSNorm move 8·D instead of 10·D (serving.yaml
    # engine_fused_add_norm)
    pointwise = Ls * rank_tokens * pointwise_elements_per_token(m, atp, fused_add_norm=fused_add_norm(cfg, chip)) \
        * cfg.act_bytes / W
    return {
        "weights": t_w if t_w >= t_mm else 0.0,
        "compute": t_mm if t_mm > t_w else 0.0,
        "kv_cache": t_kv if t_kv >= t_attn else 0.0,
        "attention": t_attn if t_attn > t_kv else 0.0,
        "collectives": Ls * _layer_comm_s(m, chip, cfg, tokens, W),
        "kernel_overhead": kernels,
        "moe_permute": permute,
        "pointwise": pointwise,
        "pipeline_p2p": _p2p_s(chip, cfg, tokens * m.d_model * cfg.act_bytes),
    }


def _rank_load(cfg: ServeConfig, decode_seqs: float, prefill_tokens: float,
               prefill_seqs: float) -> tuple[float, float, float]:
    """(decode sequences, prompt tokens, prompt chunks) of the busiest attention-DP rank in a step of the replica's
    `decode_seqs`, `prefill_tokens` in `prefill_seqs` chunks. Decodes spread evenly over the ranks (TensorRT-LLM's
    ADP request queue and SGLang's DP controller send each new request to a rank by load); a prompt chunk runs whole
    on its request's rank, so the chunks spread over min(ranks, chunks) ranks and the busiest holds at least one
    whole chunk. Load imbalance beyond that (ranks with unequal decodes at the barrier) is not modelled: no
    published figure for it was found. Without attention DP: the whole step."""
    dp = cfg.attention_dp_size
    if dp == 1:
        return decode_seqs, prefill_tokens, prefill_seqs
    ranks = min(float(dp), max(prefill_seqs, 1.0))
    return decode_seqs / dp, prefill_tokens / ranks, prefill_seqs / ranks


def _pipeline_parts(m: ModelConfig, chip: Chip, cfg: ServeConfig, eff: Efficiency, mb: float, decode_seqs: float,
                    decode_ctx: float, prefill_tokens: float, prefill_ctx: float,
                    prefill_seqs: float | None) -> dict[str, float]:
    """Each term of one step over `mb` micro-batches of a pp-stage pipeline (mb <= pp). The decodes spread evenly
    over the micro-batches; a prompt chunk rides whole in one of them, never split across micro-batches (vLLM's
    pipeline runs one scheduler per micro-batch, virtual_engine, and each request belongs to one; a prompt's chunks
    follow one another in it), so min(chunks, mb) micro-batches carry the step's prompt tokens. A stage takes every
    micro-batch in turn and a micro-batch crosses every stage before its next token, so the step lasts
    max(sum of the micro-batches' stage times, pp x the slowest one's) (book ch.3 pipelining; GPipe, Huang et al.
    2019): pp x T_stage with equal micro-batches, as before, and a prompt's own pass takes pp x T_stage(its chunk),
    its whole compute, however many sequences share the step."""
    if prefill_tokens <= 0 or cfg.pp == 1:
        chunks = None if prefill_seqs is None else prefill_seqs / mb
        stage = stage_parts(m, chip, cfg, eff, decode_seqs / mb, decode_ctx, prefill_tokens / mb, prefill_ctx, chunks)
        return {k: cfg.pp * v for k, v in stage.items()}
    carriers = min(max(prefill_seqs or 1.0, 1.0), mb)  # micro-batches with a prompt chunk
    heavy = stage_parts(m, chip, cfg, eff, decode_seqs / mb, decode_ctx, prefill_tokens / carriers, prefill_ctx,
                        (prefill_seqs or 1.0) / carriers)
    light = stage_parts(m, chip, cfg, eff, decode_seqs / mb, decode_ctx, 0.0, 0.0) if mb > carriers else heavy
    busy = {k: carriers * heavy[k] + (mb - carriers) * light[k] for k in heavy}
    trip = {k: cfg.pp * v for k, v in heavy.items()}
    return trip if sum(trip.values()) >= sum(busy.values()) else busy


def step_cost(m: ModelConfig, chip: Chip, cfg: ServeConfig, eff: Efficiency, decode_seqs: float,
              decode_ctx: float, prefill_tokens: float = 0.0, prefill_ctx: float = 0.0,
              sequences: float | None = None, prefill_seqs: float | None = None,
              engine_loop: bool = True, streamed_tokens: float | None = None) -> StepCost:
    """One engine step of a replica. `sequences` (default: decode_seqs, at least 1) sets the PP micro-batches;
    `prefill_seqs` counts the prompt chunks (default: sequences - decode_seqs, at least 1 with prefill tokens).
    `engine_loop` False: the step runs inside a device program with no engine iteration on the host (the GPU
    suite's reference loop: 16 greedy decode steps in one XLA program), so without decode_step_overhead_s.
    `streamed_tokens`: the tokens the step emits to the server path (default: one per decode sequence and per prompt
    chunk); on a path with a per-token host cost (config.frontend_token_s) they cost `stream_responses`: in series
    with the device step for an engine that runs each step after the last, only its excess over the step for one that
    schedules a step ahead (config.schedules_ahead: the host work of step n runs beside step n+1)."""
    seqs = max(sequences if sequences is not None else decode_seqs, 1.0)
    mb = min(float(cfg.pp), seqs)
    if prefill_seqs is None and prefill_tokens > 0:
        prefill_seqs = max(seqs - decode_seqs, 1.0)
    parts = _pipeline_parts(m, chip, cfg, eff, mb, decode_seqs, decode_ctx, prefill_tokens, prefill_ctx, prefill_seqs)
    parts["step_overhead"] = serving_constant("decode_step_overhead_s", chip) if engine_loop else 0.0
    per_token = frontend_token_s(cfg, chip) if engine_loop else 0.0
    step_host = engine_host_step_s(cfg, chip) if engine_loop else 0.0
    if per_token > 0.0 or step_host > 0.0:
        # host work of the step: in series for an engine that runs each step after the last; for one a step ahead
        # beside the device step, which then waits only for the excess of the step's host work over it
        ahead, device = schedules_ahead(cfg, chip), sum(parts.values())
        stream_host = 0.0
        if per_token > 0.0:
            if streamed_tokens is None:
                streamed_tokens = decode_seqs + (prefill_seqs or 0.0)
            stream_host = per_token * streamed_tokens
            parts["stream_responses"] = max(stream_host - device, 0.0) if ahead else stream_host
        if step_host > 0.0:
            # the engine's own iteration (serving.yaml engine_host_step_s), beside the streamed tokens' host work
            parts["host_step"] = (max(step_host + stream_host - device, 0.0) - parts.get("stream_responses", 0.0)
                                  if ahead else step_host)
    total = sum(parts.values())
    return StepCost(total, parts, max(parts, key=parts.get))


def decode_step(m: ModelConfig, chip: Chip, cfg: ServeConfig, eff: Efficiency, batch: float,
                context: float, engine_loop: bool = True) -> StepCost:
    """A pure decode step: `batch` sequences each attending `context` cached tokens."""
    return step_cost(m, chip, cfg, eff, batch, context, engine_loop=engine_loop)


def prefill_step(m: ModelConfig, chip: Chip, cfg: ServeConfig, eff: Efficiency, sequences: float,
                 prompt_len: float, engine_loop: bool = True) -> StepCost:
    """Prefill of `sequences` prompts of `prompt_len` tokens in one pass (causal: average context T/2)."""
    return step_cost(m, chip, cfg, eff, 0.0, 0.0, sequences * prompt_len, prompt_len / 2.0, sequences,
                     engine_loop=engine_loop)
