"""DeepSpeed JSON for ZeRO plans (data parallelism only: DeepSpeed's config file carries no tensor, pipeline or
context degree). Keys: deepspeed/runtime/constants.py, zero/config.py and activation_checkpointing/config.py at
deepspeedai/DeepSpeed@edaa7221 (data/deepspeed_keys.txt): train_batch_size, train_micro_batch_size_per_gpu,
gradient_accumulation_steps, bf16.enabled, zero_optimization.{stage, overlap_comm, contiguous_gradients,
offload_optimizer.device, offload_param.device}, activation_checkpointing.{partition_activations, cpu_checkpointing}.
Model-state offload: ZeRO-Offload's `offload_optimizer` (stages 1-3) and ZeRO-Infinity's `offload_param` (stage 3
only), both to "cpu" (DeepSpeed docs, config-json "Parameter offloading" / "Optimizer offloading").
"""

from __future__ import annotations

import json

from meshplan.errors import MeshplanError
from meshplan.export.common import (
    Job,
    PlanToExport,
    check_degrees,
    divide,
    framework_keys,
    header_lines,
    refuse,
    whole,
)
from meshplan.train.space import Pins

NAME = "deepspeed"
PINS = {"tp": 1, "pp": 1, "cp": 1, "ep": 1}  # a DeepSpeed config is data parallel only
CHIP_KINDS = ("gpu",)  # PyTorch on NVIDIA GPUs
SUFFIX = ".json"
SWITCHES = {"dp_overlap": ({"dp_overlap": True}, '"zero_optimization": {"overlap_comm": true}')}
# activation_checkpointing: whole layers or nothing; ZeRO-3 over every data-parallel rank (REASONS)
CHOICES = {"recompute_choices": ("none", "full"), "fsdp_replicas": False}
# said when `train --framework deepspeed` can run none of the plans: the degrees a DeepSpeed file cannot hold are
# set by the model script of Megatron-DeepSpeed (its --tensor-model-parallel-size, --pipeline-model-parallel-size)
TRAIN_HINT = ("For Megatron-DeepSpeed's 3D layouts (tensor and pipeline parallelism in the model script, ZeRO-1 in "
              "the config), plan with --framework megatron --zero 1")

REASONS = {
    "tp": "a DeepSpeed config has no tensor-parallel degree (Megatron-DeepSpeed sets it in the model script)",
    "pp": "the pipeline engine is built in the model script, not the config", "cp": "no context parallelism",
    "ep": "DeepSpeed-MoE sets expert parallelism in the model script",
    "dp": "ZeRO-3 shards over every data-parallel rank",
    "recompute": "activation_checkpointing recomputes whole layers (full) or nothing",
    "offload": "cpu_checkpointing moves every checkpoint (offload 1 with full recompute)",
    "compute_dtype": "FP8 comes from Transformer Engine in the model, not the config",
    "offload_params": "offload_param is valid only with ZeRO stage 3 (FSDP in meshplan's terms)",
}


def export(plan: PlanToExport) -> str:
    c, o, p = plan.config, plan.options, plan.problem
    data = c.dp * c.fsdp
    stage = 3 if c.fsdp > 1 else c.zero
    doc = {
        "_meshplan": header_lines(plan, NAME),
        "train_batch_size": p.global_batch,
        "train_micro_batch_size_per_gpu": c.microbatch,
        "gradient_accumulation_steps": divide(NAME, "global batch", p.global_batch, data * c.microbatch),
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "overlap_comm": bool(o.overlaps(p.chip.kind)[1]),
                              "contiguous_gradients": True},
    }
    if c.offload_params and stage != 3:
        raise refuse(NAME, "offload_params", c.offload_params, REASONS)
    if c.offload_optimizer:  # ZeRO-Offload: the optimizer state and step on the host CPU
        doc["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if c.offload_params:  # ZeRO-Infinity: the weights on the host, fetched per layer
        doc["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    if c.recompute == "full":
        doc["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": c.offload == 1.0}
    # JSON has no comments: the header rides in a top-level `_meshplan` key; DeepSpeedConfig looks up the top-level
    # keys it knows (deepspeed/runtime/config.py), only its sub-configs such as zero_optimization forbid extra keys
    return json.dumps(doc, indent=2) + "\n"


USED = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "bf16.enabled",
        "zero_optimization.stage", "zero_optimization.overlap_comm", "activation_checkpointing.cpu_checkpointing",
        "activation_checkpointing.partition_activations", "_meshplan", "fp16.enabled",
        "zero_optimization.offload_optimizer", "zero_optimization.offload_param"}


def load(text: str, chips: int | None = None) -> Job:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MeshplanError(f"not a JSON file: {exc}") from None
    if not isinstance(doc, dict):
        raise MeshplanError("a DeepSpeed config is a JSON object")
    doc = {k: v for k, v in doc.items() if v is not None}
    flat = {}
    for k, v in doc.items():
        if isinstance(v, dict):
            flat.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        else:
            flat[k] = v
    known = framework_keys(NAME)
    job = Job(NAME, Pins())
    job.unknown_keys = sorted(k for k in flat if k not in known and k != "_meshplan")
    job.unmodelled_keys = sorted(k for k in flat if k in known and k not in USED)
    mb = whole(NAME, "train_micro_batch_size_per_gpu", doc.get("train_micro_batch_size_per_gpu"))
    gb = whole(NAME, "train_batch_size", doc.get("train_batch_size"))
    accum = whole(NAME, "gradient_accumulation_steps", doc.get("gradient_accumulation_steps", 1))
    if gb is None and chips and mb:
        gb = mb * accum * chips
    if gb is None or mb is None:
        raise MeshplanError("the DeepSpeed config needs train_batch_size and train_micro_batch_size_per_gpu")
    data = divide(NAME, "train_batch_size", gb, mb * accum)  # train_batch_size = micro x accumulation x ranks
    check_degrees(NAME, data_parallel_ranks=data, train_micro_batch_size_per_gpu=mb)
    if chips is not None and chips != data:
        raise MeshplanError(f"the DeepSpeed config describes {data} data-parallel ranks, not --chips {chips}")
    z = doc.get("zero_optimization") or {}
    if not isinstance(z, dict):
        raise MeshplanError("deepspeed file: zero_optimization must be an object")
    stage = z.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise MeshplanError(f"deepspeed zero_optimization.stage must be 0-3, got {stage}")
    offloaded = {}
    for key, flag in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_params")):
        spec = z.get(key) or {}
        device = spec.get("device", "none") if isinstance(spec, dict) else spec
        if device not in ("none", "cpu"):
            raise MeshplanError(f"deepspeed zero_optimization.{key}.device '{device}': meshplan models host (cpu) "
                                "offload only")
        offloaded[flag] = int(device == "cpu")
    if offloaded["offload_params"] and stage != 3:
        raise MeshplanError("deepspeed zero_optimization.offload_param needs stage 3")
    ac = doc.get("activation_checkpointing")
    full = isinstance(ac, dict)
    job.chips, job.global_batch = data, gb
    job.pins = Pins(dp=1 if stage == 3 else data, fsdp=data if stage == 3 else 1, tp=1, pp=1, vpp=1, cp=1, ep=1,
                    microbatch=mb, recompute="full" if full else "none", zero=0 if stage == 3 else stage,
                    offload=1.0 if full and ac.get("cpu_checkpointing") else 0.0, **offloaded,
                    sequence_parallel=True)
    job.options.update(dp_overlap=bool(z.get("overlap_comm", False)), compute_dtype="bf16")
    job.notes.append("DeepSpeed configs do not state the sequence length: give --seq-len")
    return job
