"""Step time, memory and FLOPs of many training layouts at once (numpy arrays, one entry per layout).

The layout is applied in a fixed order on top of the single-device math of `math/transformer.py`
(STYLE.md §2): TP (Megatron with sequence parallelism, Korthikanti et al. 2022) → CP (ring attention,
load-balanced causal split) → EP (all-to-all dispatch/combine) → PP (1F1B / interleaved 1F1B, Narayanan
et al. 2021) → FSDP/ZeRO-3 (per-layer all-gather/reduce-scatter, Rajbhandari et al. 2020) → DP all-reduce
or ZeRO-1/2 reduce-scatter + all-gather. Overlap is explicit: what a collective can hide behind is named
at each term, and only the excess is exposed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.cost.efficiency import Efficiency
from meshplan.math import transformer as tm
from meshplan.train.comm import CommModel
from meshplan.train.config import LayoutArrays
from meshplan.train.space import Problem

ACT_BYTES = 2.0  # bf16 activations
PARAM_BYTES = 2.0  # bf16 working copy of the weights
OPT_BYTES = 12.0  # fp32 master, Adam m and v (ZeRO paper §3.1)
FSDP_PARAM_STATE_BYTES = 4.0  # FSDP stores the sharded parameters in fp32 (they are the master copy)
ADAM_UPDATE_BYTES = 30.0  # per local parameter: read/write master, m, v (24), read fp32 grad (4), write bf16 copy (2)
LOSS_BYTES_FUSED = 4.0 + ACT_BYTES  # per logit: fp32 softmax saved + bf16 logits
LOSS_BYTES_EAGER = 2 * (4.0 + ACT_BYTES)  # ... + fp32 gradient + its bf16 cast
# PyTorch FSDP2 (torch.distributed._composable.fsdp._fsdp_collectives) copies each all-gathered parameter out of the
# flat all-gather buffer into the unsharded parameter on the compute stream (`foreach_all_gather_copy_out`): read +
# write bf16 per parameter per gather; before each reduce-scatter it concatenates the bf16 gradients into the
# reduce-dtype input (`foreach_reduce_scatter_copy_in`, torch._chunk_cat) on the reduce-scatter stream, and the
# compute stream waits for that copy (`current_stream.wait_stream(reduce_scatter_stream)`): read 2 B + write the
# reduce dtype. XLA on TPU gathers and reduces in place.
FSDP_COPY_OUT_BYTES = 2.0 * 2.0
FSDP_COPY_IN_READ_BYTES = 2.0
FP8_CAST_BYTES = 5.0  # per element: amax read (2) + cast read (2) + fp8 write (1)
FP8_TRANSPOSE_BYTES = 3.0  # per element: read bf16 (2) + write the transposed fp8 copy (1)
# Transformer Engine (delayed scaling: the scale comes from the amax history, the amax of this pass is recorded
# by the same kernel): a fused cast-transpose reads bf16 once and writes the fp8 copy and its transpose
# (`fp8_cast_transpose_fused`); the norm in LayerNormLinear writes its output in fp8 itself, so those inputs pay
# only an fp8 transpose for the weight gradient (read 1, write 1).
FP8_TE_CAST_TRANSPOSE_BYTES = 2.0 + 1.0 + 1.0
FP8_TE_TRANSPOSE_BYTES = 1.0 + 1.0
KERNELS_PER_LAYER_FWD = 15  # norms, projections, rope, attention, activation, residuals (a LLaMA layer)
# PyTorch's context parallelism (torch.distributed.tensor.experimental._attention, torch 2.5-2.6, as torchtitan ran
# it) merges each ring step's attention output into an fp32 running output and accumulates gradients in fp32
# (`_cp_options.convert_to_f32`). HBM bytes per local output element per ring step after the first, read off that
# code, averaged over the load-balanced split's full steps and its half-query steps (which update half the rows and
# then rebuild the whole fp32 tensor with `torch.cat`, 8 B): forward `_SDPAMerger.step`, full step 38 B (cast the
# bf16 block 2+4, out - block_out 4+4+4, sigmoid-weighted product 4+4, subtract 4+4+4), half step 19 + 8 = 27 B,
# mean 32.5, plus the K/V concatenation sent on (2+2 for each of K and V) = 40.5; backward: dQ += (full 10, half
# 5 + 8) 11.5, dK and dV += (full 10, half 5 + 8) 23, their fp32 concatenation for the next rank (4+4 each) 16,
# the K/V concatenation 8 = 58.5.
CP_TORCH_MERGE_FWD_BYTES = 40.5
CP_TORCH_MERGE_BWD_BYTES = 58.5
ATTENTION_KERNELS = ("fused", "fa2", "sdpa")  # Options.attention_kernel


@dataclass(frozen=True)
class Options:
    """Modelling choices a user can change (`meshplan train --help`)."""

    compute_dtype: str = "bf16"  # matmul precision: bf16 or fp8
    headroom: float = 0.05  # fraction of HBM kept free
    tp_overlap: bool | None = None  # collective matmul / async TP; None = on for TPU (XLA), off for GPU
    fsdp_param_bytes: float = 2.0  # dtype of the FSDP all-gather (MaxText with fp32 weights: 4)
    grad_reduce_bytes: float = 4.0  # gradients reduced in fp32 (Megatron main_grad, torchtitan reduce_dtype)
    flash_attention: bool = True
    dropout: bool = False
    overlap_param_gather: bool = False  # ZeRO-1/2 all-gather overlapped with the next forward
    dp_overlap: bool | None = None  # replica gradient reduction hidden behind the backward; None = GPU yes, TPU no
    fused_elementwise: bool = True  # pointwise chains fused (torch.compile, XLA, Megatron fused kernels)
    fused_loss: bool = True  # fused cross-entropy (Megatron, XLA); False = eager PyTorch loss (torchtitan)
    fp8_weight_cache: bool = True  # FP8 weights cast once per step (Transformer Engine); False = every forward
    # FP8 casts fused as Transformer Engine fuses them (norm kernels emit fp8, fused cast-transpose, delayed
    # scaling); False = torchao's dynamic scaling, a separate amax pass and cast per operand (torchtitan)
    fp8_fused_casts: bool = True
    ep_overlap: bool = False  # MoE all-to-alls hidden behind another micro-batch's compute (DualPipe, MCore)
    moe_node_limit: int = 0  # node-limited routing: a token reaches at most this many nodes (DeepSeek-V3: 4)
    # What `selective` recomputes: "attention" = Korthikanti et al. 2022 (the attention core); "op" = torchtitan's
    # per-op policy (every second matmul and the pointwise ops around it); "layer" = torchtitan's per-layer policy
    # (every second layer fully recomputed).
    selective_flavor: str = "attention"
    # FSDP over the context-parallel ranks even when --fsdp is 1 (torchtitan shards over its dp_shard×cp mesh;
    # `--zero 3` asks for it). With --fsdp > 1 the CP ranks always join the shard group.
    fsdp_over_cp: bool = False
    # How ZeRO-3 fetches a layer: "allgather" (FSDP, ZeRO-Infinity's bandwidth-centric partitioning, Rajbhandari
    # et al. 2021 §6.1: every rank's link carries a slice, prefetched behind compute) or "broadcast" (the ZeRO
    # paper's design, Rajbhandari et al. 2020 §7.2.2: each partition's owner broadcasts it and gradients are
    # reduced back to the owner, so a layer's bytes pass one owner's link, and each fetch blocks the layer).
    zero3_fetch: str = "allgather"
    # How context parallelism runs attention. "ring": Ring Attention (Liu et al. 2023) as Megatron-Core/Transformer
    # Engine run it: each rank passes its (GQA-sized) K/V block to the next, hidden behind the block it feeds.
    # "torch": PyTorch's experimental context_parallel as torchtitan ran it (torch 2.5-2.6, rotate method
    # "allgather", torchtitan's default): the model repeats K/V to every query head before SDPA (`repeat_kv`), so
    # the KV that travels is MHA-sized; it is all-gathered once per layer pass, hidden only behind the first
    # (diagonal) block; gradients of K/V travel block by block in fp32 with the last one exposed; outputs and
    # gradients are merged in fp32 (CP_TORCH_MERGE_*).
    cp_impl: str = "ring"
    # Pipeline schedule (DeepSeek-V3 report, Table 2, compares the three): "1f1b" (Narayanan et al. 2021; interleaved
    # when vpp > 1), "zb1p" (zero-bubble ZB-H1, Qi et al. 2024: the weight-gradient GEMMs fill the bubble), or
    # "dualpipe" (DeepSeek-V3 §3.2.1: two pipelines in opposite directions, each rank holding two stages).
    pp_schedule: str = "1f1b"
    # Which fused attention kernel runs (efficiency.yaml): "fused" = the chip's best (FA3 or cuDNN on Hopper, as
    # Megatron-Core/TE and MaxText run; FA2 on Ampere); "fa2" = the flash-attn package's FlashAttention-2
    # (nanotron, llm-foundry); "sdpa" = PyTorch's scaled_dot_product_attention, whose bundled FA2 it picks first
    # on every GPU (torchtitan; pytorch/pytorch#142132). On Hopper both FA2s run at about half FA3's rate.
    attention_kernel: str = "fused"

    def overlaps(self, chip_kind: str) -> tuple[bool, bool]:
        """(TP overlapped, DP reduction overlapped) with the unset ones at the chip's default: XLA on TPU decomposes
        TP collectives into collective matmuls and reduces scanned-layer gradients after the backward; PyTorch on
        GPUs exposes TP and buckets the DP reduction behind the backward."""
        tpu = chip_kind == "tpu"
        return (self.tp_overlap if self.tp_overlap is not None else tpu,
                self.dp_overlap if self.dp_overlap is not None else not tpu)


class Terms(dict):
    """name -> array over layouts; a dict so parts can be listed and summed."""


def _shape_constants(m) -> dict[str, float]:
    D, F = m.d_model, m.d_ff
    mult = 3 if m.gated else 2
    k = m.experts_per_token if m.is_moe else 1
    shared_F = m.n_shared_experts * (m.shared_expert_d_ff or F)
    mlp_w_active = mult * D * (F * k + shared_F) + (D * m.n_experts if m.is_moe else 0)
    expert_w = mult * D * F * m.n_experts if m.is_moe else 0.0
    if m.first_dense_layers:
        # DeepSeek's leading dense layers: the layout is timed with the mean layer (their share of the weights)
        moe_share = 1 - m.first_dense_layers / m.n_layers
        mlp_w_active = moe_share * mlp_w_active + (1 - moe_share) * mult * D * m.dense_d_ff
        expert_w = moe_share * expert_w
    return dict(
        D=D, F=F, V=m.vocab_size, N=m.n_heads, K=m.n_kv_heads, H=m.head_dim, k=k, mult=mult,
        attn_w=tm.attention_matmul_weights(m), mlp_w_active=mlp_w_active, expert_w=expert_w,
    )


class CostModel:
    """Evaluates arrays of layouts for one problem."""

    def __init__(self, problem: Problem, eff: Efficiency, options: Options | None = None):
        self.p = problem
        self.eff = eff
        self.opt = options or Options()
        self.comm = CommModel(problem.chip, problem.chips, problem.slice_shape)
        self.c = _shape_constants(problem.model)
        self.pc = tm.param_counts(problem.model)
        chip = problem.chip
        self.peak_bf16 = chip.peak("bf16")
        if self.opt.compute_dtype == "fp8":
            self.mm_peak = chip.peak("fp8") * eff.fp8_peak_fraction / eff.matmul_peak_fraction
        else:
            self.mm_peak = self.peak_bf16
        self.hbm = chip.hbm_bandwidth_bytes_per_s * eff.hbm_fraction
        self.tp_overlap, self.dp_overlap = self.opt.overlaps(chip.kind)

    # --- compute -------------------------------------------------------------------------------
    def _matmul_time(self, flops, m_, n_, k_):
        return flops / (self.mm_peak * self.eff.matmul(m_, n_, k_))

    def compute_terms(self, L: LayoutArrays, g: dict) -> Terms:
        """Forward/backward/recompute seconds per micro-batch on the busiest pipeline stage."""
        c, e, S = self.c, self.eff, self.p.seq_len
        tp, t = g["tp"], g["t_mb"]
        m = self.p.model
        T_exp = t * c["k"] * g["ep"] / m.n_experts if m.is_moe else t
        f_mlp = 2 * t * c["mlp_w_active"] / tp
        mm_f = self._matmul_time(f_mlp, T_exp, c["F"] / tp, c["D"]) + self._attention_projections(t, tp)
        qkv_width = self._qkv_width(tp)
        # causal, load-balanced over cp (book ch.4): 2·t·(S/2)·N·(QKᵀ + AV widths); windowed layers attend fewer keys
        f_core = 2.0 * t * tm.mean_attended_keys(m, S) * c["N"] * tm.attention_pair_width(m) / tp
        if self.opt.flash_attention:
            fwd_frac, bwd_frac = {
                "fa2": (e.attention_fa2_fwd_fraction, e.attention_fa2_bwd_fraction),
                "sdpa": (e.attention_sdpa_fwd_fraction, e.attention_sdpa_bwd_fraction),
            }.get(self.opt.attention_kernel, (e.attention_fwd_fraction, e.attention_bwd_fraction))
            core_f = f_core / (self.peak_bf16 * fwd_frac)
            core_b = f_core * e.attention_bwd_flops_ratio / (self.peak_bf16 * bwd_frac)
        else:
            core_f, core_b = self._materialized_attention(g, f_core)
        if self.opt.cp_impl == "torch":
            # fp32 output merges and gradient accumulation of every ring step after the first
            out_elems = t * c["N"] * c["H"] / tp * (g["cp"] - 1)
            core_f = core_f + CP_TORCH_MERGE_FWD_BYTES * out_elems / self.hbm
            core_b = core_b + CP_TORCH_MERGE_BWD_BYTES * out_elems / self.hbm
        sp_div = np.where(g["sp"], tp, 1)
        act_w = c["mult"] * c["F"] * c["k"]
        elem_bytes = ACT_BYTES * t * (10 * c["D"] / sp_div + 2 * (c["N"] + c["K"]) * c["H"] / tp + act_w / tp)
        if not self.opt.fused_elementwise:
            elem_bytes = elem_bytes * e.unfused_elementwise_factor
        if m.is_moe:
            # token permutation around the experts (GShard dispatch/combine; Megatron-Core's permute/unpermute):
            # gather each token's k copies into expert order (read D, write k·D) and scatter-add them back (read
            # k·D, write D); forward here, the backward's mirror in 2·elem_f
            elem_bytes = elem_bytes + ACT_BYTES * t * 2 * (1 + c["k"]) * c["D"]
        elem_f = elem_bytes / self.hbm + KERNELS_PER_LAYER_FWD * e.kernel_overhead_s
        cast_f = np.zeros_like(elem_f)  # FP8 casts of the forward's GEMM operands
        cast_b = np.zeros_like(elem_f)
        if self.opt.compute_dtype == "fp8":
            # FP8 with dynamic per-tensor scaling (Micikevicius et al. 2022; torchao float8 as torchtitan uses it,
            # `fp8_fused_casts` off): every GEMM operand is amax-reduced and cast (read 2 B for the amax, 2 B for
            # the cast, write 1 B): forward the four linear inputs and the weights, backward the output gradients,
            # plus transposed fp8 copies of the inputs and weights for the weight- and input-gradient GEMMs (read 2,
            # write 1)
            a_in = t * (2 * c["D"] + c["N"] * c["H"] / tp + c["F"] * c["k"] / tp)
            g_out = t * (qkv_width + 2 * c["D"] + (c["mult"] - 1) * c["F"] * c["k"] / tp)
            # Transformer Engine casts a weight once per step and reuses it over the micro-batches
            # (`is_first_microbatch`); torchao's float8 (torchtitan) casts it on every forward
            w_local = (c["attn_w"] + c["mlp_w_active"]) / tp / np.where(self.opt.fp8_weight_cache, g["n_micro"], 1.0)
            if self.opt.fp8_fused_casts:
                # Transformer Engine: the qkv and gate/up inputs leave the norm in fp8 (their transposes are made
                # for the backward); the output-projection and down-projection inputs, the weights and the output
                # gradients go through fused cast-transposes
                normed = t * 2 * c["D"]
                cast_f = FP8_TE_CAST_TRANSPOSE_BYTES * (a_in - normed + w_local) / self.hbm
                cast_b = (FP8_TE_CAST_TRANSPOSE_BYTES * g_out + FP8_TE_TRANSPOSE_BYTES * normed) / self.hbm
            else:
                cast_f = FP8_CAST_BYTES * (a_in + w_local) / self.hbm
                cast_b = (FP8_CAST_BYTES * g_out + FP8_TRANSPOSE_BYTES * (a_in + w_local)) / self.hbm
        f_un = 2 * t * c["D"] * c["V"] / tp
        un_f = self._matmul_time(f_un, t, c["V"] / tp, c["D"]) + 12.0 * t * c["V"] / tp / self.hbm  # fp32 loss
        nl = g["layers_stage"]
        rc = L.recompute
        # the backward's pointwise work mirrors the forward's (2·elem_f) and casts its own operands (cast_b); a
        # recomputed forward casts its GEMM inputs again
        full = mm_f + core_f + elem_f + cast_f
        selective = {"attention": core_f, "op": 0.5 * mm_f + elem_f + cast_f,
                     "layer": 0.5 * full}[self.opt.selective_flavor]
        recompute = np.select([rc == 2, rc == 1, rc == 3], [full, selective, elem_f + cast_f], 0.0)
        return Terms(
            layer_fwd=full, layer_bwd=2 * mm_f + core_b + 2 * elem_f + cast_b,
            layer_recompute=recompute,
            layer_matmul_fwd=mm_f, layer_core_fwd=core_f, layer_core_bwd=core_b,
            fwd=nl * full + un_f,
            bwd=nl * (2 * mm_f + core_b + 2 * elem_f + cast_b + recompute) + 2 * un_f,
        )

    def _qkv_width(self, tp):
        """Width of the Q, K and V activations on one TP rank: (N/tp + 2·K/tp)·H with KV heads replicated when
        tp > K; under MLA the up-projected per-head queries, keys (H+R) and values (V)."""
        c, m = self.c, self.p.model
        if m.is_mla:
            return m.n_heads * (2 * m.qk_head_dim + m.v_dim) / tp
        return (c["N"] / tp + 2 * np.maximum(c["K"] / tp, 1.0)) * c["H"]

    def _attention_projections(self, t, tp):
        """Seconds of one layer's attention projections, each GEMM timed at its own shape."""
        c, m = self.c, self.p.model
        if not m.is_mla:
            qkv_width = self._qkv_width(tp)
            f_qkv = 2 * t * c["D"] * qkv_width
            f_o = 2 * t * c["D"] * c["N"] * c["H"] / tp
            return (self._matmul_time(f_qkv, t, qkv_width, c["D"])
                    + self._matmul_time(f_o, t, c["D"], c["N"] * c["H"] / tp))
        # MLA (DeepSeek-V2 §2.1): the latent down-projections are computed whole on every TP rank; the per-head
        # up-projections and the output projection split over the heads
        w, N = m.mla_weights(), m.n_heads
        q_in = m.q_lora_rank or c["D"]
        t_s = self._matmul_time(2 * t * w["kv_down"], t, m.kv_lora_rank + m.qk_rope_head_dim, c["D"])
        if m.q_lora_rank:
            t_s = t_s + self._matmul_time(2 * t * w["q_down"], t, m.q_lora_rank, c["D"])
        t_s = t_s + self._matmul_time(2 * t * w["q_up"] / tp, t, N * m.qk_head_dim / tp, q_in)
        t_s = t_s + self._matmul_time(2 * t * w["kv_up"] / tp, t, N * (m.head_dim + m.v_dim) / tp, m.kv_lora_rank)
        return t_s + self._matmul_time(2 * t * w["o"] / tp, t, c["D"], N * m.v_dim / tp)

    def _materialized_attention(self, g: dict, f_core):
        """Attention without a flash kernel (Megatron 2020-21, BLOOM): QKᵀ and AV as batched matmuls of
        inner dimension H, plus softmax (and dropout) over the N·s² score matrix in HBM; no causal saving
        (Korthikanti et al. 2022 §4.1 counts the 5as²b bytes these tensors take)."""
        S, c = self.p.seq_len, self.c
        flops = 2 * f_core  # the full score matrix is computed
        mm = flops / (self.mm_peak * self.eff.matmul(S, S, c["H"]))
        scores = c["N"] / g["tp"] * g["mb"] * S * (S / g["cp"])
        per_elem = ACT_BYTES * 2 + (ACT_BYTES * 2 + 1 if self.opt.dropout else 0)  # softmax r/w, dropout r/w + mask
        ew = scores * per_elem / self.hbm
        return mm + ew, 2 * mm + 2 * ew

    # --- communication -------------------------------------------------------------------------
    def comm_terms(self, L: LayoutArrays, g: dict, ct: Terms) -> Terms:
        """Exposed communication seconds: per micro-batch (`*_mb`) and once per step (`*_step`)."""
        c, comm, m = self.c, self.comm, self.p.model
        tp, cp, fs, dp, ep, pp, t = g["tp"], g["cp"], g["fsdp"], g["dp"], g["ep"], g["pp"], g["t_mb"]
        nl = g["layers_stage"]
        out = Terms()
        # TP (Megatron-SP): per layer 2 all-gathers + 2 reduce-scatters of [t, D] forward and again backward
        # (Korthikanti et al. 2022 §4.2.2); without SP, 2 all-reduces each way.
        # An MoE layer under SP gathers the k routed copies of its tokens over TP after the expert all-to-all
        # and reduce-scatters them before the return trip (Megatron-Core's alltoall dispatcher: A2A(EP) → AG(TP),
        # RS(TP) → A2A(EP)), so its MLP pair moves k times the dense one.
        v_tp = ACT_BYTES * t * c["D"]
        ag = comm.time("allgather", v_tp, tp, 1)
        rs = comm.time("reducescatter", v_tp, tp, 1)
        ar = comm.time("allreduce", v_tp, tp, 1)
        tp_layer = np.where(g["sp"], (1 + c["k"]) * (ag + rs), 2 * ar)
        # Collective matmul (book ch.10; Wang et al. 2023) hides the steps behind partial matmuls; one of
        # the tp steps cannot overlap.
        hidden_f = np.maximum(tp_layer - ct["layer_matmul_fwd"], 0) + tp_layer / np.maximum(tp, 1)
        hidden_b = np.maximum(tp_layer - 2 * ct["layer_matmul_fwd"], 0) + tp_layer / np.maximum(tp, 1)
        tp_exp = (np.where(self.tp_overlap, hidden_f, tp_layer) + np.where(self.tp_overlap, hidden_b, tp_layer))
        out["tp_mb"] = nl * tp_exp * (tp > 1)
        out["tp_link_mb"] = nl * 2 * tp_layer
        # CP ring attention: cp-1 KV block passes forward, KV and dKV backward, each overlapped with the
        # attention block it feeds (Liu et al. 2023, Ring Attention). GQA shrinks the KV bytes.
        if m.is_mla:  # the up-projected keys and values travel (N·(H+R) and N·V per token)
            kv_per_rank = m.n_heads * tm.attention_pair_width(m) / 2 / tp
        elif self.opt.cp_impl == "torch":  # K/V repeated to every query head before SDPA
            kv_per_rank = c["N"] / tp * c["H"]
        else:
            kv_per_rank = c["H"] * np.maximum(c["K"] / tp, 1.0)
        kv_bytes = 2 * ACT_BYTES * t * kv_per_rank
        if self.opt.cp_impl == "torch":
            out["cp_mb"], out["cp_link_mb"] = self._torch_cp_terms(L, kv_bytes, ct, cp, tp, nl)
        else:
            perm = comm.time("permute", kv_bytes, cp, tp)
            cp_f, cp_b = (cp - 1) * perm, 2 * (cp - 1) * perm
            out["cp_mb"] = nl * (np.maximum(cp_f - ct["layer_core_fwd"], 0)
                                 + np.maximum(cp_b - ct["layer_core_bwd"], 0))
            out["cp_link_mb"] = nl * (cp_f + cp_b)
        # EP: dispatch + combine all-to-all forward, twice again backward (GShard), exposed unless overlapped.
        if m.is_moe:
            # node-limited routing (DeepSeek-V3 §3.2.2): a token goes to at most M nodes and crosses the network
            # once per node, then fans out to its experts over NVLink, so min(k, M) copies travel instead of k
            copies = min(c["k"], self.opt.moe_node_limit) if self.opt.moe_node_limit else c["k"]
            # under SP each TP rank dispatches only its 1/tp slice of the tokens (the TP gather follows, above)
            t_rank = t / np.where(g["sp"], tp, 1)
            a2a = comm.time("alltoall", ep * ACT_BYTES * t_rank * copies * c["D"], ep, tp * cp)
            out["ep_link_mb"] = nl * 4 * a2a
            if self.opt.ep_overlap:
                # DeepSeek-V3's DualPipe (arXiv:2412.19437 §3.2.1) and Megatron-Core's A2A overlap run one
                # micro-batch's dispatch/combine beside another's layer compute: only the excess shows
                layer = ct["layer_fwd"] + ct["layer_bwd"] + ct["layer_recompute"]
                out["ep_mb"] = nl * np.maximum(4 * a2a - layer, 0)
            else:
                out["ep_mb"] = out["ep_link_mb"]
        else:
            out["ep_mb"] = np.zeros_like(t)
            out["ep_link_mb"] = np.zeros_like(t)
        # PP: one activation send forward and one gradient send backward per virtual stage (blocking p2p).
        p2p = comm.time("permute", ACT_BYTES * t * c["D"] / np.where(g["sp"], tp, 1), pp, tp * cp * fs * dp)
        out["pp_mb"] = 2 * g["vpp"] * p2p
        self._data_parallel_terms(L, g, ct, out)
        self._shared_link_slowdown(g, ct, out)
        return out

    def _torch_cp_terms(self, L: LayoutArrays, kv_bytes, ct: Terms, cp, tp, nl):
        """(exposed, link) seconds per micro-batch of PyTorch's all-gather context parallelism (`cp_impl`): each
        layer pass all-gathers the ring's K/V behind the first (diagonal) block only, 1/cp of the rank's attention;
        the backward gathers again and passes fp32 dK/dV on to the next rank after every block, each hidden behind
        the next block except the last. A recomputed forward (full recompute, or selective of the attention core)
        runs the ring again."""
        ag = self.comm.time("allgather", cp * kv_bytes, cp, tp)
        dkv = self.comm.time("permute", 2 * kv_bytes, cp, tp)  # fp32 gradients: twice the bf16 bytes
        block_f, block_b = ct["layer_core_fwd"] / cp, ct["layer_core_bwd"] / cp
        passes_f = 1 + ((L.recompute == 2) | ((L.recompute == 1) & (self.opt.selective_flavor == "attention")))
        exp_f = passes_f * np.maximum(ag - block_f, 0)
        exp_b = np.maximum(ag - block_b, 0) + np.maximum(cp - 2, 0) * np.maximum(dkv - block_b, 0) + dkv
        link = passes_f * ag + ag + (cp - 1) * dkv
        return nl * np.where(cp > 1, exp_f + exp_b, 0.0), nl * np.where(cp > 1, link, 0.0)

    def _torch_cp_buffer(self, g: dict):
        """Bytes PyTorch's all-gather context parallelism holds during one layer's attention backward (`cp_impl`):
        the gathered K/V of the whole ring (bf16, repeated to every query head) and the fp32 dQ, dK and dV
        accumulators (`_templated_ring_attention_backward`)."""
        if self.opt.cp_impl != "torch" or self.p.model.is_mla:
            return 0.0
        c, cp = self.c, g["cp"]
        width = g["t_mb"] * c["N"] * c["H"] / g["tp"]  # local elements of Q, and of each repeated K and V
        return np.where(cp > 1, cp * 2 * ACT_BYTES * width + 3 * 4.0 * width, 0.0)

    def _shared_link_slowdown(self, g: dict, ct: Terms, out: Terms) -> None:
        """Collectives that share a link slow each other: on a GPU, an FSDP group whose members sit in the
        same NVLink domain as the TP group pushes its (hidden) traffic through the same NVLink ports, so TP
        collectives see the remaining bandwidth. A TPU torus gives each mesh axis its own links."""
        if self.p.chip.links.is_torus:
            return
        domain = self.p.chip.links.nvlink_domain_size
        shares = (g["shard"] > 1) & (g["tp"] > 1) & (g["tp"] * g["cp"] < domain)
        busy = g["layers_stage"] * (ct["layer_fwd"] + ct["layer_bwd"] + ct["layer_recompute"])
        fsdp_link = out["fsdp_link_mb"] + out["fsdp_link_step"] / g["n_micro"]
        fsdp_nvlink_share = np.where(shares, np.minimum(fsdp_link / np.maximum(busy, 1e-12), 1.0), 0.0)
        out["tp_mb"] = out["tp_mb"] * (1 + fsdp_nvlink_share)

    def _data_parallel_terms(self, L: LayoutArrays, g: dict, ct: Terms, out: Terms) -> None:
        """FSDP per-layer gathers/scatters (overlapped layer by layer) and the once-a-step DP reduction."""
        comm, o = self.comm, self.opt
        tp, sh, rep = g["tp"], g["shard"], g["replicas"]
        nl = g["layers_stage"]
        w_layer = g["params_layer_local"]  # parameters of one layer on this TP/EP rank
        emb = g["params_embed_local"]
        # mesh order (dp, fsdp, cp, tp): the shard group fsdp×cp is contiguous at stride tp
        if o.zero3_fetch == "broadcast":
            # owner broadcast / reduce-to-owner: every byte of the layer crosses one owner's link (a ring
            # shift's worth of link time), and the layer waits for it
            ag = comm.time("permute", o.fsdp_param_bytes * w_layer, sh, tp)
            rs = comm.time("permute", o.grad_reduce_bytes * w_layer, sh, tp)
            ag_emb = comm.time("permute", o.fsdp_param_bytes * emb, sh, tp)
            rs_emb = comm.time("permute", o.grad_reduce_bytes * emb, sh, tp)
            fs_f = nl * ag + ag_emb
            fs_b = nl * (ag + rs) + ag_emb + rs_emb
            once_f, once_b = fs_f, nl * rs + rs_emb
        else:
            ag = comm.time("allgather", o.fsdp_param_bytes * w_layer, sh, tp)
            rs = comm.time("reducescatter", o.grad_reduce_bytes * w_layer, sh, tp)
            ag_emb = comm.time("allgather", o.fsdp_param_bytes * emb, sh, tp)
            rs_emb = comm.time("reducescatter", o.grad_reduce_bytes * emb, sh, tp)
            # ZeRO-3 / FSDP (Rajbhandari et al. 2020; torchtitan FSDP2): gather before each layer's forward and
            # again before its backward (reshard after forward), reduce-scatter its gradients; the next layer's
            # gather is prefetched behind the current layer's compute, so only the excess and the first bucket
            # show.
            comp_f = nl * ct["layer_fwd"]
            comp_b = nl * (ct["layer_bwd"] + ct["layer_recompute"])
            fs_f = np.maximum(nl * ag + ag_emb - comp_f, 0) + ag
            fs_b = np.maximum(nl * (ag + rs) + ag_emb + rs_emb - comp_b, 0) + rs
            once_f = fs_f
            once_b = np.maximum(nl * rs + rs_emb - comp_b, 0) + rs
        # With pipelining the stage stays gathered across its micro-batches: one gather per step (hidden behind
        # the first micro-batch's forward), no re-gather for the backward, and one reduce-scatter of the
        # accumulated gradients behind the last backward (torch.distributed.pipelining keeps FSDP2 unsharded
        # and skips gradient sync until the last micro-batch; torchtitan and Llama 3 train PP+FSDP so).
        once = (sh > 1) & (g["pp"] > 1)
        per_mb = (sh > 1) & ~once
        out["fsdp_mb"] = np.where(per_mb, fs_f + fs_b, 0.0)
        out["fsdp_link_mb"] = np.where(per_mb, nl * (2 * ag + rs) + 2 * ag_emb + rs_emb, 0.0)
        out["fsdp_step"] = np.where(once, once_f + once_b, 0.0)
        out["fsdp_link_step"] = np.where(once, nl * (ag + rs) + ag_emb + rs_emb, 0.0)
        # GPU FSDP's copies, kernel time the compute stream waits for: the copy-out of every gathered layer
        # (forward and backward gathers per micro-batch, one gather per step under pipelining) and the gradients'
        # copy-in before each reduce-scatter
        if self.p.chip.kind == "gpu" and o.zero3_fetch == "allgather":
            w_all = nl * w_layer + emb
            copy_out = FSDP_COPY_OUT_BYTES * w_all / self.hbm
            copy_in = (FSDP_COPY_IN_READ_BYTES + o.grad_reduce_bytes) * w_all / self.hbm
        else:
            copy_out = copy_in = np.zeros_like(w_layer)
        out["fsdp_copy_mb"] = np.where(per_mb, 2 * copy_out + copy_in, 0.0)
        out["fsdp_copy_step"] = np.where(once, copy_out + copy_in, 0.0)
        # Replicated DP: gradient all-reduce (ZeRO-0) or reduce-scatter + param all-gather (ZeRO-1/2, Megatron
        # distributed optimizer), bucketed and overlapped with the last micro-batch's backward. Without FSDP the
        # replica group takes in the CP ranks: (dp, cp) is contiguous at stride tp since fsdp = 1.
        grads = g["params_stage_local"] / sh
        stride_rep = np.where(sh > 1, tp * sh, tp)
        ar = comm.time("allreduce", o.grad_reduce_bytes * grads, rep, stride_rep)
        rs_dp = comm.time("reducescatter", o.grad_reduce_bytes * grads, rep, stride_rep)
        ag_dp = comm.time("allgather", PARAM_BYTES * grads, rep, stride_rep)
        # PyTorch DDP/Megatron bucket the reduction and hide it behind the backward; XLA can hoist the all-reduce
        # of gradients accumulated in a scanned layer loop out of the loop (WhileLoopAllReduceCodeMotion), so on
        # TPU (JAX with scanned layers: MaxText, PaLM) it runs once after the backward, exposed
        window = nl * (ct["layer_bwd"] + ct["layer_recompute"]) * (1.0 if self.dp_overlap else 0.0)
        zero = L.zero
        reduce = np.where(zero >= 1, rs_dp, ar)
        gather = np.where((zero >= 1) & (not o.overlap_param_gather), ag_dp, 0.0)
        out["dp_step"] = np.where(rep > 1, np.maximum(reduce - window, 0) + gather, 0.0)
        out["dp_link_step"] = np.where(rep > 1, reduce + np.where(zero >= 1, ag_dp, 0.0), 0.0)

    # --- geometry, memory, totals --------------------------------------------------------------
    def geometry(self, L: LayoutArrays) -> dict:
        m, pc, c = self.p.model, self.pc, self.c
        f = {k: getattr(L, k).astype(float) for k in ("dp", "fsdp", "tp", "pp", "vpp", "cp", "ep")}
        g = dict(f)
        g["mb"] = L.microbatch.astype(float)
        g["sp"] = L.sequence_parallel & (L.tp > 1)
        g["t_mb"] = g["mb"] * self.p.seq_len / g["cp"]
        g["n_micro"] = self.p.global_batch / (g["dp"] * g["fsdp"] * g["mb"])
        # CP ranks hold the same weights and see other tokens of the same sequences: they join the gradient
        # reduction and, under FSDP, the shard group (torchtitan's dp_shard×cp mesh; Megatron-LM's
        # data-parallel-with-context group for its distributed optimizer and gradient all-reduce).
        fsdp_mode = (g["fsdp"] > 1) | (self.opt.fsdp_over_cp & (g["cp"] > 1))
        g["shard"] = np.where(fsdp_mode, g["fsdp"] * g["cp"], 1.0)  # FSDP/ZeRO-3 shard group
        g["replicas"] = np.where(fsdp_mode, g["dp"], g["dp"] * g["cp"])  # gradient reduction across replicas
        # the busiest stage (an uneven pinned split puts ceil(L / (pp·vpp)) layers in each virtual stage)
        g["layers_stage"] = np.ceil(m.n_layers / (g["pp"] * g["vpp"])) * g["vpp"]
        dense_layer = pc.per_layer - (c["expert_w"] if m.is_moe else 0)
        g["params_layer_local"] = dense_layer / g["tp"] + c["expert_w"] / (g["tp"] * g["ep"])
        embed = pc.embedding + pc.position + pc.unembedding
        embed_stage = np.where(g["pp"] > 1, max(pc.embedding + pc.position, pc.unembedding or pc.embedding), embed)
        g["params_embed_local"] = embed_stage / g["tp"]
        g["params_stage_local"] = g["layers_stage"] * g["params_layer_local"] + g["params_embed_local"]
        return g

    def activation_per_layer(self, L: LayoutArrays, g: dict, policy_codes: np.ndarray) -> np.ndarray:
        """Saved bytes per layer per micro-batch (Korthikanti et al. 2022, generalised in math/transformer)."""
        # encode (tp, cp, micro-batch, policy) in one integer; 1-D unique is far faster than over rows
        key = ((L.tp.astype(np.int64) * 4096 + L.cp) * 4096 + L.microbatch) * 8 + policy_codes
        uniq, inv = np.unique(key, return_inverse=True)
        combos = [(int(k // 8 // 4096 // 4096), int(k // 8 // 4096 % 4096), int(k // 8 % 4096), int(k % 8))
                  for k in uniq]
        vals = np.array([
            tm.activation_bytes_per_layer(
                self.p.model, self.p.seq_len, mb, tm.RECOMPUTE_POLICIES[rc], tp=tp,
                sequence_parallel=L.sequence_parallel and tp > 1, cp=cp,
                flash_attention=self.opt.flash_attention, dropout=self.opt.dropout)["total"]
            for tp, cp, mb, rc in combos])
        return vals[inv.ravel()]

    def memory_terms(self, L: LayoutArrays, g: dict) -> Terms:
        """Bytes per chip on the busiest stage: params, grads, optimizer, activations, other."""
        fs, rep, zero = g["shard"], g["replicas"], L.zero
        P = g["params_stage_local"]
        shard_g = fs * np.where(zero >= 2, rep, 1)
        shard_o = fs * np.where(zero >= 1, rep, 1)
        act_layer = self.activation_per_layer(L, g, L.recompute)
        if self.opt.selective_flavor != "attention":
            # torchtitan's per-op and per-layer policies recompute about half of each layer (every second
            # matmul / every second layer): they keep about half of the no-recompute activations
            none = self.activation_per_layer(L, g, np.zeros_like(L.recompute))
            full = self.activation_per_layer(L, g, np.full_like(L.recompute, 2))
            act_layer = np.where(L.recompute == 1, 0.5 * (none + full), act_layer)
        pp, vpp = g["pp"], g["vpp"]
        # 1F1B: the first stage holds min(pp, micro-batches) in flight; interleaving multiplies by
        # 1 + (p-1)/(p·v) (Narayanan et al. 2021 §2.2; Korthikanti et al. 2022 §4.2.3).
        # DualPipe keeps PP + 1 (DeepSeek-V3 Table 2); zero-bubble ZB-H1 as many as 1F1B
        depth = pp + 1 if self.opt.pp_schedule == "dualpipe" else pp
        inflight = np.where(pp > 1, np.minimum(depth, g["n_micro"]) * (1 + (pp - 1) / (pp * vpp)) ** (vpp > 1), 1.0)
        acts = g["layers_stage"] * act_layer * inflight
        # full recompute re-materialises one layer's activations at a time in the backward
        acts = acts + np.where(L.recompute == 2, self.activation_per_layer(L, g, np.zeros_like(L.recompute)), 0)
        # the loss's peak at the start of the backward, per logit: a fused cross-entropy (Megatron's vocab-parallel
        # kernel, XLA) holds the bf16 logits and the fp32 softmax it saved and writes the gradient in place (6 B);
        # eager PyTorch (`F.cross_entropy(logits.float())`, torchtitan) also holds the fp32 gradient of the
        # log-softmax and its bf16 cast (2 + 4 + 4 + 2 = 12 B)
        loss_bytes = LOSS_BYTES_FUSED if self.opt.fused_loss else LOSS_BYTES_EAGER
        logits = loss_bytes * g["t_mb"] * self.c["V"] / g["tp"]
        saved = acts
        acts = acts * (1 - L.offload) + logits
        # FSDP holds one gathered layer in the working dtype and that layer's unsharded bf16 gradients before
        # the reduce-scatter (the prefetched next layer replaces the freed current one).
        once = (fs > 1) & (pp > 1)  # FSDP under pipelining: the stage stays gathered through the step
        # PyTorch FSDP gathers a whole transformer block; XLA (TPU) gathers each weight just before its matmul
        # and reduce-scatters each gradient as it is produced, and DeepSpeed ZeRO-3 fetches parameter by parameter,
        # so there only the largest weight (and the prefetched next one) is ever whole
        if self.p.chip.kind == "tpu" or self.opt.zero3_fetch == "broadcast":
            m, c = self.p.model, self.c
            experts_local = m.n_experts / g["ep"] if m.is_moe else 1.0
            gathered = 2 * np.maximum(c["D"] * m.q_dim, c["D"] * c["F"] * experts_local) / g["tp"]
        else:
            gathered = g["params_layer_local"]
        fsdp_buf = np.where((fs > 1) & ~once, (self.opt.fsdp_param_bytes + ACT_BYTES) * gathered, 0.0)
        other = self.eff.memory_reserved_bytes + fsdp_buf + self._torch_cp_buffer(g)
        # FSDP (torchtitan FSDP2, MaxText) keeps fp32 sharded parameters that double as Adam's master copy;
        # DP/ZeRO-1/2 (Megatron) keeps a bf16 working copy next to the fp32 master in the optimizer state.
        p_bytes = np.where(fs > 1, FSDP_PARAM_STATE_BYTES, PARAM_BYTES)
        o_bytes = np.where(fs > 1, OPT_BYTES - FSDP_PARAM_STATE_BYTES, OPT_BYTES)
        params = p_bytes * P / fs + np.where(once, self.opt.fsdp_param_bytes * P, 0.0)
        grads = self.opt.grad_reduce_bytes * P * np.where(once, 1.0, 1.0 / shard_g)  # unsharded accumulation
        # DualPipe holds two stages per rank, one of each pipeline direction: twice the model state (Table 2)
        copies = np.where((pp > 1) & (self.opt.pp_schedule == "dualpipe"), 2.0, 1.0)
        t = Terms(params=copies * params, grads=copies * grads, optimizer=copies * o_bytes * P / shard_o,
                  activations=acts, other=other)
        t["offloaded"] = saved * L.offload
        t["total"] = t["params"] + t["grads"] + t["optimizer"] + t["activations"] + t["other"]
        t["offloaded_per_microbatch"] = t["offloaded"] / inflight
        return t
