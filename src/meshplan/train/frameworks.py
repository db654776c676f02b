"""What each training framework does that changes the cost model, as `Options` overrides (`--framework`).

Each entry names the behaviour and where it is documented; an explicit flag on the command line wins over the
framework's value, and the framework's value over the `Options` default. A name alone is the framework's current
behaviour; `name@version` (VERSIONS) is an older release where its behaviour changed.
"""

from __future__ import annotations

import re
from dataclasses import fields, replace
from typing import Any

from meshplan.errors import MeshplanError, unknown_name_error
from meshplan.train.costmodel import Options

FRAMEWORKS: dict[str, dict[str, Any]] = {
    # Megatron-LM / Megatron-Core with Transformer Engine: fused kernels and vocab-parallel cross-entropy, FP8
    # weights cast once per step (TE `is_first_microbatch`), bucketed gradient reduction and parameter all-gather
    # overlapped with compute (--overlap-grad-reduce, --overlap-param-gather; Megatron-LM README); FP8 by delayed scaling
    # (megatron/training/arguments.py `--fp8-recipe`, default "delayed"); the interleaved schedule overlaps its
    # pipeline sends with the next chunk's compute (`--no-overlap-p2p-communication` turns that off, arguments.py);
    # Megatron-FSDP shards into views of its communication buffers, no copy in or out (Options.fsdp_copies), and under
    # pipelining gathers and reduce-scatters every micro-batch (Options.fsdp_pp_gathered_stage False), and its fused
    # SwiGLU saves only its input (Options.glu_saves_input; Megatron-LM arguments.py `--no-bias-swiglu-fusion` turns it
    # off); a YaRN RoPE runs unfused (Options.unfused_yarn_rope: rope_utils.py apply_rotary_pos_emb
    # falls back to `_apply_rotary_pos_emb_bshd` whenever mscale != 1)
    "megatron": dict(fused_elementwise=True, fused_loss=True, fp8_weight_cache=True, dp_overlap=True,
                     overlap_param_gather=True, pp_overlap=True, fsdp_copies=False, fsdp_pp_gathered_stage=False,
                     unfused_expert_bias=True, glu_saves_input=True, unfused_yarn_rope=True),
    # NeMo: Megatron-Core underneath, and its H100 performance recipes turn on Transformer Engine's TP
    # communication overlap (userbuffers; NeMo docs, "Communication overlap"); its FP8 recipes (Megatron-Bridge
    # 26.06 performance tables: "fp8 current scaling (tensorwise)" on H100, MXFP8 blocks on Blackwell) scale by the
    # current amax, Transformer Engine's Float8CurrentScaling. Its performance recipes reduce gradients in bf16
    # (Megatron-Bridge scripts/performance `_benchmark_common`/`set_llama3_common_configs`: grad_reduce_in_fp32 =
    # False, 2025-11 to 2026-07) and run Megatron-Core underneath: interleaved pipeline sends overlapped (Megatron-
    # Bridge training/comm_overlap.py sets overlap_p2p_comm whenever vpp > 1), Megatron-FSDP without copies, the fused
    # SwiGLU; its FP8 recipes keep the weights in FP8 (Options.fp8_params: training/mixed_precision.py
    # bf16_with_fp8_current_scaling_mixed and bf16_with_mxfp8_mixed set fp8_param_gather, v0.2.0 to v0.5.0); its MoE
    # recipes and performance presets run the experts whole on each rank, expert_tensor_parallel_size = 1
    # (Options.expert_tp; recipes/gpt_oss/gpt_oss.py, recipes/qwen/qwen3_moe.py, recipes/deepseek/deepseek_v3.py
    # v0.2.0 to v0.5.1; scripts/performance/configs/{deepseek,gpt_oss,qwen}/*_workload_base_configs.py v0.3.0 to
    # v0.5.1). The plain Megatron-LM preset keeps its default, ETP = TP (arguments.py). A YaRN RoPE (gpt-oss) runs
    # unfused as in Megatron-Core (Options.unfused_yarn_rope; Megatron-Bridge utils/fusions.py
    # validate_rope_fusion_compatibility also turns apply_rope_fusion off for position_embedding_type "yarn").
    "nemo": dict(fused_elementwise=True, fused_loss=True, fp8_weight_cache=True, dp_overlap=True,
                 overlap_param_gather=True, tp_overlap=True, fp8_recipe="tensorwise", grad_reduce_bytes=2.0,
                 pp_overlap=True, fsdp_copies=False, fsdp_pp_gathered_stage=False, unfused_expert_bias=True,
                 glu_saves_input=True, fp8_params=True, expert_tp=False, unfused_yarn_rope=True),
    # torchtitan: FSDP2 over the dp_shard×cp mesh, torch.compile on the transformer blocks only (the loss stays
    # eager: F.cross_entropy on fp32 logits), torchao float8 (dynamic scaling: an amax pass and a cast per operand,
    # weights cast on every forward; recipe "tensorwise" unless `--float8.recipe_name` says otherwise: torchao
    # Float8LinearRecipeName, TENSORWISE the default); AsyncTP is opt-in;
    # context parallelism through PyTorch's context_parallel with its "allgather" rotation (torchtitan
    # config_manager `context_parallel_rotate_method`, default "allgather"; the Llama model repeats K/V heads
    # before SDPA); attention by PyTorch SDPA, whose backend priority puts its bundled FlashAttention-2 first,
    # also on Hopper (pytorch/pytorch#142132); FSDP2 groups the token embedding alone and the final norm with the
    # output layer (torchtitan v0.2.0 models/llama3/infra/parallelize.py `apply_fsdp`, since #1094, 2025-07-28), so
    # only the embedding's gather and reduce-scatter have nothing to hide behind (Options.fsdp_edge_group); RoPE by
    # complex multiplication, which torch.compile leaves eager (Options.complex_rope; models/common/rope.py @v0.2.2
    # still view_as_complex); GQA by SDPA's enable_gqa, no K/V repeat (#2259, 2026-01-27, v0.2.2); fused AdamW
    # (config/job_config.py @v0.2.0 `optimizer.implementation` default "fused"); full AC compiled with the block, so
    # the recomputed forward is part of the compiled backward graph (Options.compiled_recompute); async TP leaves the
    # input-gradient reduce-scatters of the separate wq/wk/wv and w1/w3 unfused (Options.tp_overlap_dgrad_rs), and those
    # separate wq/wk/wv are three GEMMs (Options.separate_qkv); its selective AC is the per-op policy, which saves the
    # matmul and attention outputs and recomputes the rest (Options.selective_flavor "op": torchtitan @b5bcd76c
    # distributed/activation_checkpoint.py SelectiveAC "Per-op selective activation checkpointing", the llama3 configs'
    # SelectiveAC.Config(); selective_ac_option "op" in the shipped llama3_8b.toml before it), not Megatron's
    # recompute of the attention core; its MoE experts run whole on each rank with EP over dp_shard·cp·tp
    # (Options.expert_tp False: config/job_config.py `expert_tensor_parallel_degree: int = 1` since #1555, 2025-08-13;
    # ETP removed and experts always whole since #3167, 2026-04-30, parallel_dims.py @b5bcd76c), their GEMMs through
    # PyTorch's `torch._grouped_mm` (Options.grouped_mm_kernel "torch": models/moe/moe.py `_run_experts_grouped_mm`,
    # `use_grouped_mm` True by default, @1a36996b; models/common/moe.py `torch._grouped_mm`, @b5bcd76c)
    "torchtitan": dict(fused_elementwise=True, fused_loss=False, fp8_weight_cache=False, fp8_fused_casts=False,
                       fp8_recipe="tensorwise", fsdp_over_cp=True, dp_overlap=True, cp_impl="torch", attention_kernel="sdpa",
                       fsdp_edge_group="embedding", complex_rope=True, repeat_kv=False, optimizer_impl="fused",
                       compiled_recompute=True, tp_overlap_dgrad_rs=False, separate_qkv=True,
                       selective_flavor="op", expert_tp=False, grouped_mm_kernel="torch"),
    # MaxText (JAX/XLA): XLA fuses pointwise chains and the loss, decomposes TP collectives into collective
    # matmuls, and reduces the scanned layers' gradients across replicas after the backward; its pipeline is one
    # SPMD loop whose bubble iterations compute, with the embedding and output layer replicated on every stage
    # (layers/pipeline.py, layers/decoders.py; Options.pp_spmd_loop); its splash attention runs 512 × 512 blocks
    # forward and backward unless a config says otherwise (configs/base.yml sa_block_q, sa_block_kv, sa_block_q_dkv,
    # sa_block_kv_dkv: 512 at tpu-recipes-v0.1.2 and v0.1.4; Options.attention_block_fwd/_bwd, TPU only)
    # and its step is one XLA program on GPUs too (Options.xla_program: XLA's buffers, per-weight FSDP gathers)
    "maxtext": dict(fused_elementwise=True, fused_loss=True, tp_overlap=True, dp_overlap=False, remat_dce=True,
                    xla_program=True,
                    pp_spmd_loop=True, fold_all_reduces=True, attention_block_fwd=(512, 512),
                    attention_block_bwd=(512, 512)),
    # DeepSpeed wraps the user's own PyTorch model, typically a Hugging Face transformers one run eagerly: one kernel
    # per pointwise op, an eager loss on fp32 logits, attention through PyTorch SDPA (transformers' default
    # attn_implementation); `overlap_comm` (zero_optimization) buckets the gradient reduction behind the backward
    "deepspeed": dict(fused_elementwise=False, fused_loss=False, attention_kernel="sdpa", dp_overlap=True),
}
# The JAX reference program `meshplan verify` compiles (measure/jaxmodel.py): MaxText's XLA behaviour, with the
# program's own facts: fp32 weights, activations, gradients and collectives (its CPU twin; AdamW moments fp32 and
# no separate master copy), attention materialised (softmax over the full score matrix; the program's flash core,
# jaxmodel.blockwise_attention_core, is opt-in: `verify --attention flash`, docs/verify.md), context
# parallelism by all-gathered K/V (its ring form, `--cp-impl ring`, saves the K/V blocks it received for the
# backward: the autodiff of ppermute passes only dK/dV back), no runtime reserve on the CPU; its flash core is not
# splash attention (no splash block grid).
PROGRAM_FACTS: dict[str, Any] = dict(act_bytes=4.0, param_bytes=4.0, master_bytes=0.0, fsdp_param_bytes=4.0,
                                     grad_reduce_bytes=4.0, flash_attention=False, runtime_reserve=False,
                                     cp_impl="allgather", ring_saves_kv=True, attention_block_fwd=(0, 0),
                                     attention_block_bwd=(0, 0), expert_tp=True, fsdp_pp_gathered_stage=True)
# (the program shards its experts' F over `tensor`, measure/jaxmodel.py: ETP = TP whatever a framework preset says;
# under pipelining its FSDP stage stays gathered through the step, verify PP2xFSDP4, whatever a preset says)
FRAMEWORKS["jax"] = {**FRAMEWORKS["maxtext"], **PROGRAM_FACTS}

# Releases whose behaviour differs from the current preset (`--framework name@version`): each the changes on top of
# FRAMEWORKS[name], with its source; the newest listed version is the current behaviour (no changes).
VERSIONS: dict[str, dict[str, dict[str, Any]]] = {
    # NeMo 24.07's performance recipes ran Transformer Engine's DelayedScaling (amax history; the NeMo 24.07
    # performance summary lists FP8 "delayed"), the default Megatron-Core recipe then; NeMo 1.x's GPT config kept
    # blocking pipeline sends (examples/nlp/language_modeling/conf/megatron_gpt_config.yaml, July 2024:
    # overlap_p2p_comm False, batch_p2p_comm True) and nothing says its gradients were reduced in bf16 (the Options
    # default, fp32, stays); FP8 primary weights came later (NeMo 1.x's `fp8_params` defaulted to False); its
    # Megatron-Core had no separate expert TP size (expert_tensor_parallel_size arrived with MoE parallel folding,
    # Liu et al. 2025): experts split over TP
    "nemo": {"24.07": dict(fp8_recipe="delayed", pp_overlap=False, grad_reduce_bytes=4.0, fp8_params=False,
                           expert_tp=True),
             # NeMo 25.04 (NeMo 2.0; the long-sequence tables' 25.04.rc2 container, April 2025) predates cuDNN 9.10
             # (first in the NGC PyTorch 25.05 container, NVIDIA/cudnn-frontend@f937055 benchmark README): its fused
             # attention runs at cuDNN 9.10's rates at best (Options.attention_kernel "cudnn-9.10"); nothing else of
             # this release is known to differ from the current preset
             "25.04": dict(attention_kernel="cudnn-9.10"),
             "26.06": {}},
    # torchtitan's December 2024 performance runs (benchmarks/llama3_h100_202412_torchtitan.md, torchtitan @9dec370):
    # torchao float8 tensorwise, its only recipe then (rowwise came with pytorch/ao#1629, January 2025); June 2025
    # (v0.1.0, 2025-06-17; torchao 0.11): tensorwise by default, rowwise opt-in (`--float8.recipe_name rowwise`).
    # Both wrapped the embedding, final norm and output layer in the root FSDP2 module (parallelize_llama.py @9dec370,
    # models/llama3/infra/parallelize.py @v0.1.0: `fully_shard(model, ...)` over what the blocks leave), gathered
    # before the first block and reduce-scattered after the whole backward (Options.fsdp_edge_group "root");
    # v0.2.0 (2025-10-17) shards the token embedding and [norm, output] as groups of their own (#1094). Until v0.2.1
    # (2025-12-26) the Llama attention copied K and V to every query head (`repeat_kv`, models/llama3/model/model.py
    # @v0.2.0); v0.2.2 (2026-02-20) passes enable_gqa to SDPA instead (#2259): the current preset
    # torchtitan @9dec370 built AdamW with foreach=True unless `--optimizer.fused` (torchtitan/optimizer.py); fused
    # became the default with #881 (2025-02-24): Options.optimizer_impl. Expert parallelism arrived after v0.1.0
    # (#1324, 2025-07, EP carved from dp_shard·cp with the experts split over TP) and whole experts became the
    # default with #1555 (2025-08-13), before v0.2.0: Options.expert_tp True until then
    "torchtitan": {"2024.12": dict(fsdp_edge_group="root", repeat_kv=True, optimizer_impl="foreach", expert_tp=True),
                   "2025.06": dict(fsdp_edge_group="root", repeat_kv=True, expert_tp=True),
                   "2025.10": dict(repeat_kv=True), "2026.02": {}},
}


def preset(name: str) -> dict[str, Any]:
    """The option overrides of `name` or `name@version` (a MeshplanError naming the known ones otherwise)."""
    base, _, version = name.partition("@")
    if base not in FRAMEWORKS:
        raise unknown_name_error("framework", base, FRAMEWORKS)
    if "@" not in name:  # `megatron@` names no version: refused below, not read as the plain name
        return dict(FRAMEWORKS[base])
    known = VERSIONS.get(base, {})
    if version not in known:
        listed = ", ".join(known) if known else "none: use the plain name"
        raise MeshplanError(f"unknown version '{version}' of framework '{base}' (known versions: {listed})")
    return {**FRAMEWORKS[base], **known[version]}


def framework_options(name: str | None, base: Options, explicit: dict[str, Any]) -> Options:
    """`base` with the framework's behaviour applied, then every flag the user gave (`None` = not given)."""
    changes: dict[str, Any] = {}
    if name is not None:
        changes.update(preset(name))
    known = {f.name for f in fields(Options)}
    changes.update({k: v for k, v in explicit.items() if v is not None and k in known})
    return replace(base, **changes)


def _version_yyyymm(version: str) -> int:
    """A VERSIONS key as a date: 'YYYY.MM' (torchtitan) or NeMo's 'YY.MM'."""
    year, month = version.split(".")
    return (int(year) + (2000 if len(year) == 2 else 0)) * 100 + int(month)


def version_at(base: str, yyyymm: int | None) -> str:
    """`base@version` for a run dated `yyyymm`: the newest listed release not after that month (the oldest listed
    when the run predates them all); the plain name when the date is unknown or no versions are listed."""
    known = sorted(VERSIONS.get(base, {}), key=_version_yyyymm)
    if yyyymm is None or not known:
        return base
    before = [v for v in known if _version_yyyymm(v) <= yyyymm]
    return f"{base}@{before[-1] if before else known[0]}"


MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")


def date_of(text: str) -> int | None:
    """The latest month (yyyymm) a description names: '2024/12/26', '2025-06', 'Dec 2024', 'June 2025'; a bare year
    counts as its December (the newest behaviour a run of that year could have had); None when it names none."""
    text = text.lower()
    dates = [int(y) * 100 + int(m) for y, m in re.findall(r"(?<!\d)(20[12]\d)[-/.](0[1-9]|1[0-2])(?!\d)", text)]
    dates += [int(y) * 100 + MONTHS.index(m) + 1
              for m, y in re.findall(r"\b(" + "|".join(MONTHS) + r")[a-z]*\.?\s+(20[12]\d)\b", text)]
    if not dates:
        dates = [int(y) * 100 + 12 for y in re.findall(r"(?<!\d)(20[12]\d)(?!\d)", text)]
    return max(dates) if dates else None


# ---- reading a run's description: which behaviour its framework, kernels and notes name ------------------------
# (the importers read framework files; benchmarks/_measurements.py reads the published runs' free-text notes with
# these, so the knowledge has one home)

# TP communication overlap: torchtitan AsyncTP, Megatron/TE --tp-comm-overlap (userbuffers), XLA collective matmul
TP_OVERLAP_WORDS = ("asynctp", "async tp", "tp comm overlap", "tp_comm_overlap", "tp-comm-overlap", "userbuffer",
                    "collective matmul")
# MoE all-to-all overlap: DeepSeek-V3 DualPipe, Megatron-Core --overlap-moe-expert-parallel-comm
EP_OVERLAP_WORDS = ("dualpipe", "a2a overlap", "all-to-all overlap", "alltoall overlap", "ep overlap", "ep_overlap",
                    "overlap_moe", "moe overlap")
# Megatron-Core's benchmark routing (random logits, `--moe-router-force-load-balancing`); the Megatron-Bridge
# performance tables' footnote: "we force-balance the token distribution among experts"
FORCE_BALANCE_WORDS = ("force-balance", "force balance", "force_load_balancing", "force-load-balancing",
                       "forced load balancing")
# Megatron-Core's flex dispatcher backends (`--moe-flex-dispatcher-backend deepep|hybridep`), by name
DISPATCHER_WORDS = (("hybridep", ("hybridep", "hybrid-ep", "hybrid ep")), ("deepep", ("deepep",)))
PARAM_GATHER_WORDS = ("overlap-param-gather", "overlap_param_gather", "overlap param gather")
# Megatron-Core's expert tensor parallel size as launch flags and configs print it (Options.expert_tp: 1 = whole experts)
EXPERT_TP_PATTERN = r"expert[-_ ]tensor[-_ ]parallel[-_ ]size[\s:=]*(\d+)|\betp[\s:=]*(\d+)"
# Megatron's pipeline split that counts the embedding and the loss as layers (Options.pp_head_in_split)
HEAD_IN_SPLIT_WORDS = ("account_for_loss_in_pipeline_split", "account-for-loss-in-pipeline-split")
FA3_WORDS = ("fa3", "flashattention-3", "flash-attention-3", "flash attention 3", "cudnn")
SDPA_WORDS = ("sdpa", "scaled_dot_product")
# the flash-attn package's FlashAttention-2, which nanotron and MosaicML's llm-foundry call
FA2_WORDS = ("fa2", "flashattention-2", "flash-attention-2", "flash attention 2", "flashattention2",
             "flash_attention_2", "flash-attn", "flash_attn", "nanotron", "llm-foundry", "mosaicml")
# DeepSpeed ZeRO-3 fetched parameters by owner broadcast (ZeRO paper §7.2.2) until ZeRO-Infinity's
# bandwidth-centric partitioning (DeepSpeed v0.3.15, April 2021, arXiv:2104.07857 §6.1): all-gathers since
DEEPSPEED_ALLGATHER_SINCE_YYMM = 2105


# words that turn a feature's name into its absence when they stand right before it ("vanilla TP (no async TP)")
NEGATIONS = ("no ", "without ", "not ", "non-", "w/o ")


def names(text: str, words: tuple[str, ...]) -> bool:
    """Whether `text` names one of `words` other than as its negation ('no async tp', 'without userbuffers')."""
    for w in words:
        start = text.find(w)
        while start >= 0:
            if not text[:start].endswith(NEGATIONS):
                return True
            start = text.find(w, start + 1)
    return False


def options_from_notes(text: str) -> dict[str, Any]:
    """Behaviour a run's description names in words (lower-case text): TP and MoE overlap, ZeRO parameter-gather
    overlap, node-limited routing, force-balanced (benchmark) routing, the MoE dispatcher, the pipeline schedule
    and split, the expert tensor parallel size (`expert_tp`: False for 1, True for more). Only what the text says;
    None/False where it is silent."""
    limit = re.search(r"node[- ]limited[^0-9]{0,40}(\d+)|(\d+)\s*nodes? per token|\bm\s*=\s*(\d+)", text)
    node_limit = int(next(g for g in limit.groups() if g)) if limit else (4 if "node-limited" in text else 0)
    # DeepSeek-V3's DualPipe; zero-bubble ZB-H1, as DeepSeek-V2 used
    schedule = ("dualpipe" if "dualpipe" in text else
                "zb1p" if any(k in text for k in ("zero-bubble", "zero bubble", "zb-h1", "zbh1", "zb1p")) else "1f1b")
    etp = re.search(EXPERT_TP_PATTERN, text)
    return dict(tp_overlap=True if names(text, TP_OVERLAP_WORDS) else None,
                expert_tp=None if etp is None else int(next(g for g in etp.groups() if g)) > 1,
                ep_overlap=names(text, EP_OVERLAP_WORDS),
                overlap_param_gather=names(text, PARAM_GATHER_WORDS),
                pp_head_in_split=any(k in text for k in HEAD_IN_SPLIT_WORDS),
                moe_node_limit=node_limit, pp_schedule=schedule,
                moe_force_balance=any(k in text for k in FORCE_BALANCE_WORDS),
                moe_dispatcher=next((d for d, words in DISPATCHER_WORDS if any(w in text for w in words)), None))


def attention_kernel_of(text: str, default: str = "fused") -> str:
    """The attention kernel a description names: FA3 or cuDNN (the chip's best), PyTorch SDPA (whose bundled FA2
    it picks first, pytorch/pytorch#142132), the flash-attn package's FA2; else the framework's `default`
    (torchtitan: sdpa, FRAMEWORKS)."""
    if any(k in text for k in FA3_WORDS):
        return "fused"
    if default == "sdpa" or any(k in text for k in SDPA_WORDS):
        return "sdpa"
    if any(k in text for k in FA2_WORDS):
        return "fa2"
    return default


# FP8 scaling recipes as publications name them, most specific first (cost/data/fp8_recipes.yaml): TE DelayedScaling,
# torchao/torchtitan rowwise, DeepSeek-V3 blocks and MXFP8 (Megatron-Bridge "fp8 blockwise (MXFP8 ...)"), TE
# Float8CurrentScaling ("current scaling") and torchao tensorwise
FP8_RECIPE_WORDS = (("delayed", ("delayed",)), ("rowwise", ("rowwise", "row-wise", "axiswise")),
                    ("blockwise", ("blockwise", "block-wise", "mxfp8", "128x128", "1x128")),
                    ("tensorwise", ("tensorwise", "tensor-wise", "current scaling", "per-tensor")))


def fp8_recipe_of(text: str) -> str | None:
    """The FP8 scaling recipe a description names (lower-case text), or None when it names none (the framework's
    preset then decides)."""
    return next((recipe for recipe, words in FP8_RECIPE_WORDS if any(w in text for w in words)), None)


# FP8 on the routed experts alone (Options.fp8_scope "experts"): torchtitan's grouped-GEMM converters without a linear
# one, as run descriptions say it
FP8_EXPERTS_ONLY_WORDS = ("grouped gemms only", "grouped gemm only", "experts only", "grouped_mm only")


def fp8_scope_of(text: str) -> str | None:
    """Which GEMMs a description puts in FP8 (lower-case text): "experts" where it names the routed experts' grouped
    GEMMs alone, else None (every linear, the default)."""
    return "experts" if any(w in text for w in FP8_EXPERTS_ONLY_WORDS) else None


def zero3_fetch_of(deepspeed: bool, yymm: int | None) -> str:
    """How a ZeRO-3 run fetched its weights: owner broadcast for DeepSpeed before ZeRO-Infinity, else all-gather."""
    if deepspeed and yymm is not None and yymm < DEEPSPEED_ALLGATHER_SINCE_YYMM:
        return "broadcast"
    return "allgather"


def grad_reduce_bytes_of(deepspeed: bool, fp16: bool) -> float:
    """Bytes per gradient element the data-parallel reduction moves: DeepSpeed reduces in the model's dtype (its
    `communication_data_type` default) so an fp16 run moves 2; Megatron (main_grad) and torchtitan (FSDP2
    reduce_dtype) reduce in fp32."""
    return 2.0 if deepspeed and fp16 else 4.0


# Megatron-Core's `--recompute-modules` (megatron/core/transformer/transformer_config.py `recompute_modules`, default
# ["core_attn"]): what a selective recompute reruns. core_attn is meshplan's selective (Korthikanti et al. 2022); norms
# and activations alone ("layernorm", "moe_act"; the MoE model zoo prints them "norm, act") rerun only pointwise ops and
# keep every GEMM output, meshplan's gemm-last. mla_up_proj alone (multi_latent_attention.py: the query and key-value
# up-projections and their RoPE under CheckpointWithoutOutput) is meshplan's mla-up-proj. The others (mlp, moe,
# shared_experts, or mla_up_proj with other modules) rerun GEMMs that no meshplan policy names.
MEGATRON_POINTWISE_MODULES = ("layernorm", "norm", "moe_act", "act")


def megatron_selective_policy(modules: list[str] | None) -> str | None:
    """meshplan's --recompute for Megatron-Core's selective recompute over `modules` (None = its default, core_attn;
    [] = nothing recomputed); None where no meshplan policy matches."""
    if modules is None or list(modules) == ["core_attn"]:
        return "selective"
    if not modules:
        return "none"
    if list(modules) == ["mla_up_proj"]:
        return "mla-up-proj"
    return "gemm-last" if all(m in MEGATRON_POINTWISE_MODULES for m in modules) else None


def torchtitan_selective_flavor(recompute_text: str) -> str:
    """torchtitan's selective AC as printed: '(op)' = the per-op policy, '(layer)' = every n-th layer
    (selective_ac_option 'op' or an integer; job_config.py)."""
    return "op" if "(op)" in recompute_text else "layer" if "(layer)" in recompute_text else "attention"


# MaxText's `weight_dtype` (configs/base.yml) as descriptions print it: the dtype the weights are stored in
WEIGHT_DTYPE_BYTES = {"bfloat16": 2.0, "bf16": 2.0, "float32": 4.0, "fp32": 4.0}


def weight_dtype_bytes_of(text: str) -> float:
    """Bytes per stored weight a description names ('weight_dtype bfloat16', 'weight dtype fp32'), for
    Options.weight_dtype_bytes; 0.0 when it names none (mixed precision with an fp32 master copy)."""
    m = re.search(r"weight[_ ]dtype[\s:=]*(bfloat16|bf16|float32|fp32)", text)
    return WEIGHT_DTYPE_BYTES[m.group(1)] if m else 0.0
