"""Turn an entry of shared/reference/training_measurements.yaml into a meshplan problem at its published layout.

Only what the source prints is used: the architecture, chip, fabric, parallel degrees, micro-batch,
recompute and precision. What the source leaves out (e.g. the micro-batch) is left for meshplan to choose.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

import yaml

from meshplan.math import transformer as tm
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import ModelConfig
from meshplan.train.costmodel import Options
from meshplan.train.space import Pins, Problem

ROOT = Path(__file__).resolve().parents[1]
_REF = [Path(os.environ["MESHPLAN_REFERENCE_DIR"])] if os.environ.get("MESHPLAN_REFERENCE_DIR") else []
_REF += [ROOT.parent / "shared" / "reference", ROOT / "tests" / "reference"]
REF_DIR = next(p for p in _REF if (p / "training_measurements.yaml").is_file())

CHIPS = {  # published chip description -> catalog preset
    "A100-SXM4-80GB": "a100-80gb",
    "A100 (DGX A100; memory size not stated, 2020)": "a100-40gb",
    "H100 96GB HBM2e (SXM-class, 500W power limit)": "h100-sxm-96gb",
    "TPU v5e": "tpu-v5e",
    "V100-SXM3-32GB (DGX-2)": "v100-32gb",
}
# Published scale-out fabrics that differ from the catalog chip's default (bytes/s per chip, one way).
FABRICS = {
    # Jean Zay (BLOOM): 4 Omni-Path 100 Gb/s links per 8-GPU node (BLOOM paper §3.1, Le Scao et al. 2022)
    "Omni-Path": 4 * 100e9 / 8 / 8,
}


def load_entries() -> list[dict]:
    return yaml.safe_load((REF_DIR / "training_measurements.yaml").read_text())


def model_of(e: dict) -> ModelConfig:
    m = e["model"]
    act = m["ffn_act"]
    gpt = act == "gelu"
    name = m["name"]
    return ModelConfig(
        name=name, n_layers=m["layers"], d_model=m["d_model"], n_heads=m["heads"],
        n_kv_heads=m.get("kv_heads") or m["heads"], head_dim=m.get("head_dim") or m["d_model"] // m["heads"],
        d_ff=m["ffn"], vocab_size=m["vocab"], max_seq_len=m.get("seq_len") or e["training"]["seq_len"],
        mlp_act="swiglu" if act == "swiglu" else ("relu" if act.startswith("relu") else "gelu"),
        tied_embeddings=bool(m.get("tied_embeddings")),
        position="alibi" if "BLOOM" in name else ("learned" if gpt else "rotary"),
        norm="layernorm" if gpt else "rmsnorm", linear_bias=gpt, family="gpt2" if gpt else "llama",
    )


def chip_of(e: dict):
    chip = load_chip(CHIPS[e["hardware"]["chip"]])
    inter = str(e["hardware"].get("inter_node") or "")
    for key, bw in FABRICS.items():
        if key in inter:
            chip = replace(chip, links=replace(chip.links, scale_out_bandwidth_bytes_per_s=bw))
    return chip


def recompute_of(e: dict) -> str:
    r = str(e["training"]["recompute"]).lower()
    if r.startswith("selective"):
        return "selective"
    if r.startswith("none"):
        return "none"
    return "full"


def pins_of(e: dict) -> Pins:
    """The published degrees. dp counts FSDP shards as DP ranks (training_measurements convention)."""
    p, t = e["parallel"], e["training"]
    dp_total = p["dp"]
    zero = p.get("zero_stage") or 0
    fsdp = p.get("fsdp")
    if zero == 3 or fsdp:
        shard = dp_total if fsdp in (None, True) else int(fsdp)
        dp, fs, z = dp_total // shard, shard, 0
    else:
        dp, fs, z = dp_total, 1, int(zero)
    vpp = p.get("vpp")
    if isinstance(vpp, str) and "interleaved" in vpp:
        vpp = 2  # interleaving with the stage count unstated: 2 virtual stages per rank, the common default
    mb = t.get("micro_batch")
    if mb is None and e["group"].startswith(("torchtitan", "megatron2020", "megatron_2020")):
        # torchtitan (2024) and the 2020 Megatron runs had no gradient accumulation: the local batch is the
        # micro-batch; with pipelining torchtitan splits it into pp micro-batches
        mb = max(1, t["global_batch_seqs"] // dp_total // ((p["pp"] or 1) if (p["pp"] or 1) > 1 else 1))
    return Pins(dp=dp, fsdp=fs, tp=p["tp"] or 1, pp=p["pp"] or 1, cp=p.get("cp") or 1, ep=p.get("ep") or 1,
                vpp=vpp if isinstance(vpp, int) else (None if vpp else 1), microbatch=mb,
                recompute=recompute_of(e), zero=z, sequence_parallel=bool(p.get("sequence_parallel")),
                offload=0.0)  # none of the published runs offloads activations


def options_of(e: dict) -> Options:
    prec = str(e["training"]["precision"]).lower()
    return Options(
        compute_dtype="fp8" if "float8" in prec or "fp8" in prec else "bf16",
        tp_overlap=True if "asynctp" in prec else None,
        # MaxText keeps fp32 master weights but casts them to bf16 before use; XLA's SPMD partitioner
        # places the all-gather after the cast, so FSDP gathers move 2 bytes per parameter (the default)
        dropout="BLOOM" in e["model"]["name"] or e["group"].startswith("megatron"),
        flash_attention=not (e["group"].startswith("megatron") or "bloom" in e["group"]),
        headroom=0.0,
        # torchtitan rows without torch.compile ran eager PyTorch: one kernel per pointwise op
        selective_flavor=_selective_flavor(e),
        fused_elementwise=not (e["group"].startswith("torchtitan") and "compile" not in prec),
        # torchtitan compiles the transformer blocks only: its loss is eager F.cross_entropy on fp32 logits
        fused_loss=not e["group"].startswith("torchtitan"),
        # ZeRO-3 / FSDP shards over every rank holding the same weights, the CP ranks included (torchtitan)
        fsdp_over_cp=(e["parallel"].get("zero_stage") or 0) == 3,
        zero3_fetch=_zero3_fetch(e),
        # DeepSpeed reduces gradients in the model's dtype (its `communication_data_type` default); Megatron and
        # torchtitan reduce in fp32
        grad_reduce_bytes=2.0 if "deepspeed" in str(e["parallel"].get("notes", "")).lower()
        and "fp16" in prec else 4.0,
    )


def _zero3_fetch(e: dict) -> str:
    """DeepSpeed ZeRO-3 before ZeRO-Infinity's bandwidth-centric partitioning (DeepSpeed v0.3.15, April 2021,
    arXiv:2104.07857 §6.1) fetched parameters by owner broadcast (ZeRO paper §7.2.2); later DeepSpeed and
    every FSDP all-gather. The era is read from the source's arXiv number (yymm)."""
    p = e["parallel"]
    if (p.get("zero_stage") or 0) != 3 or "deepspeed" not in str(p.get("notes", "")).lower():
        return "allgather"
    m = re.search(r"arXiv:(\d{4})\.", str(e["source"].get("ref", "")))
    return "broadcast" if m and int(m.group(1)) <= 2104 else "allgather"


def _selective_flavor(e: dict) -> str:
    r = str(e["training"]["recompute"]).lower()
    if e["group"].startswith("torchtitan") and "(op)" in r:
        return "op"
    if e["group"].startswith("torchtitan") and "(layer)" in r:
        return "layer"
    return "attention"


def problem_of(e: dict) -> Problem:
    t = e["training"]
    return Problem(model_of(e), chip_of(e), e["hardware"]["count"], t["seq_len"], t["global_batch_seqs"])


def measured_step_time_s(e: dict) -> float:
    """Measured step time, or the source's own arithmetic turned into one (flops_conventions.md recipe)."""
    meas, der = e["measured"], e.get("derived") or {}
    if meas.get("step_time_s"):
        return float(meas["step_time_s"])
    if der.get("step_time_s"):
        return float(der["step_time_s"])
    if e["flops_convention"] == "maxtext_6N_plus_attention":
        # MaxText: 6·N_total·tokens + 12·H·L·hd·s²·B per device (non-causal in the Nov-2023 code)
        m = model_of(e)
        s = e["training"]["seq_len"]
        seqs_dev = e["training"]["global_batch_seqs"] / e["hardware"]["count"]
        n_total = tm.param_counts(m).total
        flops_dev = 6 * n_total * s * seqs_dev + 12 * m.n_heads * m.n_layers * m.head_dim * s * s * seqs_dev
        return flops_dev / (float(meas["tflops_per_chip"]) * 1e12)
    raise ValueError(f"{e['id']}: no step time in the source")


def measured_mfu(e: dict) -> float | None:
    der = e.get("derived") or {}
    return der.get("mfu_model_flops_no_recompute") or e["measured"].get("mfu")


def measured_memory_bytes(e: dict) -> float | None:
    """Peak memory per GPU the source reports: torchtitan's max over GPUs (GiB, the caching allocator's
    reserved peak) or BLOOM's notes ('59GB', read as GiB as nvidia-smi's MiB figures are)."""
    meas = e["measured"]
    if meas.get("peak_memory_gib_max_over_gpus"):
        return float(meas["peak_memory_gib_max_over_gpus"]) * 2**30
    m = re.fullmatch(r"\s*([\d.]+)\s*GB\s*", str(meas.get("peak_gpu_memory_reported") or ""))
    return float(m.group(1)) * 2**30 if m else None
