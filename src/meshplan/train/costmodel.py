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
from functools import lru_cache
from pathlib import Path

import numpy as np
import yaml

from meshplan.cost.collectives import ep_dispatch_scale_out_efficiency, ragged_destinations, tpu_reduction_s
from meshplan.cost.efficiency import (
    ATTENTION_TILE_FIELDS,
    Efficiency,
    attention_head_dim_rate,
    attention_tile_factor,
    host_constant,
    moe_constant,
)
from meshplan.errors import MeshplanError, unknown_name_error
from meshplan.math import transformer as tm
from meshplan.train.comm import CommModel
from meshplan.train.config import LayoutArrays
from meshplan.train.ledger import Ledger
from meshplan.train.space import PP_SCHEDULES, Problem, expert_tp_degree
from meshplan.validate import CLI_RULES, Rule

ACT_BYTES = 2.0  # bf16 activations
PARAM_BYTES = 2.0  # bf16 working copy of the weights
MASTER_BYTES = 4.0  # fp32 master copy of the weights (ZeRO paper §3.1)
MOMENT_BYTES = 8.0  # Adam m and v in fp32 (ZeRO paper §3.1: master + m + v = 12 B per parameter)
FSDP_PARAM_STATE_BYTES = 4.0  # FSDP stores the sharded parameters in fp32 (they are the master copy)
ADAM_UPDATE_BYTES = 30.0  # per local parameter: read/write master, m, v (24), read fp32 grad (4), write bf16 copy (2)
# PyTorch's foreach AdamW (torch/optim/adamw.py `_multi_tensor_adamw`, torch 2.5-2.6, capturable off), one pass per
# op over fp32 tensors: weight decay p *= 1 - lr·wd (r/w 8), m.lerp_(g) (12), v *= beta2 (8), v.addcmul_(g, g) (12),
# s = sqrt(v) (8), s /= bc2 (8), s += eps (8), p.addcdiv_(m, s) (16) = 80 B per local parameter (Options.optimizer_impl)
ADAMW_FOREACH_UPDATE_BYTES = 80.0
OPTIMIZER_UPDATE_BYTES = {"fused": ADAM_UPDATE_BYTES, "foreach": ADAMW_FOREACH_UPDATE_BYTES}
LOSS_SOFTMAX_BYTES = 4.0  # per logit: the fp32 softmax a cross-entropy saves (beside the logits, act_bytes each)
# XLA's cross-entropy (MaxText max_utils.cross_entropy_with_logits, tpu-recipes-v0.1.4: logits cast to fp32,
# `cast_logits_to_fp32`, a custom VJP saving exp(logits - max)): one fp32 buffer of the logits' shape. XLA folds the
# cast into the logits dot (xla_allow_excess_precision, on by default), writes the saved exponentials over the
# logits it no longer needs and the gradient over those (an elementwise fusion may reuse its dead operand's buffer);
# the backward's bf16 cast fuses into the two dots that read it. XLA's CPU compile of that loss, value_and_grad
# with T=2048 tokens, D=256, V=8k-32k: temp 4.5 B per logit (the dot there emits fp32 as well).
XLA_LOSS_BYTES_PER_LOGIT = 4.0
# PyTorch FSDP2 (torch.distributed._composable.fsdp._fsdp_collectives) copies each all-gathered parameter out of the
# flat all-gather buffer into the unsharded parameter on the compute stream (`foreach_all_gather_copy_out`): read +
# write bf16 per parameter per gather; before each reduce-scatter it concatenates the bf16 gradients into the
# reduce-dtype input (`foreach_reduce_scatter_copy_in`, torch._chunk_cat) on the reduce-scatter stream, and the
# compute stream waits for that copy (`current_stream.wait_stream(reduce_scatter_stream)`): read 2 B + write the
# reduce dtype. XLA on TPU gathers and reduces in place.
FSDP_COPY_OUT_BYTES = 2.0 * 2.0
FSDP_COPY_IN_READ_BYTES = 2.0
# Bytes of an FP8 element on a TP all-gather's wire. Transformer Engine quantises before it gathers, under every recipe:
# the norm's output for qkv/fc1 (layernorm_linear.py: the input quantizer is handed to `gather_along_first_dim` /
# `fill_userbuffers_buffer_for_all_gather`; TE v1.8 already wrote `ln_out` as uint8), the saved input for the
# weight-gradient re-gather, and the output gradient for proj/fc2 dgrad (module/base.py `grad_output_preprocess`;
# distributed.py `_all_gather_fp8`, `_all_gather_mxfp8`, the 1-D block case of `_start_all_gather_fp8_blockwise`;
# TransformerEngine @ d0067d0d and v1.8). torchao's float8 TP does the same for tensorwise scaling only
# (float8_tensor_parallel.py `PrepareFloat8ModuleInput`: "all-gather in float8. This currently assumes tensorwise
# scaling"; Float8RowwiseParallel casts the output gradient to float8 in the backward). Scales (one per tensor, or
# 1 B per 32 / 4 B per 128 elements under block scaling: 3%) are left out, as in fp8_recipes.yaml. Reduce-scatters
# carry the GEMMs' bf16 outputs.
FP8_ELEMENT_BYTES = 1.0  # an E4M3/E5M2 element
FP8_GATHER_BYTES = FP8_ELEMENT_BYTES
FP8_BLOCK_SCALE_BYTES = 1.0 / 32  # per element: MXFP8's E8M0 scale per 32 (OCP MX v1.0), TE blockwise fp32 per 128
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
# RoPE as a complex multiplication (Options.complex_rope; torchtitan models/llama/model.py @9dec370 `apply_rotary_emb`:
# view_as_complex(x.float()), times freqs_cis, view_as_real, type_as(x)). Inductor generates no code for complex
# tensors (torch/_inductor/lowering.py `unsupported_input_tensor`: "Torchinductor does not support code generation for
# complex operators", the warning pytorch/torchtitan#15 reports for its Llama), so under torch.compile the product
# stays an eager aten kernel between two compiled casts. HBM bytes per element of q and k, forward: the cast to fp32
# (read 2, write 4), the complex product (read 4, write 4; freqs_cis broadcast), the cast back (read 4, write 2) = 20;
# the backward runs the same three in reverse (the product by the conjugate) = 20.
COMPLEX_ROPE_FWD_BYTES = 20.0
COMPLEX_ROPE_BWD_BYTES = 20.0
# Megatron-Core's unfused RoPE (Options.unfused_yarn_rope). A YaRN RoPE has a concentration factor ("mscale")
# 0.1·ln(factor) + 1 (megatron/core/models/common/embeddings/yarn_rotary_pos_embedding.py `_yarn_get_mscale`: 1.347
# for gpt-oss's factor 32), and `apply_rotary_pos_emb` (rope_utils.py) runs Transformer Engine's fused kernel only
# when mscale == 1 ("mscale=... is not supported by TE's fused RoPE. Using unfused implementation"); Megatron-Bridge
# also turns apply_rope_fusion off for position_embedding_type "yarn" (src/megatron/bridge/utils/fusions.py
# `validate_rope_fusion_compatibility`, v0.2.0 .. v0.5.1; gpt-oss: models/gpt_oss/gpt_oss_bridge.py
# position_embedding_type = "yarn"). NVIDIA/Megatron-LM @ 0d8e0714, b0cc2706, 55ac7082, d7288711, d0b3b775,
# 458c8d0e (the Megatron-Bridge v0.2.0, v0.3.0, v0.3.1, v0.4.0/v0.4.1, v0.5.0, v0.5.1 pins) `_apply_rotary_pos_emb_bshd`
# on q and on k (rot_dim = the head dim, t_pass empty), HBM elements per element of q or k (cos/sin are [s, 1, 1, d],
# broadcast): forward t·cos (read 1, write 1),
# `_rotate_half` -x2 (½ + ½) and torch.cat (1 + 1), ·sin (1 + 1), the sum (2 + 1), torch.cat((t, t_pass)) (1 + 1) =
# 12; autograd's backward: g·sin (1 + 1), the negation's gradient (½ + ½), chunk's gradient concatenated (1 + 1),
# g·cos (1 + 1), the two gradients of t summed (2 + 1), the slice's gradient (zeros 1, copy 1 + 1) = 13 (the empty
# t_pass slice's own zero-filled gradient is left out: a lower bound). A fused kernel moves 2 (read, write); the
# pointwise term already charges that, and the backward twice it.
UNFUSED_ROPE_FWD_ELEMENTS = 12.0
UNFUSED_ROPE_BWD_ELEMENTS = 13.0
# Kernel launches of the unfused RoPE on one tensor, forward (mul, neg, cat, mul, add, cat), against the fused one
# KERNELS_PER_LAYER_FWD counts: 5 more on each of q and k
UNFUSED_ROPE_EXTRA_KERNELS_FWD = 10
# Options.attention_kernel → the efficiency.yaml (forward, backward) fractions of peak its kernels reach
ATTENTION_KERNEL_FRACTIONS = {
    "fused": ("attention_fwd_fraction", "attention_bwd_fraction"),
    "fa2": ("attention_fa2_fwd_fraction", "attention_fa2_bwd_fraction"),
    "sdpa": ("attention_sdpa_fwd_fraction", "attention_sdpa_bwd_fraction"),
    # cuDNN's fused attention as release 9.10 (mid-2025) ran it (efficiency.yaml attention_cudnn910_*: NVIDIA's B200
    # table at that release); a stack of that age, e.g. the nemo@25.04 preset
    "cudnn-9.10": ("attention_cudnn910_fwd_fraction", "attention_cudnn910_bwd_fraction"),
}
ATTENTION_KERNELS = tuple(ATTENTION_KERNEL_FRACTIONS)
# What each recompute policy runs again in the backward, as shares of the layer forward's parts (matmuls, attention
# core, pointwise, fp8 casts). full: the whole layer (Chen et al. 2016; Megatron's checkpointed layer); selective:
# the attention core (Korthikanti et al. 2022 §5), or torchtitan's per-op policy (every second matmul and the
# pointwise ops around it) or per-layer policy (every second layer fully); gemm-last: everything but the GEMMs.
RECOMPUTE_PARTS: dict[str, dict[str, float]] = {
    "none": {},
    "full": {"mm": 1.0, "core": 1.0, "elem": 1.0, "cast": 1.0},
    "gemm-last": {"elem": 1.0, "cast": 1.0},
    "selective/attention": {"core": 1.0},
    "selective/op": {"mm": 0.5, "elem": 1.0, "cast": 1.0},
    "selective/layer": {"mm": 0.5, "core": 0.5, "elem": 0.5, "cast": 0.5},
    # Megatron-Core's mla_up_proj (math/transformer.py RECOMPUTE_POLICIES): MLA's query and key-value up-projection
    # GEMMs ("up", CostModel._mla_up_projections); the RoPE on their outputs (one fused pointwise kernel,
    # apply_rope_fusion) and their inputs' FP8 casts are not split out of "elem"/"cast" and not charged: a lower bound
    "mla-up-proj": {"up": 1.0},
}
SELECTIVE_FLAVORS = tuple(k.split("/")[1] for k in RECOMPUTE_PARTS if k.startswith("selective/"))


def pipeline_warmup_forwards(pp, vpp, ep_overlap: bool = False):
    """Forward chunks the first pipeline rank runs before its first backward (its cool-down runs as many backwards):
    Megatron-Core's `get_pp_rank_microbatches` (megatron/core/pipeline_parallel/schedules.py @ NVIDIA/Megatron-LM
    0d8e0714, b0cc2706, d7288711, 458c8d0e: the Megatron-Bridge v0.2.0 .. v0.5.1 pins) at rank 0: none without
    pipelining; pp - 1 in the plain 1F1B (forward_backward_pipelining_without_interleaving); 2(pp - 1) + (vpp - 1)·pp
    interleaved (microbatch_group_size_per_vp_stage = pp, its default), plus one with EP A2A overlap
    (`overlap_moe_expert_parallel_comm`: "one extra micro-batch forward step before the 1f1b stages"). Before the
    cap at the step's n_micro·vpp chunks, which the callers apply. pp and vpp may be numpy arrays."""
    interleaved = 2 * (pp - 1) + (vpp - 1) * pp + (1 if ep_overlap else 0)
    return np.where(pp > 1, np.where(vpp > 1, interleaved, pp - 1), 0)


def _fp8_te_casts(r: dict, normed, a_in, g_out, w_local, compiled: bool, gather_shard, tp_sp):
    """Transformer Engine: one fused cast-transpose per operand writes the fp8 copy and its transpose
    (`fp8_cast_transpose_fused`); the qkv and gate/up inputs leave the norm (`normed` of `a_in`), which emits fp8
    itself under delayed scaling. Bytes per element from fp8_recipes.yaml. (forward, backward) HBM bytes."""
    return (r["fused_cast_transpose_bytes"] * (a_in - normed + w_local),
            r["fused_cast_transpose_bytes"] * g_out + r["fused_normed_bytes"] * normed)


def _fp8_dynamic_casts(r: dict, normed, a_in, g_out, w_local, compiled: bool, gather_shard, tp_sp):
    """torchao's Float8Linear (torchtitan), per operand role as torchao's roofline of a compiled Float8Linear counts
    it (fp8_recipes.yaml `unfused`): the inputs, the local weights and the output gradients, less the first read of
    an input or output gradient that torch.compile folds into the kernel producing it (`compiled`). `gather_shard`:
    the FSDP shard degree when the weights are all-gathered in float8 (the cast runs on the shard before each of the
    forward's and the backward's gathers; degree 1: no gather, the weight cast as without), else None. `tp_sp`: the
    TP degree where sequence parallelism gathers the norms' outputs (and, backward, the output gradients of the
    attention output and MLP down projections, `normed` elements each), else 1: torchao's float8 TP casts those on
    the sequence shard before the gather. (forward, backward) HBM bytes."""
    u = r["unfused"]
    fused = u["producer_read_bytes"] if compiled else 0.0
    (in_f, in_b), (w_f, w_b), gr = u["input"], u["weight"], u["grad_output"]
    if gather_shard is not None and "fp8_gather_weight" in u:
        fg = u["fp8_gather_weight"]
        sharded = gather_shard > 1
        w_f = np.where(sharded, fg["weight"][0] + fg["shard_cast_bytes"] / gather_shard, w_f)
        w_b = np.where(sharded, fg["weight"][1] + fg["shard_cast_bytes"] / gather_shard, w_b)
    fwd = (in_f - fused) * a_in + w_f * w_local
    bwd = in_b * a_in + (gr - fused) * g_out + w_b * w_local
    if "tp_gathered" in u:
        tg = u["tp_gathered"]
        on_shard = np.where(tp_sp > 1, normed, 0.0)  # each of the gathered inputs and gathered gradients
        shard_cast = (tg["shard_cast_bytes"] - fused) / tp_sp
        fwd = fwd + (shard_cast - (in_f - fused)) * on_shard
        bwd = bwd + (tg["transpose_bytes"] - in_b + shard_cast + tg["transpose_bytes"] - (gr - fused)) * on_shard
    return fwd, bwd


FP8_CASTS = {True: _fp8_te_casts, False: _fp8_dynamic_casts}  # Options.fp8_fused_casts
FP8_RECIPES_FILE = Path(__file__).resolve().parent.parent / "cost" / "data" / "fp8_recipes.yaml"


@lru_cache(maxsize=1)
def _fp8_table() -> dict[str, dict]:
    return yaml.safe_load(FP8_RECIPES_FILE.read_text())


def fp8_recipes() -> dict[str, dict]:
    """The FP8 scaling recipes' cast bytes and GEMM fractions (cost/data/fp8_recipes.yaml, sources there)."""
    return {k: v for k, v in _fp8_table().items() if k != "any_layout_chips"}


def fp8_cast_bytes(recipe: str, chip_name: str) -> dict:
    """A recipe's cast bytes per element on a chip: its `any_layout` bytes (no transposed copy) on a chip whose FP8
    GEMMs take any operand layout (fp8_recipes.yaml any_layout_chips), else the recipe's own."""
    r = fp8_recipes()[recipe]
    return {**r, **r["any_layout"]} if "any_layout" in r and chip_name in _fp8_table()["any_layout_chips"] else r


def fp8_gemm_fraction(recipe: str, chip_name: str, chip_kind: str) -> float:
    """A recipe's FP8 GEMM throughput relative to the per-tensor-scaled GEMM, for a chip (by name, then kind)."""
    if recipe not in fp8_recipes():
        raise unknown_name_error("FP8 recipe", recipe, fp8_recipes())
    table = fp8_recipes()[recipe]["gemm_fraction"]
    return float((table.get(chip_name) or table[chip_kind])["value"])


MOE_DISPATCHERS = ("alltoall", "deepep", "hybridep")  # Options.moe_dispatcher
# CUDA-graph capture scopes (Options.cuda_graph_scopes), as Megatron-Core names them (docs 'CUDA Graph':
# `--cuda-graph-impl transformer_engine|local --cuda-graph-modules attn mlp moe moe_router moe_preprocess`, or
# `--cuda-graph-impl full_iteration`): a captured scope's kernels are replayed by one graph launch, not issued one by
# one from Python. `full_iteration` captures the whole forward and backward (it needs a sync-free step).
CUDA_GRAPH_SCOPES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "full_iteration")
# MaxText's checkpoint names of the attention projections (layers/attentions.py `checkpoint_name`) -> which output
KEPT_PROJECTIONS = {"query_proj": "q", "key_proj": "kv", "value_proj": "kv", "out_proj": "o"}
FSDP_EDGE_GROUPS = ("none", "embedding", "root")  # Options.fsdp_edge_group
FP8_SCOPES = ("all", "experts")  # Options.fp8_scope
GROUPED_MM_KERNELS = ("default", "torch")  # Options.grouped_mm_kernel
CP_IMPLS = {"ring": "_ring_cp_terms", "torch": "_torch_cp_terms", "allgather": "_allgather_cp_terms"}  # Options.cp_impl → CostModel method


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
    overlap_param_gather: bool = False  # ZeRO-1/2 all-gather overlapped with the next step's first forward
    dp_overlap: bool | None = None  # replica gradient reduction hidden behind the backward; None = GPU yes, TPU no
    fused_elementwise: bool = True  # pointwise chains fused (torch.compile, XLA, Megatron fused kernels)
    fused_loss: bool = True  # fused cross-entropy (Megatron, XLA); False = eager PyTorch loss (torchtitan)
    # the step is one program XLA compiles (JAX, MaxText), whose memory follows XLA's buffers (`_xla_saved_layer`,
    # `_xla_activations`: verified against XLA's buffer assignment by `meshplan verify`) and which gathers each FSDP
    # weight just before its dot; None = on TPUs only (every TPU program is XLA's; a GPU one is XLA's when JAX runs it)
    xla_program: bool | None = None
    fp8_weight_cache: bool = True  # FP8 weights cast once per step (Transformer Engine); False = every forward
    # FP8 casts fused as Transformer Engine fuses them (norm kernels emit fp8, fused cast-transpose, delayed
    # scaling); False = torchao's Float8Linear, its casts kernel by kernel as torchao's roofline counts them (torchtitan)
    fp8_fused_casts: bool = True
    # FP8 scaling recipe (fp8_recipes.yaml): tensorwise | rowwise | blockwise | delayed; None = delayed when the casts
    # are fused (Transformer Engine's default), tensorwise when not (torchao's default)
    fp8_recipe: str | None = None
    # Which GEMMs run in FP8 under compute_dtype "fp8" (FP8_SCOPES): "all" = every linear but the output layer
    # (Transformer Engine's fp8_autocast; torchtitan's linear converters with filter_fqns ["output"], and for MoE its
    # grouped-GEMM converter too); "experts" = the routed experts' grouped GEMMs alone, the rest in bf16 (torchtitan's
    # `quantize.grouped_mm.float8` / `quantize.grouped_mm.mx` converters with fqns ["experts"] and no linear converter:
    # the PyTorch/Nebius DeepSeek-V3 recipe, ml-cookbook pytorch-dsv3-mxfp8 `mxfp8_default`)
    fp8_scope: str = "all"
    # The routed experts' grouped GEMM kernel (GROUPED_MM_KERNELS): "default" = the chip's grouped fraction (TE
    # GroupedLinear, MegaBlocks, XLA's ragged dot); "torch" = PyTorch's `torch._grouped_mm`, at its own measured ceiling
    # (efficiency.yaml torch_grouped_matmul_peak_fraction; torchtitan's experts, models/moe/moe.py)
    grouped_mm_kernel: str = "default"
    ep_overlap: bool = False  # MoE all-to-alls hidden behind another micro-batch's compute (DualPipe, MCore)
    moe_node_limit: int = 0  # node-limited routing: a token reaches at most this many nodes (DeepSeek-V3: 4)
    # Benchmark routing with random router logits (Megatron-Core `--moe-router-force-load-balancing`: router.py
    # replaces the logits by `apply_random_logits` "for benchmark"; the Megatron-Bridge performance tables all run
    # so: "we force-balance the token distribution among experts"): i.i.d. uniform routing, no learned-router skew
    moe_force_balance: bool = False
    # MoE token dispatcher (MOE_DISPATCHERS): "alltoall" = Megatron-Core's MoEAlltoAllTokenDispatcher (its default,
    # GShard's dispatch): a token routed to several experts on one rank travels once per expert; "deepep" /
    # "hybridep" = the flex dispatcher (`--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend`): DeepEP's
    # dispatch layout (`get_dispatch_layout`: is_token_in_rank, num_tokens_per_rdma_rank) sends a token once to each
    # rank that holds any of its experts, and across nodes once to each node (RDMA), forwarding inside it over NVLink
    moe_dispatcher: str = "alltoall"
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
    # PyTorch FSDP2 copies every all-gathered parameter out of the flat communication buffer and the gradients into
    # one before the reduce-scatter (FSDP_COPY_*). Megatron-FSDP assigns parameters sliced views of its contiguous
    # communication buffers and needs no such copy (Megatron-LM docs/user-guide/features/megatron_fsdp.md: "FSDP2
    # requires COPY operations to move parameters and gradients in and out of communication buffers ... while
    # Megatron-FSDP assigns sliced views of contiguous communication buffers"): False there.
    fsdp_copies: bool = True
    # FSDP under pipelining. True: the stage stays gathered through the step and its gradients accumulate unsharded
    # until the last micro-batch's backward (torch.distributed.pipelining with FSDP2, torchtitan; the JAX program,
    # verify PP2xFSDP4). False: Megatron-FSDP, which de-allocates the unsharded weights after every fprop and dgrad and
    # reduce-scatters the weight gradients "during every backward pass" (Megatron-LM docs/user-guide/features/
    # megatron_fsdp.md, FSDP fundamentals; megatron_fsdp.py `grad_reduce_every_bprop` for optim_grads(_params)), pipeline
    # or not: each micro-batch gathers and reduce-scatters as without pipelining
    fsdp_pp_gathered_stage: bool = True
    # The FSDP parameter group besides one layer that nothing can hide (FSDP_EDGE_GROUPS): its all-gather comes before
    # the first layer's compute and its reduce-scatter after the last backward. "none": only the first layer's gather
    # and the last reduce-scatter show (XLA, Megatron-FSDP). "root": torchtitan up to v0.1.0 wraps the embedding,
    # final norm and output layer in the root FSDP2 module (torchtitan @9dec370 parallelisms/parallelize_llama.py
    # `apply_fsdp`: fully_shard(model) after the blocks); the root gathers them all at its pre-forward, keeps them
    # (root reshard_after_forward False, FSDP2 `_lazy_init`) and reduce-scatters them in the final backward
    # callback (`_root_post_backward_final_callback`), when every other gradient is done. "embedding": since
    # torchtitan #1094 (2025-07-28, v0.2.0) tok_embeddings and [norm, output] are groups of their own; the output
    # layer's gather is prefetched behind the last layer and its reduce-scatter runs behind the layers' backward, and
    # only the token embedding's are exposed (a tied table is the output layer too: all of it).
    fsdp_edge_group: str = "none"
    # RoPE by complex multiplication that torch.compile leaves eager (COMPLEX_ROPE_*; torchtitan's Llama models): with
    # fused_elementwise its q/k passes cost what those three kernels move, not one fused pass. Eager PyTorch's RoPE is
    # already in unfused_elementwise_factor.
    complex_rope: bool = False
    # Megatron-Core applies a YaRN-scaled RoPE (ModelConfig.rope_scaling "yarn": gpt-oss) with its unfused PyTorch
    # function, op by op, instead of Transformer Engine's fused RoPE kernel (`_unfused_rope_bytes`). On for the
    # Megatron-Core presets (train/frameworks.py); no effect on other RoPE scalings or on MLA
    unfused_yarn_rope: bool = False
    # K and V copied to every query head before attention under GQA (torchtitan `repeat_kv`, models/llama/model.py
    # @9dec370 to v0.2.1; replaced by SDPA's enable_gqa in #2259, 2026-01-27): one copy each forward (read K·H, write
    # N·H per token) and the gradient summed back over the repeats in the backward (read N·H, write K·H)
    repeat_kv: bool = False
    # The AdamW implementation (OPTIMIZER_UPDATE_BYTES): "fused" = one kernel per tensor group reading and writing
    # each state once (Megatron/Apex FusedAdam, torch's fused=True); "foreach" = PyTorch's multi-tensor AdamW, a
    # pass per op (torchtitan's default until #881, 2025-02-24, "use Fused AdamW as default")
    optimizer_impl: str = "fused"
    # How context parallelism runs attention. "ring": Ring Attention (Liu et al. 2023) as Megatron-Core/Transformer
    # Engine run it: each rank passes its (GQA-sized) K/V block to the next, hidden behind the block it feeds.
    # "torch": PyTorch's experimental context_parallel as torchtitan ran it (torch 2.5-2.6, rotate method
    # "allgather", torchtitan's default): the model repeats K/V to every query head before SDPA (`repeat_kv`), so
    # the KV that travels is MHA-sized; it is all-gathered once per layer pass, hidden only behind the first
    # (diagonal) block; gradients of K/V travel block by block in fp32 with the last one exposed; outputs and
    # gradients are merged in fp32 (CP_TORCH_MERGE_*).
    # "allgather": each layer all-gathers the sequence's GQA-sized K/V and reduce-scatters their gradients (the JAX
    # program `meshplan verify` compiles; Llama 3 §3.3.2).
    cp_impl: str = "ring"
    # Pipeline schedule (DeepSeek-V3 report, Table 2, compares the three): "1f1b" (Narayanan et al. 2021; interleaved
    # when vpp > 1), "zb1p" (zero-bubble ZB-H1, Qi et al. 2024: the weight-gradient GEMMs fill the bubble), or
    # "dualpipe" (DeepSeek-V3 §3.2.1: two pipelines in opposite directions, each rank holding two stages), or "gpipe"
    # (all forwards, then all backwards: GPipe, Huang et al. 2019; with vpp > 1 looped breadth-first, each chunk run
    # for every micro-batch before the next, Lamy-Poirier 2023 and torchtitan's LoopedBFS; Llama 3 405B at 16K GPUs,
    # Chu et al. ISCA 2025 §3.1.3: "ZeRO-2 with all-forward-all-backward when bs < 2×pp").
    pp_schedule: str = "1f1b"
    # The pipeline as one SPMD loop (MaxText layers/pipeline.py `Pipeline.__call__`: total_iterations =
    # num_pipeline_microbatches·num_pipeline_repeats + (num_stages − 1), every iteration running every stage through
    # one vmap, so the bubble iterations compute on filler data; the JAX program's `pipeline_layers` the same): the
    # layers' FLOPs and collectives are (M·v + p − 1)/(M·v) of the useful ones, the state shifts one stage on every
    # iteration but the last (2(M·v + p − 2) sends a step), and the embedding and output layer sit outside the
    # pipeline replicated on every stage (MaxText layers/decoders.py applies the embedding before and the logits
    # after `pipeline_module`): their gradients join the data all-reduce and the last stage's output and the input
    # gradients are all-reduced over `stage` (2M activations). False: Megatron/torchtitan stages that idle in the
    # bubble, the embedding on the first stage and the output layer on the last.
    pp_spmd_loop: bool = False
    # Megatron-Core's interleaved schedule overlaps each pipeline send/receive with the next model chunk's compute
    # (`overlap_p2p_comm`: on by default with interleaving in Megatron-LM, `--no-overlap-p2p-communication` turns it
    # off, megatron/training/arguments.py; Megatron-Bridge sets it whenever vpp > 1, training/comm_overlap.py). Only
    # the steady state overlaps: the warm-up and flush transfers stay blocking (`overlap_p2p_comm_warmup_flush`
    # defaults to False, megatron/core/model_parallel_config.py). False: every send blocks (torchtitan, 1F1B).
    pp_overlap: bool = False
    # Megatron's `account_for_embedding_in_pipeline_split` / `account_for_loss_in_pipeline_split` (Megatron-Bridge's
    # Llama 3.1 405B recipe sets both, recipes/llama/llama3.py): the embedding and the loss each take one layer's
    # place when the layers are divided into pipeline chunks, so the last stage runs one layer fewer beside the
    # loss instead of a full stage plus the loss (Megatron asserts that the L + 2 slots divide evenly; an uneven pinned
    # split is timed at its fullest stage). False: the layers are split alone and the loss sits on top. The ledger
    # and the memory keep describing a full stage (an upper bound by one layer on the first and last stages).
    pp_head_in_split: bool = False
    # Ring CP's backward reuses the K/V blocks its forward received (the autodiff of a ppermute ring saves them, the
    # JAX program's `ring` form): only dK/dV travel back, 2(cp − 1) passes a layer. False: Transformer Engine's ring
    # (AttnFuncWithCPAndKVP2P.backward) passes K/V again beside dK/dV, 3(cp − 1).
    ring_saves_kv: bool = False
    # Which fused attention kernel runs (efficiency.yaml): "fused" = the chip's best (FA3 or cuDNN on Hopper, as
    # Megatron-Core/TE and MaxText run; FA2 on Ampere); "fa2" = the flash-attn package's FlashAttention-2
    # (nanotron, llm-foundry); "sdpa" = PyTorch's scaled_dot_product_attention, whose bundled FA2 it picks first
    # on every GPU (torchtitan; pytorch/pytorch#142132). On Hopper both FA2s run at about half FA3's rate.
    attention_kernel: str = "fused"
    # The block grid of a TPU splash-attention kernel, (block_q, block_kv) of its forward and of its backward (MaxText
    # sa_block_q/sa_block_kv and sa_block_q_dkv/sa_block_kv_dkv): the causal blocks it computes whole
    # (tm.causal_block_visit_ratio). (0, 0) = no block granularity (the causal half); read on TPUs only.
    attention_block_fwd: tuple[int, int] = (0, 0)
    attention_block_bwd: tuple[int, int] = (0, 0)
    # Element sizes of the program (the planner's defaults describe bf16 training with an fp32 master copy; the CPU
    # program `meshplan verify` compiles is fp32 throughout: 4, 4, 0)
    act_bytes: float = ACT_BYTES  # activations and the TP/CP/EP/PP collectives that carry them
    param_bytes: float = PARAM_BYTES  # the working copy of the weights (without FSDP) and the ZeRO-1/2 all-gather
    master_bytes: float = MASTER_BYTES  # the fp32 master copy in the optimizer state (0: the weights are the master)
    # JAX/XLA remat recomputes only what the backward reads (dead code elimination of the rematerialised forward):
    # full recompute skips a dense MLP's down-projection, materialised selective attention reruns QKᵀ and the
    # softmax but not AV, and the backward's TP re-gathers serve the recomputed forward too. PyTorch's eager checkpoint
    # (Megatron) reruns the whole checkpointed function (torchtitan's compiled one: compiled_recompute). On for
    # maxtext/jax (train/frameworks.py).
    remat_dce: bool = False
    # torch.compile of a checkpointed block (torchtitan @9dec370 parallelisms/parallelize_llama.py: apply_ac wraps each
    # TransformerBlock with ptd_checkpoint_wrapper, then apply_compile runs torch.compile(block, fullgraph=True) "after
    # AC wrapping"): dynamo's checkpoint HOP tags every op of the region PREFER_RECOMPUTE (torch/_higher_order_ops/
    # wrap.py TagActivationCheckpoint.tag_nodes), AOTAutograd's min-cut partitioner (torch/_functorch/partitioners.py
    # must_recompute) puts those ops into the compiled backward graph, which _extract_graph_with_inputs_outputs builds
    # from what the gradients read and dead-code-eliminates. So the recomputed forward is part of the backward graph
    # Inductor's post-grad passes run on (micro_pipeline_tp_pass included), and of its TP collectives only those the
    # backward reads rerun (`_tp_terms`). On for torchtitan (train/frameworks.py); Megatron/DeepSpeed rerun eagerly.
    # Collectives only: the recompute's GEMMs are still charged whole (the partitioner drops the MLP down-projection's
    # rerun too, as remat_dce models for XLA; not modelled here).
    compiled_recompute: bool = False
    # Full recompute's checkpointed layer input kept as 1/tp on each TP rank and all-gathered over TP at the start of
    # the layer's backward, before the recomputed forward (`tm.activation_bytes_per_layer` distribute_saved;
    # `_tp_terms`). Megatron-LM `--distribute-saved-activations` (megatron/core/tensor_parallel/random.py @004bfb5
    # CheckpointFunction: split_tensor_into_1d_equal_chunks after the forward, gather_split_1d_tensor in the backward;
    # arguments.py: full recompute granularity and TP > 1 only; legacy transformer.py applies it `and not
    # sequence_parallel`, Megatron-Core's TransformerConfig refuses it with SP), DeepSpeed activation checkpointing
    # `partition_activations` (deepspeed/runtime/activation_checkpointing/checkpointing.py: get_full_inputs
    # dist.all_gather over the model-parallel group), metaseq `--distribute-checkpointed-activations`
    # (metaseq/modules/checkpoint_activation_wrapper/checkpoint_activations.py @9b0bbc6, through Megatron's mpu
    # split/gather). No effect with SP (the saved input is already 1/tp), tp = 1 or another recompute policy.
    distribute_saved_activations: bool = False
    # Under tp_overlap the backward's input-gradient reduce-scatters are decomposed with their dgrad GEMM (TE's
    # userbuffers: bulk overlap with qkv/fc1 wgrad, `_collective_matmul_exposed`). PyTorch's async TP cannot pair them
    # in torchtitan's Llama: micro_pipeline_tp's fuse_matmul_reduce_scatter needs the reduce-scatter's input to be one
    # matmul's output (`_find_producer_matmul`: mm / _scaled_mm, or reshape -> mm -> reshape; else "no producer matmul
    # found for reduce scatter, skipping"), and the gathered input's gradient is the sum of the separate wq/wk/wv (w1/w3)
    # dgrad GEMMs (torchtitan @9dec370 parallelize_llama.py plans "attention.wq", "attention.wk", "attention.wv",
    # "feed_forward.w1", "feed_forward.w3" as separate colwise linears behind one PrepareModuleInput gather). False:
    # those reduce-scatters stay exposed whole. Off for torchtitan (train/frameworks.py).
    tp_overlap_dgrad_rs: bool = True
    # The attention's Q, K and V as three GEMMs of their own widths on the layer input, not one fused QKV GEMM
    # (torchtitan's Llama: `self.wq`, `self.wk`, `self.wv` nn.Linear, torchtitan models/llama3/model.py @9dec370 and
    # models/llama3/model/model.py @v0.2.2; Megatron-Core and Transformer Engine fuse them in `linear_qkv`). Under GQA
    # and TP the K and V GEMMs are narrow (Llama 3 8B at TP 8: 128 columns each), where a GEMM runs far from peak
    # (Efficiency.matmul at its smallest dimension); torchtitan#1207 found those two layers ~40% slower under float8
    # rowwise than in bf16 (its fix, torchtitan#1319, leaves them in bf16 through torchao's auto filter). On for
    # torchtitan (train/frameworks.py). The MLP is timed at F/tp wide either way (torchtitan's separate w1/w3).
    separate_qkv: bool = False
    # XLA folds an all-reduce of an all-reduce's result into one over both groups (AllReduceFolder, run by the GPU and
    # TPU compilers right after SPMD partitioning): the norm scales' gradients, partial over `tensor`/`context` and
    # over the replicas, are reduced in one step. On for maxtext/jax; Megatron reduces them over TP, then over DP.
    fold_all_reduces: bool = False
    # optimizer offload with ZeRO-Offload's one-step delayed parameter update (Ren et al. 2021 §4.2): the host's
    # part of step i overlaps step i+1's compute; off unless asked for (the weights then lag the gradients one step)
    offload_delayed_update: bool = False
    runtime_reserve: bool = True  # HBM the runtime keeps (CUDA context, XLA's reserve; efficiency.yaml); none on CPU
    # Bytes per parameter of the stored weights when the program keeps no separate master copy (MaxText's
    # `weight_dtype`: bfloat16 = 2): weights, gradients and Adam's moments then all take it. 0 = mixed precision
    # with an fp32 master copy (the FSDP/ZeRO byte counts above).
    weight_dtype_bytes: float = 0.0
    # MaxText's `remat_policy: custom` (configs/base.yml): the attention projections' outputs it names ('query_proj',
    # 'key_proj', 'value_proj', 'out_proj') are kept (offloaded to the host with the layer input when --offload is
    # set) instead of rematerialised: under full recompute their GEMMs are not run again (KEPT_PROJECTIONS)
    kept_projections: tuple[str, ...] = ()
    # The gradient reductions (FSDP reduce-scatter, replica all-reduce) run on the TPU's SparseCores (XLA
    # --xla_tpu_enable_sparse_core_collective_offload_all_reduce, MaxText xla_flags_library.py
    # ENABLE_SPARSECORE_OFFLOADING_FOR_ALL_REDUCE, v6e): their merges then take no TensorCore time. False (every TPU
    # without that flag, and v4/v5e/v5p's programs): the TensorCore merges them (`_tpu_reduction_s`)
    sparsecore_reduce: bool = False
    # MaxText's `use_iota_embed` (layers/embeddings.py @tpu-recipes-v0.1.4): the token embedding as a one-hot dot on
    # the MXU, not a gather (`_iota_embedding_term`); base.yml's default is False, every tpu-recipes v6e recipe sets it
    iota_embedding: bool = False
    # MaxText's dropping MoE (capacity_factor > 0 with megablox and sparse_matmul off): fixed expert buffers filled by
    # one-hot einsums (`_capacity_einsum_moe`); 0 = dropless routing through grouped GEMMs
    moe_capacity_factor: float = 0.0
    # Which parts of a layer run as CUDA graphs (CUDA_GRAPH_SCOPES); () = eager, every kernel issued by the CPU
    # (host_op_s each, cost/data/host_overhead.yaml). Megatron-Bridge recipes name theirs (`cuda_graph_impl`,
    # `cuda_graph_scope` in scripts/performance/configs/*/..._workload_base_configs.py)
    cuda_graph_scopes: tuple[str, ...] = ()
    # Megatron-Core's eager expert path (TEGroupedMLP without the Transformer Engine op fuser): the experts' fc2 bias
    # added outside the grouped GEMM and the attention output's bias outside a fused bias-dropout-add
    # (`_expert_bias_bytes`), and a clamped GLU's clamps outside the fused activation (`_glu_clamp_bytes`). On for the
    # Megatron-Core frameworks (train/frameworks.py); no effect on a model without linear biases or GLU clamp
    unfused_expert_bias: bool = False
    # Megatron-Core's fused SwiGLU (`bias_activation_fusion`: `bias_swiglu_impl`) saves only its input and reruns the
    # activation in its backward (megatron/core/fusions/fused_bias_swiglu.py @d98e8a6; Megatron-Bridge's Llama provider
    # sets it, models/llama/llama_bridge.py, and the Qwen3 performance configs, @v0.5.0): math/transformer
    # activation_bytes_per_layer `glu_saves_input`. On for the Megatron-Core frameworks
    glu_saves_input: bool = False
    # Megatron's `fp8_param_gather` (DistributedDataParallelConfig: "keep the compute param in fp8 (do not use any other
    # intermediate dtype) and perform the param all-gather in fp8", megatron/core/distributed/
    # distributed_data_parallel_config.py @d98e8a6): the working weights are Transformer Engine FP8 tensors beside the
    # distributed optimizer's fp32 master; Megatron-Bridge's FP8 recipes set it (training/mixed_precision.py
    # bf16_with_fp8_current_scaling_mixed, bf16_with_mxfp8_mixed @v0.5.0). Only with --dtype fp8
    fp8_params: bool = False
    # Expert tensor parallelism (Megatron-Core `--expert-tensor-parallel-size`, TransformerConfig.
    # expert_tensor_parallel_size; "MoE Parallel Folding", Liu et al. 2025, arXiv:2504.14960). True: the routed experts
    # are split over the attention's TP ranks (ETP = TP: Megatron-LM's default, megatron/training/arguments.py sets
    # it to the TP size when unset; MaxText and the JAX program shard the experts over `tensor`). False: ETP = 1, each
    # rank holds E/ep whole experts and dispatches its own sequence-parallel slice of the tokens; parallel_state folds
    # ETP x EP x expert-DP over the same ranks as TP x CP x DP of a pipeline stage (expert rank order tp-ep-dp: the
    # EP group takes consecutive ranks). Every Megatron-Bridge MoE recipe and performance preset sets 1
    # (recipes/{gpt_oss/gpt_oss,qwen/qwen3_moe,deepseek/deepseek_v3}.py v0.2.0..v0.5.1; scripts/performance/configs/
    # {deepseek,gpt_oss,qwen}/*_workload_base_configs.py v0.3.0..v0.5.1), as does the Megatron-MoE-ModelZoo
    # (model_configs/benchmarking/*.yaml @ e8650517). Megatron-Core requires sequence parallelism for MoE with TP
    # (arguments.py "When using MoE and tensor parallelism, sequence parallelism must be used"): without SP the
    # experts stay split over TP here. A layout whose EP does not divide its context × data ranks exists only with
    # ETP = 1, which it then gets (`expert_tp_degree`).
    expert_tp: bool = True

    def __post_init__(self) -> None:
        """Names are checked where the options are made (CLI, --from, harness, Python), once, not in the cost terms."""
        for name in self.cuda_graph_scopes:
            if name not in CUDA_GRAPH_SCOPES:
                raise unknown_name_error("CUDA-graph scope", name, CUDA_GRAPH_SCOPES)
        for name in self.kept_projections:
            if name not in KEPT_PROJECTIONS:
                raise unknown_name_error("MaxText checkpoint name", name, KEPT_PROJECTIONS)
        # the word options (an unknown one used to end in a KeyError deep in the cost terms, or be ignored)
        for kind, name, choices in (("matmul dtype", self.compute_dtype, ("bf16", "fp8")),
                                    ("CP implementation", self.cp_impl, tuple(CP_IMPLS)),
                                    ("MoE dispatcher", self.moe_dispatcher, MOE_DISPATCHERS),
                                    ("pipeline schedule", self.pp_schedule, PP_SCHEDULES),
                                    ("attention kernel", self.attention_kernel, ATTENTION_KERNELS),
                                    ("ZeRO-3 fetch", self.zero3_fetch, ("allgather", "broadcast")),
                                    ("FSDP edge group", self.fsdp_edge_group, FSDP_EDGE_GROUPS),
                                    ("optimizer implementation", self.optimizer_impl, tuple(OPTIMIZER_UPDATE_BYTES)),
                                    ("selective recomputation", self.selective_flavor, SELECTIVE_FLAVORS),
                                    ("FP8 recipe", self.fp8_recipe or "delayed", tuple(fp8_recipes())),
                                    ("FP8 scope", self.fp8_scope, FP8_SCOPES),
                                    ("grouped GEMM kernel", self.grouped_mm_kernel, GROUPED_MM_KERNELS)):
            if name not in choices:
                raise unknown_name_error(kind, str(name), choices)
        for name, rule in _OPTION_RULES.items():  # the numbers, by the shared pydantic rules (meshplan.validate)
            rule.check(getattr(self, name), f"Options.{name}")
        for name in ("attention_block_fwd", "attention_block_bwd"):
            block = getattr(self, name)
            if len(block) != 2:
                raise MeshplanError(f"Options.{name} must be (block_q, block_kv), got {block!r}")
            for i, size in enumerate(block):
                _BLOCK.check(size, f"Options.{name}[{i}]")

    def overlaps(self, chip_kind: str) -> tuple[bool, bool]:
        """(TP overlapped, DP reduction overlapped) with the unset ones at the chip's default: XLA on TPU decomposes
        TP collectives into collective matmuls and reduces scanned-layer gradients after the backward; PyTorch on
        GPUs exposes TP and buckets the DP reduction behind the backward."""
        tpu = chip_kind == "tpu"
        return (self.tp_overlap if self.tp_overlap is not None else tpu,
                self.dp_overlap if self.dp_overlap is not None else not tpu)

    @property
    def fp8_dense(self) -> bool:
        """The dense linears (projections, dense and shared-expert MLPs) run in FP8: FP8 matmuls over every linear
        (`fp8_scope` "all"), not the routed experts alone."""
        return self.compute_dtype == "fp8" and self.fp8_scope == "all"

    @property
    def fp8_scaling(self) -> str:
        """The FP8 recipe in force: `fp8_recipe`, or the default of the cast implementation."""
        if self.fp8_recipe is not None:
            return self.fp8_recipe
        return "delayed" if self.fp8_fused_casts else "tensorwise"


_BYTES = Rule(0, 8, "bytes per element", integer=False)  # 0: not kept (no fp32 master, mixed precision)
_BLOCK = Rule(0, 1 << 24, "tokens; 0 = no block grid")  # a splash-attention block size (Options.attention_block_*)
_OPTION_RULES = {"headroom": Rule(-1e9, CLI_RULES["headroom"].hi, "a fraction of HBM kept free; below 0 (more HBM than "
                                  "the chip has) the searches that ignore memory", integer=False), "moe_node_limit": Rule(0, 1 << 20, "nodes; 0 = no limit"),
                 "moe_capacity_factor": Rule(0, 1e3, "0 = dropless", integer=False),
                 **{k: _BYTES for k in ("master_bytes", "weight_dtype_bytes")},
                 **{k: Rule(0, 8, "bytes per element", integer=False, open_lo=True)
                    for k in ("act_bytes", "param_bytes", "fsdp_param_bytes", "grad_reduce_bytes")}}


class Terms(dict):
    """name -> array over layouts; a dict so parts can be listed and summed."""


def _shape_constants(m) -> dict[str, float]:
    D, F = m.d_model, m.d_ff
    mult = 3 if m.gated else 2
    k = m.experts_per_token if m.is_moe else 1
    shared_F = m.n_shared_experts * (m.shared_expert_d_ff or F)
    mlp_w_active = mult * D * (F * k + shared_F) + (D * m.n_experts if m.is_moe else 0)
    expert_w = mult * D * F * m.n_experts if m.is_moe else 0.0
    moe_share = 1.0 if m.is_moe else 0.0
    if m.first_dense_layers:
        # DeepSeek's leading dense layers: the layout is timed with the mean layer (their share of the weights)
        moe_share = 1 - m.first_dense_layers / m.n_layers
        mlp_w_active = moe_share * mlp_w_active + (1 - moe_share) * mult * D * m.dense_d_ff
        expert_w = moe_share * expert_w
    return dict(
        D=D, F=F, V=m.vocab_size, N=m.n_heads, K=m.n_kv_heads, H=m.head_dim, k=k, mult=mult,
        attn_w=tm.attention_matmul_weights(m), mlp_w_active=mlp_w_active, expert_w=expert_w,
        # the routed experts' weights one token passes through (the grouped GEMM), in the mean layer
        routed_w_active=moe_share * mult * D * F * k if m.is_moe else 0.0, moe_share=moe_share,
    )


def _left_over(comm, gemm):
    """Seconds of a collective left exposed by the one GEMM it is decomposed with (a collective matmul)."""
    return np.maximum(comm - gemm, 0)


class CostModel:
    """Evaluates arrays of layouts for one problem."""

    def __init__(self, problem: Problem, eff: Efficiency, options: Options | None = None):
        self.p = problem
        self.eff = eff
        self.opt = options or Options()
        self.comm = CommModel(problem.chip, problem.chips, problem.slice_shape)
        if self.opt.compute_dtype == "fp8" and self.opt.fp8_scope == "experts" and not problem.model.is_moe:
            raise MeshplanError(f"FP8 scope 'experts' puts only the routed experts' GEMMs in FP8, and "
                                f"{problem.model.name} has none: use --fp8-scope all, or --dtype bf16")
        self.c = _shape_constants(problem.model)
        self.pc = tm.param_counts(problem.model)
        chip = problem.chip
        self.peak_bf16 = chip.peak("bf16")
        fp8_peak = (chip.peak("fp8") * eff.dtype_scale("fp8") * fp8_gemm_fraction(self.opt.fp8_scaling, chip.name, chip.kind)
                    if self.opt.compute_dtype == "fp8" else self.peak_bf16)
        # the dense GEMMs' peak, and the routed experts' grouped GEMMs' (FP8 under either Options.fp8_scope)
        self.mm_peak = fp8_peak if self.opt.fp8_dense else self.peak_bf16
        self.expert_mm_peak = fp8_peak
        self.hbm = chip.hbm_bandwidth_bytes_per_s * eff.hbm_fraction
        self.tp_overlap, self.dp_overlap = self.opt.overlaps(chip.kind)

    # --- compute -------------------------------------------------------------------------------
    # Each term function returns one layer's (or the loss's) work for one micro-batch: seconds forward (`f_s`)
    # and backward (`b_s`), FLOPs and HBM bytes; `compute_terms` adds them up and writes the ledger.
    def _matmul_time(self, flops, m_, n_, k_, grouped: bool = False):
        """Seconds of `flops` in [m,k]x[k,n] GEMMs; `grouped`: a MoE layer's grouped expert GEMMs, at the grouped
        kernel's large-problem fraction (Efficiency.grouped_matmul)."""
        if grouped:
            torch_kernel = self.opt.grouped_mm_kernel == "torch"
            return flops / (self.expert_mm_peak * self.eff.grouped_matmul(m_, n_, k_, torch_kernel))
        return flops / (self.mm_peak * self.eff.matmul(m_, n_, k_))

    def _matmul_term(self, g: dict) -> dict:
        """The layer's projection and MLP GEMMs (2·tokens·weights FLOPs; book ch.4), each timed at its shape: the
        routed experts as a grouped GEMM (`_grouped_gemm_s`), the rest (dense MLP, shared experts, router gate) at
        the micro-batch's rows."""
        c, m, tp, t = self.c, self.p.model, g["tp"], g["t_mb"]
        f_mlp = 2 * t * c["mlp_w_active"] / tp
        f_routed = 2 * t * c["routed_w_active"] / tp
        proj_s, proj_flops = self._attention_projections(t, tp)
        up_s, up_flops = self._mla_up_projections(t, tp)  # what mla-up-proj reruns (compute_terms)
        # a dense MLP's down-projection: its output only feeds the residual sum, which no backward reads
        down = 0.0 if m.is_moe else 2 * t * c["D"] * c["F"] / tp
        if m.is_moe and self.opt.moe_capacity_factor > 0:
            disp_s, disp_flops, f_capacity = self._capacity_einsum_moe(g, f_routed)
            mlp_s = self._matmul_time(f_mlp - f_routed, t, c["F"] / tp, c["D"]) + disp_s
            return dict(f_s=mlp_s + proj_s, flops=f_mlp - f_routed + f_capacity + disp_flops + proj_flops,
                        down_s=0.0, down_flops=0.0, mlp_s=mlp_s, out_proj_s=self._out_projection_s(t, tp),
                        up_s=up_s, up_flops=up_flops)
        mlp_s = self._matmul_time(f_mlp - f_routed, t, c["F"] / tp, c["D"]) + self._grouped_gemm_s(g, f_routed)
        return dict(f_s=mlp_s + proj_s, flops=f_mlp + proj_flops,
                    down_s=self._matmul_time(down, t, c["F"] / tp, c["D"]), down_flops=down, mlp_s=mlp_s,
                    out_proj_s=self._out_projection_s(t, tp), up_s=up_s, up_flops=up_flops)

    def _capacity_einsum_moe(self, g: dict, f_routed):
        """MaxText's dropping MoE without sparse kernels (layers/moe.py `dense_matmul`, megablox and sparse_matmul
        off; tpu-recipes-v0.1.2): every expert runs a buffer of C = ceil(S·k/E)·capacity_factor tokens per sequence
        (`generate_masks`), filled or not, so the expert GEMMs cost capacity_factor times the routed FLOPs; tokens
        enter and leave the buffers by two one-hot einsums, dispatch 'BSM,BSEC->EBCM' and combine 'EBCM,BSEC->BSM',
        each 2·S·E·C·D FLOPs a sequence = 2·D·E·C per token. (seconds, dispatch+combine FLOPs, expert FLOPs)."""
        c, m, t, tp = self.c, self.p.model, g["t_mb"], g["tp"]
        S = self.p.seq_len
        slots = m.n_experts * np.ceil(S * c["k"] / m.n_experts) * self.opt.moe_capacity_factor  # E·C per sequence
        f_capacity = f_routed * slots / (S * c["k"])
        f_disp = c["moe_share"] * 2 * (2 * t * slots * c["D"] / tp)
        seconds = (self._matmul_time(f_capacity, slots * t / S / m.n_experts, c["F"] / tp, c["D"])
                   + self._matmul_time(f_disp, t, c["D"] / tp, slots))
        return seconds, f_disp, f_capacity

    def _expert_load_ratio(self, g: dict):
        """Tokens on the busiest EP rank over the mean under dropless routing: the rank holding the busiest expert
        (max/mean load 1 + MaxVio, moe_overlap.yaml: a published measurement) with its other E/ep - 1 experts at the
        mean, 1 + MaxVio·ep/E (a lower bound: other hot experts may share the rank). The multinomial tail of
        i.i.d. uniform routing alone is negligible at training batch sizes (a rank's load is Binomial(ep·t·k, 1/ep):
        relative spread √((1 - 1/ep)/(t·k)), 0.3% at t·k = 131072), so skew of the learned router is what counts."""
        m = self.p.model
        if not m.is_moe or self.opt.moe_force_balance:
            # random logits (`moe_force_balance`) route i.i.d. uniformly: only the negligible multinomial tail
            return 1.0
        return 1.0 + moe_constant("expert_load_max_violation") * g["ep"] / m.n_experts

    def _grouped_gemm_s(self, g: dict, f_routed):
        """Routed-expert GEMMs of one layer forward as a grouped GEMM (MegaBlocks, Gale et al. 2023; Transformer
        Engine GroupedLinear): each local expert's GEMM has rows = tokens·k·ep/E (the tokens whose copies the rank's
        experts compute, `t_expert`) and width F/etp (whole experts under ETP = 1, Options.expert_tp), and is timed at
        that shape by the efficiency model (`Efficiency.matmul`); the FLOPs per rank are the same either way
        (t_expert·k·F/etp = t_mb·k·F/tp); the busiest EP rank's tokens set the time (`_expert_load_ratio`);
        each local expert's GEMMs are separate launches (moe_overlap.yaml grouped_gemm_gemms_per_expert_fwd)."""
        c, m = self.c, self.p.model
        if not m.is_moe:
            return 0.0
        rows = g["t_expert"] * c["k"] * g["ep"] / m.n_experts
        return (self._expert_load_ratio(g) * self._matmul_time(f_routed, rows, c["F"] / g["etp"], c["D"], grouped=True)
                + self.layer_kernels_fwd(g)["moe"] * self.eff.kernel_overhead_s)

    def layer_kernels_fwd(self, g: dict) -> dict:
        """Kernels one layer's forward launches, by the CUDA-graph scope that captures them (CUDA_GRAPH_SCOPES):
        `attn` the dense part (KERNELS_PER_LAYER_FWD: norms, projections, rope, attention, activation, residuals;
        Megatron-Core's unfused YaRN RoPE adds UNFUSED_ROPE_EXTRA_KERNELS_FWD),
        `moe_router` and `moe_preprocess` their shares of the routing kernels (moe_overlap.yaml router_kernels_fwd),
        `moe_permute` the rest of them (permute/unpermute around the all-to-all), `moe` the expert GEMMs (one launch
        per local expert per linear, grouped_gemm_gemms_per_expert_fwd), `moe_quant` the FP8 quantizes of the expert
        GEMMs' inputs (`_expert_quantize_launches`; host issue only). MoE parts in the mean layer (moe_share)."""
        m, c = self.p.model, self.c
        dense = float(KERNELS_PER_LAYER_FWD + (UNFUSED_ROPE_EXTRA_KERNELS_FWD if self._unfused_rope() else 0))
        if not m.is_moe:
            return {"attn": dense, "moe_router": 0.0, "moe_preprocess": 0.0,
                    "moe_permute": 0.0, "moe": 0.0, "moe_quant": 0.0}
        router, pre = moe_constant("router_scope_kernels_fwd"), moe_constant("preprocess_scope_kernels_fwd")
        share = c["moe_share"]
        bias_k, bias_layer = self._expert_bias_kernels()
        clamps = 3.0 if self._unfused_glu_clamp() else 0.0  # the two clamps and the cat (_glu_clamp_bytes)
        clamps += 2.0 if self._fp8_expert_padding() else 0.0  # the FP8 row padding and unpadding copies
        return {"attn": dense, "moe_router": share * router, "moe_preprocess": share * pre,
                "moe_permute": share * (moe_constant("router_kernels_fwd") - router - pre),
                "moe": share * (m.n_experts / g["ep"] * (moe_constant("grouped_gemm_gemms_per_expert_fwd") + bias_k)
                                + bias_layer + clamps),
                "moe_quant": share * self._expert_quantize_launches(g)}

    def _expert_quantize_launches(self, g: dict):
        """Quantize launches of one MoE layer forward's expert GEMM inputs under FP8 on Megatron-Core's eager
        TEGroupedMLP (Options.unfused_expert_bias): TE GroupedLinear quantizes fc1's and fc2's inputs with
        `tex.split_quantize`, which runs one quantize per local expert unless the recipe is delayed scaling (one fused
        multi-cast for all: one per GEMM input); per quantize 3 launches under current (tensorwise) scaling, 1 under
        block scaling (moe_overlap.yaml fp8_quantize_kernels_*). The backward quantizes the two output gradients
        likewise, once each (host_bound_per_mb counts them once, not twice as the GEMMs' dgrad and wgrad)."""
        o = self.opt
        if not (o.compute_dtype == "fp8" and o.unfused_expert_bias and self.p.chip.kind == "gpu"):
            return 0.0
        if o.fp8_scaling == "delayed":
            return 2.0
        per = moe_constant("fp8_quantize_kernels_current_scaling" if o.fp8_scaling == "tensorwise"
                           else "fp8_quantize_kernels_block_scaling")
        return 2.0 * per * self.p.model.n_experts / g["ep"]

    def _expert_bias_kernels(self) -> tuple[float, float]:
        """(launches per local expert, per layer) of Megatron-Core's unfused fc2 bias (`_expert_bias_bytes`): the
        product b·p and the add for each local expert; one torch.cat, and the cast back where the probabilities are
        fp32 (flex dispatchers)."""
        m = self.p.model
        if not (self.opt.unfused_expert_bias and m.is_moe and m.linear_bias):
            return 0.0, 0.0
        return 2.0, 2.0 if self.opt.moe_dispatcher in ("deepep", "hybridep") else 1.0

    def _attention_core_term(self, g: dict) -> dict:
        """QKᵀ, softmax and AV: causal and load-balanced over cp with a fused kernel (ATTENTION_KERNELS), or
        materialised (no causal saving); PyTorch's CP adds its fp32 merges (CP_TORCH_MERGE_*)."""
        c, e, S, m = self.c, self.eff, self.p.seq_len, self.p.model
        t, tp = g["t_mb"], g["tp"]
        # causal, load-balanced over cp (book ch.4): 2·t·(S/2)·N·(QKᵀ + AV widths); windowed layers attend fewer keys
        f_core = 2.0 * t * tm.mean_attended_keys(m, S) * c["N"] * tm.attention_pair_width(m) / tp
        if self.opt.flash_attention:
            fwd_frac, bwd_frac = (self._attention_mxu_fill(d) * getattr(e, a)
                                  for a, d in zip(ATTENTION_KERNEL_FRACTIONS[self.opt.attention_kernel],
                                                  ("fwd", "bwd"), strict=True))
            # the causal blocks a TPU splash kernel computes whole: the fractions are its rate on the scores it computes
            visit_f, visit_b = (self._causal_block_visits(b) for b in (self.opt.attention_block_fwd,
                                                                         self.opt.attention_block_bwd))
            f_core_f, bwd_flops = f_core * visit_f, f_core * e.attention_bwd_flops_ratio * visit_b
            kernel = self.opt.attention_kernel
            if kernel in ATTENTION_TILE_FIELDS:
                # cuDNN's fixed work per query tile, at this length, window and ring-step count, over the 8K causal
                # shape the fractions are read at (efficiency.attention_tile_factor, with the release's own tile
                # constants; 1 where the chip has no tile constant). Measured for cuDNN only: the FA2/SDPA fractions
                # are long-sequence figures of their own
                keys, diag = tm.mean_attended_keys(m, S), tm.masked_tile_share(m, S)
                calls = g["cp"] if self.opt.cp_impl in ("ring", "torch") else 1.0
                fwd_frac = fwd_frac / attention_tile_factor(e, "fwd", keys, diag, calls, tm.attention_pair_width(m),
                                                            kernel=kernel)
                bwd_frac = bwd_frac / attention_tile_factor(e, "bwd", keys, diag, calls, kernel=kernel)
            out = dict(f_s=f_core_f / (self.peak_bf16 * fwd_frac), b_s=bwd_flops / (self.peak_bf16 * bwd_frac),
                       flops_f=f_core_f, flops_b=bwd_flops, hbm_f=0.0, hbm_b=0.0)
            out.update(qk_f_s=out["f_s"], qk_flops=f_core_f, qk_hbm=0.0)  # a fused kernel recomputes as a whole
        else:
            out = self._materialized_attention(g, f_core)
        if self.opt.cp_impl == "torch":
            # fp32 output merges and gradient accumulation of every ring step after the first
            out_elems = t * c["N"] * c["H"] / tp * (g["cp"] - 1)
            out["hbm_f"] = out["hbm_f"] + CP_TORCH_MERGE_FWD_BYTES * out_elems
            out["hbm_b"] = out["hbm_b"] + CP_TORCH_MERGE_BWD_BYTES * out_elems
            out["f_s"] = out["f_s"] + CP_TORCH_MERGE_FWD_BYTES * out_elems / self.hbm
            out["b_s"] = out["b_s"] + CP_TORCH_MERGE_BWD_BYTES * out_elems / self.hbm
        return out

    def _causal_block_visits(self, block: tuple[int, int]) -> float:
        """Scores a TPU splash kernel computes over the causal ones (tm.causal_block_visit_ratio) for its (block_q,
        block_kv); 1 on GPUs (FlashAttention's 128-row tiles waste 1/64 of the scores at 8k) and for windowed
        layers (their blocks follow the window, not the causal triangle: not modelled). The grid of the whole
        sequence: a context-parallel shard's own grid is not modelled."""
        if self.p.chip.kind != "tpu" or self.p.model.has_windows:
            return 1.0
        return tm.causal_block_visit_ratio(self.p.seq_len, *block)

    def _attention_mxu_fill(self, direction: str = "fwd") -> float:
        """Share of a TPU's systolic array an attention kernel's dots fill: QKᵀ contracts over the head width and
        AV produces it, so a head narrower than the MXU leaves the rest of the array idle (book ch.2: "tensor dims
        should be padded to >= 128 (>= 256 on v6e)"; efficiency.yaml matmul_half_dim is the MXU width on TPUs:
        128 on v4/v5e/v5p, 256 on v6e). The attention fractions (efficiency.yaml, splash attention on v5e at head
        dim 128) are for a filled array: head dim 128 on v6e's 256x256 MXU runs at half of them. GPUs' fractions
        are measured at head dim 128: a narrower head runs at the published rate of its kernel at that width
        and pass (efficiency.attention_head_dim_rate; gpt-oss's 64 on cuDNN: 0.670 forward, 0.836 backward), except
        cuDNN's forward where the chip has a tile constant: its tile factor takes the width instead
        (efficiency.attention_tile_factor)."""
        head = tm.attention_pair_width(self.p.model) / 2  # mean of the QKᵀ and AV widths
        if self.p.chip.kind != "tpu":
            kernel = self.opt.attention_kernel
            tiled = kernel in ATTENTION_TILE_FIELDS
            if (direction == "fwd" and tiled and getattr(self.eff, ATTENTION_TILE_FIELDS[kernel][0])
                    and self.opt.flash_attention):
                return 1.0  # cuDNN's forward tile factor carries the width (efficiency.attention_tile_factor)
            # any cuDNN release takes the fused kernel's published head-width points
            return attention_head_dim_rate(self.p.chip, head, "fused" if tiled else kernel, direction)
        return min(1.0, head / self.eff.matmul_half_dim)

    def _pointwise_term(self, g: dict) -> dict:
        """Norms, residuals, RoPE, activation function (HBM-bound): bytes read and written once per fused kernel,
        plus the MoE token permutation; the backward mirrors the forward (twice the bytes)."""
        e, t, tp = self.eff, g["t_mb"], g["tp"]
        act = self.opt.act_bytes
        sp_div = np.where(g["sp"], tp, 1)
        elem_bytes = act * t * tm.pointwise_elements_per_token(self.p.model, tp=tp, sp=sp_div)
        if not self.opt.fused_elementwise:
            elem_bytes = elem_bytes * e.unfused_elementwise_factor
        elem_bytes = elem_bytes + self._moe_permute_bytes(g) + self._moe_router_bytes(g)
        # the backward mirrors all of that (twice the bytes and launches), except the unfused bias adds, whose
        # autograd backward is counted op by op (_expert_bias_bytes), and the dispatcher's regrouping copies, whose
        # backward is the same copy with the inverse index (_moe_regroup_bytes)
        bias_f, bias_b = self._expert_bias_bytes(g)
        clamp_f, clamp_b = self._glu_clamp_bytes(g)
        regroup = self._moe_regroup_bytes(g) + self._fp8_expert_padding_bytes(g)
        copy_f, copy_b = self._attention_input_copy_bytes(g)
        bias_f, bias_b = bias_f + clamp_f + regroup + copy_f, bias_b + clamp_b + regroup + copy_b
        k = self.layer_kernels_fwd(g)
        kernels = k["attn"] + k["moe_router"] + k["moe_preprocess"] + k["moe_permute"]
        f_s = (elem_bytes + bias_f) / self.hbm + kernels * e.kernel_overhead_s
        b_s = (2 * elem_bytes + bias_b) / self.hbm + 2 * kernels * e.kernel_overhead_s
        return dict(f_s=f_s, b_s=b_s, hbm=elem_bytes + bias_f, hbm_b=2 * elem_bytes + bias_b)

    def _attention_input_copy_bytes(self, g: dict):
        """(forward, backward) HBM bytes per layer per micro-batch that a PyTorch Llama moves preparing attention's
        inputs beyond the fused pointwise pass (pointwise_elements_per_token counts RoPE as one read and one write):
        the complex RoPE left eager under torch.compile (Options.complex_rope, COMPLEX_ROPE_*), the K/V repeat to
        every query head (Options.repeat_kv), and Megatron-Core's unfused YaRN RoPE (Options.unfused_yarn_rope,
        UNFUSED_ROPE_*: (12 − 2) elements forward, (13 − 4) backward per element of q and k). E.g. Llama 3 8B (N=32, K=8, H=128), one token, bf16, both on: RoPE
        (32+8)·128·(20 − 4) = 81,920 B forward, (32+8)·128·(20 − 8) = 61,440 B backward; the repeat
        2·(8+32)·128·2 = 20,480 B each way."""
        c, m, t, tp, act = self.c, self.p.model, g["t_mb"], g["tp"], self.opt.act_bytes
        if m.is_mla:
            return 0.0, 0.0
        q, kv = c["N"] / tp * c["H"], np.maximum(c["K"] / tp, 1.0) * c["H"]
        fwd = bwd = 0.0
        if self.opt.complex_rope and self.opt.fused_elementwise:
            fwd = fwd + t * (q + kv) * (COMPLEX_ROPE_FWD_BYTES - 2 * act)
            bwd = bwd + t * (q + kv) * (COMPLEX_ROPE_BWD_BYTES - 4 * act)
        if self.opt.repeat_kv and c["N"] > c["K"]:
            repeat = t * 2 * (kv + q) * act  # K and V: read the GQA heads, write every query head's copy
            fwd, bwd = fwd + repeat, bwd + repeat
        if self._unfused_rope():
            fwd = fwd + t * (q + kv) * (UNFUSED_ROPE_FWD_ELEMENTS - 2) * act
            bwd = bwd + t * (q + kv) * (UNFUSED_ROPE_BWD_ELEMENTS - 4) * act
        return fwd, bwd

    def _unfused_rope(self) -> bool:
        """Whether RoPE runs as Megatron-Core's unfused PyTorch function (Options.unfused_yarn_rope,
        UNFUSED_ROPE_*): a YaRN-scaled RoPE on a non-MLA model."""
        m = self.p.model
        return bool(self.opt.unfused_yarn_rope and m.rope_scaling == "yarn" and m.position == "rotary"
                    and not m.is_mla)

    def _expert_bias_bytes(self, g: dict):
        """(forward, backward) HBM bytes per layer of Megatron-Core's unfused bias adds in an MoE model with linear biases
        (gpt-oss; Options.unfused_expert_bias). TEGroupedMLP builds linear_fc2 with skip_bias_add=True and adds the
        bias in `_apply_bias` (megatron/core/transformer/moe/experts.py @ Megatron-LM 0d8e0714, b0cc2706, d7288711,
        458c8d0e, the Megatron-Bridge v0.2.0, v0.3.0, v0.4.1, v0.5.1 pins): per local expert `t + b * p` (p the
        routing probability), then torch.cat and `.to` the activation dtype. Per routed copy of D elements: b·p
        writes P bytes, the add reads A + P and writes P, cat reads and writes P, the cast (P != A only) reads P and
        writes A; P = 4 (fp32) under the flex dispatchers, which cast the probabilities to fp32
        (token_dispatcher.py: "HybridEP only supports float32 probs"; DeepEP asserts float32), else A (the router's
        softmax `.type_as(logits)`, moe_utils.py). The same assertion forbids bias_dropout_fusion with biased
        experts, so the attention output's bias is its own add (read and write D; fused_bias_dropout.py
        `_bias_dropout_add_func`; dropout at p = 0 launches nothing).
        Backward (PyTorch autograd of the same ops), per routed element: the cast's gradient back to P (reads A, writes
        P) and the add's gradient to the bf16 GEMM output cast to A (reads P, writes A), both only where P != A; the
        split's gradient concatenated (reads and writes A); b's gradient (g·p written, read back by the sum over
        tokens: 3·P) and p's (g·b, summed over D: 3·P). The attention bias's gradient is a sum over tokens (reads A)."""
        m, c = self.p.model, self.c
        if not (self.opt.unfused_expert_bias and m.is_moe and m.linear_bias):
            return 0.0, 0.0
        a = self.opt.act_bytes
        p_b = 4.0 if self.opt.moe_dispatcher in ("deepep", "hybridep") else a
        casts = (p_b + a) if p_b != a else 0.0
        fwd = p_b + (a + 2 * p_b) + 2 * p_b + casts
        bwd = 2 * casts + 2 * a + 6 * p_b
        routed = g["t_expert"] * c["D"] * c["moe_share"] * c["k"]  # the routed copies this rank's experts compute
        return routed * fwd + g["t_mb"] * c["D"] * 2 * a, routed * bwd + g["t_mb"] * c["D"] * a

    def _glu_clamp_bytes(self, g: dict):
        """(forward, backward) HBM bytes per layer of Megatron-Core's clamp of a clamped GLU (gpt-oss, ModelConfig.
        glu_limit) on its eager expert path (Options.unfused_expert_bias): `weighted_bias_quick_geglu_impl`
        (megatron/core/fusions/fused_bias_geglu.py @ NVIDIA/Megatron-LM 0d8e0714, b0cc2706, d7288711, 458c8d0e, the
        Megatron-Bridge v0.2.0 .. v0.5.1 pins) clamps the fc1 output's two halves and concatenates them before the
        fused activation: `torch.cat((x_glu.clamp(max=limit), x_linear.clamp(-limit, limit)), -1)`, each clamp reading
        and writing F and the cat reading and writing 2F per routed copy: 8·F elements forward. Autograd's backward:
        each clamp's gradient reads the gradient and the saved input and writes the masked gradient (3·F each), and
        `chunk`'s gradient concatenates the two halves (reads and writes 2F): 10·F elements. Megatron-Bridge's perf
        scripts turn the op fuser off through v0.4.x (scripts/performance/utils/overrides.py: "use_transformer_engine_
        op_fuser = False"); with it on, TE's ScaledClampedQGeGLU clamps inside its kernel (not modelled here)."""
        if not self._unfused_glu_clamp():
            return 0.0, 0.0
        c = self.c
        routed = self.opt.act_bytes * g["t_expert"] * c["moe_share"] * c["k"] * c["F"] / g["etp"]
        return 8.0 * routed, 10.0 * routed

    def _unfused_glu_clamp(self) -> bool:
        """Whether the experts' GLU is clamped outside its fused kernel (`_glu_clamp_bytes`)."""
        m = self.p.model
        return bool(self.opt.unfused_expert_bias and m.is_moe and m.glu_limit > 0 and m.gated)

    def _moe_router_bytes(self, g: dict):
        """Megatron-Core's routing outside the gate GEMM, per layer forward (moe_overlap.yaml): the fp32 scores
        (tokens × experts, 4 B) passed `router_score_passes` times through HBM (score function, top-k, aux loss);
        its small kernels are counted in `layer_kernels_fwd`. The router runs on the rank's sequence-parallel slice
        of the tokens (`t_route`: TopKRouter on the SP hidden states, megatron/core/transformer/moe/moe_layer.py)."""
        m, c = self.p.model, self.c
        if not m.is_moe:
            return 0.0
        return c["moe_share"] * moe_constant("router_score_passes") * 4.0 * g["t_route"] * m.n_experts

    def _moe_permute_bytes(self, g: dict):
        """Token permutation around the experts (GShard dispatch/combine; Megatron-Core's permute/unpermute):
        gather each token's k copies into expert order (read D, write k·D) and scatter-add them back (read k·D,
        write D); forward here, the backward's mirror in the pointwise backward. On the tokens the rank routes
        (`t_route`, its SP slice: the permutation runs before the all-to-all, token_dispatcher.py
        `dispatch_preprocess`)."""
        if not self.p.model.is_moe:
            return 0.0
        # in the mean layer: DeepSeek's leading dense layers permute nothing (moe_share)
        return self.c["moe_share"] * self.opt.act_bytes * g["t_route"] * 2 * (1 + self.c["k"]) * self.c["D"]

    def _fp8_expert_padding(self) -> bool:
        """Whether Megatron-Core's eager TEGroupedMLP pads each local expert's rows for the FP8 GEMMs by a copy
        (`_fp8_expert_padding_bytes`): FP8 compute on the eager path (Options.unfused_expert_bias) behind the alltoall
        or DeepEP dispatcher, which leave the per-expert token counts unaligned (HybridEP pads inside its dispatch:
        token_dispatcher.py _HybridEPManager `pad_multiple = get_align_size_for_quantization(config)` under fp8)."""
        o = self.opt
        return bool(self.p.model.is_moe and o.compute_dtype == "fp8" and o.unfused_expert_bias
                    and o.moe_dispatcher in ("alltoall", "deepep"))

    def _fp8_expert_padding_bytes(self, g: dict):
        """HBM bytes per layer (forward, and the same again backward) of the FP8 row padding around the expert GEMMs:
        TEGroupedMLP.forward runs `quantization_padding` (Transformer Engine Fp8Padding) on the permuted input and
        `quantization_unpadding` on the fc2 output whenever fp8 is on (megatron/core/transformer/moe/experts.py @
        NVIDIA/Megatron-LM 0d8e0714, b0cc2706, d7288711, 458c8d0e). Fp8Padding rounds every expert's row count up to
        a multiple of 16 (32 for MXFP8) and, unless all already are, copies the rows into a new buffer
        (transformer_engine/pytorch/module/fp8_padding.py `tex.fused_multi_row_padding`; Fp8Unpadding the reverse);
        balanced or random routing leaves the counts unaligned. Each copy reads and writes the k routed rows of D per
        token (the padding's few extra rows neglected): 2 copies × 2 passes × k·D forward; the backward runs the
        inverse copies on the gradients, as many bytes. The Megatron-Bridge presets of these runs do not set
        moe_router_padding_for_quantization (the router-side alignment that would make the copies no-ops)."""
        if not self._fp8_expert_padding():
            return 0.0
        c = self.c
        return c["moe_share"] * self.opt.act_bytes * g["t_expert"] * 4 * c["k"] * c["D"]

    def _moe_regroup_bytes(self, g: dict):
        """HBM bytes per layer of Megatron-Core's alltoall dispatcher regrouping what the all-to-all delivered
        (rank-major) by local expert: "Permutation 2: Sort tokens by local expert" after the dispatch and
        "Unpermutation 2" before the combine (token_dispatcher.py `sort_chunks_by_idxs`, with moe_permute_fusion a TE
        moe_sort_chunks_by_index copy), run whenever num_local_experts > 1 (NVIDIA/Megatron-LM @ 0d8e0714, b0cc2706,
        d7288711, 458c8d0e, the Megatron-Bridge v0.2.0 .. v0.5.1 pins). Each reads and writes the rank's k routed
        copies of D (balanced routing: as many as it sent): 2 copies x 2 passes x k·D per token, in the forward and
        again in the backward (the same copy with the inverse index). The flex dispatchers have no such pass:
        HybridEP permutes inside its dispatch/combine (fused_a2a.py dispatch_with_permute / combine_with_unpermute),
        DeepEP's one permute after its dispatch is the gather of _moe_permute_bytes."""
        m, c, ep = self.p.model, self.c, g["ep"]
        if not m.is_moe or self.opt.moe_dispatcher != "alltoall":
            return 0.0
        local_experts = m.n_experts / np.maximum(ep, 1)
        regroups = (ep > 1) & (local_experts > 1)
        return np.where(regroups, c["moe_share"] * self.opt.act_bytes * g["t_expert"] * 4 * c["k"] * c["D"], 0.0)

    def _fp8_cast_term(self, g: dict) -> dict:
        """FP8 casts of the GEMM operands (FP8_CASTS by `fp8_fused_casts`, bytes by `fp8_recipe`); zero in bf16."""
        if self.opt.compute_dtype != "fp8":
            return dict(hbm_f=0.0, hbm_b=0.0, f_s=0.0, b_s=0.0)
        c, t, tp = self.c, g["t_mb"], g["tp"]
        mlp_in, mlp_normed = self._fp8_mlp_rows()
        # the routed copies are the expert side's rows: t_expert·k of D (1/tp of t_mb·k under ETP = 1), and their
        # F-wide fc2 inputs t_expert·k·F/etp = t_mb·k·F/tp either way
        routed = c["moe_share"] * c["k"] if self.p.model.is_moe else 0.0
        if self.opt.fp8_dense:
            rows_d = t * (mlp_in - routed) + g["t_expert"] * routed  # tokens' rows of D into the MLP's first GEMM
            # the four linear inputs and the output gradients of the forward's GEMMs (the MLP's first input and last
            # output: `rows_d` rows of D)
            a_in = t * (c["D"] + c["N"] * c["H"] / tp + c["F"] * c["k"] / tp) + rows_d * c["D"]
            g_out = t * (self._qkv_width(tp) + c["D"] + (c["mult"] - 1) * c["F"] * c["k"] / tp) + rows_d * c["D"]
            w_dense = (c["attn_w"] + c["mlp_w_active"] - c["routed_w_active"]) / tp
            normed = t * (1 + mlp_normed) * c["D"]  # the qkv input and the MLP inputs that leave the norm
        else:
            # Options.fp8_scope "experts": the grouped GEMMs' operands alone: the routed copies into fc1 and their
            # F-wide fc2 inputs, fc1's and fc2's output gradients; none leaves a norm (the permutation comes first)
            rows_d = g["t_expert"] * routed
            a_in = rows_d * c["D"] + t * routed * c["F"] / tp
            g_out = t * (c["mult"] - 1) * routed * c["F"] / tp + rows_d * c["D"]
            w_dense, normed = 0.0, 0.0
        # Transformer Engine casts a weight once per step and reuses it over the micro-batches
        # (`is_first_microbatch`); torchao's float8 (torchtitan) casts it on every forward; the routed experts' share
        # is split over ETP (Options.expert_tp)
        w_rank = w_dense + c["routed_w_active"] / g["etp"]
        w_local = w_rank / np.where(self.opt.fp8_weight_cache, g["n_micro"], 1.0)
        recipe = fp8_cast_bytes(self.opt.fp8_scaling, self.p.chip.name)
        # FSDP float8 all-gather (torchao `enable_fsdp_float8_all_gather`: fsdp_param_bytes 1 under FSDP)
        gather_shard = g["shard"] if self.opt.fsdp_param_bytes == FP8_ELEMENT_BYTES else None
        # TP with sequence parallelism: the norms' outputs are gathered (into dense linears only)
        tp_sp = np.where(g["sp"] & self.opt.fp8_dense, tp, 1.0)
        hbm_f, hbm_b = FP8_CASTS[self.opt.fp8_fused_casts](recipe, normed, a_in, g_out, w_local,
                                                           self.opt.fused_elementwise, gather_shard, tp_sp)
        return dict(hbm_f=hbm_f, hbm_b=hbm_b, f_s=hbm_f / self.hbm, b_s=hbm_b / self.hbm)

    def _fp8_mlp_rows(self) -> tuple[float, float]:
        """Rows of D per token that the MLP's first GEMM quantises as its input (and its last GEMM's output gradient
        has), and how many of them come straight from the pre-MLP norm, in the mean layer. Dense: 1 and 1. An MoE
        layer quantises each token's k routed copies, the permuted input of every expert GEMM (Transformer Engine
        GroupedLinear: `split_quantize` of the [sum(m_splits), D] input, one quantizer per expert; the fc2 output
        gradient likewise per copy), plus the normed token once for the shared experts if any; only that one is the
        norm's output (the routed copies pass through the permutation first)."""
        m, c = self.p.model, self.c
        if not m.is_moe:
            return 1.0, 1.0
        share, shared = c["moe_share"], 1.0 if m.n_shared_experts else 0.0
        return share * (c["k"] + shared) + (1 - share), share * shared + (1 - share)

    def _loss_term(self, g: dict) -> dict:
        """Unembedding GEMM and the fp32 cross-entropy over the local vocabulary shard (12 B per logit). The output
        layer runs in bf16 under FP8 too, in every framework here: torchtitan converts every linear but the output
        (torchao `convert_to_float8_training(..., module_filter_fn=lambda mod, fqn: fqn != "output")`, torchtitan
        @9dec370 float8.py; later its llama3 train configs' `filter_fqns = ["output"]`, v0.2.2), Megatron-Core's output layer is a
        ColumnParallelLinear, not a Transformer Engine module (fp8_autocast leaves it in bf16), and DeepSeek-V3 §3.3.1
        keeps "the output head" in its original precision. GPU only: on TPU (int8 through AQT) as the layers."""
        c, t, tp = self.c, g["t_mb"], g["tp"]
        f_un = 2 * t * c["D"] * c["V"] / tp
        hbm = 12.0 * t * c["V"] / tp
        peak = self.peak_bf16 if self.p.chip.kind == "gpu" else self.mm_peak
        f_s = f_un / (peak * self.eff.matmul(t, c["V"] / tp, c["D"]))
        return dict(f_s=f_s + hbm / self.hbm, flops=f_un, hbm=hbm)

    def _iota_embedding_term(self, g: dict) -> dict:
        """MaxText's `use_iota_embed` (Options.iota_embedding; layers/embeddings.py @tpu-recipes-v0.1.4:
        `one_hot = inputs[..., None] == iota(V)`, `jnp.dot(one_hot, embedding)`): the embedding lookup is a
        [t, V/tp] x [V/tp, D] matmul, 2·t·V·D/tp FLOPs forward, and the table's gradient one_hotᵀ·dY the same again in
        the backward (the one-hot of integer ids has no gradient); both timed at the forward's shape. With pipelining
        it is timed with the loss on the last stage (it runs on the first). Zero without the option."""
        c, t, tp = self.c, g["t_mb"], g["tp"]
        if not self.opt.iota_embedding:
            return dict(f_s=0.0, flops=0.0)
        f = 2 * t * c["V"] * c["D"] / tp
        return dict(f_s=self._matmul_time(f, t, c["D"], c["V"] / tp), flops=f)

    def _recompute_parts(self, policy: str) -> dict[str, float]:
        """Shares of the layer forward's parts (mm, core, elem, cast) a policy runs again in the backward.
        Under XLA remat (Options.remat_dce) a rematerialised pointwise op is fused into the backward's fusion that
        reads the same GEMM outputs for that op's own gradient, so it costs no pass of its own: on an H200
        (benchmarks/results/gpu_h200_2026-12-04_s15.json, JAX 0.11.2) Llama 3.2 1B's step under gemm-last, which
        recomputes every pointwise op, took 273.0 ms against 272.6 ms with none."""
        parts = RECOMPUTE_PARTS[f"selective/{self.opt.selective_flavor}" if policy == "selective" else policy]
        return {k: v for k, v in parts.items() if k != "elem"} if self.opt.remat_dce else parts

    def compute_terms(self, L: LayoutArrays, g: dict) -> Terms:
        """Forward/backward/recompute seconds per micro-batch on the busiest pipeline stage; writes the FLOPs and
        HBM bytes of the step (n_micro micro-batches of `layers_stage` layers and the loss) into the ledger."""
        parts = {"mm": self._matmul_term(g), "core": self._attention_core_term(g), "elem": self._pointwise_term(g),
                 "cast": self._fp8_cast_term(g)}
        mm, core, elem, cast = parts["mm"], parts["core"], parts["elem"], parts["cast"]
        loss = self._loss_term(g)
        # the backward's pointwise work mirrors the forward's (elem b_s: twice the bytes, but the unfused bias adds'
        # own backward) and casts its own operands (cast b_s); a recomputed forward casts its GEMM inputs again
        full = mm["f_s"] + core["f_s"] + elem["f_s"] + cast["f_s"]
        layer_bwd = 2 * mm["f_s"] + core["b_s"] + elem["b_s"] + cast["b_s"]
        rc_s, rc_mm, rc_core, rc_hbm = [], [], [], []
        for policy in tm.RECOMPUTE_POLICIES:
            w = self._recompute_parts(policy)
            mm_s, mm_flops, wc = w.get("mm", 0) * mm["f_s"], w.get("mm", 0) * mm["flops"], w.get("core", 0)
            mm_s, mm_flops = mm_s + w.get("up", 0) * mm["up_s"], mm_flops + w.get("up", 0) * mm["up_flops"]
            core_s, core_flops, core_hbm = wc * core["f_s"], wc * core["flops_f"], wc * core["hbm_f"]
            if self.opt.remat_dce and policy == "full":
                # JAX/XLA remat recomputes only what the backward reads: the dense MLP's down-projection is dropped
                mm_s, mm_flops = mm_s - mm["down_s"], mm_flops - mm["down_flops"]
            if policy == "full" and self.opt.kept_projections:
                # MaxText's custom policy keeps the named projection outputs: their GEMMs are not rerun
                kept_s, kept_flops, _ = self._kept_projections(g)
                mm_s, mm_flops = mm_s - kept_s, mm_flops - kept_flops
            if self.opt.remat_dce and wc == 1 and policy == "selective":
                # ... and of the attention core only QKᵀ and the softmax (the backward never reads AV's output)
                core_s, core_flops, core_hbm = core["qk_f_s"], core["qk_flops"], core["qk_hbm"]
            rc_s.append(mm_s + core_s + w.get("elem", 0) * elem["f_s"] + w.get("cast", 0) * cast["f_s"])
            rc_mm.append(mm_flops)
            rc_core.append(core_flops)
            rc_hbm.append(core_hbm + w.get("elem", 0) * elem["hbm"] + w.get("cast", 0) * cast["hbm_f"])
        pick = [L.recompute == i for i in range(len(tm.RECOMPUTE_POLICIES))]
        recompute = np.select(pick, rc_s, 0.0)
        nm, led = g["n_micro"], g["ledger"]
        nl = g["layers_stage"] * g["bubble_runs"]  # layer passes per micro-batch, an SPMD pipeline's bubble included
        led.flops("matmul", nm * (nl * (3 * mm["flops"] + np.select(pick, rc_mm, 0.0)) + 3 * loss["flops"]))
        led.flops("attention", nm * nl * (core["flops_f"] + core["flops_b"] + np.select(pick, rc_core, 0.0)))
        emb = self._iota_embedding_term(g)
        led.flops("matmul", nm * 2 * emb["flops"])  # the one-hot embedding dot forward and the table's gradient
        led.flops("other", 0.0)  # pointwise work is costed by its HBM bytes, not its FLOPs
        led.add("hbm", nm * (nl * (elem["hbm"] + elem["hbm_b"] + cast["hbm_f"] + cast["hbm_b"] + core["hbm_f"] + core["hbm_b"]
                                   + np.select(pick, rc_hbm, 0.0)) + 3 * loss["hbm"]))
        nl = g["layers_stage"]
        # the loss on the last stage: on top of its layers, or in one layer's place (Options.pp_head_in_split), where
        # the busier of a middle stage (nl layers; there is one when pp > 2) and the last (nl - 1 layers + the loss)
        # sets the pace: the loss adds max(loss, middle·layer) - layer to nl layers
        head, middle = g["head_in_split"], g["pp"] > 2
        loss_f = np.where(head, np.maximum(loss["f_s"], middle * full) - full, loss["f_s"])
        loss_b = np.where(head, np.maximum(2 * loss["f_s"], middle * (layer_bwd + recompute)) - layer_bwd - recompute,
                          2 * loss["f_s"])
        loss_f, loss_b = loss_f + emb["f_s"], loss_b + emb["f_s"]
        return Terms(
            layer_fwd=full, layer_bwd=layer_bwd, layer_recompute=recompute,
            layer_matmul_fwd=mm["f_s"], layer_core_fwd=core["f_s"], layer_core_bwd=core["b_s"],
            layer_mlp_mm_fwd=mm["mlp_s"], layer_out_proj_fwd=mm["out_proj_s"],
            loss_s=loss_f + loss_b,
            fwd=nl * full + loss_f,
            bwd=nl * (layer_bwd + recompute) + loss_b,
        )

    def _qkv_width(self, tp):
        """Width of the Q, K and V activations on one TP rank: (N/tp + 2·K/tp)·H with KV heads replicated when
        tp > K; under MLA the up-projected per-head queries, keys (H+R) and values (V)."""
        c, m = self.c, self.p.model
        if m.is_mla:
            return m.n_heads * (2 * m.qk_head_dim + m.v_dim) / tp
        return (c["N"] / tp + 2 * np.maximum(c["K"] / tp, 1.0)) * c["H"]

    def _kept_projections(self, g: dict):
        """(seconds, FLOPs, output elements per token) of one layer's attention projections whose outputs MaxText's
        custom remat policy keeps (Options.kept_projections); each GEMM timed at its own shape. Nothing under MLA."""
        c, t, tp = self.c, g["t_mb"], g["tp"]
        if self.p.model.is_mla:
            return 0.0, 0.0, 0.0
        widths = {"q": c["N"] / tp * c["H"], "kv": np.maximum(c["K"] / tp, 1.0) * c["H"], "o": c["D"]}
        seconds = flops = width = 0.0
        for name in self.opt.kept_projections:
            out = widths[KEPT_PROJECTIONS[name]]
            inner = c["N"] * c["H"] / tp if name == "out_proj" else c["D"]
            f = 2 * t * inner * out
            seconds, flops, width = seconds + self._matmul_time(f, t, out, inner), flops + f, width + out
        return seconds, flops, width

    def _out_projection_s(self, t, tp):
        """Seconds of one layer's attention output projection, the GEMM whose output the attention's reduce-scatter
        (all-reduce without SP) sums over TP: [t, heads·v/tp]·[heads·v/tp, D]."""
        c, m = self.c, self.p.model
        width = m.n_heads * m.v_dim if m.is_mla else c["N"] * c["H"]
        return self._matmul_time(2 * t * c["D"] * width / tp, t, c["D"], width / tp)

    def _attention_projections(self, t, tp):
        """(seconds, FLOPs) of one layer's attention projections, each GEMM timed at its own shape."""
        c, m = self.c, self.p.model
        if not m.is_mla:
            qkv_width = self._qkv_width(tp)
            f_qkv = 2 * t * c["D"] * qkv_width
            f_o = 2 * t * c["D"] * c["N"] * c["H"] / tp
            if self.opt.separate_qkv:  # Q, then K and V alike (Options.separate_qkv): the same FLOPs, narrower GEMMs
                q_width = c["N"] / tp * c["H"]
                kv_width = (qkv_width - q_width) / 2
                qkv_s = (self._matmul_time(2 * t * c["D"] * q_width, t, q_width, c["D"])
                         + 2 * self._matmul_time(2 * t * c["D"] * kv_width, t, kv_width, c["D"]))
            else:
                qkv_s = self._matmul_time(f_qkv, t, qkv_width, c["D"])
            return qkv_s + self._out_projection_s(t, tp), f_qkv + f_o
        # MLA (DeepSeek-V2 §2.1): the latent down-projections are computed whole on every TP rank; the per-head
        # up-projections and the output projection split over the heads
        w = m.mla_weights()
        t_s = self._matmul_time(2 * t * w["kv_down"], t, m.kv_lora_rank + m.qk_rope_head_dim, c["D"])
        flops = 2 * t * w["kv_down"] + 2 * t * (w["q_up"] + w["kv_up"] + w["o"]) / tp
        if m.q_lora_rank:
            t_s = t_s + self._matmul_time(2 * t * w["q_down"], t, m.q_lora_rank, c["D"])
            flops = flops + 2 * t * w["q_down"]
        return t_s + self._mla_up_projections(t, tp)[0] + self._out_projection_s(t, tp), flops

    def _mla_up_projections(self, t, tp):
        """(seconds, FLOPs) of one layer's MLA query and key-value up-projections (split over the heads), each GEMM
        timed at its own shape: what the mla-up-proj recompute runs again. (0, 0) without MLA."""
        c, m = self.c, self.p.model
        if not m.is_mla:
            return 0.0, 0.0
        w, N = m.mla_weights(), m.n_heads
        q_in = m.q_lora_rank or c["D"]
        t_s = (self._matmul_time(2 * t * w["q_up"] / tp, t, N * m.qk_head_dim / tp, q_in)
               + self._matmul_time(2 * t * w["kv_up"] / tp, t, N * (m.head_dim + m.v_dim) / tp, m.kv_lora_rank))
        return t_s, 2 * t * (w["q_up"] + w["kv_up"]) / tp

    def _materialized_attention(self, g: dict, f_core) -> dict:
        """Attention without a flash kernel (Megatron 2020-21, BLOOM, the JAX reference of `verify`): QKᵀ and AV as
        batched matmuls of inner dimension H, plus softmax (and dropout) over the N·s² score matrix in HBM; no
        causal saving (Korthikanti et al. 2022 §4.1 counts the 5as²b bytes these tensors take)."""
        S, c = self.p.seq_len, self.c
        flops = 2 * f_core  # the full score matrix is computed
        mm = flops / (self.mm_peak * self.eff.matmul(S, S, c["H"]))
        scores = c["N"] / g["tp"] * g["mb"] * S * (S / g["cp"])
        act = self.opt.act_bytes
        per_elem = act * 2 + (act * 2 + 1 if self.opt.dropout else 0)  # softmax r/w, dropout r/w + mask
        ew_bytes = scores * per_elem
        ew = ew_bytes / self.hbm
        # recomputing for the backward needs only QKᵀ (half the matmul FLOPs) and the softmax (`remat_dce`)
        return dict(f_s=mm + ew, b_s=2 * mm + 2 * ew, flops_f=flops, flops_b=2 * flops, hbm_f=ew_bytes,
                    hbm_b=2 * ew_bytes, qk_f_s=0.5 * mm + ew, qk_flops=0.5 * flops, qk_hbm=ew_bytes)

    # --- communication -------------------------------------------------------------------------
    # Each collective family records its bytes per device per step in the ledger (kind/mesh axes, the byte
    # convention of train/ledger.py) and turns the same bytes into seconds through the CommModel.
    def comm_terms(self, L: LayoutArrays, g: dict, ct: Terms) -> Terms:
        """Exposed communication seconds: per micro-batch (`*_mb`) and once per step (`*_step`)."""
        out = Terms()
        self._tp_terms(L, g, ct, out)
        self._cp_terms(L, g, ct, out)
        self._ep_terms(L, g, ct, out)
        self._pp_terms(L, g, ct, out)
        self._data_parallel_terms(L, g, ct, out)
        self._shared_link_slowdown(g, ct, out)
        return out

    def _tp_terms(self, L: LayoutArrays, g: dict, ct: Terms, out: Terms) -> None:
        """TP (Megatron-SP, Korthikanti et al. 2022 §4.2.2), per layer: the forward all-gathers the attention and
        MLP inputs and reduce-scatters both outputs; the backward reduce-scatters the input gradients, all-gathers
        the output gradients and gathers both inputs again for the weight gradients (Megatron-LM's
        `LinearWithGradAccumulationAndAsyncCommunication.backward` launches that re-gather asynchronously beside
        the input-gradient GEMM; XLA re-gathers because no remat policy saves a sharding constraint's result). Without
        SP, 2 all-reduces each way. Outside the layers: the vocab-parallel embedding reduce-scatters its output
        onto the sequence (an all-reduce without SP) and the final norm's output is gathered for the logits, each
        mirrored in the backward; the vocab-parallel cross-entropy all-reduces 3 fp32 numbers per token (max,
        Σexp, target logit); under SP the replicated norm scales' gradients are all-reduced once a step.
        An MoE layer under SP gathers the k routed copies of its tokens over TP after the expert all-to-all
        and reduce-scatters them before the return trip (Megatron-Core's alltoall dispatcher: A2A(EP) → AG(TP),
        RS(TP) → A2A(EP)), so its MLP pair moves k times the dense one. Under ETP = 1 (Options.expert_tp) the
        dispatcher's gather group is the expert-TP group of one rank: the routed experts move nothing over TP, and a
        shared expert (TP-split, Megatron-Core SharedExpertMLP) keeps the one pair of a dense MLP
        (`_mlp_tp_pairs`)."""
        c, comm, led = self.c, self.comm, g["ledger"]
        tp, nl, nm, sp = g["tp"], g["layers_stage"], g["n_micro"], g["sp"]
        v_tp = self.opt.act_bytes * g["t_mb"] * c["D"]
        ag = comm.time("allgather", v_tp, tp, 1)
        rs = comm.time("reducescatter", v_tp, tp, 1)
        ar = comm.time("allreduce", v_tp, tp, 1)
        k_mlp, routed_tp = self._mlp_tp_pairs(g)
        pairs = 1 + k_mlp  # collective pairs per layer pass
        # the layers' gathers feed linears, in FP8 where the framework gathers FP8 (_tp_gather_elem_bytes); an MoE
        # layer's routed tokens are gathered by the token dispatcher before any quantisation (a shared expert's
        # input under ETP = 1 by its own linear)
        v_ag = self._tp_gather_elem_bytes() * g["t_mb"] * c["D"]
        v_ag_mlp = np.where(routed_tp, v_tp, v_ag) if self.p.model.is_moe else v_ag
        ag_attn, ag_mlp = comm.time("allgather", v_ag, tp, 1), comm.time("allgather", v_ag_mlp, tp, 1)
        ag_layer = ag_attn + k_mlp * ag_mlp
        tp_layer = np.where(sp, ag_layer + pairs * rs, 2 * ar)
        # Collective matmul (book ch.10; Wang et al. 2023) hides the steps behind partial matmuls; one of
        # the tp steps cannot overlap. Each collective hides only behind the GEMM it is decomposed with
        # (_collective_matmul_exposed), not behind the layer's GEMMs as one pool.
        dgrad_rs = self.opt.tp_overlap_dgrad_rs
        ag_pair = (ag_attn, k_mlp * ag_mlp)
        hidden_f, hidden_b = self._collective_matmul_exposed(ct, sp, ag_pair, rs, ar, k_mlp, dgrad_rs)
        last = tp_layer / np.maximum(tp, 1)
        # input-gradient reduce-scatters the overlap cannot pair (Options.tp_overlap_dgrad_rs) are exposed whole in
        # hidden_b, so the backward's unoverlappable step is the gathers' only
        last_b = np.where(sp & ~np.asarray(dgrad_rs), ag_layer / np.maximum(tp, 1), last)
        tp_exp = (np.where(self.tp_overlap, hidden_f + last, tp_layer) + np.where(self.tp_overlap, hidden_b + last_b, tp_layer))
        # the backward's re-gather of the inputs runs beside the input-gradient GEMMs (the forward GEMMs' FLOPs)
        regather = np.where(sp, ag_layer, 0.0)
        # JAX remat (`remat_dce`) under full recompute reruns the attention output's reduce-scatter (it feeds the
        # recomputed MLP norm); its gathers are the backward's re-gathers, and the MLP output only feeds the residual
        rc_rs = np.where(sp & (L.recompute == 2) & self.opt.remat_dce, rs, 0.0)
        # PyTorch's checkpoint under full recompute reruns the whole layer's forward in the backward, its TP collectives
        # included (SP: both all-gathers and reduce-scatters; without SP: both all-reduces): Megatron-LM
        # tensor_parallel/random.py CheckpointFunction.backward calls run_function again, whose Column/RowParallelLinear
        # forwards gather/reduce (tensor_parallel/layers.py); DeepSpeed activation_checkpointing/checkpointing.py the
        # same. Not XLA (remat_dce: the backward's re-gathers serve the rematerialised forward) nor TPUs (XLA programs
        # only). Exposed as the forward's collectives are (overlapped the same way where tp_overlap: Transformer
        # Engine's userbuffers overlap lives in its modules' forward, which the recompute calls again).
        rc_any = (L.recompute == 2) & ~np.asarray(self.opt.remat_dce) & (self.p.chip.kind != "tpu")
        rc_fwd = rc_any & ~np.asarray(self.opt.compiled_recompute)
        # torch.compile (Options.compiled_recompute, torchtitan: ptd_checkpoint_wrapper, full AC) reruns only what the
        # compiled backward graph reads: both all-gathers (their outputs are the weight gradients' operands, i.e. the
        # backward's gathers, `regather`, and the recomputed projections' inputs) and the attention output's
        # reduce-scatter (it feeds the recomputed MLP norm); the MLP output's only feeds the block output, so the
        # partitioner drops it (without SP: the attention's all-reduce). The gathers feed the recomputed QKV and fc1
        # GEMMs, so without async TP nothing hides them; with it Inductor's micro_pipeline_tp_pass, run by
        # post_grad_passes on the backward graph as on the forward (torch/_inductor/fx_passes/post_grad.py, via
        # compile_fx's _recursive_post_grad_passes), fuses them with those GEMMs and the reduce-scatter with the
        # out-projection (fused_all_gather_matmul / fused_matmul_reduce_scatter) exactly as in the forward.
        rc_cmp = rc_any & np.asarray(self.opt.compiled_recompute)
        rc_cmp_layer = np.where(sp, ag_layer + rs, ar)
        rc_cmp_hidden = self._compiled_rerun_exposed(ct, sp, ag_pair, rs, ar)
        rc_exp = (np.where(rc_fwd, np.where(self.tp_overlap, hidden_f + last, tp_layer), 0.0)
                  + np.where(rc_cmp, np.where(self.tp_overlap, rc_cmp_hidden + rc_cmp_layer / np.maximum(tp, 1),
                                              rc_cmp_layer), 0.0))
        # the compiled rerun's gathers are the backward's gathers: their time is in rc_exp, not beside the dgrad GEMMs
        regather_exp = np.where(rc_cmp, 0.0, np.maximum(regather - ct["layer_matmul_fwd"], 0))
        rc_link = np.where(rc_fwd, tp_layer, 0.0) + np.where(rc_cmp, np.where(sp, rs, ar), 0.0)
        # Options.distribute_saved_activations (full recompute, no SP): the backward of each layer first all-gathers
        # its checkpointed input, [b, s, D] gathered, over TP (Megatron's gather_split_1d_tensor, DeepSpeed's
        # get_full_inputs: a blocking all-gather the recomputed forward waits for, with no GEMM to hide behind)
        dist = np.asarray(self.opt.distribute_saved_activations) & (L.recompute == 2) & ~sp & (tp > 1)
        dist_ag = np.where(dist, ag, 0.0)
        # the embedding and the logits' input: a reduce-scatter and an all-gather each way (an all-reduce without SP)
        outside = np.where(sp, 2 * (ag + rs), 2 * ar)
        ce = 3 * comm.time("allreduce", 4.0 * g["t_mb"], tp, 1)
        norms = (2 * nl + 1) * c["D"] * self.opt.grad_reduce_bytes  # per step, replicated under SP
        norm_ar = np.where(sp, comm.time("allreduce", norms, tp, 1), 0.0)
        on = tp > 1
        # ZeRO-2 reduces every micro-batch's gradients into its shard (`_grad_reduces`), the norm scales' partial sums
        # over `tensor` with them (verify DP4×TP2 ZeRO-2 with 2 micro-batches: all_reduce/tensor +45% without)
        norm_ar = norm_ar * self._grad_reduces(L, g)
        out["tp_mb"] = on * (nl * (tp_exp + regather_exp + rc_rs + rc_exp + dist_ag)
                             + outside + ce + norm_ar / nm)
        out["tp_link_mb"] = on * (nl * (2 * tp_layer + regather + rc_rs + rc_link + dist_ag) + outside + ce
                                  + norm_ar / nm)
        axes = [("tensor", tp)]
        nlr = nl * g["bubble_runs"]  # an SPMD pipeline's bubble iterations run the layers' collectives too
        n_rs = nlr * ((2 + rc_fwd) * pairs + (L.recompute == 2) * self.opt.remat_dce + rc_cmp) + 2
        # per layer pass: forward, output-gradient and re-gather all-gathers (+ the recomputed forward's under
        # PyTorch's eager full checkpoint; a compiled one's are the re-gathers); outside: the logits' input, each way
        ag_bytes = nlr * (3 + rc_fwd) * (v_ag + k_mlp * v_ag_mlp) + 2 * v_tp
        led.collective("all_gather", axes, np.where(sp, nm * ag_bytes, 0.0) + np.where(dist, nm * nlr * v_tp, 0.0))
        led.collective("reduce_scatter", axes, np.where(sp, nm * n_rs * v_tp, 0.0))
        led.collective("all_reduce", axes, nm * (np.where(sp, 0.0, (nlr * (4 + 2 * rc_fwd + rc_cmp) + 2) * v_tp)
                                                 + 3 * 4.0 * g["t_mb"]))
        # the norm scales' gradients are partial sums over the tokens' shards on `tensor` and, with context
        # parallelism (no FSDP), on `context`: one all-reduce over both (XLA's program for CP×TP; verify)
        # Inside MaxText's SPMD pipeline (pp_spmd_loop) the layers' scales are reduced over `tensor` alone and join
        # the other gradients' reduction over the replicas (the JAX program: `pipeline_layers`, verify PP×CP×TP)
        alone = np.where(sp & self._spmd_pp(g), 2 * nl * c["D"] * self.opt.grad_reduce_bytes, 0.0)
        led.collective("all_reduce", axes, alone)
        data, expert = self._norm_replicas(L, g)
        led.collective("all_reduce", [("data", data), ("expert", expert), ("context", self._norm_context(g)),
                                      ("tensor", tp)], np.where(sp, norms * self._grad_reduces(L, g), 0.0) - alone)

    def _mlp_tp_pairs(self, g: dict):
        """(TP all-gather/reduce-scatter pairs of one layer's MLP under SP, whether the routed experts' tokens cross
        TP): a dense MLP 1; an MoE layer with ETP = TP k (the dispatcher gathers the k routed copies, `_tp_terms`);
        with ETP = 1 (Options.expert_tp) only a shared expert's pair, in the mean layer with DeepSeek's leading
        dense layers (moe_share)."""
        c, m = self.c, self.p.model
        if not m.is_moe:
            return c["k"], np.asarray(True)
        routed_tp = g["etp"] > 1
        shared = 1.0 if m.n_shared_experts else 0.0
        return np.where(routed_tp, c["k"], c["moe_share"] * shared + 1 - c["moe_share"]), routed_tp

    def _tp_gather_elem_bytes(self) -> float:
        """Bytes per element of the layers' TP all-gathers: FP8_GATHER_BYTES where the framework quantises before
        gathering (Transformer Engine, `fp8_fused_casts`, any recipe; torchao float8 with tensorwise scaling), else
        the activations' bytes."""
        o = self.opt
        fp8 = o.fp8_dense and self.p.chip.kind == "gpu"  # the gathered inputs feed dense linears
        return FP8_GATHER_BYTES if fp8 and (o.fp8_fused_casts or o.fp8_scaling == "tensorwise") else o.act_bytes

    def _collective_matmul_exposed(self, ct: Terms, sp, ag, rs, ar, k, dgrad_rs=True):
        """(forward, backward) seconds per layer of TP collectives left over by a collective matmul, pairing each
        collective with the one GEMM it is decomposed with: the consumer of an all-gather, the producer of a
        reduce-scatter (Wang et al. 2023 §3: a collective overlaps its *dependent* einsum). Transformer Engine's
        userbuffers name the pairs (NeMo's tp_overlap configs, e.g. userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192):
        forward, the all-gathers with qkv_fprop and fc1_fprop (ring_exchange), the reduce-scatters with proj_fprop
        and fc2_fprop (pipeline); backward, the output gradients' all-gathers with proj_dgrad and fc2_dgrad
        (ring_exchange), the input gradients' reduce-scatters with qkv_wgrad and fc1_wgrad (bulk); PyTorch's
        async TP fuses the same pairs (torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter).
        The MLP's first GEMM (fc1) is (mult - 1)/mult of its FLOPs, fc2 the rest. Without SP the all-reduces
        follow the producers (proj, fc2) forward and the input-gradient GEMMs (qkv, fc1 dgrad) backward.
        `ag` is (attention's all-gather, the MLP's k all-gathers together), as `_tp_terms` times them.
        E.g. a 5 ms all-gather into a 4 ms QKV GEMM leaves 1 ms, however long the MLP's GEMMs are. `dgrad_rs` False
        (Options.tp_overlap_dgrad_rs): the backward's input-gradient reduce-scatters pair with nothing."""
        in_s, out_s, fc1, fc2 = self._tp_gemm_split(ct)
        left = _left_over
        ag_attn, ag_mlp = ag
        fwd_sp = left(ag_attn, in_s) + left(rs, out_s) + left(ag_mlp, fc1) + left(k * rs, fc2)
        bwd_rs = np.where(dgrad_rs, left(rs, in_s) + left(k * rs, fc1), rs + k * rs)
        bwd_sp = left(ag_attn, out_s) + left(ag_mlp, fc2) + bwd_rs
        fwd_ar = left(ar, out_s) + left(ar, fc2)
        bwd_ar = left(ar, in_s) + left(ar, fc1)
        return np.where(sp, fwd_sp, fwd_ar), np.where(sp, bwd_sp, bwd_ar)

    def _compiled_rerun_exposed(self, ct: Terms, sp, ag, rs, ar):
        """Seconds per layer left over when async TP fuses a compiled recomputed forward's collectives
        (Options.compiled_recompute): the gathers with the recomputed QKV and fc1 GEMMs, the attention output's
        reduce-scatter with the recomputed out-projection, the pairs of the forward (_collective_matmul_exposed);
        without SP the attention's all-reduce after its out-projection."""
        in_s, out_s, fc1, _ = self._tp_gemm_split(ct)
        ag_attn, ag_mlp = ag
        sp_s = _left_over(ag_attn, in_s) + _left_over(rs, out_s) + _left_over(ag_mlp, fc1)
        return np.where(sp, sp_s, _left_over(ar, out_s))

    def _tp_gemm_split(self, ct: Terms):
        """Forward seconds per layer of the GEMMs a TP collective can be decomposed with: (the attention's input
        projections (QKV; MLA's down/up), its output projection, the MLP's first GEMM fc1 ((mult - 1)/mult of the
        MLP's FLOPs), its last fc2 (the rest))."""
        out_s, mlp = ct["layer_out_proj_fwd"], ct["layer_mlp_mm_fwd"]
        mult = self.c["mult"]
        return ct["layer_matmul_fwd"] - out_s - mlp, out_s, mlp * (mult - 1) / mult, mlp / mult

    def _carved_experts(self, g: dict):
        """Parameters of the stage's routed experts on this rank when the expert ranks are carved out of dp (else 0)."""
        return np.where(self._carved(g), g["experts_stage_local"], 0.0)

    @staticmethod
    def _carved(g: dict):
        """The experts have their own data-parallel group (Megatron's expert-data-parallel layout): ep > 1 and ep
        divides the ranks the expert grid folds over (parallel_state.initialize_model_parallel's expert rank generator:
        ETP × EP × expert-DP = TP × CP × DP of a stage, MoE Parallel Folding, Liu et al. 2025): under ETP = TP the
        cp·dp ranks (EP carved out of dp, or out of dp × cp where ep does not divide dp: Mixtral dp 2 cp 2 ep 4 has
        expert DP 1), under ETP = 1 the tp·cp·dp ranks. Not where the CP ranks are FSDP shards (torchtitan's mesh,
        `ep_fsdp` in geometry). Kept in `g` once computed (the terms ask for it dozens of times a search)."""
        if "carved" not in g:
            cp = np.where(g["shard"] > 1, 1.0, g["cp"])
            folded = np.where(g["etp"] < g["tp"], g["tp"] * g["cp"] * g["dp"], cp * g["dp"])
            g["carved"] = (folded % g["ep"] == 0) & (g["ep"] > 1)
        return g["carved"]

    @staticmethod
    def _carved_over_cp(g: dict):
        """EP carved out of dp × cp but not out of dp alone (ETP = TP): the experts' group is not a mesh axis of its
        own; the ledger labels it `data` (the expert-DP ranks) and the dense group data + context."""
        return CostModel._carved(g) & (g["etp"] == g["tp"]) & (g["dp"] % g["ep"] != 0)

    @staticmethod
    def _expert_replicas(g: dict):
        """Ranks that hold the same experts and reduce their gradients together (the expert-data-parallel group):
        replicas / ep under ETP = TP; under ETP = 1 the tp/etp ranks of each tensor group join it (parallel_state
        folds ETP × EP × expert-DP over TP × CP × DP: expert DP = tp·cp·dp / ep without FSDP), at least 1."""
        return np.maximum(g["replicas"] * g["tp"] / (g["etp"] * g["ep"]), 1.0)

    def _zero_local(self, g: dict, on, P=None, E=None):
        """Parameters of this rank's ZeRO shard of the stage (`P`, default the stage's local parameters, of which `E`
        are routed experts, default the stage's) where `on` (else its FSDP shard, `_sharded`): the replicas split the
        dense weights, and a routed expert's only among the replicas that hold it, rep / ep where the experts are
        carved out of dp (Megatron's expert-data-parallel group; verify DP2×EP4 ZeRO-1, arguments +49% when every
        weight was split rep ways), all rep where EP is carved out of the FSDP group (torchtitan: the experts are
        replicated over dp_replicate)."""
        P = g["params_stage_local"] if P is None else P
        E = g["experts_stage_local"] if E is None else E
        fs, rep = g["shard"], g["replicas"]
        rep_e = np.where(self._carved(g), self._expert_replicas(g), rep)
        return np.where(on, (P - E) / (fs * rep) + E / (g["shard_expert"] * rep_e), self._sharded(g, P, E))

    @staticmethod
    def _sharded(g: dict, P, E):
        """Parameters this rank holds of `P` (local to its TP/EP rank, `E` of them routed experts) under FSDP: the
        dense ones split over the shard group, the experts over theirs (`shard_expert`)."""
        return (P - E) / g["shard"] + E / g["shard_expert"]

    def _grad_reduces(self, L: LayoutArrays, g: dict):
        """Gradient reductions per step: ZeRO-2 keeps only its shard of the gradients, so every micro-batch's are
        reduced (DeepSpeed reduces at each micro-step; the JAX program's accumulation does too); ZeRO-0/1 accumulate
        and reduce once a step, and so does ZeRO-2 under a looped breadth-first pipeline (`_chunk_major_backward`)."""
        return np.where((L.zero == 2) & ~self._chunk_major_backward(g), g["n_micro"], 1.0)

    def _fsdp_stage_gathered(self, g: dict):
        """FSDP under pipelining that keeps the stage gathered, and its gradients unsharded, through the step
        (Options.fsdp_pp_gathered_stage: FSDP2 under torch.distributed.pipelining and the JAX program, not
        Megatron-FSDP): one gather and one reduce-scatter a step, the gathered stage and its gradients in memory."""
        return (g["shard"] > 1) & (g["pp"] > 1) & self.opt.fsdp_pp_gathered_stage

    def _chunk_major_backward(self, g: dict):
        """A pipeline whose backward runs each model chunk for every micro-batch before the next chunk (Options.
        pp_schedule "gpipe" with vpp > 1, looped breadth-first): a chunk's gradients are whole once its micro-batches
        are done, so ZeRO-2 reduce-scatters them once a step and holds one chunk's unsharded gradients meanwhile
        (Chu et al., ISCA 2025 §3.1.3, Llama 3 405B: ZeRO-2 with all-forward-all-backward)."""
        return (self.opt.pp_schedule == "gpipe") & (g["pp"] > 1) & (g["vpp"] > 1)

    def _spmd_pp(self, g: dict):
        """The layers run in MaxText's SPMD pipeline loop (Options.pp_spmd_loop with pp > 1)."""
        return (g["pp"] > 1) & self.opt.pp_spmd_loop

    def _norm_context(self, g: dict):
        """Size of the context group the norm gradients are reduced over together with `tensor` (1 = not)."""
        return np.where(g["sp"] & (g["shard"] <= 1), g["cp"], 1.0)

    def _replica_axes(self, g: dict) -> tuple:
        """(data, expert) sizes of the replica group in mesh axes: the planner's dp holds the expert ranks (carved
        out of it, as Megatron does), so the mesh's `data` axis is dp/ep and `expert` joins dense gradients. Under
        ETP = 1 (Options.expert_tp) the experts' group folds over the tensor ranks instead: the dense replicas stay
        `data` (`_data_parallel_terms` labels the experts' own group `data` too)."""
        # carved out of dp itself (not folded over dp × cp, `_carved_over_cp`)
        ep, carved = g["ep"], self._carved(g) & (g["etp"] == g["tp"]) & (g["dp"] % g["ep"] == 0)
        return np.where(carved, g["dp"] / ep, g["dp"]), np.where(carved, ep, 1.0)

    def _norm_replicas(self, L: LayoutArrays, g: dict) -> tuple:
        """(data, expert) sizes that join the context+tensor reduction of the norm scales' gradients: all replicas
        under `fold_all_reduces` (CP×TP), else none. Under ZeRO-1/2 too: the folded all-reduce over every rank leaves
        each replica the whole scale gradient, which it slices to its shard (verify DP2×TP2×CP2 ZeRO-2: the scales'
        5120 B all-reduced over data+context+tensor, none reduce-scattered)."""
        data, expert = self._replica_axes(g)
        fold = self.opt.fold_all_reduces & (self._norm_context(g) > 1)
        return np.where(fold, data, 1.0), np.where(fold, expert, 1.0)

    def _kv_bytes(self, g: dict):
        """Bytes of one micro-batch's local K and V on one TP rank (GQA-sized; MHA-sized when PyTorch's CP repeats
        them; under MLA the up-projected keys and values, N·(H+R) and N·V per token)."""
        c, m, tp = self.c, self.p.model, g["tp"]
        if m.is_mla:
            kv_per_rank = m.n_heads * tm.attention_pair_width(m) / 2 / tp
        elif self.opt.cp_impl == "torch":  # K/V repeated to every query head before SDPA
            kv_per_rank = c["N"] / tp * c["H"]
        else:
            kv_per_rank = c["H"] * np.maximum(c["K"] / tp, 1.0)
        return 2 * self.opt.act_bytes * g["t_mb"] * kv_per_rank

    def _cp_terms(self, L: LayoutArrays, g: dict, ct: Terms, out: Terms) -> None:
        """Context parallelism by the implementation `cp_impl` names (CP_IMPLS)."""
        exposed, link = getattr(self, CP_IMPLS[self.opt.cp_impl])(L, g, ct, self._kv_bytes(g))
        out["cp_mb"], out["cp_link_mb"] = exposed, link

    def _ring_cp_terms(self, L: LayoutArrays, g: dict, ct: Terms, kv_bytes):
        """CP ring attention: cp-1 KV block passes forward, KV and dKV backward, each overlapped with the
        attention block it feeds (Liu et al. 2023, Ring Attention). GQA shrinks the KV bytes."""
        cp, nl = g["cp"], g["layers_stage"]
        perm = self.comm.time("permute", kv_bytes, cp, g["tp"])
        cp_f, cp_b = (cp - 1) * perm, 2 * (cp - 1) * perm
        passes = 2 if self.opt.ring_saves_kv else 3  # K/V forward, dK/dV (and K/V again, TE) backward
        g["ledger"].collective("permute", [("context", cp)],
                               g["n_micro"] * nl * g["bubble_runs"] * passes * (cp - 1) * kv_bytes)
        return (nl * (np.maximum(cp_f - ct["layer_core_fwd"], 0) + np.maximum(cp_b - ct["layer_core_bwd"], 0)),
                nl * (cp_f + cp_b))

    def _torch_cp_terms(self, L: LayoutArrays, g: dict, ct: Terms, kv_bytes):
        """(exposed, link) seconds per micro-batch of PyTorch's all-gather context parallelism (`cp_impl`): each
        layer pass all-gathers the ring's K/V behind the first (diagonal) block only, 1/cp of the rank's attention;
        the backward gathers again and passes fp32 dK/dV on to the next rank after every block, each hidden behind
        the next block except the last. A recomputed forward (full recompute, or selective of the attention core)
        runs the ring again."""
        cp, tp, nl = g["cp"], g["tp"], g["layers_stage"]
        ag = self.comm.time("allgather", cp * kv_bytes, cp, tp)
        dkv = self.comm.time("permute", 2 * kv_bytes, cp, tp)  # fp32 gradients: twice the bf16 bytes
        block_f, block_b = ct["layer_core_fwd"] / cp, ct["layer_core_bwd"] / cp
        passes_f = 1 + ((L.recompute == 2) | ((L.recompute == 1) & (self.opt.selective_flavor == "attention")))
        exp_f = passes_f * np.maximum(ag - block_f, 0)
        exp_b = np.maximum(ag - block_b, 0) + np.maximum(cp - 2, 0) * np.maximum(dkv - block_b, 0) + dkv
        link = passes_f * ag + ag + (cp - 1) * dkv
        on, axes, nm = cp > 1, [("context", cp)], g["n_micro"]
        g["ledger"].collective("all_gather", axes, np.where(on, nm * nl * (passes_f + 1) * cp * kv_bytes, 0.0))
        g["ledger"].collective("permute", axes, np.where(on, nm * nl * (cp - 1) * 2 * kv_bytes, 0.0))
        return nl * np.where(on, exp_f + exp_b, 0.0), nl * np.where(on, link, 0.0)

    def _allgather_cp_terms(self, L: LayoutArrays, g: dict, ct: Terms, kv_bytes):
        """(exposed, link) seconds per micro-batch of all-gather context parallelism (`cp_impl` "allgather", the JAX
        program `meshplan verify` compiles; Llama 3 §3.3.2 gathers K/V the same way): each layer all-gathers the
        whole sequence's K and V (GQA-sized) before its attention and reduce-scatters their gradients after the
        attention backward; a fully recomputed layer gathers again (otherwise the gathered K/V are saved). Both
        wait on or feed the attention: exposed."""
        cp, nl, on = g["cp"], g["layers_stage"], g["cp"] > 1
        ag = self.comm.time("allgather", cp * kv_bytes, cp, g["tp"])
        rs = self.comm.time("reducescatter", cp * kv_bytes, cp, g["tp"])
        passes_f = 1 + (L.recompute == 2)
        axes, nm = [("context", cp)], g["n_micro"]
        nlr = nl * g["bubble_runs"]  # an SPMD pipeline's bubble iterations gather too
        g["ledger"].collective("all_gather", axes, np.where(on, nm * nlr * passes_f * cp * kv_bytes, 0.0))
        g["ledger"].collective("reduce_scatter", axes, np.where(on, nm * nlr * cp * kv_bytes, 0.0))
        link = nl * np.where(on, passes_f * ag + rs, 0.0)
        return link, link

    def _ep_terms(self, L: LayoutArrays, g: dict, ct: Terms, out: Terms) -> None:
        """EP: dispatch + combine all-to-all forward, twice again backward (GShard), exposed unless overlapped."""
        c, m, t, ep, nl = self.c, self.p.model, g["t_mb"], g["ep"], g["layers_stage"]
        if not m.is_moe:
            out["ep_mb"] = np.zeros_like(t)
            out["ep_link_mb"] = np.zeros_like(t)
            return
        # node-limited routing (DeepSeek-V3 §3.2.2): a token goes to at most M nodes and crosses the network
        # once per node, then fans out to its experts over NVLink, so min(k, M) copies travel instead of k
        copies = min(c["k"], self.opt.moe_node_limit) if self.opt.moe_node_limit else c["k"]
        stride = self._ep_stride(g)
        copies = self._dispatch_copies(copies, ep, stride)
        # under SP each TP rank dispatches only its 1/tp slice of the tokens (the TP gather follows under ETP = TP,
        # above; none under ETP = 1)
        sent = self.opt.act_bytes * g["t_route"] * copies * c["D"]  # one device's tokens (the all-to-all's operand)
        a2a = self.comm.time("alltoall", ep * sent, ep, stride)  # the CommModel takes the group's array
        # a DeepEP/HybridEP dispatcher's network leg at its own measured rate (not NCCL's)
        a2a = np.maximum(a2a, self._dispatcher_network_s(sent, ep, stride))
        # dropless routing: the busiest rank receives (and returns) the most tokens and the others wait for it
        a2a = a2a * self._expert_load_ratio(g)
        # a fully recomputed layer dispatches and combines again (Megatron's checkpointed MoE layer, JAX remat)
        n_a2a = 4 + 2 * (L.recompute == 2)
        # only the MoE layers dispatch: in the mean layer, their share of the stage's layers (moe_share: DeepSeek's
        # leading dense layers, Llama 4's interleaved ones), as every other MoE term of the layer counts them
        nl = nl * c["moe_share"]
        # (an SPMD pipeline's bubble iterations dispatch and combine too: bubble_runs)
        g["ledger"].collective("all_to_all", self._ep_axes(g), g["n_micro"] * nl * g["bubble_runs"] * n_a2a * sent)
        out["ep_link_mb"] = nl * n_a2a * a2a
        if self.opt.ep_overlap:
            out["ep_mb"] = nl * self._ep_overlap_exposed(g, ct, a2a, n_a2a)
        else:
            out["ep_mb"] = out["ep_link_mb"]

    @staticmethod
    def _ep_stride(g: dict):
        """Rank distance between the members of an EP group. ETP = TP: the EP ranks are carved out of the data ranks
        outside the tensor and context ones, tp·cp apart (meshplan's mesh order; Megatron-Core before the folding);
        where ep does not divide dp but dp × cp (`_carved_over_cp`) the group exists only as Megatron-Core's folded
        expert grid builds it: its expert rank generator orders tp-ep-dp (cp = 1 there), so the EP ranks are etp = tp
        apart and run over the context ranks, then the data ones (parallel_state.initialize_model_parallel,
        `expert_decoder_rank_generator`; Liu et al. 2025, §3, MoE Parallel Folding). ETP = 1 (Options.expert_tp): the
        same generator with an expert TP size of 1, so an EP group takes ep consecutive ranks of the stage: EP 32
        with TP 2 on 8-GPU nodes spans 4 nodes, not the 8 that a stride-2 group spans. Session 40: a layout sweep
        (benchmarks/layout_sweep.py) found Mixtral dp 2 cp 4 ep 4 refused, its EP group placed tp·cp apart."""
        return np.where(g["etp"] < g["tp"], 1.0, np.where(CostModel._ep_spans_cp(g), g["tp"], g["tp"] * g["cp"]))

    @staticmethod
    def _ep_spans_cp(g: dict):
        """The EP group (ETP = TP) runs over the context ranks, tp apart: folded over dp × cp (`_carved_over_cp`), or
        carved out of an FSDP shard group that takes in the context ranks (`ep_fsdp`; torchtitan's ParallelDims: EP is
        dp_shard_in_ep × cp, the mesh [dp_shard_mod_ep, dp_shard_in_ep, cp, tp], so the EP ranks are the contiguous
        cp block and then dp_shard's, as `_data_parallel_terms` places the experts' FSDP group tp·ep apart)."""
        return CostModel._carved_over_cp(g) | (g["ep_fsdp"] & (g["cp"] > 1))

    @staticmethod
    def _ep_axes(g: dict) -> list:
        """The EP group in mesh axes for the ledger: `expert` (ETP = TP), or under ETP = 1 the tensor ranks it folds
        over first, then context, then `expert` for the rest (consecutive ranks, `_ep_stride`). EP folded over the
        data and context ranks under ETP = TP (`_carved_over_cp`) has no axis of its own: the context ranks first,
        then `data` (the mesh keeps dp whole there, `_replica_axes`); carved out of an FSDP group over the context
        ranks (`ep_fsdp`), the context ranks, then `expert` for the rest."""
        fold = g["etp"] < g["tp"]
        over_cp = CostModel._carved_over_cp(g)
        ep, tp, cp = g["ep"], g["tp"], g["cp"]
        on_tp = np.where(fold, np.minimum(ep, tp), 1.0)
        on_cp = np.where(fold, np.clip(ep / tp, 1.0, cp), np.where(CostModel._ep_spans_cp(g), np.minimum(ep, cp), 1.0))
        rest = ep / (on_tp * on_cp)
        return [("expert", np.where(over_cp, 1.0, rest)), ("data", np.where(over_cp, rest, 1.0)),
                ("context", on_cp), ("tensor", on_tp)]

    def ep_group(self, cfg) -> tuple[int, int]:
        """(size, stride) of a layout's EP group as the cost model places it (`_ep_stride`), for the plan's
        explanation (planner._link_of)."""
        g = self.geometry(LayoutArrays.from_configs([cfg]))
        return int(cfg.ep), int(np.asarray(self._ep_stride(g)).reshape(-1)[0])

    @staticmethod
    def _ep_overlap_exposed(g: dict, ct: Terms, a2a, n_a2a):
        """Exposed all-to-all seconds per layer per micro-batch under EP A2A overlap. Megatron-Core's combined 1F1B
        (core.pipeline_parallel.combined_1f1b, `--overlap-moe-expert-parallel-comm`: "the forward pass of Transformer
        layers for one micro-batch runs in parallel with the backward pass of another ... EP A2A in forward step is
        hidden by the attention/mlp computation in the backward step, and vice versa") and DualPipe's forward/backward
        chunk pairs (DeepSeek-V3, arXiv:2412.19437 §3.2.1): a forward's dispatch + combine (2 all-to-alls) hide behind
        the partner's backward compute (with its recompute), the backward's (and a recompute's) behind the partner's
        forward compute; only each side's excess shows. A forward or backward with no partner shows its all-to-alls
        in full: the first forward and last backward of a step without pipelining (F0, (F1,B0), ..., B_last:
        combined_1f1b_schedule_for_no_pipelining), the warm-up forwards and cool-down backwards of a pipeline on its
        first rank (pipeline_warmup_forwards with the overlap's extra forward; as _pp_terms): a fraction
        max(warm-up, 1) / (n_micro·vpp)."""
        fwd_a2a, bwd_a2a = 2 * a2a, (n_a2a - 2) * a2a
        paired = (np.maximum(fwd_a2a - (ct["layer_bwd"] + ct["layer_recompute"]), 0)
                  + np.maximum(bwd_a2a - ct["layer_fwd"], 0))
        vpp = g["vpp"]
        warmup = np.maximum(pipeline_warmup_forwards(g["pp"], vpp, ep_overlap=True), 1)
        unpaired = np.minimum(warmup / (g["n_micro"] * vpp), 1.0)
        return (1 - unpaired) * paired + unpaired * n_a2a * a2a

    def _ep_nodes(self, ep, stride):
        """Nodes (NVLink domains) an EP group of `ep` ranks `stride` apart spans; 1 inside one domain."""
        domain = self.p.chip.links.nvlink_domain_size or 0
        span = np.asarray(ep * stride, float)
        return np.where((domain > 0) & (span > domain), np.ceil(span / max(domain, 1)), 1.0)

    def _dispatcher_network_s(self, sent, ep, stride):
        """Seconds of the network leg of one DeepEP/HybridEP dispatch (or combine) whose EP group spans M > 1 nodes, at
        the dispatcher's measured share of the per-GPU line rate (collective_efficiency.yaml `ep_dispatch_scale_out`,
        by M): of the `sent` bytes (each token once per node it hits, `_dispatch_copies`) the share (M - 1)/M
        leaves the node under uniform routing, through the GPU's own NIC. Those measurements were taken on
        InfiniBand; on other fabrics, and for the alltoall dispatcher (NCCL), 0 (the generic all-to-all stands)."""
        links = self.p.chip.links
        backend = self.opt.moe_dispatcher
        if links.scale_out_kind != "infiniband" or backend not in ("deepep", "hybridep"):
            return np.zeros_like(np.asarray(sent, float))
        nodes = self._ep_nodes(ep, stride)
        eff = np.vectorize(lambda n: ep_dispatch_scale_out_efficiency(backend, float(n)) if n > 1 else 1.0,
                           otypes=[float])(nodes)
        leaves = np.asarray(sent, float) * (nodes - 1) / nodes
        return leaves / (links.scale_out_bandwidth_bytes_per_s * eff)

    def _dispatch_copies(self, copies, ep, stride):
        """Copies of a token one dispatch sends. Megatron-Core's alltoall dispatcher: one per routed expert
        (`copies`). A DeepEP/HybridEP dispatcher (`moe_dispatcher`) deduplicates: inside one NVLink domain a token
        goes once to each rank holding any of its experts, ragged_destinations(copies, ep) under uniform routing;
        a group spanning M nodes sends it once to each node over the network, ragged_destinations(copies, M), and
        that leg sets the time (DeepEP README, H800: ~150 GB/s NVLink against ~45 GB/s RDMA per GPU)."""
        if self.opt.moe_dispatcher == "alltoall":
            return copies
        if self.opt.moe_dispatcher not in MOE_DISPATCHERS:
            raise unknown_name_error("MoE dispatcher", self.opt.moe_dispatcher, MOE_DISPATCHERS)
        nodes = self._ep_nodes(ep, stride)
        targets = np.where(nodes > 1, nodes, np.asarray(ep, float))
        # otypes: an empty layout array (every candidate filtered out) has no element to infer the type from
        out = np.vectorize(lambda n: ragged_destinations(int(copies), int(n)) if n > 1 else 1.0, otypes=[float])(targets)
        return np.minimum(out, copies)

    def _pp_terms(self, L: LayoutArrays, g: dict, ct: Terms, out: Terms) -> None:
        """PP: one activation send forward and one gradient send backward per virtual stage; blocking, or under
        interleaving with `pp_overlap` each steady-state one hidden behind the next model chunk's compute (the
        smaller, forward chunk's: layers_stage / vpp layer forwards), only the excess exposed. The warm-up forwards
        and the cool-down backwards still block (Options.pp_overlap): Megatron-Core's first rank runs
        pipeline_warmup_forwards warm-up chunks, as many cool-down ones. Per micro-batch, the step's sends spread
        over its micro-batches; `pp_link_mb`: all of them blocking."""
        pp, tp = g["pp"], g["tp"]
        nbytes = self.opt.act_bytes * g["t_mb"] * self.c["D"] / np.where(g["sp"], tp, 1)
        stride = tp * g["cp"] * g["fsdp"] * g["dp"]
        p2p = self.comm.time("permute", nbytes, pp, stride)
        nm, led = g["n_micro"], g["ledger"]
        if not self.opt.pp_spmd_loop:
            out["pp_link_mb"] = 2 * g["vpp"] * p2p
            chunk_fwd = g["layers_stage"] / g["vpp"] * ct["layer_fwd"]
            overlapped = self.opt.pp_overlap & (g["vpp"] > 1)
            sends = 2 * g["vpp"] * nm
            warmup = pipeline_warmup_forwards(pp, g["vpp"], ep_overlap=self.opt.ep_overlap and self.p.model.is_moe)
            blocking = np.minimum(2 * warmup, sends)
            hidden = (blocking * p2p + (sends - blocking) * np.maximum(p2p - chunk_fwd, 0)) / nm
            out["pp_mb"] = np.where(overlapped, hidden, out["pp_link_mb"])
            led.collective("permute", [("stage", pp)], nm * 2 * g["vpp"] * nbytes)
            return
        # SPMD loop (Options.pp_spmd_loop): the state shifts one stage on at every iteration but the last, forward
        # and backward: 2(M·v + p − 2) sends a step; the last stage's output reaches the replicated head by an
        # all-reduce over `stage`, and the input gradients return by another (2M activations)
        sends = np.where(pp > 1, 2 * (nm * g["vpp"] + pp - 2), 0.0)
        out["pp_mb"] = sends / nm * p2p + 2 * self.comm.time("allreduce", nbytes, pp, stride)
        out["pp_link_mb"] = out["pp_mb"]
        led.collective("permute", [("stage", pp)], sends * nbytes)
        led.collective("all_reduce", [("stage", pp)], np.where(pp > 1, 2 * nm * nbytes, 0.0))

    def _torch_cp_buffer(self, g: dict):
        """Bytes PyTorch's all-gather context parallelism holds during one layer's attention backward (`cp_impl`):
        the gathered K/V of the whole ring (bf16, repeated to every query head) and the fp32 dQ, dK and dV
        accumulators (`_templated_ring_attention_backward`)."""
        if self.opt.cp_impl != "torch" or self.p.model.is_mla:
            return 0.0
        c, cp = self.c, g["cp"]
        width = g["t_mb"] * c["N"] * c["H"] / g["tp"]  # local elements of Q, and of each repeated K and V
        return np.where(cp > 1, cp * 2 * self.opt.act_bytes * width + 3 * 4.0 * width, 0.0)

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
        # with EP carved out of the FSDP group the experts are gathered and reduce-scattered over their own, smaller
        # group (`shard_expert`, torchtitan's efsdp: the ranks ep·etp apart in the sparse mesh, ep·tp under ETP = TP,
        # ep under whole experts), beside the dense weights over the whole one (none where that group is one rank)
        ep_fs, sh_e = g["ep_fsdp"], g["shard_expert"]
        w_exp = np.where(ep_fs, g["experts_layer_local"], 0.0)
        w_dense = w_layer - w_exp

        def layer_time(kind, nbytes):
            dense = comm.time(kind, nbytes * w_dense, sh, tp)
            experts = comm.time(kind, nbytes * w_exp, sh_e, g["etp"] * g["ep"])
            return dense + np.where((w_exp > 0) & (sh_e > 1), experts, 0.0)
        # a TPU merges every reduce-scatter step's received chunk on its TensorCore (_tpu_reduction_s): the layers'
        # gradients over the shard group, the experts' over theirs. The backward's TensorCore time is then the
        # layers' and the merges': the gathers and scatters hide behind both, and what they cannot hide shows
        merge = self._tpu_reduction_s(o.grad_reduce_bytes * (nl * w_dense + emb), sh) \
            + self._tpu_reduction_s(o.grad_reduce_bytes * nl * w_exp, sh_e)
        # mesh order (dp, fsdp, cp, tp): the shard group fsdp×cp is contiguous at stride tp
        if o.zero3_fetch == "broadcast":
            # owner broadcast / reduce-to-owner: every byte of the layer crosses one owner's link (a ring
            # shift's worth of link time), and the layer waits for it
            ag = layer_time("permute", o.fsdp_param_bytes)
            rs = layer_time("permute", o.grad_reduce_bytes)
            ag_emb = comm.time("permute", o.fsdp_param_bytes * emb, sh, tp)
            rs_emb = comm.time("permute", o.grad_reduce_bytes * emb, sh, tp)
            fs_f = nl * ag + ag_emb
            fs_b = nl * (ag + rs) + ag_emb + rs_emb  # DeepSpeed fetches every parameter again for the backward
            once_f, once_b = fs_f, nl * rs + rs_emb
            emb_gathers = 2
        else:
            ag = layer_time("allgather", o.fsdp_param_bytes)
            rs = layer_time("reducescatter", o.grad_reduce_bytes)
            ag_emb = comm.time("allgather", o.fsdp_param_bytes * emb, sh, tp)
            rs_emb = comm.time("reducescatter", o.grad_reduce_bytes * emb, sh, tp)
            # the group gathered before the first layer and reduced after the last backward (Options.fsdp_edge_group):
            # exposed in full; the rest of the embedding parameters are hidden like the layers'
            edge = self._fsdp_edge_params(g)
            ag_edge, rs_edge, ag_rest, rs_rest = (
                np.where(part > 0, comm.time(kind, nbytes * part, sh, tp), 0.0)
                for kind, nbytes, part in (("allgather", o.fsdp_param_bytes, edge),
                                           ("reducescatter", o.grad_reduce_bytes, edge),
                                           ("allgather", o.fsdp_param_bytes, emb - edge),
                                           ("reducescatter", o.grad_reduce_bytes, emb - edge)))
            # ZeRO-3 / FSDP (Rajbhandari et al. 2020; torchtitan FSDP2): gather before each layer's forward and
            # again before its backward (reshard after forward), reduce-scatter its gradients; the next layer's
            # gather is prefetched behind the current layer's compute, so only the excess and the first bucket
            # show. The embedding, final norm and output layer are gathered once and kept for the backward: FSDP2
            # does not reshard the root module after its forward (`fully_shard`, reshard_after_forward: "the root
            # FSDP state has its value specially set to False"), and XLA keeps the gathered table (verify: FSDP8).
            comp_f = nl * ct["layer_fwd"]
            comp_b = nl * (ct["layer_bwd"] + ct["layer_recompute"]) + merge
            fs_f = np.maximum(nl * ag + ag_rest - comp_f, 0) + ag + ag_edge
            fs_b = np.maximum(nl * (ag + rs) + rs_rest - comp_b, 0) + rs + rs_edge
            once_f = fs_f
            once_b = np.maximum(nl * rs + rs_rest - comp_b, 0) + rs + rs_edge
            emb_gathers = 1
        # With pipelining the stage stays gathered across its micro-batches: one gather per step (hidden behind
        # the first micro-batch's forward), no re-gather for the backward, and one reduce-scatter of the
        # accumulated gradients behind the last backward (torch.distributed.pipelining keeps FSDP2 unsharded
        # and skips gradient sync until the last micro-batch; torchtitan and Llama 3 train PP+FSDP so).
        once = self._fsdp_stage_gathered(g)  # (Megatron-FSDP: never)
        per_mb = (sh > 1) & ~once
        out["fsdp_mb"] = np.where(per_mb, fs_f + fs_b, 0.0)
        out["fsdp_link_mb"] = np.where(per_mb, nl * (2 * ag + rs) + emb_gathers * ag_emb + rs_emb, 0.0)
        out["fsdp_step"] = np.where(once, once_f + once_b, 0.0)
        out["fsdp_link_step"] = np.where(once, nl * (ag + rs) + ag_emb + rs_emb, 0.0)
        # GPU FSDP's copies, kernel time the compute stream waits for: the copy-out of every gathered layer
        # (forward and backward gathers per micro-batch, one gather per step under pipelining) and the gradients'
        # copy-in before each reduce-scatter
        if self.p.chip.kind == "gpu" and o.zero3_fetch == "allgather" and o.fsdp_copies:
            w_all = nl * w_layer + emb
            copy_out = FSDP_COPY_OUT_BYTES * w_all / self.hbm
            copy_in = (FSDP_COPY_IN_READ_BYTES + o.grad_reduce_bytes) * w_all / self.hbm
        else:
            copy_out = copy_in = np.zeros_like(w_layer)
        copy_in = copy_in + merge
        out["fsdp_copy_mb"] = np.where(per_mb, 2 * copy_out + copy_in, 0.0)
        out["fsdp_copy_step"] = np.where(once, copy_out + copy_in, 0.0)
        led, nm = g["ledger"], g["n_micro"]
        led.add("hbm", np.where(per_mb, nm * (2 * copy_out + copy_in), np.where(once, copy_out + copy_in, 0.0))
                * self.hbm)
        # the shard group in mesh axes: fsdp, and the context ranks that join it
        # (EP carved out of it: the mesh's `fsdp` axis is fsdp/ep and `expert` the rest, Layout.ep_in_fsdp), and the
        # experts' own group there: `fsdp` (and context)
        # With whole experts (ETP 1) the EP group takes the tensor ranks first, then context, then fsdp ones
        # (`_ep_axes`), and the experts' group the rest of each: tp/on_tp × cp/on_cp × fsdp/ep_f = efsdp
        whole = ep_fs & (g["etp"] < tp)
        ep_axes = dict(self._ep_axes(g))
        on_tp, on_cp = np.where(whole, ep_axes["tensor"], 1.0), np.where(whole, ep_axes["context"], 1.0)
        ep_f = np.where(ep_fs, g["ep"] / (on_tp * on_cp), 1.0)
        shard_axes = [("fsdp", np.where(sh > 1, g["fsdp"] / ep_f, 1)), ("expert", np.where(sh > 1, ep_f, 1)),
                      ("context", np.where(sh > 1, sh / g["fsdp"], 1))]
        expert_shard_axes = [("fsdp", np.where(sh_e > 1, g["fsdp"] / ep_f, 1)),
                             ("context", np.where(sh_e > 1, sh / g["fsdp"] / on_cp, 1)),
                             ("tensor", np.where(whole & (sh_e > 1), tp / on_tp, 1))]
        for w, e, axes in ((w_dense, emb, shard_axes), (w_exp, 0.0, expert_shard_axes)):
            gathers = np.where(per_mb, nm * (2 * nl * w + emb_gathers * e), np.where(once, nl * w + e, 0.0))
            scatters = np.where(per_mb, nm, np.where(once, 1.0, 0.0)) * (nl * w + e)
            led.collective("all_gather", axes, o.fsdp_param_bytes * gathers)
            led.collective("reduce_scatter", axes, o.grad_reduce_bytes * scatters)
        # Replicated DP: gradient all-reduce (ZeRO-0) or reduce-scatter + param all-gather (ZeRO-1/2, Megatron
        # distributed optimizer), bucketed and overlapped with the last micro-batch's backward. Without FSDP the
        # replica group takes in the CP ranks: (dp, cp) is contiguous at stride tp since fsdp = 1.
        grads = self._sharded(g, g["params_stage_local"], g["experts_stage_local"])
        stride_rep = np.where(sh > 1, tp * sh, tp)
        # the replica group in mesh axes: the planner's dp holds the expert ranks (carved out of it, as Megatron
        # does); the experts' own gradients are reduced only over the replicas that hold the same experts
        data, expert_n = self._replica_axes(g)
        expert = self._carved_experts(g) / sh
        ar, rs_dp, ag_dp = (self._replica_collective(kind, nbytes * grads, nbytes * expert, g, stride_rep)
                            for kind, nbytes in (("allreduce", o.grad_reduce_bytes),
                                                 ("reducescatter", o.grad_reduce_bytes),
                                                 ("allgather", o.param_bytes)))
        # PyTorch DDP/Megatron bucket the reduction and hide it behind the backward; XLA can hoist the all-reduce
        # of gradients accumulated in a scanned layer loop out of the loop (WhileLoopAllReduceCodeMotion), so on
        # TPU (JAX with scanned layers: MaxText, PaLM) it runs once after the backward, exposed
        window = nl * (ct["layer_bwd"] + ct["layer_recompute"]) * (1.0 if self.dp_overlap else 0.0)
        zero = L.zero
        # ZeRO-2 keeps only its shard of the gradients, so every micro-batch's gradients are reduce-scattered
        # (DeepSpeed reduces at each micro-step; the JAX program with accumulation does too); ZeRO-0/1 accumulate
        # locally and reduce once a step
        n_reduce = self._grad_reduces(L, g)
        reduce = np.where(zero >= 1, rs_dp, ar)
        # the updated parameters' all-gather: blocking, or with `overlap_param_gather` bucket by bucket behind the next
        # step's first micro-batch forward, only the excess shown: Megatron-Core's forward pre-hook waits on the
        # module's bucket and dispatches the next one (distributed_data_parallel.py `_make_forward_pre_hook`,
        # `next_param_gather_bucket_group` @ NVIDIA/Megatron-LM d7288711), so no later compute hides it. It shows where
        # the expert-data-parallel group (_replica_collective) crosses the scale-out network with a small forward.
        first_fwd = nl * ct["layer_fwd"]
        gather = np.where(zero >= 1, np.where(o.overlap_param_gather, np.maximum(ag_dp - first_fwd, 0), ag_dp), 0.0)
        out["dp_step"] = np.where(rep > 1, n_reduce * np.maximum(reduce - window, 0) + gather, 0.0)
        # ... and the replicas' reduction of the gradients it holds (the experts' over their own replicas) where it
        # runs behind the backward (dp_overlap); an exposed reduction merges inside its own exposed time
        dp_merge = np.where(self.dp_overlap, n_reduce, 0.0) * (
            self._tpu_reduction_s(o.grad_reduce_bytes * (grads - expert), rep)
            + self._tpu_reduction_s(o.grad_reduce_bytes * expert, self._expert_replicas(g)))
        out["fsdp_copy_step"] = out["fsdp_copy_step"] + dp_merge
        led.add("hbm", dp_merge * self.hbm)
        out["dp_link_step"] = np.where(rep > 1, n_reduce * reduce + np.where(zero >= 1, ag_dp, 0.0), 0.0)
        ctx = ("context", np.where(sh > 1, 1, g["cp"]))
        # the norm scales already reduced over context with `tensor` (_tp_terms) are reduced over the rest only (or
        # there with the rest too, `fold_all_reduces`)
        pc = self.pc
        layer_norms = np.where(self._spmd_pp(g), 0.0, g["layers_stage"] * pc.per_layer_norms)  # see _tp_terms
        norms = np.where(self._norm_context(g) > 1, layer_norms + pc.final_norm, 0.0)
        expert_ax = ("expert", expert_n)
        fold_data, fold_expert = self._norm_replicas(L, g)
        folded = np.where(fold_data * fold_expert > 1, norms, 0.0)
        norms = np.where(zero == 0, norms, folded)  # ZeRO: only folded scales leave the replicas' reduce-scatter
        # the experts' own group: replicas/ep of `data` with `context`, or under ETP = 1 the folded expert-DP group
        fold = (g["etp"] < tp) | self._carved_over_cp(g)
        expert_axes = [("data", np.where(fold, self._expert_replicas(g), data)), ("context", np.where(fold, 1, ctx[1]))]
        for part, axes in ((grads - expert - norms, [("data", data), expert_ax, ctx]),
                           (expert, expert_axes), (norms - folded, [("data", data), expert_ax])):
            led.collective("all_reduce", axes, np.where(zero >= 1, 0.0, o.grad_reduce_bytes * part))
            led.collective("reduce_scatter", axes, np.where(zero >= 1, n_reduce * o.grad_reduce_bytes * part, 0.0))
        # ZeRO's all-gather of the updated parameters: every shard, the norm scales' included
        for part, axes in ((grads - expert, [("data", data), expert_ax, ctx]), (expert, expert_axes)):
            led.collective("all_gather", axes, np.where(zero >= 1, o.param_bytes * part, 0.0))
        # the step's mean loss: one fp32 scalar all-reduced over every rank that holds other tokens, once a step also
        # with micro-batches (MaxText sums them in its scan's carry, train.py `accumulate_gradient`, and XLA's TPU
        # compiler moves the carried all-reduce out of the loop: one all-reduce, docs/verify.md); it is
        # issued after the forward and read only for logging, so it runs behind the backward (no seconds)
        led.collective("all_reduce", [("data", data), ("fsdp", g["fsdp"] / ep_f), ("expert", expert_n * ep_f),
                                      ("context", g["cp"])], 4.0)

    def _tpu_reduction_s(self, nbytes, n):
        """TensorCore seconds of a TPU reduce-scatter (or an all-reduce's reduce-scatter half) of an `nbytes` array
        per rank over `n` ranks: each rank merges (n - 1)/n of the array's elements, each merge an HBM-bound pass of
        tpu_reduction_hbm_passes() accesses (read the local partial sum and the received chunk, write the sum;
        data/collective_efficiency.yaml `tpu_reduction`), at the chip's HBM rate (self.hbm, hbm_fraction). The ring's
        DMAs run beside compute, the merges do not (the reason v6e recipes offload them to the SparseCores,
        Options.sparsecore_reduce: 0 then). 0 on GPUs (NCCL's reduction kernels are in the SM slow-down) and for a
        group of one. E.g. 1 GB of fp32 gradients over 4 v6e chips: 3 x 1e9 x 3/4 / (1.6e12 x 0.85) = 1.65 ms."""
        if self.p.chip.kind != "tpu" or self.opt.sparsecore_reduce:
            return np.zeros_like(np.asarray(nbytes, float))
        return tpu_reduction_s(nbytes, n, self.hbm)

    def _fsdp_edge_params(self, g: dict):
        """Parameters (local to a TP rank) of the FSDP group that nothing hides (Options.fsdp_edge_group): none; the
        root module's (the embedding, final norm and output layer outside the layers: params_embed_local); or the
        token embedding's own group (the whole table when the output layer shares it)."""
        emb, pc = g["params_embed_local"], self.pc
        if self.opt.fsdp_edge_group == "root":
            return emb
        if self.opt.fsdp_edge_group == "embedding":
            return np.minimum((pc.embedding + pc.position) / g["tp"], emb) if pc.unembedding else emb
        return np.zeros_like(emb)

    def _replica_collective(self, kind: str, all_bytes, expert_bytes, g: dict, stride_rep):
        """Seconds of one data-parallel gradient collective (`kind`) when the routed experts' share of it runs over
        its own, smaller group. Megatron-Core reduces the expert parameters over the expert-data-parallel group
        (parallel_state: ranks holding the same experts, rank order tp-cp-ep-dp, so `dp/ep` replicas `ep` ranks
        apart) and the rest over the whole data-parallel group (distributed.DistributedDataParallel: separate
        expert and dense buffers). With EP inside a node that expert group spans the nodes: its bytes cross the
        scale-out network where a whole-DP ring would mostly ride NVLink. The two groups share the links: summed."""
        rep, ep = g["replicas"], g["ep"]
        dense = self.comm.time(kind, all_bytes - expert_bytes, rep, stride_rep)
        # ETP = TP: replicas/ep groups ep·stride apart; ETP = 1 (Options.expert_tp): the tensor ranks join the group,
        # whose members are etp·ep = ep ranks apart (expert rank order tp-ep-dp)
        rep_e = self._expert_replicas(g)
        experts = self.comm.time(kind, expert_bytes, rep_e, stride_rep * g["etp"] / g["tp"] * ep)
        return dense + np.where(expert_bytes > 0, experts, 0.0)

    # --- geometry, memory, totals --------------------------------------------------------------
    def fsdp_mode(self, fsdp, cp):
        """Whether the weights are sharded (FSDP / ZeRO-3) over the fsdp ranks, or over the cp ranks too under
        fsdp_over_cp; arrays or plain integers. Sharded, the gradients reduce over the dp replicas of a shard;
        otherwise over dp x cp ranks (geometry's `shard` and `replicas`)."""
        return (fsdp > 1) | (self.opt.fsdp_over_cp & (cp > 1))

    def geometry(self, L: LayoutArrays) -> dict:
        m, pc, c = self.p.model, self.pc, self.c
        f = {k: getattr(L, k).astype(float) for k in ("dp", "fsdp", "tp", "pp", "vpp", "cp", "ep")}
        g = dict(f)
        g["mb"] = L.microbatch.astype(float)
        g["sp"] = L.sequence_parallel & (L.tp > 1)
        g["t_mb"] = g["mb"] * self.p.seq_len / g["cp"]
        g["etp"] = expert_tp_degree(self.opt.expert_tp, g["tp"], g["cp"], g["dp"] * g["fsdp"], g["ep"], g["sp"])
        # tokens one rank routes (its sequence-parallel slice: Megatron-Core's router and dispatcher run on the SP
        # hidden states) and tokens whose routed copies its experts compute: the dispatcher gathers the ETP group's
        # slices after the all-to-all (A2A(EP) -> AG(ETP)), so t_mb·etp/tp under SP (balanced routing)
        g["t_route"] = g["t_mb"] / np.where(g["sp"], g["tp"], 1.0)
        g["t_expert"] = g["t_route"] * np.where(g["sp"], g["etp"], 1.0)
        g["n_micro"] = self.p.global_batch / (g["dp"] * g["fsdp"] * g["mb"])
        # CP ranks hold the same weights and see other tokens of the same sequences: they join the gradient
        # reduction and, under FSDP, the shard group (torchtitan's dp_shard×cp mesh; Megatron-LM's
        # data-parallel-with-context group for its distributed optimizer and gradient all-reduce).
        fsdp_mode = self.fsdp_mode(g["fsdp"], g["cp"])
        g["shard"] = np.where(fsdp_mode, g["fsdp"] * g["cp"], 1.0)  # FSDP/ZeRO-3 shard group
        g["replicas"] = np.where(fsdp_mode, g["dp"], g["dp"] * g["cp"])  # gradient reduction across replicas
        # the busiest stage (an uneven pinned split puts ceil(L / (pp·vpp)) layers in each virtual stage); with the
        # embedding and the loss counted as a layer each (Options.pp_head_in_split) the split divides L + 2 slots and
        # the last stage holds one layer fewer beside the loss (compute_terms)
        head = np.where((g["pp"] > 1) & self.opt.pp_head_in_split, 2.0, 0.0)
        g["head_in_split"] = head > 0
        g["layers_stage"] = np.ceil((m.n_layers + head) / (g["pp"] * g["vpp"])) * g["vpp"]
        # norm scales are replicated over TP (Megatron-SP, and the JAX program: verify's TP8 arguments showed it)
        # the mean layer, as c["expert_w"] is (DeepSeek's leading dense layers have no experts): its weights less the
        # norms and the routed experts it holds on average
        mean_layer = (pc.total - pc.embedding - pc.position - pc.final_norm - pc.unembedding) / m.n_layers
        dense_layer = mean_layer - pc.per_layer_norms - (c["expert_w"] if m.is_moe else 0)
        g["params_layer_local"] = (dense_layer / g["tp"] + pc.per_layer_norms
                                   + c["expert_w"] / (g["etp"] * g["ep"]))
        # outside the layers: embeddings, output layer and the final norm (which sits with the output layer)
        embed = (pc.embedding + pc.position + pc.unembedding) / g["tp"] + pc.final_norm
        last = (pc.unembedding or pc.embedding) / g["tp"] + pc.final_norm
        split = (g["pp"] > 1) & (not self.opt.pp_spmd_loop)  # an SPMD loop keeps both on every stage
        g["params_embed_local"] = np.where(split, np.maximum((pc.embedding + pc.position) / g["tp"], last), embed)
        # layer passes run per useful one: the SPMD loop's bubble iterations compute too (Options.pp_spmd_loop)
        ticks = g["n_micro"] * g["vpp"]
        g["bubble_runs"] = np.where((g["pp"] > 1) & self.opt.pp_spmd_loop, (ticks + g["pp"] - 1) / ticks, 1.0)
        g["params_stage_local"] = g["layers_stage"] * g["params_layer_local"] + g["params_embed_local"]
        # EP carved out of the FSDP group (torchtitan's FSDP+EP, parallel_dims.py: the sparse mesh [pp, dp_replicate,
        # efsdp, ep, etp], efsdp = dp_shard·cp·tp/(etp·ep), the experts fully_shard-ed over efsdp and replicated over
        # dp_replicate; @1a36996b, and #1555 for ETP 1) where ep does not divide dp (`_carved`, Megatron's) but
        # divides the shard group's ranks the expert grid folds over: fsdp·cp under ETP = TP (ep = dp_shard_in_ep·cp),
        # fsdp·cp·tp with whole experts (ETP 1: ep = dp_shard_in_ep·cp·tp, torchtitan's default since #1555,
        # 2025-08-13, and its only EP mesh since #3167 removed ETP). An expert is split over the ep ranks and
        # FSDP-sharded over the efsdp ranks only; the dense weights over the whole shard group
        fold = g["shard"] * g["tp"] / g["etp"]
        g["ep_fsdp"] = (g["ep"] > 1) & ~self._carved(g) & (g["shard"] > 1) & (fold % g["ep"] == 0)
        g["shard_expert"] = np.where(g["ep_fsdp"], fold / g["ep"], g["shard"])  # the experts' FSDP group (efsdp)
        g["experts_layer_local"] = (c["expert_w"] / (g["etp"] * g["ep"]) if m.is_moe
                                    else np.zeros_like(g["params_layer_local"]))
        g["experts_stage_local"] = g["layers_stage"] * g["experts_layer_local"]
        g["ledger"] = Ledger()
        return g

    def activation_per_layer(self, L: LayoutArrays, g: dict, policy_codes: np.ndarray) -> np.ndarray:
        """Saved bytes per layer per micro-batch (Korthikanti et al. 2022, generalised in math/transformer). Kept in
        `g` (the geometry of `L`) per cost model and policy array: one evaluation's memory rules ask for one policy's
        several times."""
        cache = g.setdefault("activation_per_layer", {})
        key = (self, policy_codes.dtype.str, policy_codes.tobytes())
        if key not in cache:
            cache[key] = self._activation_per_layer(L, policy_codes)
        return cache[key]

    def _activation_per_layer(self, L: LayoutArrays, policy_codes: np.ndarray) -> np.ndarray:
        # encode (tp, cp, micro-batch, policy) in one integer; 1-D unique is far faster than over rows
        key = ((L.tp.astype(np.int64) * 4096 + L.cp) * 4096 + L.microbatch) * 8 + policy_codes
        uniq, inv = np.unique(key, return_inverse=True)
        combos = [(int(k // 8 // 4096 // 4096), int(k // 8 // 4096 % 4096), int(k // 8 % 4096), int(k % 8))
                  for k in uniq]
        vals = np.array([
            tm.activation_bytes_per_layer(
                self.p.model, self.p.seq_len, mb, tm.RECOMPUTE_POLICIES[rc], tp=tp,
                sequence_parallel=L.sequence_parallel and tp > 1, cp=cp,
                flash_attention=self.opt.flash_attention, dropout=self.opt.dropout,
                act_bytes=self.opt.act_bytes, glu_saves_input=self.opt.glu_saves_input,
                gemm_input_bytes=self._fp8_saved_input_bytes(),
                distribute_saved=self.opt.distribute_saved_activations)["total"]
            for tp, cp, mb, rc in combos])
        return vals[inv.ravel()]

    def _fp8_saved_input_bytes(self) -> float | None:
        """Bytes per element of the FP8 copy a Transformer Engine GEMM saves of its input for the backward (one
        usage, `update_usage`, module/linear.py @d0067d0), with its block scales where the recipe has them (MXFP8: one
        E8M0 byte per 32 elements, OCP Microscaling Formats spec v1.0 §5.2; TE's 1×128 blocks: one fp32 per 128, the
        same 1/32 B); None where the saved input is the bf16 activation (bf16, or torchao's float8, which saves the
        high-precision input: Options.fp8_fused_casts False; the dense GEMMs' under Options.fp8_scope "experts", taken
        for every GEMM input here)."""
        if not self.opt.fp8_dense or not self.opt.fp8_fused_casts:
            return None
        return FP8_ELEMENT_BYTES + (FP8_BLOCK_SCALE_BYTES if self.opt.fp8_scaling == "blockwise" else 0.0)

    def _fp8_param_bytes(self) -> float:
        """Bytes per parameter of FP8 primary weights (Options.fp8_params): one FP8 copy where the chip's FP8 GEMMs
        take either operand layout and one scale covers the tensor (fp8_recipes.yaml any_layout_chips), else a second,
        column-wise copy for the backward's data-gradient GEMM (Hopper's transpose; MXFP8 and block scales along the
        other axis: TE quantises weights with `set_usage(rowwise=True, columnwise=True)`, layernorm_linear.py
        @d0067d0), with block scales where the recipe has them."""
        per_tensor = self.opt.fp8_scaling in ("tensorwise", "delayed")
        copies = 1.0 if per_tensor and self.p.chip.name in _fp8_table()["any_layout_chips"] else 2.0
        return copies * (self._fp8_saved_input_bytes() or FP8_ELEMENT_BYTES)

    def _head_in_split_relief(self, g: dict):
        """Layer passes fewer in flight on the busiest stage when the embedding and the loss take a layer's slot each
        (Options.pp_head_in_split). In Megatron-Core's 1F1B, rank r runs p − r − 1 warm-up forwards, interleaved
        2(p − r − 1) + (v − 1)·p chunk forwards (schedules.py `get_forward_backward_func`, microbatch_group_size_per_
        vp_stage = p), and holds those plus one at its peak: rank 0 holds the formula's count, layers_stage·p·(1 +
        (p − 1)/(p·v)) layer passes, but its first chunk runs one layer fewer (the embedding's slot), which its 2p − 1
        (interleaved; p plain) in-flight first-chunk forwards each carry; rank 1 holds full chunks and two chunk
        forwards fewer (one micro-batch fewer without interleaving). The busiest is the larger of the two."""
        pp, vpp, chunk = g["pp"], g["vpp"], g["layers_stage"] / g["vpp"]
        full = g["n_micro"] >= pp  # a steady state: every warm-up forward runs
        first = np.where(vpp > 1, 2 * pp - 1, pp)
        second = np.where(vpp > 1, 2 * chunk, g["layers_stage"])
        return np.where(g["head_in_split"] & full & ~self._spmd_pp(g), np.minimum(first, second), 0.0)

    def memory_terms(self, L: LayoutArrays, g: dict) -> Terms:
        """Bytes per chip on the busiest stage: params, grads, optimizer, activations, other."""
        fs, rep, zero = g["shard"], g["replicas"], L.zero
        # the busiest stage's weights: with the embedding and the loss in the split (Options.pp_head_in_split) the first
        # and last stages hold one layer fewer beside them, so a full middle stage or the end one holds the most
        P = g["params_stage_local"] - np.where(g["head_in_split"],
                                               np.minimum(g["params_embed_local"], g["params_layer_local"]), 0.0)
        # the routed experts among them (a layer fewer where the layer gave way)
        layer_out = g["head_in_split"] & (g["params_layer_local"] <= g["params_embed_local"])
        E = g["experts_stage_local"] - np.where(layer_out, g["experts_layer_local"], 0.0)
        P_fs = self._sharded(g, P, E)  # what this rank holds under FSDP
        # ZeRO-2's gradients, ZeRO-1's state
        P_g, P_o = self._zero_local(g, zero >= 2, P, E), self._zero_local(g, zero >= 1, P, E)
        act_layer = self.activation_per_layer(L, g, L.recompute)
        if self.opt.selective_flavor != "attention":
            # torchtitan's per-op and per-layer policies recompute about half of each layer (every second
            # matmul / every second layer): they keep about half of the no-recompute activations
            none = self.activation_per_layer(L, g, np.zeros_like(L.recompute))
            full = self.activation_per_layer(L, g, np.full_like(L.recompute, 2))
            act_layer = np.where(L.recompute == 1, 0.5 * (none + full), act_layer)
        xla = self._xla_program()  # the program XLA compiles (MaxText, JAX): `_xla_activations`
        if xla:
            act_layer = self._xla_saved_layer(L, g, act_layer)
        # Context parallelism that keeps the other ranks' K/V for the backward: the all-gather form saves the gathered
        # K/V (its backward reduce-scatters their gradients without gathering again, `_allgather_cp_terms`), a ring
        # that sends only dK/dV back the cp − 1 blocks it received (`ring_saves_kv`); a fully recomputed layer
        # gathers again. Beyond the local K/V the activation formula counts: (cp − 1) · the local K/V bytes a layer
        # (verify DP2×TP2×CP2: two layers' [8, 128, 1, 32] K and V saved, 0.5 MiB, 0.25 of them other ranks')
        keeps_kv = self.opt.cp_impl == "allgather" or (self.opt.cp_impl == "ring" and self.opt.ring_saves_kv)
        other_kv = np.where(L.recompute != 2, (g["cp"] - 1) * self._kv_bytes(g), 0.0) if keeps_kv else 0.0
        act_layer = act_layer + other_kv
        pp, vpp = g["pp"], g["vpp"]
        # 1F1B: the first stage holds min(pp, micro-batches) in flight; interleaving multiplies by
        # 1 + (p-1)/(p·v) (Narayanan et al. 2021 §2.2; Korthikanti et al. 2022 §4.2.3).
        # DualPipe keeps PP + 1 (DeepSeek-V3 Table 2); zero-bubble ZB-H1 as many as 1F1B
        depth = pp + 1 if self.opt.pp_schedule == "dualpipe" else pp
        inflight = np.where(pp > 1, np.minimum(depth, g["n_micro"]) * (1 + (pp - 1) / (pp * vpp)) ** (vpp > 1), 1.0)
        if self.opt.pp_schedule == "gpipe":
            # every forward runs before the first backward: at the turn each stage holds all its layers' activations
            # of every micro-batch (GPipe, Huang et al. 2019 §2.2; looped breadth-first alike, Lamy-Poirier 2023 §3),
            # the most on a full middle stage (no relief where the embedding or the loss takes a layer's slot)
            inflight = np.where(pp > 1, g["n_micro"], 1.0)
        # MaxText's SPMD pipeline (Options.pp_spmd_loop) is no 1F1B: its forward is a loop of M·v + pp − 1
        # iterations, each running one repeat's layers (layers_stage / v) on one micro-batch, and the backward is
        # jax's autodiff of that loop, so every iteration's saved residuals (bubble iterations' too) stay live until
        # the backward reaches them, as in GPipe (Huang et al. 2019) (MaxText layers/pipeline.py: each
        # iteration is `nn.remat`ed under get_pipeline_remat_policy and the loop is unrolled or `nn.scan`ned;
        # verify PP2×DP4, 4 micro-batches: the peak at the start of the backward holds five iterations' saved
        # gate/up outputs, docs/verify.md "Memory")
        spmd_iters = (g["n_micro"] * vpp + pp - 1) / vpp
        inflight = np.where(self._spmd_pp(g), spmd_iters, inflight)
        if self.opt.kept_projections:
            # MaxText's custom policy keeps the named projection outputs beside the layer input (_kept_projections)
            kept = self.opt.act_bytes * g["t_mb"] * self._kept_projections(g)[2]
            act_layer = act_layer + np.where(L.recompute == 2, kept, 0.0)
        stage_layers = g["layers_stage"] * inflight  # layer passes whose activations the busiest stage holds
        if self.opt.pp_schedule in ("1f1b", "zb1p"):
            stage_layers = stage_layers - self._head_in_split_relief(g)
        acts = stage_layers * act_layer
        # full recompute re-materialises one layer's activations at a time in the backward
        if xla:
            working = self._xla_layer_backward(L, g, act_layer - other_kv)  # the other ranks' K/V: no rebuild
        else:
            working = np.where(L.recompute == 2, self.activation_per_layer(L, g, np.zeros_like(L.recompute)), 0)
        # the loss's peak at the start of the backward, per logit: a fused cross-entropy (Megatron's vocab-parallel
        # kernel) holds the bf16 logits and the fp32 softmax it saved and writes the gradient in place (6 B);
        # eager PyTorch (`F.cross_entropy(logits.float())`, torchtitan) also holds the fp32 gradient of the
        # log-softmax and its bf16 cast (2 + 4 + 4 + 2 = 12 B); XLA one fp32 buffer (XLA_LOSS_BYTES_PER_LOGIT)
        loss_bytes = (LOSS_SOFTMAX_BYTES + self.opt.act_bytes) * (1 if self.opt.fused_loss else 2)
        if xla and self.opt.fused_loss:
            loss_bytes = XLA_LOSS_BYTES_PER_LOGIT
        # MaxText's SPMD pipeline returns all M micro-batches' outputs reshaped to the device's whole batch and the
        # head and loss run once on it after the loop (layers/pipeline.py: `final_output` reshaped to
        # micro_batch_size_to_train_on): the loss buffers hold M micro-batches' logits (verify PP2×DP4: [512, 512])
        logits = loss_bytes * g["t_mb"] * np.where(self._spmd_pp(g), g["n_micro"], 1.0) * self.c["V"] / g["tp"]
        saved = acts
        # the layer being rematerialised is what the backward computes with: it stays on the device under offload
        # (in an XLA program `_xla_activations` holds it, as the larger of the step's two peaks)
        acts = acts * (1 - L.offload) + (0.0 if xla else logits + working)
        # FSDP holds one gathered layer in the working dtype and that layer's unsharded bf16 gradients before
        # the reduce-scatter (the prefetched next layer replaces the freed current one).
        once = self._fsdp_stage_gathered(g)  # FSDP under pipelining: the stage stays gathered through the step
        # PyTorch FSDP gathers a whole transformer block; XLA (Options.xla_program) gathers each weight just before its matmul
        # and reduce-scatters each gradient as it is produced, and DeepSpeed ZeRO-3 fetches parameter by parameter,
        # so there only the largest weight (and the prefetched next one) is ever whole
        # experts whose FSDP group is one rank (EP carved out of the whole FSDP group) are never gathered
        whole_experts = g["shard_expert"] <= 1
        if xla or self.opt.zero3_fetch == "broadcast":
            m, c = self.p.model, self.c
            experts_local = np.where(whole_experts, 0.0, m.n_experts / g["ep"]) if m.is_moe else 1.0
            gathered = 2 * np.maximum(c["D"] * m.q_dim / g["tp"], c["D"] * c["F"] * experts_local / g["etp"])
        else:
            gathered = g["params_layer_local"] - np.where(whole_experts, g["experts_layer_local"], 0.0)
        fsdp_buf = np.where((fs > 1) & ~once, (self.opt.fsdp_param_bytes + self.opt.act_bytes) * gathered, 0.0)
        reserve = self.eff.memory_reserved_bytes if self.opt.runtime_reserve else 0.0
        other = reserve + fsdp_buf + self._torch_cp_buffer(g)
        # FSDP (torchtitan FSDP2, MaxText) keeps fp32 sharded parameters that double as Adam's master copy;
        # DP/ZeRO-1/2 (Megatron) keeps a bf16 working copy next to the fp32 master in the optimizer state.
        working_bytes = self._fp8_param_bytes() if self.opt.fp8_params and self.opt.fp8_dense else None
        p_bytes = np.where(fs > 1, FSDP_PARAM_STATE_BYTES, working_bytes or self.opt.param_bytes)
        o_bytes = np.where(fs > 1, MOMENT_BYTES, self.opt.master_bytes + MOMENT_BYTES)
        w_bytes = self.opt.weight_dtype_bytes
        if w_bytes:
            # MaxText's `weight_dtype` (configs/base.yml, default float32): the weights are stored in it with no
            # other master copy, and Adam's moments take it too (base.yml: "mu_dtype ... Inherits from weight_dtype
            # if unset"; optax's scale_by_adam gives nu the params' dtype): weights w, moments 2w per parameter
            p_bytes, o_bytes = np.full_like(p_bytes, w_bytes), np.full_like(o_bytes, 2 * w_bytes)
        # ZeRO-Offload (Ren et al. 2021 §4.1, Fig. 2-3): the fp32 master and both Adam moments (12 B per parameter
        # of the rank's ZeRO partition) live on the host, with the gradients accumulated there (fp32, 4 B); the device
        # keeps only the 2 B working copy (under FSDP that replaces the fp32 sharded parameters, whose master role
        # moves to the host)
        opt_off = L.offload_optimizer == 1
        p_bytes = np.where(opt_off, self.opt.param_bytes, p_bytes)
        host_opt = np.where(opt_off, (MASTER_BYTES + MOMENT_BYTES + self.opt.grad_reduce_bytes) * P_o, 0.0)
        o_bytes = np.where(opt_off, 0.0, o_bytes)
        # ZeRO-Infinity (Rajbhandari et al. 2021 §5.1.1, §6.2): the rank's parameter shard lives on the host and
        # each layer is fetched before its forward and again before its backward; the device holds the layer in
        # use and the prefetched next one
        par_off = L.offload_params == 1
        host_par = np.where(par_off, p_bytes * P_fs, 0.0)
        fetch_buf = np.where(par_off, 2 * self.opt.param_bytes
                             * self._sharded(g, g["params_layer_local"], g["experts_layer_local"]), 0.0)
        params = np.where(par_off, 0.0, p_bytes * P_fs)
        # the stage gathered once under pipelining is a working copy beside the sharded parameters (the arguments
        # hold the shards: verify PP2×FSDP4), so it counts with the transient buffers
        gathered_stage = np.where(once, self.opt.fsdp_param_bytes * (P - np.where(whole_experts, E, 0.0)), 0.0)
        # unsharded accumulation under pipelining; gradients take the weights' dtype where it is set (JAX)
        grads = (w_bytes or self.opt.grad_reduce_bytes) * np.where(once, P, P_g)
        # a chunk-major backward accumulates the chunk in progress unsharded beside the ZeRO-2 shards
        grads = grads + np.where(self._chunk_major_backward(g) & (zero >= 2) & ~once,
                                 (w_bytes or self.opt.grad_reduce_bytes) * P / g["vpp"], 0.0)
        if xla and not self.dp_overlap:
            # XLA reduces the scanned layers' gradients across the replicas after the backward (MaxText; dp_overlap
            # off): the backward's loop writes the micro-batch's whole (1/fs) gradients, so under ZeRO-2 they are
            # live beside the 1/(fs·replicas) accumulator of the earlier micro-batches (none with one micro-batch)
            # until the reduce-scatter after it (verify ZeRO-2 DP8, 2 micro-batches: the stacked [L, ...] layer
            # gradients and the output layer's, docs/verify.md "Memory"); DeepSpeed's and Megatron's ZeRO-2 reduce
            # bucket by bucket inside the backward (`overlap_comm`) and keep the 1/dp rule
            whole = (w_bytes or self.opt.grad_reduce_bytes) * P_fs
            z2 = (zero >= 2) & (rep > 1) & ~once
            grads = np.where(z2, whole + np.where(g["n_micro"] > 1, grads, 0.0), grads)
        # under optimizer offload the gradients go to the host as the backward produces them, bucket by bucket, and
        # accumulate there (fp32): the device holds one layer's (ZeRO-Offload §4.1: the GPU keeps the fp16 weights)
        grads = np.where(opt_off, self.opt.grad_reduce_bytes * g["params_layer_local"], grads)
        if xla:
            acts = acts + self._xla_activations(g, fs, opt_off | once, grads, logits, working)
        # DualPipe holds two stages per rank, one of each pipeline direction: twice the model state (Table 2)
        copies = np.where((pp > 1) & (self.opt.pp_schedule == "dualpipe"), 2.0, 1.0)
        t = Terms(params=copies * params, grads=copies * grads, optimizer=copies * o_bytes * P_o,
                  activations=acts, other=other + copies * (fetch_buf + gathered_stage))
        t["offloaded"] = saved * L.offload
        t["host_state"] = copies * (host_opt + host_par)  # model state held in host memory
        t["host"] = t["offloaded"] + t["host_state"]
        # bytes one micro-batch fetches from the host per pass (forward, and again backward) under weight offload
        t["param_fetch_per_microbatch"] = copies * np.where(par_off, self.opt.param_bytes * P_fs, 0.0)
        t["total"] = t["params"] + t["grads"] + t["optimizer"] + t["activations"] + t["other"]
        t["offloaded_per_microbatch"] = t["offloaded"] / inflight
        led = g["ledger"]
        for k in ("params", "grads", "optimizer", "activations", "total"):
            led.add(f"memory/{k}", t[k])
        led.add("memory/temp", t["other"])  # transient buffers: gathered weights, CP buffers, the runtime's reserve
        led.add("host/memory", t["host"])
        return t

    def _xla_program(self) -> bool:
        """Whether the step is one XLA-compiled program (Options.xla_program; unset: on TPUs)."""
        return self.opt.xla_program if self.opt.xla_program is not None else self.p.chip.kind == "tpu"

    def _xla_saved_layer(self, L: LayoutArrays, g: dict, act_layer):
        """What one layer of XLA's scanned layer stack saves for its backward under no recompute and selective: the
        matmul outputs (gemm-last's set, `tm.activation_bytes_per_layer`; under none with the scores S, from which
        the backward rebuilds the softmax output P), not the norm outputs and the MLP's elementwise products
        Korthikanti et al. 2022 count, which XLA's backward fusions rebuild from the matmul outputs
        (`_xla_layer_backward` counts one layer's). MaxText's least-recomputing policy ("minimal": the projection and MLP outputs by name; before it
        JAX's `checkpoint_dots_with_no_batch_dims`) and the verify program's (measure/jaxmodel.py `remat_policy`,
        scanned) keep these; an unrolled program's fusions kept the same gate/up outputs (docs/verify.md "Memory").
        Not under pipelining, whose iterations the program runs unrolled (MaxText's SPMD loop, Options.pp_spmd_loop)."""
        gemm_last = self.activation_per_layer(L, g, np.full_like(L.recompute, 3))
        score = 0.0 if self.opt.flash_attention else tm.attention_score_bytes(
            self.p.model, self.p.seq_len, g["mb"], tp=g["tp"], cp=g["cp"], act_bytes=self.opt.act_bytes)
        scanned = g["pp"] == 1
        act_layer = np.where(scanned & (L.recompute == 0), gemm_last, act_layer)
        return np.where(scanned & (L.recompute == 1), gemm_last - score, act_layer)

    def _xla_layer_backward(self, L: LayoutArrays, g: dict, saved_layer):
        """Bytes one layer's backward holds beside every layer's saved activations and the gradients, in the program
        XLA compiles (`_xla_activations`' `working`; verify's buffer assignments put the step's peak there, docs/verify.md
        "Memory"). Korthikanti et al. 2022 count only what is saved; the backward of the layer also holds:
        - the values of the layer its policy did not save, rebuilt for it: the no-recompute set less the saved one
          kept in HBM (all of it under full recompute; what is offloaded comes back for the layer's backward, so
          counts here); where the saved set holds the scores S (none, gemm-last) also the softmax output P;
        - under sequence parallelism the layer's two inputs (attention's and the MLP's) re-gathered over `tensor`
          (XLA never saves a gathered value: GATHER_PRIMS in measure/jaxmodel.py) at the start of its backward and
          both live until their weight gradients at its end: [b, s, D] each where the saved shard is 1/tp of it;
          and each block's output gradient re-gathered likewise (the transpose of the forward's reduce-scatter),
          [b, s, D] read by the block's data- and weight-gradient dots: the MLP's from the start of the layer's
          backward to its end, the attention's through the attention backward (verify FSDP4×TP2, none and full: both
          live at dP/dS, the MLP's at the gate/up gradient, docs/verify.md "Memory");
        - the larger of two gradient peaks that come one after the other: with a materialised attention core,
          dP = dO·Vᵀ and dS = P∘(dP − rowsum(dO∘O)), two score-sized buffers (Dao et al. 2022, Appendix B,
          Algorithm 3: the standard attention backward writes P, dP and dS to HBM); the MLP's up-projection
          gradient (gate and up, 2F/tp wide), held with the rebuilt activation until the gate/up weight gradient
          (verify FSDP4×TP2 and its flash core: the peak is there, docs/verify.md "Memory")."""
        tp, t, a = g["tp"], g["t_mb"], self.opt.act_bytes
        none = self.activation_per_layer(L, g, np.zeros_like(L.recompute))
        score = 0.0 if self.opt.flash_attention else tm.attention_score_bytes(
            self.p.model, self.p.seq_len, g["mb"], tp=tp, cp=g["cp"], act_bytes=a)
        p_again = (L.recompute == 3) | ((L.recompute == 0) & (g["pp"] == 1))  # S saved (_xla_saved_layer)
        rebuilt = np.maximum(none - saved_layer * (1 - L.offload), 0.0) + np.where(p_again, score, 0.0)
        gathered = np.where(g["sp"], 2 * a * t * self.c["D"] * (1 - 1 / tp), 0.0)
        # under SP each block's output gradient re-gathered over `tensor` (the forward reduce-scatter's transpose), [b, s, D],
        # read by its data- and weight-gradient dots: the MLP's lives to the layer's end, the attention's from its start
        d_out = np.where(g["sp"], a * t * self.c["D"], 0.0)
        d_up = tm.mlp_up_out_bytes(self.p.model, self.p.seq_len, g["mb"], tp=tp, cp=g["cp"], act_bytes=a)
        return rebuilt + gathered + np.maximum(2 * score + 2 * d_out, d_up + d_out)

    def _xla_activations(self, g: dict, fs, grads_held, grads, logits, working):
        """Activation bytes beyond the saved (kept) ones in the program XLA compiles (TPU): the step's two peaks
        are never live together, so the larger counts. At the loss (the end of the forward, the start of the
        backward) the logits' buffer (XLA_LOSS_BYTES_PER_LOGIT) and, under FSDP, the gathered output layer the
        logits dot and its input gradient read (XLA gathers a weight before its dot: `gathered` below); the layer
        gradients do not exist yet (the backward's scan produces them), unless a gradient accumulator is carried
        over micro-batches, pipeline ticks or to the host (`grads_held`). In the layer backward: the gradients and
        the one layer being rematerialised (`working`, which is not offloaded: it is what the backward computes
        with). Expressed on top of the gradients the memory total already counts."""
        unembed = (self.pc.unembedding or self.pc.embedding) / g["tp"]
        loss_peak = logits + np.where(fs > 1, self.opt.fsdp_param_bytes * unembed, 0.0)
        not_yet = np.where(grads_held | (g["n_micro"] > 1), 0.0, grads)
        return np.maximum(loss_peak - not_yet, working)

    # --- host (CPU issue) ------------------------------------------------------------------------
    def host_launches_fwd(self, g: dict):
        """Launches the CPU issues for one layer's forward: the kernels of `layer_kernels_fwd` outside the captured
        CUDA-graph scopes (Options.cuda_graph_scopes), plus one graph launch per captured scope. `attn` captures the
        dense part of an MoE layer; of a dense layer `attn` and `mlp` each half of it; `moe` the whole MoE block
        (router, dispatch, experts); `full_iteration` everything (0 launches per layer)."""
        scopes = set(self.opt.cuda_graph_scopes)
        if "full_iteration" in scopes:
            return 0.0
        k, moe = self.layer_kernels_fwd(g), self.p.model.is_moe
        dense = ("attn" in scopes) if moe else (("attn" in scopes) + ("mlp" in scopes)) / 2
        whole_moe = "moe" in scopes
        captured = {"attn": dense, "moe": whole_moe, "moe_permute": whole_moe, "moe_quant": whole_moe,
                    "moe_router": whole_moe or "moe_router" in scopes,
                    "moe_preprocess": whole_moe or "moe_preprocess" in scopes}
        eager = sum(n * (1 - captured[part]) for part, n in k.items())
        graphs = sum(1 for name in scopes if name != "mlp" or not moe)  # one replay per captured scope
        return eager + graphs

    def host_syncs(self) -> bool:
        """Whether each MoE layer's forward stops the CPU until the GPU catches up: Megatron-Core's dropless
        all-to-all dispatcher needs the token counts on the host to size the all-to-all and the expert GEMMs
        (token_dispatcher.py MoEAlltoAllTokenDispatcher.preprocess, NVIDIA/Megatron-LM @0014f13: 'A synchronization
        is needed before expert parallel AlltoAll communication to get the input_splits and output_splits CPU
        values', `_maybe_dtoh_and_synchronize`); DeepEP's dispatch likewise (deepseek-ai/DeepEP README: 'we may not
        know how many tokens to receive for the current rank. So an implicit CPU wait for GPU received count signal
        will be involved'). A full-iteration CUDA graph runs sync-free (static shapes), so none there."""
        return self.p.model.is_moe and "full_iteration" not in self.opt.cuda_graph_scopes

    def host_bound_per_mb(self, L: LayoutArrays, g: dict, ct: Terms, per_mb):
        """One micro-batch's time when the CPU issues its kernels one by one (eager PyTorch): the GPU cannot run a
        kernel the CPU has not issued. With `launches` per layer forward (host_launches_fwd), the backward issuing
        twice as many (a GEMM's dgrad and wgrad; the pointwise backward mirrors the forward, as `compute_terms`
        counts it) and a recomputed forward its share again (the policy's pointwise share, RECOMPUTE_PARTS 'elem':
        launches are mostly the small kernels), each costing host_op_s (cost/data/host_overhead.yaml).
        GPU work is issued in order, so a phase whose CPU issue takes longer than its GPU time sets the pace: with
        the forward and backward as phases (GPU time split by their compute shares), the step is
        max(gpu_f + gpu_b, cpu_f + gpu_b, cpu_f + cpu_b) when the CPU may run ahead (the GPU starts its critical
        path at the start, at the backward, or waits for the last launch). A host sync in every forward layer
        (host_syncs) drains the CPU's lead, so the phases add: max(gpu_f, cpu_f) + max(gpu_b, cpu_b).
        Returns (per_mb, host seconds per micro-batch issue)."""
        h = host_constant("host_op_s", self.p.chip)
        launches = self.host_launches_fwd(g)
        nl = g["layers_stage"]
        rc = np.select([L.recompute == i for i in range(len(tm.RECOMPUTE_POLICIES))],
                       [self._recompute_parts(p).get("elem", 0.0) for p in tm.RECOMPUTE_POLICIES], 0.0)
        cpu_f = nl * launches * h
        # the backward issues twice the forward's launches (dgrad and wgrad), but its expert-input quantizes once each
        quant = 0.0 if {"moe", "full_iteration"} & set(self.opt.cuda_graph_scopes) else self.layer_kernels_fwd(g)["moe_quant"]
        cpu_b = nl * ((2 + rc) * launches - quant) * h
        work = np.maximum(ct["fwd"] + ct["bwd"], 1e-30)
        gpu_f = per_mb * ct["fwd"] / work
        gpu_b = per_mb - gpu_f
        if self.host_syncs():
            bound = np.maximum(gpu_f, cpu_f) + np.maximum(gpu_b, cpu_b)
        else:
            bound = np.maximum(np.maximum(per_mb, cpu_f + gpu_b), cpu_f + cpu_b)
        return bound, cpu_f + cpu_b

    def optimizer_terms(self, L: LayoutArrays, g: dict):
        """Seconds of the AdamW update over this rank's shard of the stage's parameters (HBM-bound), or under
        optimizer offload (ZeRO-Offload) the host's: gradients out, the CPU's Adam, the updated weights back."""
        # the parameters this rank updates are its ZeRO shard as the memory ledger holds it (`_zero_local`): a routed
        # expert's state is sharded only over its expert-data-parallel group (Megatron-Core distributed optimizer)
        local = self._zero_local(g, L.zero >= 1)
        nbytes = OPTIMIZER_UPDATE_BYTES[self.opt.optimizer_impl] * local
        off = L.offload_optimizer == 1
        led = g["ledger"]
        led.add("hbm", np.where(off, 0.0, nbytes))
        device_s = nbytes / self.hbm
        # ZeRO-Offload (Ren et al. 2021 §4.1, Fig. 2): each micro-batch's fp16 gradients of the rank's partition go
        # device→host during its backward (2 B per parameter; `grad_copy_mb_s`, hidden behind the backward where
        # the link allows, in evaluate), the CPU runs Adam once a step, and the updated fp16 partition comes back
        # host→device (2 B); each over the host link (host_bandwidth_bytes_per_s, one direction). The CPU Adam
        # streams the same bytes as the device's update (ADAM_UPDATE_BYTES) through host DRAM
        # (host_memory_bandwidth_bytes_per_s): the paper's CPU-Adam is a vectorised, memory-bound loop (§4.2).
        chip = self.p.chip
        grad_mb = np.where(off, self.opt.param_bytes * local, 0.0)  # fp16/bf16 gradients, as the paper copies them
        h2d = np.where(off, self.opt.param_bytes * local, 0.0)
        led.add("host/device_to_host", g["n_micro"] * grad_mb)
        led.add("host/host_to_device", h2d)
        g["grad_copy_mb_s"] = grad_mb / chip.host_bandwidth_bytes_per_s
        cpu_bw = chip.host_memory_bandwidth_bytes_per_s or np.inf  # not searched without the figure (space.py)
        host_s = h2d / chip.host_bandwidth_bytes_per_s + np.where(off, nbytes / cpu_bw, 0.0)
        return np.where(off, host_s, device_s)
