"""MaxText YAML (run as `python -m maxtext.trainers.pre_train.train FILE`). Key names: src/maxtext/configs/base.yml at
AI-Hypercomputer/maxtext@e591f30cbbf217ed67ef71263ec0538239f9c3b8 (data/maxtext_keys.txt lists every key).

Mesh: MaxText multiplies ici_* (inside a slice) and dcn_* (across slices) degrees per axis. meshplan's data,
fsdp, tensor, pipeline and context axes map onto MaxText's data, fsdp, tensor, pipeline and context axes; the slow
(DCN) share is taken from the outermost axes first, as meshplan places them (ParallelConfig.mesh). MaxText's
expert axis also shards the batch and the non-expert weights (its logical rule `embed -> [fsdp, ..., expert]`),
so meshplan's expert parallelism, carved out of the FSDP ranks, is MaxText's expert axis times its fsdp axis.
Batch: global batch = per_device_batch_size x devices x gradient_accumulation_steps (base.yml); with pipelining,
the micro-batch is global batch / num_pipeline_microbatches (base.yml).
libtpu flags: what MaxText sets through XLA flags rather than config keys (the SparseCore gradient reduction,
Options.sparsecore_reduce) goes in a `launch:` comment line as the LIBTPU_INIT_ARGS environment variable, where
MaxText's own runner puts it (benchmarks/maxtext_xpk_runner.py); the flag strings are data/maxtext_libtpu_flags.yaml
(benchmarks/xla_flags_library.py at the same commit), and the loader reads that line back.
"""

from __future__ import annotations

import math
import shlex
from functools import cache

import yaml

from meshplan.cost.topology import make_cluster
from meshplan.errors import MeshplanError
from meshplan.export.common import (
    KEYS_DIR,
    NO_STATE_OFFLOAD,
    Job,
    PlanToExport,
    check_degrees,
    commented,
    divide,
    framework_keys,
    header_lines,
    refuse,
    whole,
    yaml_mapping,
)
from meshplan.train.frameworks import FRAMEWORKS
from meshplan.train.space import Pins

NAME = "maxtext"
PINS = {"zero": 0, "offload": 0.0, "offload_params": 0, "offload_optimizer": 0}  # what a MaxText config cannot say (REASONS)
SUFFIX = ".yml"
# meshplan recompute -> remat_policy (layers/decoders.py): "minimal" saves the matmul outputs without batch
# dimensions, so the attention core (QK^T, AV) and the pointwise ops are recomputed (Korthikanti's selective);
# "minimal_with_context" also saves the attention output: only the pointwise ops run again (gemm-last)
REMAT = {"full": "full", "selective": "minimal", "gemm-last": "minimal_with_context"}
AXES = (("pp", "pipeline"), ("dp", "data"), ("fsdp", "fsdp"), ("cp", "context"), ("tp", "tensor"))  # outermost first
CHOICES = {"recompute_choices": tuple(REMAT)}  # the remat policies meshplan writes (REMAT)
REASONS = {
    "recompute": "MaxText rematerialises every scanned layer: its least recompute, remat_policy "
                 "minimal_with_context, is meshplan's gemm-last",
    "zero": "MaxText shards with its fsdp axis (ZeRO-3)",
    "offload": "activation offload is a custom remat policy meshplan does not write",
    "pp_schedule": "MaxText pipelines with a circular GPipe-like schedule",
    "ep": "MaxText's expert axis must divide the FSDP ranks",
    "tp_overlap": "XLA decomposes TP collectives into collective matmuls",
    "dp_overlap": "XLA reduces the scanned layers' gradients after the backward",
}
MODEL_KEYS = {"base_num_decoder_layers": "n_layers", "base_emb_dim": "d_model", "base_num_query_heads": "n_heads",
              "base_num_kv_heads": "n_kv_heads", "base_mlp_dim": "d_ff", "head_dim": "head_dim",
              "vocab_size": "vocab_size", "num_experts": "n_experts", "num_experts_per_tok": "experts_per_token"}


# the module MaxText trains with (docstring above); the exported file is its config argument
LAUNCH = "python3 -m maxtext.trainers.pre_train.train FILE"
LIBTPU_ENV = "LIBTPU_INIT_ARGS"


@cache
def libtpu_flags() -> dict[str, dict]:
    """{Options field: {"flags": [...], "switch": flag name}}: data/maxtext_libtpu_flags.yaml, the flag groups of
    AI-Hypercomputer/maxtext@e591f30cbbf217ed67ef71263ec0538239f9c3b8 benchmarks/xla_flags_library.py (sparsecore_reduce:
    ENABLE_SPARSECORE_OFFLOADING_FOR_ALL_REDUCE + ENABLE_SPARSECORE_OFFLOADING_BASE_FLAGS), copied verbatim."""
    return yaml.safe_load((KEYS_DIR / "maxtext_libtpu_flags.yaml").read_text())


def _launch_line(o, tpu: bool) -> str:
    """How to run the file: LIBTPU_INIT_ARGS with the flags of every option on (TPU only), then the trainer."""
    flags = [f for name, group in libtpu_flags().items() if tpu and getattr(o, name) for f in group["flags"]]
    env = f"{LIBTPU_ENV}={shlex.quote(' '.join(flags))} " if flags else ""
    return f"launch: {env}{LAUNCH}"


def _read_libtpu_flags(text: str) -> dict[str, bool]:
    """Options set by a LIBTPU_INIT_ARGS=... assignment in the file's comments (the last one wins): each option
    whose switch flag it sets, true or false; an option whose switch it does not name is left to the preset."""
    value = None
    for line in text.splitlines():
        body = line.strip()
        if not body.startswith("#") or f"{LIBTPU_ENV}=" not in body:
            continue
        try:
            words = shlex.split(body.lstrip("#"))
        except ValueError as exc:  # an unclosed quote
            raise MeshplanError(f"maxtext file: cannot read the {LIBTPU_ENV} line: {exc}") from None
        value = next((w.split("=", 1)[1] for w in words if w.startswith(f"{LIBTPU_ENV}=")), value)
    if value is None:
        return {}
    given = dict(f.split("=", 1) if "=" in f else (f, "true") for f in value.split())
    return {name: given[g["switch"]].lower() in ("true", "1") for name, g in libtpu_flags().items()
            if g["switch"] in given}


# splash attention's block sizes (configs/base.yml; Options.attention_block_fwd = the first two, _bwd = the dKV pair)
SA_BLOCK_KEYS = ("sa_block_q", "sa_block_kv", "sa_block_q_dkv", "sa_block_kv_dkv")


def _dcn_split(c, slices: int) -> dict[str, int]:
    """The share of each axis that crosses slices, outermost axes first."""
    out, left = {}, slices
    for attr, _ in AXES:
        f = math.gcd(getattr(c, attr), left)
        out[attr], left = f, left // f
    if left != 1:
        raise MeshplanError(f"maxtext: the {slices} slices cannot be split over this plan's outer axes")
    return out


def export(plan: PlanToExport) -> str:
    c, o, p = plan.config, plan.options, plan.problem
    if c.recompute not in REMAT:
        raise refuse(NAME, "recompute", c.recompute, REASONS)
    m = p.model
    slices = make_cluster(p.chip, p.chips, p.slice_shape).n_slices
    dcn = _dcn_split(c, slices)
    ep_axis = c.ep if m.is_moe else 1
    degrees = {attr: getattr(c, attr) for attr, _ in AXES}
    if ep_axis > 1:
        if c.fsdp % ep_axis:  # the expert axis is carved out of the FSDP ranks (module docstring)
            raise MeshplanError(f"{NAME} cannot express this plan: expert parallelism = {ep_axis} does not divide "
                                f"the FSDP degree {c.fsdp} (MaxText's expert axis shards the batch and the non-expert "
                                f"weights with its fsdp axis: ep must divide fsdp). Pin --fsdp to a multiple of --ep")
        degrees["fsdp"] = c.fsdp // ep_axis
    data = c.dp * c.fsdp
    n_micro = p.global_batch // (data * c.microbatch)
    accum = 1 if c.pp > 1 else n_micro
    doc: dict = {"base_config": "base.yml", "hardware": "tpu" if p.chip.kind == "tpu" else "gpu"}
    if plan.model_arg == m.name:
        doc["model_name"] = m.name
    doc.update({k: getattr(m, v) for k, v in MODEL_KEYS.items() if v not in ("n_experts", "experts_per_token")})
    if m.is_moe:
        doc.update(num_experts=m.n_experts, num_experts_per_tok=m.experts_per_token)
    doc.update({
        "max_target_length": p.seq_len,
        "per_device_batch_size": p.global_batch / (p.chips * accum),
        "gradient_accumulation_steps": accum,
        "remat_policy": REMAT.get(c.recompute, c.recompute),
        "dtype": "bfloat16",
        "quantization": "fp8" if o.compute_dtype == "fp8" else "",
        "attention": "flash" if p.chip.kind == "tpu" else "cudnn_flash_te",
    })
    if o.iota_embedding:  # base.yml `use_iota_embed: false`: the embedding as a one-hot matmul (Options.iota_embedding)
        doc["use_iota_embed"] = True
    if c.pp > 1:
        doc["num_pipeline_microbatches"] = n_micro
        doc["num_layers_per_pipeline_stage"] = -(-m.n_layers // (c.pp * c.vpp))
    if p.chip.kind == "tpu":
        doc["num_slices"] = slices
        # splash attention's block grid (Options.attention_block_fwd/_bwd): base.yml's sa_block_* keys
        doc.update({k: int(v) for k, v in zip(SA_BLOCK_KEYS, (*o.attention_block_fwd, *o.attention_block_bwd),
                                                strict=True) if v > 0})
    for attr, axis in AXES:
        # _dcn_split's share divides the plan's degree (a gcd), but not always the fsdp axis left beside the experts
        if degrees[attr] % dcn[attr]:
            raise MeshplanError(f"{NAME} cannot express this plan: its {axis} axis ({degrees[attr]} after the "
                                f"expert axis's {ep_axis}) cannot be split {dcn[attr]} ways over the {slices} slices "
                                f"(ici x dcn must give the degree)")
        doc[f"ici_{axis}_parallelism"], doc[f"dcn_{axis}_parallelism"] = degrees[attr] // dcn[attr], dcn[attr]
    doc["ici_expert_parallelism"], doc["dcn_expert_parallelism"] = ep_axis, 1
    header = header_lines(plan, NAME) + [_launch_line(o, p.chip.kind == "tpu")]
    return commented(header) + yaml.safe_dump(doc, sort_keys=False)


def load(text: str, chips: int | None = None) -> Job:
    doc = yaml_mapping(text, "a MaxText config")
    doc = {k: v for k, v in doc.items() if v is not None}  # a null key is an unset one: base.yml's default
    known = framework_keys(NAME)
    used = {"base_config", "hardware", "model_name", "max_target_length", "per_device_batch_size",
            "gradient_accumulation_steps", "remat_policy", "dtype", "quantization", "attention",
            "num_pipeline_microbatches", "num_layers_per_pipeline_stage", "num_slices", "use_iota_embed", *MODEL_KEYS,
            *SA_BLOCK_KEYS}
    used |= {f"{kind}_{axis}_parallelism" for kind in ("ici", "dcn")
             for axis in ("data", "fsdp", "tensor", "pipeline", "context", "sequence", "expert")}
    job = Job(NAME, Pins())
    job.unknown_keys = sorted(k for k in doc if k not in known)
    job.unmodelled_keys = sorted(k for k in doc if k in known and k not in used)
    deg: dict[str, int] = {}
    for kind in ("ici", "dcn"):
        for axis in ("data", "fsdp", "tensor", "pipeline", "context", "expert"):
            # base.yml defaults: ici_fsdp_parallelism -1 and dcn_data_parallelism -1 take what is left
            default = -1 if (kind, axis) in (("ici", "fsdp"), ("dcn", "data")) else 1
            key = f"{kind}_{axis}_parallelism"
            v = whole(NAME, key, doc.get(key, default), minimum=-1)
            if axis == "context":  # the older name of the context axis
                v *= whole(NAME, f"{kind}_sequence_parallelism", doc.get(f"{kind}_sequence_parallelism", 1))
            if v == 0:
                raise MeshplanError(f"maxtext file: {key} must be positive or -1, got 0")
            deg[f"{kind}_{axis}"] = v
    slices = whole(NAME, "num_slices", doc.get("num_slices", -1), minimum=-1)
    slices = slices if slices > 0 else None
    _fill(deg, "dcn", slices)
    total_dcn = math.prod(v for k, v in deg.items() if k.startswith("dcn"))
    if any(v == -1 for k, v in deg.items() if k.startswith("ici")):
        if chips is None:
            raise MeshplanError("the MaxText file leaves an ici_*_parallelism at -1 (all devices left over): "
                                "give --chips")
        _fill(deg, "ici", divide(NAME, "--chips", chips, total_dcn))
    job.chips = math.prod(deg.values())
    job.slices = math.prod(v for k, v in deg.items() if k.startswith("dcn")) if doc.get("hardware", "tpu") \
        .startswith("tpu") else None
    both = {axis: deg[f"ici_{axis}"] * deg[f"dcn_{axis}"] for axis in ("data", "fsdp", "tensor", "pipeline",
                                                                        "context", "expert")}
    dp, tp, pp, cp, ep = both["data"], both["tensor"], both["pipeline"], both["context"], both["expert"]
    fsdp = both["fsdp"] * ep  # the expert axis shards the batch and the non-expert weights as fsdp does
    check_degrees(NAME, data=dp, fsdp=fsdp, tensor=tp, pipeline=pp, context=cp, expert=ep)
    accum = whole(NAME, "gradient_accumulation_steps", doc.get("gradient_accumulation_steps", 1))
    per_device = doc.get("per_device_batch_size", 12.0)
    if isinstance(per_device, bool) or not isinstance(per_device, int | float) or per_device <= 0:
        raise MeshplanError(f"maxtext file: per_device_batch_size must be a positive number, got {per_device!r}")
    gb = per_device * job.chips * accum
    if abs(gb - round(gb)) > 1e-9:
        raise MeshplanError(f"maxtext file: per_device_batch_size {per_device} x {job.chips} devices is not a whole "
                            "number of sequences")
    job.global_batch = round(gb)
    job.seq_len = whole(NAME, "max_target_length", doc.get("max_target_length", 2048))
    if job.global_batch < 1:
        raise MeshplanError(f"maxtext file: per_device_batch_size {per_device} gives no whole sequence")
    data = dp * fsdp
    if pp > 1:
        n_micro = whole(NAME, "num_pipeline_microbatches", doc.get("num_pipeline_microbatches", -1), minimum=-1)
        n_micro = pp if n_micro in (-1, None) else n_micro  # base.yml: by default the number of stages
        mb = divide(NAME, "global batch per data-parallel rank", job.global_batch // data, n_micro)
        # the stages repeat around the pipeline until the layers are used up (num_pipeline_repeats): virtual stages
        vpp = None
        job.layers_per_stage = whole(NAME, "num_layers_per_pipeline_stage", doc.get("num_layers_per_pipeline_stage", 1))
    else:
        mb, vpp = divide(NAME, "global batch", job.global_batch, data * accum), 1
    policy = str(doc.get("remat_policy", "full"))
    back = {v: k for k, v in REMAT.items()}
    if policy not in back:
        raise MeshplanError(f"maxtext remat_policy '{policy}' is not one meshplan models ({', '.join(back)}): "
                            "give --recompute")
    job.pins = Pins(dp=dp, fsdp=fsdp, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, microbatch=mb, recompute=back[policy],
                    zero=0, offload=0.0, **NO_STATE_OFFLOAD,
                    sequence_parallel=True)
    q = str(doc.get("quantization") or "")
    job.options["compute_dtype"] = "fp8" if q.startswith("fp8") or q == "nanoo_fp8" else "bf16"
    if doc.get("attention") == "dot_product":
        job.options["flash_attention"] = False
    # the splash block grid the file sets; an unset key keeps the maxtext preset's (base.yml's) 512
    blocks = [whole(NAME, k, doc[k]) if k in doc else None for k in SA_BLOCK_KEYS]
    for name, pair in (("attention_block_fwd", blocks[:2]), ("attention_block_bwd", blocks[2:])):
        if any(b is not None for b in pair):
            job.options[name] = tuple(d if b is None else b for b, d in zip(pair, FRAMEWORKS[NAME][name], strict=True))
    if "use_iota_embed" in doc:
        if not isinstance(doc["use_iota_embed"], bool):
            raise MeshplanError(f"maxtext file: use_iota_embed must be true or false, got {doc['use_iota_embed']!r}")
        job.options["iota_embedding"] = doc["use_iota_embed"]
    job.options.update(_read_libtpu_flags(text))
    hw = str(doc.get("hardware", "tpu"))
    job.chip_kind = "gpu" if hw.startswith("gpu") else "tpu" if hw.startswith("tpu") else None
    name = doc.get("model_name")
    job.model = str(name) if name not in (None, "default") else None
    job.model_dims = {v: doc[k] for k, v in MODEL_KEYS.items() if isinstance(doc.get(k), int) and doc[k] > 0
                      and not (k == "num_experts" and doc[k] == 1) and not (k == "num_experts_per_tok" and doc[k] == 1)}
    return job


def _fill(deg: dict[str, int], kind: str, total: int | None) -> None:
    """MaxText's -1: the one axis of `kind` that takes whatever `total` leaves (1 when total is unknown)."""
    free = [k for k, v in deg.items() if k.startswith(kind) and v == -1]
    if len(free) > 1:
        raise MeshplanError(f"maxtext file: more than one {kind}_*_parallelism is -1 ({', '.join(free)})")
    if not free:
        return
    fixed = math.prod(v for k, v in deg.items() if k.startswith(kind) and v > 0)
    deg[free[0]] = 1 if total is None else divide(NAME, f"{kind} devices", total, fixed)
