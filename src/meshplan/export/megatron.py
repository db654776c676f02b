"""Megatron-LM / Megatron-Core: the `torchrun ... pretrain_gpt.py` argument list. Flag names and choices:
megatron/training/arguments.py at NVIDIA/Megatron-LM tag core_v0.15.0 (data/megatron_keys.txt lists every flag).
The torchrun prefix carries the world size, which Megatron's own arguments do not state.
"""

from __future__ import annotations

from meshplan.errors import MeshplanError
from meshplan.export.common import (
    NO_STATE_OFFLOAD,
    Job,
    PlanToExport,
    argv_lines,
    check_degrees,
    commented,
    divide,
    expert_tp_of,
    expert_tp_size,
    fp8_recipe_from_name,
    fp8_recipe_name,
    framework_keys,
    header_lines,
    refuse,
    selective_recompute_of,
    split_command,
)
from meshplan.train.space import Pins

NAME = "megatron"
PINS = {"offload": 0.0, "offload_params": 0, "offload_optimizer": 0}  # what pretrain_gpt.py cannot do (REASONS; the file states no model-state offload)
# the values of a free degree a file can say (REASONS: no gemm-last flag; the distributed optimizer is ZeRO-1)
CHOICES = {"recompute_choices": ("none", "selective", "full", "mla-up-proj"), "zero_choices": (0, 1),
           "fsdp_replicas": False}
CHIP_KINDS = ("gpu",)  # PyTorch on NVIDIA GPUs
SUFFIX = ".sh"
# behaviour pretrain_gpt.py switches on: (Options changes, the flags to add); `--from` predicts each
SWITCHES = {
    "tp_overlap": ({"tp_overlap": True}, "--tp-comm-overlap"),
    "dp_overlap": ({"dp_overlap": True}, "--overlap-grad-reduce"),
    "param_gather": ({"overlap_param_gather": True}, "--overlap-param-gather (with --use-distributed-optimizer)"),
}
REASONS = {
    "zero": "the distributed optimizer shards the optimizer state (ZeRO-1); ZeRO-2 has no flag",
    "offload": "pretrain_gpt.py has no activation-offload flag",
    "recompute": "--recompute-granularity is full or selective (--recompute-modules core_attn or mla_up_proj); "
                 "gemm-last has no flag",
    "selective_flavor": "selective recompute is the attention core (--recompute-modules core_attn)",
    "cp_impl": "Megatron-Core runs ring attention (Transformer Engine)",
    "attention_kernel": "--attention-backend auto picks Transformer Engine's fused kernel",
    "pp_schedule": "Megatron runs (interleaved) 1F1B",
    "fused_elementwise": "Megatron's fused kernels are on by default",
    "fused_loss": "Megatron computes a vocab-parallel fused cross-entropy",
    "fp8_weight_cache": "Transformer Engine caches FP8 weights per step",
    "fp8_fused_casts": "Transformer Engine fuses the FP8 casts",
    "moe_node_limit": "not expressed here",
    "moe_dispatcher": "HybridEP (--moe-flex-dispatcher-backend) came after core_v0.15.0, the Megatron-LM these files target",
    "dp": "Megatron FSDP (--use-megatron-fsdp) shards over every data-parallel rank",
}
LAUNCH = ("torchrun", "--nnodes", "--nproc-per-node", "--nproc_per_node")


def export(plan: PlanToExport) -> str:
    c, o, p = plan.config, plan.options, plan.problem
    if c.recompute == "gemm-last":
        raise refuse(NAME, "recompute", c.recompute, REASONS)
    m = p.model
    gpus = min(p.chip.links.chips_per_host, p.chips)  # processes per node: the GPUs of one host (an NVL72 tray: 4)
    nodes = divide(NAME, "chips", p.chips, gpus)
    args = [
        "--tensor-model-parallel-size", c.tp, "--pipeline-model-parallel-size", c.pp,
        "--context-parallel-size", c.cp, "--expert-model-parallel-size", c.ep,
        "--micro-batch-size", c.microbatch, "--global-batch-size", p.global_batch,
        "--seq-length", p.seq_len, "--max-position-embeddings", max(p.seq_len, m.max_seq_len),
        "--num-layers", m.n_layers, "--hidden-size", m.d_model, "--ffn-hidden-size", m.d_ff,
        "--num-attention-heads", m.n_heads, "--kv-channels", m.head_dim,
    ]
    flags: list = ["--bf16"]
    if m.n_kv_heads != m.n_heads:
        args += ["--group-query-attention", "--num-query-groups", m.n_kv_heads]
    if m.gated:
        flags.append("--swiglu")
    if m.norm == "rmsnorm":
        args += ["--normalization", "RMSNorm"]
    if m.position == "rotary":
        args += ["--position-embedding-type", "rope"]
    if not m.tied_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    if not m.linear_bias:
        flags.append("--disable-bias-linear")
    if m.is_moe:
        args += ["--num-experts", m.n_experts, "--moe-router-topk", m.experts_per_token]
        # Options.expert_tp: whole experts (1) or split over TP (Megatron-LM's default, written out for clarity)
        args += ["--expert-tensor-parallel-size", expert_tp_size(o, c)]
    if c.pp > 1 and c.vpp > 1:
        args += ["--num-virtual-stages-per-pipeline-rank", c.vpp]
    if c.tp > 1 and c.sequence_parallel:
        flags.append("--sequence-parallel")
    if c.fsdp > 1:
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
    elif c.zero >= 1:
        flags.append("--use-distributed-optimizer")
    if c.recompute == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", 1]
        # Options.distribute_saved_activations: arguments.py allows it with TP > 1 and full recompute only, and
        # Megatron-Core's TransformerConfig refuses it with --sequence-parallel (the saved input is split there already)
        if o.distribute_saved_activations and c.tp > 1 and not c.sequence_parallel:
            flags.append("--distribute-saved-activations")
    elif c.recompute == "selective":
        args += ["--recompute-granularity", "selective"]
    elif c.recompute == "mla-up-proj":  # transformer_config.py recompute_modules: "mla_up_proj"
        args += ["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"]
    if o.compute_dtype == "fp8":  # Transformer Engine: casts fused, weights cached per step
        args += ["--fp8-format", "hybrid", "--fp8-recipe", fp8_recipe_name("te", o, p.chip.name)]
    tp_ov, dp_ov = o.overlaps(p.chip.kind)
    if tp_ov and c.tp > 1:
        flags.append("--tp-comm-overlap")
    if dp_ov:
        flags.append("--overlap-grad-reduce")
    if o.overlap_param_gather:
        flags.append("--overlap-param-gather")
    if o.ep_overlap and m.is_moe:
        flags.append("--overlap-moe-expert-parallel-comm")
    if o.pp_head_in_split and c.pp > 1:  # Options.pp_head_in_split
        flags += ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    if o.moe_force_balance and m.is_moe:
        flags.append("--moe-router-force-load-balancing")
    if o.moe_dispatcher == "deepep" and m.is_moe:  # core_v0.15.0: the flex dispatcher runs DeepEP
        args += ["--moe-token-dispatcher-type", "flex"]
        flags.append("--moe-enable-deepep")
    launch = ["torchrun", "--nnodes", nodes, "--nproc-per-node", gpus, "pretrain_gpt.py"]
    return commented(header_lines(plan, NAME)) + argv_lines(launch + args + flags, lead=6)


_VALUED = {"--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
           "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--micro-batch-size", "--global-batch-size", "--seq-length",
           "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups",
           "--kv-channels", "--num-experts", "--moe-router-topk", "--num-virtual-stages-per-pipeline-rank",
           "--num-layers-per-virtual-pipeline-stage", "--recompute-granularity", "--recompute-method",
           "--recompute-num-layers", "--recompute-modules", "--fp8-format", "--fp8-recipe", "--data-parallel-sharding-strategy",
           "--moe-token-dispatcher-type",
           # the architecture comes from --model; these describe it
           "--normalization", "--position-embedding-type", "--max-position-embeddings"}
_SWITCHES = {"--sequence-parallel", "--use-distributed-optimizer", "--use-megatron-fsdp", "--tp-comm-overlap",
             "--overlap-grad-reduce", "--overlap-param-gather", "--overlap-moe-expert-parallel-comm", "--bf16",
             "--moe-router-force-load-balancing", "--moe-enable-deepep",
             "--group-query-attention", "--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
             "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
             "--distribute-saved-activations"}


def load(text: str, chips: int | None = None) -> Job:
    toks = split_command(text, "Megatron")
    job = Job(NAME, Pins())
    values: dict[str, str] = {}
    switches: set[str] = set()
    launch: dict[str, str] = {}
    known = framework_keys(NAME)
    i, in_launcher = 0, False
    while i < len(toks):
        t = toks[i]
        if t == "torchrun" or t.endswith("python") or t.endswith("python3"):
            in_launcher = t == "torchrun"
        elif t.endswith(".py"):
            in_launcher = False
        elif t.startswith("--"):
            key, eq, val = t.partition("=")
            has_val = bool(eq) or (i + 1 < len(toks) and not toks[i + 1].startswith("--"))
            if not eq and has_val:
                val, i = toks[i + 1], i + 1
            if in_launcher:
                launch[key.replace("_", "-")] = val
            elif key in _VALUED or (has_val and key not in _SWITCHES):
                values[key] = val
            else:
                switches.add(key)
            if not in_launcher and key not in _VALUED | _SWITCHES:
                (job.unmodelled_keys if key in known else job.unknown_keys).append(key)
        i += 1

    def num(flag: str, default: int | None = None) -> int | None:
        if flag not in values:
            return default
        try:
            return int(values[flag])
        except ValueError:
            raise MeshplanError(f"megatron file: {flag} must be an integer, got '{values[flag]}'") from None

    tp, pp = num("--tensor-model-parallel-size", 1), num("--pipeline-model-parallel-size", 1)
    cp, ep = num("--context-parallel-size", 1), num("--expert-model-parallel-size", 1)
    check_degrees(NAME, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                  expert_model_parallel_size=ep)
    expert_tp = expert_tp_of(NAME, "--expert-tensor-parallel-size", num("--expert-tensor-parallel-size"), tp)
    if "--nnodes" in launch and "--nproc-per-node" in launch:
        job.chips = int(launch["--nnodes"]) * int(launch["--nproc-per-node"])
    else:
        job.chips = chips
    if job.chips is None:
        raise MeshplanError("the Megatron arguments do not state the world size (no torchrun --nnodes/"
                            "--nproc-per-node): give --chips")
    data = divide(NAME, "world size", job.chips, tp * pp * cp)
    fsdp = "--use-megatron-fsdp" in values or "--use-megatron-fsdp" in switches
    strategy = values.get("--data-parallel-sharding-strategy", "no_shard")
    zero3 = fsdp and strategy == "optim_grads_params"
    vpp = num("--num-virtual-stages-per-pipeline-rank")
    layers = num("--num-layers")
    if vpp is None and num("--num-layers-per-virtual-pipeline-stage"):
        job.layers_per_stage = num("--num-layers-per-virtual-pipeline-stage")
    gran = values.get("--recompute-granularity")
    recompute = {None: "none", "full": "full", "selective": "selective"}.get(gran)
    if recompute is None:
        raise MeshplanError(f"megatron file: --recompute-granularity must be full or selective, got '{gran}'")
    modules = values.get("--recompute-modules")
    if recompute == "selective" and modules is not None:
        recompute = selective_recompute_of(NAME, "--recompute-modules", [modules])
    job.pins = Pins(dp=1 if zero3 else data, fsdp=data if zero3 else 1, tp=tp, pp=pp, vpp=vpp or (None if
                    job.layers_per_stage else 1), cp=cp, ep=ep, microbatch=num("--micro-batch-size", 1),
                    recompute=recompute, zero=1 if "--use-distributed-optimizer" in switches and not zero3 else 0,
                    offload=0.0, **NO_STATE_OFFLOAD,
                    sequence_parallel="--sequence-parallel" in switches)
    job.seq_len, job.global_batch = num("--seq-length"), num("--global-batch-size")
    if job.global_batch is None:  # Megatron's default: one micro-batch per data-parallel rank
        job.global_batch = job.pins.microbatch * data
    job.options.update(
        compute_dtype="fp8" if "--fp8-format" in values else "bf16",
        fp8_recipe=fp8_recipe_from_name("te", values.get("--fp8-recipe", "delayed")),
        tp_overlap="--tp-comm-overlap" in switches, dp_overlap="--overlap-grad-reduce" in switches,
        overlap_param_gather="--overlap-param-gather" in switches,
        ep_overlap="--overlap-moe-expert-parallel-comm" in switches, pp_schedule="1f1b",
        pp_head_in_split="--account-for-loss-in-pipeline-split" in switches,
        distribute_saved_activations="--distribute-saved-activations" in switches,
        moe_force_balance="--moe-router-force-load-balancing" in switches, expert_tp=expert_tp,
        moe_dispatcher=("deepep" if values.get("--moe-token-dispatcher-type") == "flex"
                        and "--moe-enable-deepep" in switches else "alltoall"),
    )
    dims = {"n_layers": layers, "d_model": num("--hidden-size"), "n_heads": num("--num-attention-heads"),
            "d_ff": num("--ffn-hidden-size"), "head_dim": num("--kv-channels"), "n_experts": num("--num-experts"),
            "experts_per_token": num("--moe-router-topk")}
    if "--group-query-attention" in switches:
        dims["n_kv_heads"] = num("--num-query-groups")
    job.model_dims = {k: v for k, v in dims.items() if v}
    return job
