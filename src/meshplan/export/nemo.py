"""NeMo 2 recipe overrides: a YAML of the recipe attributes to set on a `nemo.collections.llm` pretraining recipe, each
one a dotted path NeMo-Run's CLI also takes (`nemo llm pretrain --factory llama3_8b trainer.num_nodes=4 ...`).
Paths: data/nemo_keys.txt (NeMo's MegatronStrategy, MegatronMixedPrecision and PreTrainingDataModule arguments
at NVIDIA/NeMo@8cfedd72; Megatron-Core config fields at core_v0.15.0). NeMo runs Megatron-Core, so the behaviour is Megatron's plus the
TP communication overlap its performance recipes turn on (train/frameworks.py "nemo").
"""

from __future__ import annotations

import yaml

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
    selective_recompute_of,
    whole,
    yaml_mapping,
)
from meshplan.export.megatron import CHOICES as MEGATRON_CHOICES
from meshplan.export.megatron import REASONS as MEGATRON_REASONS
from meshplan.train.space import Pins

NAME = "nemo"
PINS = {"offload": 0.0, "offload_params": 0, "offload_optimizer": 0}  # as Megatron
CHIP_KINDS = ("gpu",)  # PyTorch on NVIDIA GPUs
SUFFIX = ".yaml"
SWITCHES = {
    "tp_overlap": ({"tp_overlap": True}, "model.config.tp_comm_overlap: true"),
    "dp_overlap": ({"dp_overlap": True}, "trainer.strategy.ddp.overlap_grad_reduce: true"),
    "param_gather": ({"overlap_param_gather": True}, "trainer.strategy.ddp.overlap_param_gather: true"),
}
CHOICES = MEGATRON_CHOICES  # NeMo writes Megatron-Core's recompute and optimizer settings
REASONS = dict(MEGATRON_REASONS, fsdp="meshplan writes NeMo's Megatron DDP (no FSDP)",
               dp="meshplan writes NeMo's Megatron DDP (no FSDP)")


def _unflatten(flat: dict) -> dict:
    out: dict = {}
    for path, v in flat.items():
        d = out
        *parents, leaf = path.split(".")
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = v
    return out


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + str(k)] = v
    return out


def export(plan: PlanToExport) -> str:
    c, o, p = plan.config, plan.options, plan.problem
    gpus = min(p.chip.links.chips_per_host, p.chips)  # processes per node: the GPUs of one host (an NVL72 tray: 4)
    tp_ov, dp_ov = o.overlaps(p.chip.kind)
    flat = {
        "trainer.num_nodes": divide(NAME, "chips", p.chips, gpus), "trainer.devices": gpus,
        "trainer.strategy.tensor_model_parallel_size": c.tp, "trainer.strategy.pipeline_model_parallel_size": c.pp,
        "trainer.strategy.virtual_pipeline_model_parallel_size": c.vpp if c.pp > 1 and c.vpp > 1 else None,
        "trainer.strategy.context_parallel_size": c.cp, "trainer.strategy.expert_model_parallel_size": c.ep,
        # Options.expert_tp (MegatronStrategy expert_tensor_parallel_size: whole experts 1, or the TP degree)
        "trainer.strategy.expert_tensor_parallel_size": (expert_tp_size(o, c)
                                                         if p.model.is_moe else None),
        "trainer.strategy.sequence_parallel": bool(c.sequence_parallel and c.tp > 1),
        "trainer.strategy.ddp.overlap_grad_reduce": bool(dp_ov),
        "trainer.strategy.ddp.overlap_param_gather": bool(o.overlap_param_gather),
        "optim.config.use_distributed_optimizer": c.zero >= 1,
        "model.config.tp_comm_overlap": bool(tp_ov and c.tp > 1),
        "model.config.recompute_granularity": None if c.recompute == "none" else c.recompute,
        "data.seq_length": p.seq_len, "data.micro_batch_size": c.microbatch, "data.global_batch_size": p.global_batch,
        "trainer.plugins.fp8": "hybrid" if o.compute_dtype == "fp8" else None,
        "trainer.plugins.fp8_recipe": fp8_recipe_name("te", o, p.chip.name) if o.compute_dtype == "fp8" else None,
        # Options.pp_head_in_split (Megatron-Bridge's Llama 3.1 405B recipe sets both)
        "model.config.account_for_embedding_in_pipeline_split": True if o.pp_head_in_split and c.pp > 1 else None,
        "model.config.account_for_loss_in_pipeline_split": True if o.pp_head_in_split and c.pp > 1 else None,
    }
    if c.recompute == "full":
        flat.update({"model.config.recompute_method": "uniform", "model.config.recompute_num_layers": 1})
    if c.recompute == "mla-up-proj":  # Megatron-Core TransformerConfig.recompute_modules
        flat.update({"model.config.recompute_granularity": "selective",
                     "model.config.recompute_modules": ["mla_up_proj"]})
    elif c.recompute not in ("none", "full", "selective"):
        flat["model.config.recompute_granularity"] = c.recompute  # read back as not expressible
    if c.fsdp > 1:
        flat["trainer.strategy.ddp.data_parallel_sharding_strategy"] = "optim_grads_params"
    cli = "nemo llm pretrain --factory RECIPE " + " ".join(f"{k}={v}" for k, v in flat.items() if v is not None)
    lines = header_lines(plan, NAME) + [f"as NeMo-Run overrides: {cli}"]
    return commented(lines) + yaml.safe_dump(_unflatten({k: v for k, v in flat.items() if v is not None}),
                                             sort_keys=False)


USED = {"trainer.num_nodes", "trainer.devices", "trainer.strategy.tensor_model_parallel_size",
        "trainer.strategy.pipeline_model_parallel_size", "trainer.strategy.virtual_pipeline_model_parallel_size",
        "trainer.strategy.context_parallel_size", "trainer.strategy.expert_model_parallel_size",
        "trainer.strategy.expert_tensor_parallel_size", "model.config.expert_tensor_parallel_size",
        "trainer.strategy.sequence_parallel", "trainer.strategy.ddp.overlap_grad_reduce",
        "trainer.strategy.ddp.overlap_param_gather", "optim.config.use_distributed_optimizer",
        "trainer.strategy.ddp.use_distributed_optimizer", "model.config.tp_comm_overlap",
        "model.config.recompute_granularity", "model.config.recompute_method", "model.config.recompute_num_layers",
        "model.config.recompute_modules",
        "data.seq_length", "data.micro_batch_size", "data.global_batch_size", "trainer.plugins.fp8",
        "trainer.plugins.fp8_recipe", "trainer.strategy.ddp.data_parallel_sharding_strategy",
        "model.config.account_for_embedding_in_pipeline_split", "model.config.account_for_loss_in_pipeline_split",
        "trainer.strategy.account_for_embedding_in_pipeline_split", "trainer.strategy.account_for_loss_in_pipeline_split"}


def load(text: str, chips: int | None = None) -> Job:
    doc = yaml_mapping(text, "a NeMo override file")
    # a recipe serialised by NeMo-Run (fiddle) names each object's class in `_target_` (and `_partial_`): structure
    flat = {k: v for k, v in _flatten(doc).items() if k.rsplit(".", 1)[-1] not in ("_target_", "_partial_", "_call_")}
    known = framework_keys(NAME)
    job = Job(NAME, Pins())
    job.unknown_keys = sorted(k for k in flat if k not in known)
    job.unmodelled_keys = sorted(k for k in flat if k in known and k not in USED)
    def g(key, default=None):
        v = flat.get(key)
        v = default if v is None else v
        ints = ("size", "num_nodes", "devices", "seq_length", "batch_size", "num_layers")
        return whole(NAME, key, v) if key.endswith(ints) and not key.endswith("sequence_parallel") else v

    tp, pp = g("trainer.strategy.tensor_model_parallel_size", 1), g("trainer.strategy.pipeline_model_parallel_size", 1)
    cp, ep = g("trainer.strategy.context_parallel_size", 1), g("trainer.strategy.expert_model_parallel_size", 1)
    check_degrees(NAME, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                  expert_model_parallel_size=ep)
    if g("trainer.num_nodes") and g("trainer.devices"):
        job.chips = g("trainer.num_nodes") * g("trainer.devices")
    else:
        job.chips = chips
    if job.chips is None:
        raise MeshplanError("the NeMo file does not say trainer.num_nodes and trainer.devices: give --chips")
    data = divide(NAME, "chips", job.chips, tp * pp * cp)
    gran = flat.get("model.config.recompute_granularity")
    if gran not in (None, "full", "selective"):
        raise MeshplanError(f"nemo model.config.recompute_granularity must be full or selective, got '{gran}'")
    modules = flat.get("model.config.recompute_modules")
    if gran == "selective" and modules is not None:
        listed = [str(x) for x in modules] if isinstance(modules, list) else [str(modules)]
        gran = selective_recompute_of(NAME, "model.config.recompute_modules", listed)
    zero3 = g("trainer.strategy.ddp.data_parallel_sharding_strategy") == "optim_grads_params"
    vpp = g("trainer.strategy.virtual_pipeline_model_parallel_size") or 1
    distopt = bool(g("optim.config.use_distributed_optimizer") or g("trainer.strategy.ddp.use_distributed_optimizer"))
    job.pins = Pins(dp=1 if zero3 else data, fsdp=data if zero3 else 1, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep,
                    microbatch=g("data.micro_batch_size", 1), recompute=gran or "none",
                    zero=1 if distopt and not zero3 else 0, offload=0.0,
                    **NO_STATE_OFFLOAD,
                    sequence_parallel=bool(g("trainer.strategy.sequence_parallel", False)))
    job.seq_len, job.global_batch = g("data.seq_length"), g("data.global_batch_size")
    etp_key = next((k for k in ("trainer.strategy.expert_tensor_parallel_size", "model.config.expert_tensor_parallel_size")
                    if flat.get(k) is not None), "trainer.strategy.expert_tensor_parallel_size")
    job.options.update(expert_tp=expert_tp_of(NAME, etp_key, g(etp_key), tp),
                       compute_dtype="fp8" if g("trainer.plugins.fp8") else "bf16",
                       fp8_recipe=fp8_recipe_from_name("te", g("trainer.plugins.fp8_recipe", "delayed")),
                       tp_overlap=bool(g("model.config.tp_comm_overlap", False)),
                       dp_overlap=bool(g("trainer.strategy.ddp.overlap_grad_reduce", False)),
                       overlap_param_gather=bool(g("trainer.strategy.ddp.overlap_param_gather", False)),
                       pp_head_in_split=bool(g("model.config.account_for_loss_in_pipeline_split", False)
                                             or g("trainer.strategy.account_for_loss_in_pipeline_split", False)))
    return job
