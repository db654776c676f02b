"""What every exporter and importer shares: the plan being written, the job read back, the header, the check
that a framework can express a plan (an exporter never drops a feature silently).

An exporter turns (problem, layout, options, prediction) into a framework's own file. An importer reads such a
file back into a `Job`: the degrees as `Pins` (every one set), the framework behaviour as `Options` overrides on
top of the framework's preset (train/frameworks.py), and every key it did not use, by kind. `check_expressible`
reads an exported file back with the importer and refuses the export where anything that changes the prediction
would come back different, so `export` then `--from` gives the same plan and the same prediction.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, fields, replace
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from meshplan import __version__
from meshplan.errors import MeshplanError
from meshplan.specs.model import ModelConfig
from meshplan.train.config import OFFLOAD_FLAGS, ParallelConfig
from meshplan.train.costmodel import Options, fp8_recipes
from meshplan.train.frameworks import framework_options, megatron_selective_policy
from meshplan.train.space import Pins, Problem, expert_tp_degree
from meshplan.units import fmt_bytes, fmt_time

# no framework file meshplan writes carries model-state offload (optimizer, weights): read back, there is none
NO_STATE_OFFLOAD = dict.fromkeys(OFFLOAD_FLAGS, 0)

KEYS_DIR = Path(__file__).resolve().parent / "data"
# How each framework's file names an FP8 recipe (`--fp8-recipe`): Megatron-LM `--fp8-recipe` and NeMo
# `trainer.plugins.fp8_recipe` (tensorwise, delayed, blockwise on Hopper, mxfp8 on Blackwell: Transformer Engine's
# recipes), torchtitan `quantize.linear.float8.recipe_name` (torchao's tensorwise and rowwise)
FP8_RECIPE_NAMES: dict[str, dict[str, str]] = {
    "te": {"tensorwise": "tensorwise", "delayed": "delayed", "blockwise": "blockwise"},
    "torchtitan": {"tensorwise": "tensorwise", "rowwise": "rowwise"},
}
def mxfp8_chips() -> frozenset[str]:
    """Chips where meshplan's blockwise recipe is MXFP8: those fp8_recipes.yaml's blockwise GEMM row names by chip
    (native block scaling in the MMA) rather than by kind."""
    return frozenset(fp8_recipes()["blockwise"]["gemm_fraction"]) - {"gpu", "tpu"}


def fp8_recipe_name(kind: str, opts: Options, chip_name: str) -> str:
    """The framework's word for the plan's FP8 recipe (FP8_RECIPE_NAMES); a MeshplanError if it has none."""
    recipe = opts.fp8_scaling
    if kind == "te" and recipe == "blockwise" and chip_name in mxfp8_chips():
        return "mxfp8"
    names = FP8_RECIPE_NAMES[kind]
    if recipe not in names:
        who = "Transformer Engine (Megatron, NeMo)" if kind == "te" else kind
        raise MeshplanError(f"{who} has no '{recipe}' FP8 recipe; plan with --fp8-recipe {' or '.join(names)}")
    return names[recipe]


def fp8_recipe_from_name(kind: str, name: str | None) -> str | None:
    """The inverse of fp8_recipe_name (None when the file names none or one meshplan does not know)."""
    if name == "mxfp8":
        return "blockwise"
    return next((r for r, n in FP8_RECIPE_NAMES[kind].items() if n == name), None)


@cache
def expert_tp_size(options: Options, cfg: ParallelConfig) -> int:
    """Megatron-Core's expert_tensor_parallel_size of a plan: the cost model's (space.expert_tp_degree)."""
    sp = cfg.sequence_parallel and cfg.tp > 1
    return int(expert_tp_degree(options.expert_tp, cfg.tp, cfg.cp, cfg.dp * cfg.fsdp, cfg.ep, sp))


def expert_tp_of(name: str, key: str, etp: int | None, tp: int) -> bool:
    """Options.expert_tp from a file's expert tensor parallel size: unset = TP (Megatron-LM's default, arguments.py),
    1 = whole experts; meshplan models those two, so another size is refused by name."""
    if etp is None or etp == tp:
        return True
    if etp == 1:
        return False
    raise MeshplanError(f"{name} file: {key} {etp} is neither 1 nor the tensor-parallel size {tp}; meshplan models "
                        "expert tensor parallelism of 1 or TP")


def framework_keys(name: str) -> frozenset[str]:
    """The keys a framework's own config parser accepts, from data/<name>_keys.txt (each file names the source
    file and commit it was read from in its header)."""
    lines = (KEYS_DIR / f"{name}_keys.txt").read_text().splitlines()
    return frozenset(x.strip() for x in lines if x.strip() and not x.startswith("#"))


@dataclass(frozen=True)
class PlanToExport:
    """One ranked plan of `meshplan train` with everything an exporter writes."""

    problem: Problem
    config: ParallelConfig
    options: Options
    prediction: dict  # the plan's DESIGN.md JSON object (step_time_s, mfu, memory_bytes_per_chip ...)
    command: str  # the meshplan command line that produced it
    model_arg: str  # what --model was given (a preset name is written where the framework names models)


@dataclass
class Job:
    """A training job read from a framework's file."""

    framework: str
    pins: Pins
    options: dict[str, Any] = field(default_factory=dict)  # Options overrides on top of the framework preset
    seq_len: int | None = None
    global_batch: int | None = None
    chips: int | None = None
    model: str | None = None  # a meshplan model preset the file names
    model_dims: dict[str, int] = field(default_factory=dict)  # ModelConfig fields the file states
    unknown_keys: list[str] = field(default_factory=list)  # not keys of the framework at all (typos?)
    unmodelled_keys: list[str] = field(default_factory=list)  # real keys that do not change the prediction
    notes: list[str] = field(default_factory=list)
    layers_per_stage: int | None = None
    slices: int | None = None  # TPU slices joined over DCN
    chip_kind: str | None = None  # "gpu" or "tpu" where the file says which  # interleaved pipelines given as layers per virtual stage

    def finish(self, model: ModelConfig) -> None:
        """What needs the model: virtual stages from a layers-per-stage count."""
        if self.pins.vpp is None:
            pp, per = self.pins.pp or 1, self.layers_per_stage or model.n_layers
            self.pins = replace(self.pins, vpp=max(1, -(-model.n_layers // (pp * per))))

    def resolved_options(self, base: Options, explicit: dict[str, Any] | None = None) -> Options:
        """The framework preset, then what the file says, then flags given on the command line."""
        opts = framework_options(self.framework, base, {})
        opts = replace(opts, **self.options)
        return framework_options(None, opts, explicit or {})


def check_model(job: Job, model: ModelConfig) -> None:
    """A file that states the model's shape must agree with --model."""
    wrong = [f"{k} {v} (--model {model.name}: {getattr(model, k)})" for k, v in job.model_dims.items()
             if v and getattr(model, k) != v]
    if wrong:
        raise MeshplanError(f"the {job.framework} file's model shape does not match --model: " + ", ".join(wrong))


def header_lines(plan: PlanToExport, framework: str) -> list[str]:
    """The lines every exported file starts with (the caller adds its comment marker)."""
    p, pr = plan.problem, plan.prediction
    mem = pr["memory_bytes_per_chip"]
    return [
        f"{framework} config written by meshplan {__version__}",
        f"command: {plan.command}",
        f"plan: {plan.config.describe()} on {p.chips} x {p.chip.name}, {p.model.name}, seq {p.seq_len}, "
        f"global batch {p.global_batch}",
        f"predicted: step {fmt_time(pr['step_time_s'])} ({pr['step_time_s']:.6g} s), MFU {pr['mfu']:.1%}, "
        f"{pr['tokens_per_s_per_chip']:.0f} tokens/s/chip, memory {fmt_bytes(mem['total'])} per chip "
        f"({mem['total']:.6g} bytes)",
        f"read it back: meshplan train --from FILE --hardware {p.chip.name} --model {plan.model_arg}"
        # a DeepSpeed config does not state the sequence length (deepspeed.load's note)
        + (f" --seq-len {p.seq_len}" if framework == "deepspeed" else ""),
    ]


def commented(lines: list[str], marker: str = "#") -> str:
    return "".join(f"{marker} {x}\n" if x else f"{marker}\n" for x in lines)


def yaml_mapping(text: str, what: str) -> dict[str, Any]:
    """A YAML file that must be a mapping of keys (MaxText configs, NeMo overrides)."""
    try:
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise MeshplanError(f"not a YAML file: {str(exc).splitlines()[0]}") from None
    if not isinstance(doc, dict):
        raise MeshplanError(f"{what} is a YAML mapping of keys")
    return doc


def split_command(text: str, what: str) -> list[str]:
    """A shell command line (backslash continuations, # comments) as words."""
    lex = shlex.shlex(text.replace("\\\n", " "), posix=True)
    lex.whitespace_split, lex.commenters = True, "#"
    try:
        return list(lex)
    except ValueError as exc:  # an unclosed quote
        raise MeshplanError(f"cannot read the {what} command line: {exc}") from None


def argv_lines(argv: list[str], lead: int = 1) -> str:
    """A command line, one flag (and its value) per continued line after the first `lead` words."""
    argv = [str(a) for a in argv]
    lines = [" ".join(shlex.quote(a) for a in argv[:lead])]
    i = lead
    while i < len(argv):
        j = i + 1 + (i + 1 < len(argv) and not argv[i + 1].startswith("-"))
        lines.append("    " + " ".join(shlex.quote(a) for a in argv[i:j]))
        i = j
    return " \\\n".join(lines) + "\n"


# What each comparable quantity means, for the refusal message.
_WORDS = {
    "dp": "data-parallel replicas", "fsdp": "FSDP (ZeRO-3) shard degree", "tp": "tensor parallelism",
    "pp": "pipeline stages", "vpp": "virtual pipeline stages", "cp": "context parallelism",
    "ep": "expert parallelism", "microbatch": "micro-batch", "recompute": "recompute policy",
    "zero": "ZeRO stage over the replicas", "offload": "activation offload fraction",
    "offload_optimizer": "optimizer offload to the host (ZeRO-Offload)",
    "offload_params": "weight offload to the host (ZeRO-Infinity)",
    "sequence_parallel": "sequence parallelism", "compute_dtype": "matmul precision",
    "tp_overlap": "TP communication overlap", "dp_overlap": "DP gradient reduction behind the backward",
    "overlap_param_gather": "ZeRO parameter all-gather overlapped", "fused_elementwise": "fused pointwise kernels",
    "fused_loss": "fused cross-entropy", "fp8_weight_cache": "FP8 weights cast once per step",
    "fp8_fused_casts": "fused FP8 casts (Transformer Engine)", "fp8_recipe": "FP8 scaling recipe", "ep_overlap": "MoE all-to-all overlap",
    "moe_node_limit": "node-limited MoE routing", "moe_force_balance": "force-balanced MoE routing",
    "moe_dispatcher": "MoE token dispatcher", "expert_tp": "experts split over TP (ETP = TP)",
    "selective_flavor": "what selective recompute saves",
    "fsdp_over_cp": "FSDP over the CP ranks", "zero3_fetch": "ZeRO-3 fetch", "cp_impl": "context-parallel attention",
    "pp_schedule": "pipeline schedule", "attention_kernel": "attention kernel",
    "fp8_scope": "GEMMs in FP8 (all, or the routed experts only)", "grouped_mm_kernel": "the experts' grouped GEMM kernel",
}


def relevant(name: str, cfg: ParallelConfig, opts: Options, problem: Problem) -> bool:
    """Whether a quantity changes this plan's prediction (a feature the plan does not use cannot be lost)."""
    moe, fp8, data = problem.model.is_moe, opts.compute_dtype == "fp8", cfg.dp * cfg.fsdp
    return {
        "vpp": cfg.pp > 1, "sequence_parallel": cfg.tp > 1, "ep": moe,
        "zero": cfg.dp * (cfg.cp if cfg.fsdp == 1 else 1) > 1,
        "tp_overlap": cfg.tp > 1, "dp_overlap": data * cfg.cp > 1,
        "overlap_param_gather": cfg.zero >= 1 and cfg.dp > 1,
        "fp8_weight_cache": fp8, "fp8_fused_casts": fp8, "fp8_recipe": fp8, "ep_overlap": moe and cfg.ep > 1,
        "fp8_scope": fp8 and moe, "grouped_mm_kernel": moe,
        "moe_node_limit": moe and cfg.ep > 1, "moe_force_balance": moe and cfg.ep > 1,
        "moe_dispatcher": moe and cfg.ep > 1,
        # a choice only where the layout allows both (space.expert_tp_degree)
        "expert_tp": moe and cfg.tp > 1 and cfg.sequence_parallel and (cfg.cp * data) % cfg.ep == 0,
        "selective_flavor": cfg.recompute == "selective",
        "fsdp_over_cp": cfg.cp > 1, "zero3_fetch": cfg.fsdp > 1 or cfg.zero == 3 or opts.fsdp_over_cp and cfg.cp > 1,
        "cp_impl": cfg.cp > 1, "pp_schedule": cfg.pp > 1,
    }.get(name, True)


# Options a file never carries: modelling parameters given on meshplan's command line (headroom) or fixed
# conventions of the cost model that no framework key changes.
_NOT_IN_FILES = ("headroom", "fsdp_param_bytes", "grad_reduce_bytes", "flash_attention", "dropout")


def check_expressible(framework: str, plan: PlanToExport, job: Job, reasons: dict[str, str] | None = None) -> None:
    """Refuse an export whose file, read back, would describe a different plan: name every feature lost."""
    cfg, opts, p = plan.config, plan.options, plan.problem
    lost = []
    back_cfg = job.pins
    for f in fields(ParallelConfig):
        mine, theirs = getattr(cfg, f.name), getattr(back_cfg, f.name)
        if relevant(f.name, cfg, opts, p) and theirs != mine:
            lost.append((f.name, mine, theirs))
    back_opts = job.resolved_options(replace(Options(), compute_dtype=opts.compute_dtype, headroom=opts.headroom))
    for f in fields(Options):
        if f.name in _NOT_IN_FILES:
            continue
        mine, theirs = getattr(opts, f.name), getattr(back_opts, f.name)
        if f.name in ("tp_overlap", "dp_overlap"):  # None = the chip's default
            i = 0 if f.name == "tp_overlap" else 1
            mine, theirs = opts.overlaps(p.chip.kind)[i], back_opts.overlaps(p.chip.kind)[i]
        if f.name == "fp8_recipe":  # None = the cast implementation's default
            mine, theirs = opts.fp8_scaling, back_opts.fp8_scaling
        if relevant(f.name, cfg, opts, p) and theirs != mine:
            lost.append((f.name, mine, theirs))
    if not lost:
        return
    why = reasons or {}
    parts = []
    for name, mine, theirs in lost:
        extra = f" ({why[name]})" if name in why else ""
        parts.append(f"{_WORDS.get(name, name)} = {mine!r} (a {framework} file can only say {theirs!r}){extra}")
    raise MeshplanError(f"{framework} cannot express this plan: " + "; ".join(parts)
                        + f". Pin what {framework} can run (e.g. --framework {framework} and the degrees) or "
                          "export to another framework")


# the Megatron-Core selective recompute modules a file may list that meshplan reads back (megatron_selective_policy)
READABLE_SELECTIVE = ("none", "selective", "mla-up-proj")


def selective_recompute_of(framework: str, key: str, modules: list[str]) -> str:
    """meshplan's --recompute for a Megatron-Core file's selective recompute over `modules` (its recompute_modules),
    or one clear error where meshplan has no policy for them."""
    policy = megatron_selective_policy(modules)
    if policy not in READABLE_SELECTIVE:
        raise MeshplanError(f"{framework} file: {key} {modules}: meshplan reads [], [core_attn] or [mla_up_proj]")
    return policy


def refuse(framework: str, name: str, value: Any, reasons: dict[str, str]) -> MeshplanError:
    """The refusal for a value the framework has no key value for."""
    why = f" ({reasons[name]})" if name in reasons else ""
    return MeshplanError(f"{framework} cannot express this plan: {_WORDS.get(name, name)} = {value!r}{why}")


def whole(framework: str, key: str, value: Any, minimum: int | None = 1) -> Any:
    """An integer setting read from a file (None passes through); a clear error for anything else."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        need = "an integer" if minimum is None else f"an integer of at least {minimum}"
        raise MeshplanError(f"{framework} file: {key} must be {need}, got {value!r}")
    return value


def check_degrees(framework: str, **degrees: int) -> None:
    """Degrees read from a file must be positive integers."""
    for k, v in degrees.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise MeshplanError(f"{framework} file: {k} must be a positive integer, got {v!r}")


def divide(framework: str, what: str, a: int, b: int) -> int:
    if b <= 0 or a % b:
        raise MeshplanError(f"{framework} file: {what} {a} is not divisible by {b}")
    return a // b


def reversed_map(table: dict[str, str]) -> dict[str, str]:
    return {v: k for k, v in table.items()}
