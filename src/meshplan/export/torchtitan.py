"""torchtitan job TOML (the `--job.config_file` format torchtitan read until its February 2026 move to Python config
registries). Key names: torchtitan/config/job_config.py at pytorch/torchtitan@e347b1e5e6b6941d789d16d340145294d82dc71e
(the last commit with TOML job configs; data/torchtitan_keys.txt lists every key of that file).
"""

from __future__ import annotations

import tomllib
from typing import Any

from meshplan.errors import MeshplanError
from meshplan.export.common import (
    NO_STATE_OFFLOAD,
    Job,
    PlanToExport,
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
    reversed_map,
    whole,
)
from meshplan.train.space import Pins

NAME = "torchtitan"
PINS = {"zero": 0, "offload": 0.0, "offload_params": 0, "offload_optimizer": 0}  # what a torchtitan job cannot do (REASONS)
CHIP_KINDS = ("gpu",)  # PyTorch on NVIDIA GPUs
SUFFIX = ".toml"
# behaviour a torchtitan file switches on: (Options changes, the keys to set); `--from` predicts each
SWITCHES = {
    "compile": ({"fused_elementwise": True, "fused_loss": True},
                '[compile] enable = true, components = ["model", "loss"]'),
    "async_tp": ({"fused_elementwise": True, "tp_overlap": True},
                 "[compile] enable = true and [parallelism] enable_async_tensor_parallel = true"),
}
# torchtitan model flavours (torchtitan/models/llama3/__init__.py `llama3_configs`) <-> meshplan presets
FLAVORS = {("llama3", "8B"): "llama3-8b", ("llama3", "70B"): "llama3-70b", ("llama3", "405B"): "llama3-405b"}
# meshplan schedule -> torch.distributed.pipelining schedule name (torch/distributed/pipelining/schedules.py)
SCHEDULES = {"1f1b": "1F1B", "interleaved": "Interleaved1F1B", "zb1p": "InterleavedZeroBubble",
             "dualpipe": "DualPipeV", "gpipe": "GPipe", "looped_bfs": "LoopedBFS"}
# schedules with virtual stages (pipeline_parallel_layers_per_stage sets their count) -> meshplan's schedule
MULTI_STAGE = {"interleaved": "1f1b", "looped_bfs": "gpipe"}
RECOMPUTE = {"none": "none", "selective": "selective", "full": "full"}
# selective_ac_option: "op" = the per-op policy, an integer n = every n-th layer fully recomputed; meshplan's
# "layer" flavour is torchtitan's default of every second layer
SELECTIVE = {"op": "op", "layer": "2"}
CHOICES = {"recompute_choices": ("none", "selective", "full")}  # activation_checkpoint.mode (REASONS)
REASONS = {
    "zero": "torchtitan shards with FSDP2 (ZeRO-3, data_parallel_shard_degree) only",
    "offload": "torchtitan has no activation offload",
    "recompute": "activation_checkpoint.mode is none, selective or full",
    "selective_flavor": "torchtitan's selective AC is per-op ('op') or every n-th layer, not the attention core",
    "fp8_weight_cache": "torchao float8 casts the weights on every forward",
    "fp8_fused_casts": "torchao float8 scales dynamically: an amax pass and a cast per operand",
    "cp_impl": "torchtitan runs PyTorch's context_parallel",
    "attention_kernel": "torchtitan attends through PyTorch SDPA",
    "dp_overlap": "FSDP2 always reduces behind the backward",
    "tp_overlap": "async TP needs torch.compile (compile.enable)",
    "moe_node_limit": "torchtitan's router has no node limit",
    "sequence_parallel": "torchtitan's TP always shards the norms' sequence (SequenceParallel)",
    "fp8_moe_layout": "its float8 MoE converter (Float8GroupedMMConverter) asserts pipeline_parallel_degree == 1 and "
                      "context_parallel_degree == 1",
    "fp8_scope": "its float8 grouped GEMMs scale rowwise (Float8GroupedMMConverter: dynamic float8 rowwise "
                 "quantization): plan the experts-only scope with --fp8-recipe rowwise",
}
# FP8 converters (torchtitan/components/quantization/float8.py @e347b1e, register_model_converter): every linear but
# `filter_fqns`, and the MoE experts' grouped GEMMs (`quantize.grouped_mm.float8.fqns`, rowwise scaling)
LINEAR_FP8, GROUPED_FP8 = "quantize.linear.float8", "quantize.grouped_mm.float8"


def export(plan: PlanToExport) -> str:
    c, o, p = plan.config, plan.options, plan.problem
    if c.recompute not in RECOMPUTE:
        raise refuse(NAME, "recompute", c.recompute, REASONS)
    data = c.dp * c.fsdp
    pp = c.pp > 1
    local = p.global_batch // data
    multi = {v: k for k, v in MULTI_STAGE.items()}
    sched = SCHEDULES[multi[o.pp_schedule] if c.vpp > 1 and o.pp_schedule in multi else o.pp_schedule]
    components = ["model"] + (["loss"] if o.fused_loss else [])
    model: dict[str, Any] = {}
    flavor = next((k for k, v in FLAVORS.items() if v == plan.model_arg), None)
    if flavor:
        model.update(name=flavor[0], flavor=flavor[1])
    moe_fp8 = o.compute_dtype == "fp8" and p.model.is_moe
    if moe_fp8 and (c.pp > 1 or c.cp > 1):
        raise refuse(NAME, "fp8_moe_layout", f"pp {c.pp}, cp {c.cp}", REASONS)
    if moe_fp8 and not o.fp8_dense and o.fp8_scaling != "rowwise":
        raise refuse(NAME, "fp8_scope", f"experts with {o.fp8_scaling} scaling", REASONS)
    if o.compute_dtype == "fp8":
        # the routed experts run FP8 under either scope (Options.fp8_scope), the linears only under "all"
        model["converters"] = [LINEAR_FP8] * o.fp8_dense + [GROUPED_FP8] * p.model.is_moe
    sections: dict[str, dict[str, Any]] = {
        "job": {"description": f"meshplan plan: {c.describe()}"},
        "model": model,
        "training": {
            # with pipelining the local batch is split into micro-batches of pipeline_parallel_microbatch_size;
            # without it, gradient accumulation runs global / (local x data-parallel) micro-steps
            "local_batch_size": local if pp else c.microbatch,
            "global_batch_size": p.global_batch,
            "seq_len": p.seq_len,
            "mixed_precision_param": "bfloat16",
        },
        "parallelism": {
            "data_parallel_replicate_degree": c.dp,
            "data_parallel_shard_degree": c.fsdp,
            "tensor_parallel_degree": c.tp,
            "enable_async_tensor_parallel": bool(o.tp_overlap and c.tp > 1),
            "pipeline_parallel_degree": c.pp,
            "context_parallel_degree": c.cp,
            "context_parallel_rotate_method": "allgather",
            "expert_parallel_degree": c.ep,
        },
        "activation_checkpoint": {"mode": RECOMPUTE.get(c.recompute, c.recompute)},
        "compile": {"enable": o.fused_elementwise, "components": components},
    }
    if p.model.is_moe and c.ep > 1:
        # whole experts (1, torchtitan's default since #1555) or split over the TP ranks (tp): the plan's own
        sections["parallelism"]["expert_tensor_parallel_degree"] = expert_tp_size(o, c)
    if pp:
        sections["parallelism"].update(pipeline_parallel_schedule=sched, pipeline_parallel_microbatch_size=c.microbatch)
        if c.vpp > 1:
            sections["parallelism"]["pipeline_parallel_layers_per_stage"] = -(-p.model.n_layers // (c.pp * c.vpp))
        if o.pp_schedule == "dualpipe" and p.model.is_moe:
            sections["parallelism"]["pipeline_parallel_expert_parallel_overlap"] = o.ep_overlap
    if c.recompute == "selective":
        sections["activation_checkpoint"]["selective_ac_option"] = SELECTIVE.get(o.selective_flavor, "attention")
    if o.fp8_dense:
        sections[LINEAR_FP8] = {"recipe_name": fp8_recipe_name("torchtitan", o, p.chip.name), "filter_fqns": ["output"]}
    if moe_fp8:
        sections[GROUPED_FP8] = {"fqns": ["experts"]}
    return commented(header_lines(plan, NAME)) + "\n" + dumps(sections)


def dumps(sections: dict[str, dict[str, Any]]) -> str:
    """A TOML document of flat sections (the stdlib reads TOML but does not write it)."""
    out = []
    for name, body in sections.items():
        if not body:
            continue
        out.append(f"[{name}]")
        out += [f"{k} = {_value(v)}" for k, v in body.items()]
        out.append("")
    return "\n".join(out) + "\n"


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


# keys this importer reads (the rest of torchtitan's keys do not change a step's time or memory)
USED = {
    "model.name", "model.flavor", "model.converters", "training.local_batch_size", "training.global_batch_size",
    "training.seq_len", "training.mixed_precision_param", "training.enable_cpu_offload",
    "parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree",
    "parallelism.tensor_parallel_degree", "parallelism.enable_async_tensor_parallel",
    "parallelism.pipeline_parallel_degree", "parallelism.pipeline_parallel_schedule",
    "parallelism.pipeline_parallel_microbatch_size", "parallelism.pipeline_parallel_layers_per_stage",
    "parallelism.pipeline_parallel_expert_parallel_overlap", "parallelism.context_parallel_degree",
    "parallelism.context_parallel_rotate_method", "parallelism.expert_parallel_degree",
    "activation_checkpoint.mode", "activation_checkpoint.selective_ac_option", "compile.enable", "compile.components",
    "quantize.linear.float8.recipe_name", "quantize.linear.float8.filter_fqns",
}


# keys that change a step but that meshplan times at torchtitan's default: a file that sets them gets a note
TIMED_AT_DEFAULT = {
    "training.enable_cpu_offload": (False, "FSDP2 CPU offload of parameters, gradients and optimizer state"),
    "training.mixed_precision_param": ("bfloat16", "the dtype FSDP2 gathers and computes parameters in"),
    "parallelism.fsdp_reshard_after_forward": ("default", "whether FSDP2 frees gathered parameters after forward"),
    "quantize.linear.float8.enable_fsdp_float8_all_gather": (False, "FSDP all-gathers in float8"),
}


def load(text: str, chips: int | None = None) -> Job:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise MeshplanError(f"not a TOML file: {exc}") from None
    flat = _flatten(doc)
    known = framework_keys(NAME)
    job = Job(NAME, Pins())
    job.unknown_keys = sorted(k for k in flat if k not in known)
    job.unmodelled_keys = sorted(k for k in flat if k in known and k not in USED)
    for key, (default, what) in TIMED_AT_DEFAULT.items():
        if key in flat and flat[key] != default:
            job.notes.append(f"{key} = {flat[key]!r} ({what}) is not modelled: timed as {default!r}")
    # defaults are torchtitan's own (job_config.py) where a key is absent
    par, tr = doc.get("parallelism", {}), doc.get("training", {})
    dp = par.get("data_parallel_replicate_degree", 1)
    tp, pp, cp = par.get("tensor_parallel_degree", 1), par.get("pipeline_parallel_degree", 1), \
        par.get("context_parallel_degree", 1)
    ep = par.get("expert_parallel_degree", 1)
    check_degrees(NAME, data_parallel_replicate_degree=dp, tensor_parallel_degree=tp, pipeline_parallel_degree=pp,
                  context_parallel_degree=cp, expert_parallel_degree=ep)
    fsdp = whole(NAME, "parallelism.data_parallel_shard_degree", par.get("data_parallel_shard_degree", -1), minimum=-1)
    if fsdp == -1:  # -1: every rank left over (torchtitan ParallelDims)
        if chips is None:
            raise MeshplanError("the torchtitan file has data_parallel_shard_degree = -1 (all ranks left over): "
                                "give --chips")
        fsdp = divide(NAME, "--chips", chips, dp * tp * pp * cp)
        job.notes.append(f"data_parallel_shard_degree -1 -> {fsdp} (--chips {chips})")
    check_degrees(NAME, data_parallel_shard_degree=fsdp)
    job.chips = dp * fsdp * tp * pp * cp
    job.seq_len = whole(NAME, "training.seq_len", tr.get("seq_len", 2048))
    local = whole(NAME, "training.local_batch_size", tr.get("local_batch_size", 8))
    gb = whole(NAME, "training.global_batch_size", tr.get("global_batch_size", -1), minimum=-1)
    job.global_batch = gb if gb and gb > 0 else local * dp * fsdp
    if pp > 1:
        mb = whole(NAME, "parallelism.pipeline_parallel_microbatch_size",
                   par.get("pipeline_parallel_microbatch_size", 1))
        sched = par.get("pipeline_parallel_schedule", "1F1B")
        back = reversed_map(SCHEDULES)
        if sched not in back:
            raise MeshplanError(f"torchtitan pipeline_parallel_schedule '{sched}' is not one meshplan models "
                                f"(known: {', '.join(SCHEDULES.values())})")
        schedule = MULTI_STAGE.get(back[sched], back[sched])
        vpp = 1
        if back[sched] in MULTI_STAGE:  # virtual stages from the layers per stage once the model is known
            vpp, job.layers_per_stage = None, par.get("pipeline_parallel_layers_per_stage")
            if job.layers_per_stage is None:
                vpp = 2
                job.notes.append(f"{sched} without pipeline_parallel_layers_per_stage: 2 stages per rank")
        job.options["pp_schedule"] = schedule
        if schedule == "dualpipe":
            job.options["ep_overlap"] = bool(par.get("pipeline_parallel_expert_parallel_overlap", True))
    else:
        mb, vpp = local, 1
    ac = doc.get("activation_checkpoint", {})
    mode = ac.get("mode", "selective")
    if mode not in RECOMPUTE.values():
        raise MeshplanError(f"torchtitan activation_checkpoint.mode '{mode}' is not one meshplan models "
                            f"({', '.join(RECOMPUTE.values())}): give --recompute")
    if mode == "selective":
        opt = str(ac.get("selective_ac_option", "2"))
        job.options["selective_flavor"] = "op" if opt == "op" else "layer"
        if opt not in ("op", "2"):
            job.notes.append(f"selective_ac_option {opt} is timed as every second layer (meshplan's 'layer')")
    comp = doc.get("compile", {})
    compiled = bool(comp.get("enable", False))
    converters = doc.get("model", {}).get("converters", [])
    job.options.update(
        fused_elementwise=compiled, fused_loss=compiled and "loss" in comp.get("components", ["model", "loss"]),
        tp_overlap=bool(par.get("enable_async_tensor_parallel", False)),
        compute_dtype="fp8" if any(c in ("float8", LINEAR_FP8, GROUPED_FP8) for c in converters) else "bf16",
        fp8_recipe=fp8_recipe_from_name("torchtitan", doc.get("quantize", {}).get("linear", {}).get("float8", {})
                                        .get("recipe_name", "tensorwise")),
    )
    # parallelism.expert_tensor_parallel_degree: unset is 1 in torchtitan (job_config.py since #1555), whole experts
    key = "parallelism.expert_tensor_parallel_degree"
    job.options["expert_tp"] = expert_tp_of(NAME, key, whole(NAME, key, par.get("expert_tensor_parallel_degree", 1)),
                                            tp)
    if GROUPED_FP8 in converters and not any(c in ("float8", LINEAR_FP8) for c in converters):
        # the experts' grouped GEMMs alone, which torchao quantizes rowwise
        job.options.update(fp8_scope="experts", fp8_recipe="rowwise")
    if par.get("context_parallel_rotate_method", "allgather") != "allgather":
        job.notes.append("context_parallel_rotate_method alltoall is timed as the all-gather rotation")
    job.pins = Pins(dp=dp, fsdp=fsdp, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, microbatch=mb, recompute=mode, zero=0,
                    offload=0.0, **NO_STATE_OFFLOAD,
                    sequence_parallel=True)
    m = doc.get("model", {})
    job.model = FLAVORS.get((m.get("name", "llama3"), m.get("flavor")))
    return job

