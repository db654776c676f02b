"""Launchable configs out, existing configs in: one module per framework (DESIGN.md "export" / "import").

Training: torchtitan (job TOML), megatron (pretrain_gpt.py arguments), nemo (NeMo 2 recipe overrides), maxtext
(YAML), deepspeed (JSON, ZeRO plans). Serving: vllm, sglang (command lines), trtllm (trtllm-serve + YAML).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from meshplan.errors import MeshplanError, unknown_name_error
from meshplan.export import deepspeed, maxtext, megatron, nemo, torchtitan
from meshplan.export.common import Job, PlanToExport, check_expressible
from meshplan.specs._load import read_text

TRAIN: dict[str, ModuleType] = {m.NAME: m for m in (torchtitan, megatron, nemo, maxtext, deepspeed)}
SERVE = ("vllm", "sglang", "trtllm")
# the behaviour preset (train/frameworks.py) a plan for each framework is made with
PRESET = {"torchtitan": "torchtitan", "megatron": "megatron", "nemo": "nemo", "maxtext": "maxtext",
          "deepspeed": "deepspeed"}


def train_module(name: str) -> ModuleType:
    if name not in TRAIN:
        raise unknown_name_error("training framework to export to", name, TRAIN)
    return TRAIN[name]


def export_train(name: str, plan: PlanToExport) -> tuple[str, str]:
    """(file name, text) of `plan` in framework `name`; refused when the file would describe another plan."""
    mod = train_module(name)
    kinds = getattr(mod, "CHIP_KINDS", None)
    if kinds and plan.problem.chip.kind not in kinds:
        raise MeshplanError(f"{name} cannot express this plan: it runs on {' or '.join(kinds).upper()}s, not "
                            f"{plan.problem.chip.name} ({plan.problem.chip.kind})")
    text = mod.export(plan)
    job = mod.load(text, None)  # an exported file states every degree itself
    job.finish(plan.problem.model)
    check_expressible(name, plan, job, getattr(mod, "REASONS", None))
    return f"{name}{mod.SUFFIX}", text


def detect_train_format(path: Path, text: str) -> str:
    """Which framework wrote a training config: by its suffix, then by the keys it uses."""
    suffix = path.suffix.lower()
    if suffix == ".toml":
        return "torchtitan"
    if suffix == ".json":
        return "deepspeed"
    if "pretrain_gpt" in text or "--tensor-model-parallel-size" in text or "--micro-batch-size" in text:
        return "megatron"
    if suffix in (".yml", ".yaml"):
        import yaml

        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise MeshplanError(f"{path}: not a YAML file: {str(exc).splitlines()[0]}") from None
        if isinstance(doc, dict) and any(k in doc for k in ("trainer", "data", "model", "optim")) and \
                isinstance(doc.get("trainer", doc.get("data", {})), dict) and not any(
                    str(k).startswith(("ici_", "dcn_")) for k in doc):
            return "nemo"
        return "maxtext"
    raise MeshplanError(f"cannot tell which framework wrote {path}: use a .toml (torchtitan), .yml (MaxText, NeMo), "
                        ".json (DeepSpeed) or a file of pretrain_gpt.py arguments (Megatron-LM)")


def load_train(path: Path, chips: int | None) -> Job:
    text = read_text(path, "training config")
    return TRAIN[detect_train_format(path, text)].load(text, chips)


__all__ = ["TRAIN", "SERVE", "PRESET", "Job", "PlanToExport", "export_train", "load_train", "train_module"]
