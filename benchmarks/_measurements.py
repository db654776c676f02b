"""Turn an entry of shared/reference/training_measurements.yaml into a meshplan problem at its published layout.

Only what the source prints is used: the architecture, chip, fabric, parallel degrees, micro-batch,
recompute and precision. What the source leaves out (e.g. the micro-batch) is left for meshplan to choose.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import yaml

from meshplan.cost.topology import default_slice_shape, make_cluster
from meshplan.errors import MeshplanError
from meshplan.math import transformer as tm
from meshplan.specs.hardware import load_chip, match_chip
from meshplan.specs.model import ModelConfig, load_model, preset_models, validate_model
from meshplan.train.costmodel import Options
from meshplan.train.frameworks import (
    FRAMEWORKS,
    attention_kernel_of,
    date_of,
    fp8_recipe_of,
    fp8_scope_of,
    grad_reduce_bytes_of,
    megatron_selective_policy,
    options_from_notes,
    preset,
    torchtitan_selective_flavor,
    version_at,
    weight_dtype_bytes_of,
    zero3_fetch_of,
)
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
# Line rates of fabrics that descriptions name without a number (bits/s per link or port, one way).
LINK_RATES_BIT_PER_S = {
    "omni-path": 100e9, "opa": 100e9,  # Intel Omni-Path 100 Series (Jean Zay, BLOOM paper §3.1)
    "edr": 100e9, "hdr": 200e9, "ndr": 400e9, "xdr": 800e9,  # InfiniBand generations (IBTA roadmap)
}
# scale_out_kind by the words a description uses (collective efficiencies differ per kind)
FABRIC_KINDS = (("infiniband", "infiniband"), (" ib", "infiniband"), ("hdr", "infiniband"), ("ndr", "infiniband"),
                ("roce", "roce"), ("efa", "ethernet"), ("ethernet", "ethernet"))


def load_entries() -> list[dict]:
    entries = yaml.safe_load((REF_DIR / "training_measurements.yaml").read_text()) or []
    for e in entries:
        if isinstance(e, dict):
            e.setdefault("group", "ungrouped")
    return entries


def _int(x) -> int:
    """An integer from a number or the first integer in a string ('8 experts' -> 8); 0 when absent."""
    if isinstance(x, bool) or x is None:
        return 0
    if isinstance(x, (int, float)):
        return int(x)
    found = re.search(r"\d+", str(x))
    return int(found.group()) if found else 0


def _first(d: dict, *keys, default=0):
    for k in keys:
        if d.get(k) not in (None, ""):
            return d[k]
    return default


def _activation(act: str) -> str:
    """'swiglu', 'SwiGLU (gated SiLU)', 'geglu', 'gelu', 'relu (single up-projection)', 'squared relu' -> ModelConfig."""
    a = act.lower()
    if "swi" in a or "silu" in a:
        return "swiglu"
    if "geglu" in a or ("gelu" in a and "gat" in a):
        return "geglu"
    if "relu" in a:
        return "relu"
    return "gelu"


def _moe_fields(m: dict) -> dict:
    """The optional `moe` block (experts, top-k, expert width, shared experts) under the key names sources use."""
    moe = m.get("moe")
    if not moe:
        return {}
    if not isinstance(moe, dict):
        nums = [int(x) for x in re.findall(r"\d+", str(moe))]
        return {"n_experts": nums[0], "experts_per_token": nums[1]} if len(nums) >= 2 else {}
    # key names as papers, Megatron (--num-experts, --moe-router-topk, --moe-ffn-hidden-size) and Hugging Face
    # configs (num_local_experts, n_routed_experts, num_experts_per_tok, moe_intermediate_size) spell them
    experts = _int(_first(moe, "experts", "num_experts", "n_experts", "routed_experts", "n_routed_experts",
                          "num_local_experts", "num_moe_experts", "E"))
    topk = _int(_first(moe, "top_k", "topk", "k", "experts_per_token", "num_experts_per_tok", "moe_router_topk",
                       "router_topk", "active_experts", "active"))
    if experts <= 1 or topk <= 0:
        return {}
    out = {"n_experts": experts, "experts_per_token": topk}
    width = _int(_first(moe, "expert_ffn", "ffn", "moe_ffn", "expert_d_ff", "d_ff", "ffn_expert", "expert_hidden",
                        "moe_intermediate_size", "moe_ffn_hidden_size", "ffn_per_expert", "intermediate_size"))
    if width:
        out["d_ff"] = width
    shared = _int(_first(moe, "shared_experts", "n_shared_experts", "num_shared_experts", "shared"))
    shared_width = _int(_first(moe, "shared_ffn", "shared_expert_ffn", "shared_d_ff",
                               "moe_shared_expert_intermediate_size", "shared_expert_intermediate_size"))
    if shared:
        out["n_shared_experts"] = shared
        out["shared_expert_d_ff"] = shared_width or out.get("d_ff", _int(m.get("ffn")))
    return out


def model_of(e: dict) -> ModelConfig:
    m = e["model"]
    act = _activation(str(m.get("ffn_act") or "swiglu"))
    name = str(m.get("name") or e["id"])
    gpt = act == "gelu"  # GPT-style (non-gated GELU): learned positions, LayerNorm, biases
    heads = _int(m["heads"])
    d = _int(m["d_model"])
    seq = _int(m.get("seq_len")) or seq_len_of(e)
    # an unprinted MLP width or vocabulary takes the architecture's convention: 4d for a plain MLP, 8d/3 rounded
    # up to 256 for a gated one (LLaMA, Touvron et al. 2023 §2.2); 32,000 tokens (LLaMA's tokenizer)
    ffn = _int(m.get("ffn")) or (4 * d if act in ("gelu", "relu") else -(-8 * d // 3 // 256) * 256)
    fields = dict(
        name=name, n_layers=_int(m["layers"]), d_model=d, n_heads=heads,
        n_kv_heads=_int(m.get("kv_heads")) or heads, head_dim=_int(m.get("head_dim")) or d // max(heads, 1),
        d_ff=ffn, vocab_size=_int(m.get("vocab")) or 32000, max_seq_len=seq, mlp_act=act,
        tied_embeddings=bool(m.get("tied_embeddings")),
        position="alibi" if "bloom" in name.lower() else ("learned" if gpt else "rotary"),
        norm="layernorm" if gpt else "rmsnorm", linear_bias=gpt, family="gpt2" if gpt else "llama",
    )
    fields.update(_moe_fields(m))
    # multi-head latent attention (DeepSeek-V2/V3), under the Hugging Face key names or in an `mla` block
    mla = dict(m, **(m.get("mla") or {})) if isinstance(m.get("mla"), dict) else m
    if _int(mla.get("kv_lora_rank")):
        fields.update(kv_lora_rank=_int(mla["kv_lora_rank"]), q_lora_rank=_int(mla.get("q_lora_rank")),
                      qk_rope_head_dim=_int(mla.get("qk_rope_head_dim")), v_head_dim=_int(mla.get("v_head_dim")))
        if _int(mla.get("qk_nope_head_dim")):
            fields["head_dim"] = _int(mla["qk_nope_head_dim"])
    moe_block = m.get("moe") if isinstance(m.get("moe"), dict) else {}
    dense = _int(_first(m, "first_k_dense_replace", "first_dense_layers")
                 or _first(moe_block, "first_k_dense_replace", "first_dense_layers"))
    if dense and fields.get("n_experts"):
        fields.update(first_dense_layers=dense, dense_d_ff=_int(m.get("ffn")))
    model = _catalog_architecture(ModelConfig(**fields))
    validate_model(model)  # a missing or zero size is a clear error, not a NaN step time
    return model


# Architecture the measurement schema has no field for, taken from the catalog model of the same name when its
# sizes are the entry's (the catalog file is the model's Hugging Face config.json, its `_source`): gpt-oss's
# alternating 128-token sliding window, attention sinks and linear biases (gpt-oss model card; the entries'
# model_source: "not expressible in the schema"), and its YaRN RoPE scaling (config.json rope_scaling)
CATALOG_ONLY_FIELDS = ("layer_windows", "window_kind", "attention_sinks", "linear_bias", "qkv_bias", "out_bias",
                       "router_bias", "glu_limit", "rope_scaling")
_SIZE_FIELDS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size", "n_experts",
                "experts_per_token")


def _catalog_architecture(model: ModelConfig) -> ModelConfig:
    """`model` with CATALOG_ONLY_FIELDS from the catalog model named like it, where every size agrees."""
    key = model.name.lower()
    if key not in preset_models():
        return model
    cat = load_model(key)
    if any(getattr(cat, f) != getattr(model, f) for f in _SIZE_FIELDS):
        return model
    return replace(model, **{f: getattr(cat, f) for f in CATALOG_ONLY_FIELDS})


def chip_of(e: dict):
    """The catalog chip the entry names, with the scale-out network its hardware text describes."""
    hw = e["hardware"]
    desc = str(hw["chip"])
    chip = load_chip(CHIPS.get(desc) or match_chip(desc))
    if chip.links.is_torus:
        return chip
    gpus = re.search(r"(\d+)\s*(?:x\s*)?(?:[a-z0-9-]+\s+)?gpus?\b", str(hw.get("intra_node") or "").lower())
    bw, kind = scale_out_of(str(hw.get("inter_node") or ""), int(gpus.group(1)) if gpus else
                            chip.links.nvlink_domain_size)
    links = chip.links
    if bw:
        links = replace(links, scale_out_bandwidth_bytes_per_s=bw)
    if kind:
        links = replace(links, scale_out_kind=kind)
    return replace(chip, links=links)


def scale_out_of(text: str, gpus_per_node: int) -> tuple[float | None, str | None]:
    """(bytes/s per GPU one way, fabric kind) read from a description of the inter-node network: '8x 200 Gb/s HDR
    InfiniBand HCAs per node', 'RDMA 400 Gb/s per GPU', '3200 Gbps EFA per node', '4 OPA links per node'. A count
    ('8x', '4 links') multiplies the rate and makes it the node's unless the text says per GPU; a bare rate is per
    GPU unless the text says per node/host. None for what the text does not say."""
    t = " " + text.lower().replace("×", "x") + " "
    kind = next((k for word, k in FABRIC_KINDS if word in t), None)
    # the case says the unit: 'Gb/s' / 'Gbps' are bits (the NIC rating), 'GB/s' / 'GBps' bytes (8 bits each)
    rate = re.search(r"(\d+(?:\.\d+)?)\s*([GT])(b/s|bps|bit/s|bits/s|B/s|Bps)", " " + text.replace("×", "x") + " ",
                     re.IGNORECASE)
    if rate:
        unit = 8.0 if rate.group(3) in ("B/s", "Bps") else 1.0
        bits = float(rate.group(1)) * (1e12 if rate.group(2).lower() == "t" else 1e9) * unit
    else:
        bits = next((r for name, r in LINK_RATES_BIT_PER_S.items() if name in t), None)
        if bits is None:
            return None, kind
    count = re.search(r"(\d+)\s*x\s|(\d+)\s+(?:[a-z-]+\s+){0,2}(?:links|ports|nics|hcas|adapters|cards)\b", t)
    n = int(count.group(1) or count.group(2)) if count else 1
    # a count of NICs without 'per GPU' describes the node ('8x 400 Gb/s NDR')
    per_node = (re.search(r"per\s+(?:node|host|server)|/\s*(?:node|host)", t) is not None
                or (count is not None and re.search(r"per\s+(?:gpu|accelerator|device)", t) is None))
    total = n * bits / 8
    if total <= 0:
        return None, kind
    return (total / gpus_per_node if per_node else total), kind


def recompute_of(e: dict) -> str | None:
    """The published recompute policy. Where the source does not name one but prints both HFU and MFU, their
    ratio says how much of the forward was run again (full recompute: 8/6 = 1.33). Otherwise None: meshplan
    chooses."""
    r = str(e["training"].get("recompute") or "").lower().strip()
    if _maxtext_custom_offload(r):
        return "full"
    if r == "gemm-last":  # meshplan's own name, where a row's reading says so (its comment gives the source)
        return r
    listed = re.search(r"selective\s*\(([^)]*)\)", r)
    if listed and not set(w.strip() for w in listed.group(1).split(",")) <= {"op", "layer"}:
        # Megatron-Core's recompute modules as printed ('selective (norm, act)'); torchtitan's '(op)'/'(layer)' below
        return megatron_selective_policy([w.strip() for w in listed.group(1).split(",")])
    if "selective" in r or "partial" in r:
        return "selective"
    if "full" in r:
        return "full"
    if r.startswith(("none", "no ", "off", "false", "disabled")) or r == "no":
        return "none"
    meas, der = e["measured"], e.get("derived") or {}
    hfu, mfu = _num(meas, "hfu") or _num(der, "hfu"), _num(meas, "mfu") or _num(der, "mfu")
    if hfu and mfu:
        ratio = hfu / mfu
        return "full" if ratio >= 1.2 else ("selective" if ratio >= 1.02 else "none")
    if any(k in r for k in ("remat", "checkpoint")):
        return "full"
    return None


def _maxtext_custom_offload(recompute: str) -> bool:
    """MaxText's `remat_policy: custom` with tensors marked `offload`. Every checkpoint name left unset is
    rematerialized: MaxText's RematAndOffload config defaults `decoder_layer_input` to 'device' and every other name
    (context, mlpwi*, mlpwo, query/key/value/out_proj) to 'remat' (src/MaxText/configs/types.py). So offloading
    decoder_layer_input (+ the q/k/v/out projections) keeps nothing per layer in HBM: full recompute from the layer
    input, which lives in host memory ("other activations saved" in a row's text is not what the policy does)."""
    return "custom" in recompute and "offload" in recompute and "decoder_layer_input" in recompute


def kept_projections_of(e: dict) -> tuple[str, ...]:
    """The attention projections a MaxText custom remat policy names beside decoder_layer_input (kept on the host,
    not rematerialised; Options.kept_projections)."""
    r = str(e["training"].get("recompute") or "").lower()
    if not _maxtext_custom_offload(r):
        return ()
    return tuple(n for n in ("query_proj", "key_proj", "value_proj", "out_proj") if n in r)


def _capacity_factor(text: str) -> float:
    """MaxText's capacity_factor where a run prints it with the sparse kernels off ('megablox false, sparse_matmul
    false, capacity_factor 1.25'): the dropping einsum MoE (Options.moe_capacity_factor); else 0 (dropless)."""
    m = re.search(r"capacity_factor[\s:=]*([\d.]+)", text)
    sparse_off = "megablox false" in text and "sparse_matmul false" in text
    return float(m.group(1)) if m and sparse_off else 0.0


def _vpp_of(vpp) -> int | None:
    """vpp as printed: an integer, null (no interleaving), or text ('interleaved', '2 chunks')."""
    if vpp is None or vpp is False:
        return 1
    if isinstance(vpp, bool):
        return None  # interleaved, count unstated
    if isinstance(vpp, (int, float)):
        return max(int(vpp), 1)
    n = _int(vpp)
    if n:
        return n
    # interleaving with the stage count unstated: 2 virtual stages per rank, the common default
    return 2 if "interleav" in str(vpp).lower() else 1


def harness_notes(e: dict) -> list[str]:
    """What the harness changed while reading the entry, shown next to its row."""
    return e.setdefault("_harness_notes", [])


def pins_of(e: dict) -> Pins:
    """The published degrees. dp counts FSDP shards as DP ranks (training_measurements convention)."""
    p, t = e["parallel"], e["training"]
    tp, pp, cp = _int(p.get("tp")) or 1, _int(p.get("pp")) or 1, _int(p.get("cp")) or 1
    chips = _int(e["hardware"]["count"])
    dp_total = _int(p.get("dp")) or max(chips // (tp * pp * cp), 1)
    if chips > 0 and dp_total * tp * pp * cp != chips and chips % (tp * pp * cp) == 0:
        # a printed dp that does not close the product (a typo, or a count that includes other axes): the chip
        # count and the model-parallel degrees decide, and the row says so
        note = f"dp {dp_total} -> {chips // (tp * pp * cp)} (tp·pp·cp·dp = chips)"
        if note not in harness_notes(e):  # reading the entry again must not repeat it
            harness_notes(e).append(note)
        dp_total = chips // (tp * pp * cp)
    zero = _int(p.get("zero_stage"))
    fsdp = p.get("fsdp")
    if zero == 3 or fsdp:
        shard = dp_total if fsdp in (None, True) or _int(fsdp) < 1 else min(_int(fsdp), dp_total)
        dp, fs, z = max(dp_total // shard, 1), shard, 0
    else:
        dp, fs, z = dp_total, 1, min(zero, 2)
    mb = _int(t.get("micro_batch")) or None
    accum = _int(t.get("grad_accum"))
    if mb is not None and _is_maxtext(e) and pp == 1 and not accum:
        # MaxText prints per_device_batch_size, sequences per chip: a data rank (dp x fsdp) runs the tp x cp chips'
        # share in one pass (global batch = per_device_batch_size x chips, no gradient accumulation unless
        # gradient_accumulation_steps says so; MaxText configs/base.yml; export/maxtext.py reads a file the same way)
        mb *= tp * cp
    if mb is None and accum > 0 and global_batch_of(e) % (dp_total * accum) == 0:
        mb = global_batch_of(e) // (dp_total * accum)  # global batch = dp × micro-batch × accumulation steps
    if mb is None and (_is_torchtitan(e) or e["group"].startswith(("megatron2020", "megatron_2020"))):
        # torchtitan (2024) and the 2020 Megatron runs had no gradient accumulation: the local batch is the
        # micro-batch; with pipelining torchtitan splits it into pp micro-batches
        mb = max(1, global_batch_of(e) // dp_total // (pp if pp > 1 else 1))
    recipe = mbridge_recipe_of(e)  # what a Megatron-Bridge row's recipe ran where the table prints no recompute
    offload = 1.0 if _maxtext_custom_offload(str(t.get("recompute") or "").lower()) else recipe.get("offload", 0.0)
    return Pins(dp=dp, fsdp=fs, tp=tp, pp=pp, cp=cp, ep=_int(p.get("ep")) or 1, vpp=_vpp_of(p.get("vpp")),
                microbatch=mb, recompute=recompute_of(e) or recipe.get("recompute"), zero=z,
                sequence_parallel=_sequence_parallel(e, tp), offload=offload,
                offload_optimizer=0, offload_params=0)  # no published run offloads model state


def _sequence_parallel(e: dict, tp: int) -> bool:
    """Megatron's flag as printed; on TPUs MaxText shards the residual stream's embed dimension over the tensor
    axis (its `activation_embed -> tensor` rule), which divides pointwise work and saved activations by tp and
    turns TP traffic into all-gather + reduce-scatter, as sequence parallelism does."""
    return bool(e["parallel"].get("sequence_parallel")) or (_is_tpu(e) and tp > 1)


def _is_maxtext(e: dict) -> bool:
    """A MaxText run: the new data's `framework: maxtext`, or the reference set's MaxText groups."""
    return e.get("framework") == "maxtext" or str(e.get("group", "")).startswith("maxtext")


def _is_tpu(e: dict) -> bool:
    return chip_of(e).kind == "tpu"


def seq_len_of(e: dict) -> int:
    return _int(e["training"].get("seq_len")) or _int(e["model"].get("seq_len"))


def global_batch_of(e: dict) -> int:
    t = e["training"]
    return _int(t.get("global_batch_seqs")) or _int(t.get("tokens_per_step")) // seq_len_of(e)


def _source_key(e: dict) -> str:
    return str((e.get("source") or {}).get("key") or "")


def _source_text(e: dict) -> str:
    src = e.get("source") or {}
    return " ".join(str(src.get(k) or "") for k in ("ref", "title", "where", "also"))


def _year(e: dict) -> int | None:
    """The source's year: from an arXiv number (yymm) or a 20xx year in its reference text."""
    text = _source_text(e)
    m = re.search(r"arXiv:(\d{2})(\d{2})\.", text)
    if m:
        return 2000 + int(m.group(1))
    years = [int(y) for y in re.findall(r"\b(20[12]\d)\b", text)]
    return max(years) if years else None


def _is_torchtitan(e: dict) -> bool:
    """Trained with torchtitan: named in the group or the source."""
    return "torchtitan" in (e["group"] + " " + _source_text(e)).lower()


def _text(e: dict) -> str:
    """Precision and notes, lower-cased, where sources name kernels and overlap features."""
    t, p = e["training"], e["parallel"]
    return " ".join(str(x or "") for x in (t.get("precision"), t.get("notes"), p.get("notes"))).lower()


def options_of(e: dict) -> Options:
    """The run's framework behaviour: what its framework does (src/meshplan/train/frameworks.py presets) and what its
    notes name (frameworks.options_from_notes and friends, the same knowledge the importers use)."""
    prec = str(e["training"].get("precision") or "").lower()
    text, group, year, titan = _text(e), e["group"], _year(e), _is_torchtitan(e)
    # no FlashAttention before 2023 (Megatron 2020-22, BLOOM, PaLM): the score matrix goes through HBM
    old = group.startswith("megatron") or "bloom" in group or (year is not None and year <= 2022)
    named = options_from_notes(text)
    tpu = _is_tpu(e)
    # XLA's collective-matmul decomposition on TPU (Wang et al., ASPLOS 2023) postdates the 2022 TPU runs
    tp_default = False if (tpu and year is not None and year <= 2022) else None
    # NeMo's H100 performance recipes run Transformer Engine's TP communication overlap (the "nemo" preset)
    nemo = "nemo" in (group + " " + _source_text(e)).lower()
    if nemo:
        tp_default = FRAMEWORKS["nemo"]["tp_overlap"]
    if _vpp_of(e["parallel"].get("vpp")) != 1:
        named["pp_schedule"] = "1f1b"  # interleaving was printed: the schedule is interleaved 1F1B
    if e["parallel"].get("pp_schedule"):
        named["pp_schedule"] = e["parallel"]["pp_schedule"]  # a schedule the source names (meshplan's name for it)
    # torchtitan's own behaviour (its preset of the release the source's date falls in): eager fp32 loss, torchao
    # float8 (weights cast every forward, dynamic scaling), PyTorch's context_parallel, SDPA attention, the FSDP2
    # group that nothing hides
    titan_kw = preset(version_at("torchtitan", date_of(_source_text(e)))) if titan else {}
    framework_kw = {k: titan_kw[k] for k in ("fused_loss", "fp8_weight_cache", "fp8_fused_casts", "fp8_recipe",
                                             "cp_impl", "fsdp_edge_group", "complex_rope", "repeat_kv",
                                             "optimizer_impl", "tp_overlap_dgrad_rs", "separate_qkv", "expert_tp",
                                             "grouped_mm_kernel")} \
        if titan else {}
    if titan:
        # full AC compiled with the block (torchtitan's apply_ac, then apply_compile): the recomputed forward is part of
        # the compiled backward graph (Options.compiled_recompute); without torch.compile it reruns eagerly
        framework_kw["compiled_recompute"] = titan_kw["compiled_recompute"] and "compile" in prec
    if nemo:
        # NeMo's performance recipes (the "nemo" preset of the run's release): parameter all-gather behind the
        # forward, the gradient reduction's dtype, interleaved pipeline sends overlapped or not, Megatron-FSDP,
        # Megatron-Core's unfused expert biases
        # the NeMo release the source key names (its container, e.g. 'nemo-long-sequence-25.04:'): that release's
        # preset (frameworks.version_at: the newest listed not after it, the oldest for NeMo 1.x's 24.03); a key
        # without one (Megatron-Bridge's tables) the current preset
        release = re.search(r"-(\d\d)\.(\d\d):", _source_key(e))
        nemo_kw = preset(version_at("nemo", (2000 + int(release[1])) * 100 + int(release[2])) if release else "nemo")
        framework_kw = {k: nemo_kw[k] for k in ("overlap_param_gather", "grad_reduce_bytes", "pp_overlap",
                                                "fsdp_copies", "unfused_expert_bias", "glu_saves_input", "fp8_params",
                                                "expert_tp", "unfused_yarn_rope", "attention_kernel") if k in nemo_kw}
        framework_kw["overlap_param_gather"] = framework_kw["overlap_param_gather"] or named["overlap_param_gather"]
        # a Megatron-Bridge row: the TP overlap and parameter all-gather overlap its recipe set (mbridge_recipes.yaml)
        recipe_kw = {k: v for k, v in mbridge_recipe_of(e).items()
                     if k in ("tp_overlap", "overlap_param_gather", "pp_head_in_split", "unfused_expert_bias")}
        framework_kw.update(recipe_kw)
        tp_default = recipe_kw.get("tp_overlap", tp_default)
    if e.get("framework") == "megatron":
        # Megatron-LM launched directly (the MoE model zoo's sbatch_benchmarking.sh): the "megatron" preset's interleaved
        # pipeline sends overlapped, Megatron-FSDP without copies, unfused expert biases; parameter gather as named
        mg = preset("megatron")
        framework_kw = {k: mg[k] for k in ("pp_overlap", "fsdp_copies", "unfused_expert_bias", "glu_saves_input",
                                           "unfused_yarn_rope")}
    if e.get("framework") == "maxtext":
        # MaxText on TPU (the "maxtext" preset): JAX remat reruns only what the backward reads, folded all-reduces,
        # the SPMD pipeline loop, splash attention's block grid (the recipe's, data/maxtext_recipes.yaml, else the
        # preset's base.yml default); the TP and DP overlap defaults are already the TPU's
        framework_kw = {k: FRAMEWORKS["maxtext"][k] for k in ("remat_dce", "fold_all_reduces", "pp_spmd_loop",
                                                             "attention_block_fwd", "attention_block_bwd")}
        framework_kw.update(maxtext_recipe_of(e))
    if e["parallel"].get("cp_impl"):
        framework_kw["cp_impl"] = e["parallel"]["cp_impl"]  # the context-parallel algorithm the source describes
    if named["expert_tp"] is not None:
        # the expert tensor parallel size the run's flags print (the model zoo's --expert-tensor-parallel-size 1)
        framework_kw["expert_tp"] = named["expert_tp"]
    if titan and any(w in prec for w in FSDP_FP8_GATHER_WORDS):
        # torchtitan's float8.enable_fsdp_float8_all_gather: FSDP2 gathers the float8 weights (1 byte per parameter)
        framework_kw["fsdp_param_bytes"] = 1.0
    # the FP8 recipe the source names (its fp8_recipe field, else its precision text); unnamed: the framework's
    recipe = fp8_recipe_of(str(e["training"].get("fp8_recipe") or "").lower() + " " + prec)
    if recipe is not None:
        framework_kw["fp8_recipe"] = recipe
    if fp8_scope_of(prec) is not None:
        framework_kw["fp8_scope"] = fp8_scope_of(prec)  # FP8 on the routed experts' grouped GEMMs alone
    return replace(Options(
        pp_schedule=named["pp_schedule"],
        # the dispatcher and EP A2A overlap the source names, else what the row's recipe ran (mbridge_moe_dispatch.yaml)
        ep_overlap=named["ep_overlap"] or moe_dispatch_of(e).get("ep_overlap", False),
        moe_node_limit=named["moe_node_limit"],
        pp_head_in_split=named["pp_head_in_split"],
        moe_force_balance=named["moe_force_balance"],
        moe_dispatcher=named["moe_dispatcher"] or moe_dispatch_of(e).get("moe_dispatcher", "alltoall"),
        overlap_param_gather=named["overlap_param_gather"],
        compute_dtype="fp8" if "float8" in prec or "fp8" in prec else "bf16",
        tp_overlap=named["tp_overlap"] if named["tp_overlap"] else tp_default,
        # MaxText keeps fp32 master weights but casts them to bf16 before use; XLA's SPMD partitioner
        # places the all-gather after the cast, so FSDP gathers move 2 bytes per parameter (the default)
        # GPU recipes before 2023 (Megatron GPT, BLOOM, OPT) trained with dropout 0.1; TPU recipes (PaLM) and the
        # Llama-era ones without
        dropout=old and not tpu,
        flash_attention=not old,
        headroom=0.0,
        selective_flavor=_selective_flavor(e),
        # torchtitan rows without torch.compile ran eager PyTorch: one kernel per pointwise op
        fused_elementwise=not (titan and "compile" not in prec),
        attention_kernel=_attention_kernel(text + " " + _source_text(e).lower(), titan),
        # ZeRO-3 / FSDP shards over every rank holding the same weights, the CP ranks included (torchtitan)
        fsdp_over_cp=_int(e["parallel"].get("zero_stage")) == 3,
        zero3_fetch=_zero3_fetch(e),
        # MaxText's weight_dtype where the run prints it: weights, gradients (and their reduction) and Adam's moments
        weight_dtype_bytes=weight_dtype_bytes_of(text),
        kept_projections=kept_projections_of(e),
        moe_capacity_factor=_capacity_factor(text),
        cuda_graph_scopes=cuda_graph_scopes_of(e),
        grad_reduce_bytes=weight_dtype_bytes_of(text) or grad_reduce_bytes_of("deepspeed" in text, "fp16" in prec),
        # the checkpointed layer inputs split over TP, where the source's flags say so (`training.
        # distribute_saved_activations`: Megatron-LM --distribute-saved-activations, DeepSpeed partition_activations,
        # metaseq --distribute-checkpointed-activations)
        distribute_saved_activations=e["training"].get("distribute_saved_activations") is True,
    ), **framework_kw)


# torchtitan's `float8.enable_fsdp_float8_all_gather` as run descriptions name it (torchtitan docs/float8.md: FSDP2
# all-gathers the weights already cast to float8, with `precompute_float8_dynamic_scale_for_fsdp`)
FSDP_FP8_GATHER_WORDS = ("fsdp float8 all-gather", "fsdp float8 all gather", "enable_fsdp_float8_all_gather")


@lru_cache(maxsize=8)
def _bench_table(name: str) -> dict:
    """A per-row table of benchmarks/data (row id -> what its source ran), read once."""
    return yaml.safe_load((ROOT / "benchmarks" / "data" / name).read_text()) or {}


def _mbridge_cuda_graphs() -> dict:
    return _bench_table("mbridge_cuda_graphs.yaml")


def cuda_graph_scopes_of(e: dict) -> tuple[str, ...]:
    """The CUDA-graph scopes a Megatron-Bridge row's recipe captured (data/mbridge_cuda_graphs.yaml, read from the
    release tag's workload presets); () for other rows (eager)."""
    return tuple(_mbridge_cuda_graphs().get(e["id"], {}).get("cuda_graph_scopes") or ())


def _mbridge_recipes() -> dict:
    return _bench_table("mbridge_recipes.yaml")


def mbridge_recipe_of(e: dict, table: dict | None = None) -> dict:
    """What a Megatron-Bridge row's recipe ran (data/mbridge_recipes.yaml, read from the release tag's recipe and
    workload preset; `table` replaces that file): `recompute` (a meshplan policy; absent where meshplan has none),
    `tp_overlap`, `overlap_param_gather`, `offload` (fraction of the saved activations on the host), `pp_head_in_split`,
    `unfused_expert_bias` (False under Transformer Engine's op fuser); {} for other rows."""
    entry = (_mbridge_recipes() if table is None else table).get(e["id"]) or {}
    return {k: entry[k] for k in ("recompute", "tp_overlap", "overlap_param_gather", "offload", "pp_head_in_split",
                                  "unfused_expert_bias")
            if entry.get(k) is not None}


def maxtext_recipe_of(e: dict, table: dict | None = None) -> dict:
    """The splash-attention block grid a tpu-recipes (MaxText) row's recipe ran (data/maxtext_recipes.yaml, read from
    the recipe's workload details; `table` replaces that file): `attention_block_fwd`, `attention_block_bwd` as
    (block_q, block_kv), `sparsecore_reduce` (its XLA flags offload the gradient reduction to the SparseCores) and
    `iota_embedding` (use_iota_embed); {} for other rows (the maxtext preset's base.yml defaults)."""
    entry = (_bench_table("maxtext_recipes.yaml") if table is None else table).get(e["id"]) or {}
    out: dict = {k: tuple(int(v) for v in entry[k]) for k in ("attention_block_fwd", "attention_block_bwd") if k in entry}
    for key in ("sparsecore_reduce", "iota_embedding"):
        if key in entry:
            out[key] = bool(entry[key])
    return out


def _mbridge_moe_dispatch() -> dict:
    return _bench_table("mbridge_moe_dispatch.yaml")


def moe_dispatch_of(e: dict, table: dict | None = None) -> dict:
    """The MoE dispatcher (`moe_dispatcher`: alltoall|deepep|hybridep) and EP all-to-all overlap (`ep_overlap`) a
    Megatron-Bridge row's recipe ran (data/mbridge_moe_dispatch.yaml, read from the release tag's workload presets;
    `table` replaces that file); {} for other rows (the Options defaults: alltoall, no overlap)."""
    entry = (_mbridge_moe_dispatch() if table is None else table).get(e["id"]) or {}
    return {k: entry[k] for k in ("moe_dispatcher", "ep_overlap") if k in entry}


def _attention_kernel(text: str, titan: bool) -> str:
    """The attention kernel a run names (in its precision, notes or source); torchtitan's default is SDPA."""
    return attention_kernel_of(text, FRAMEWORKS["torchtitan"]["attention_kernel"] if titan else "fused")


def _zero3_fetch(e: dict) -> str:
    """ZeRO-3's fetch in the run's DeepSpeed era, read from the source's arXiv number (yymm)."""
    p = e["parallel"]
    if _int(p.get("zero_stage")) != 3:
        return "allgather"
    m = re.search(r"arXiv:(\d{4})\.", str((e.get("source") or {}).get("ref", "")))
    return zero3_fetch_of("deepspeed" in str(p.get("notes", "")).lower(), int(m.group(1)) if m else None)


def _selective_flavor(e: dict) -> str:
    if not _is_torchtitan(e):
        return "attention"
    return torchtitan_selective_flavor(str(e["training"].get("recompute") or "").lower())


def problem_of(e: dict) -> Problem:
    chip, count = chip_of(e), _int(e["hardware"]["count"])
    return Problem(model_of(e), chip, count, seq_len_of(e), global_batch_of(e), slice_shape_of(e, chip, count))


def slice_shape_of(e: dict, chip, count: int) -> tuple[int, ...] | None:
    """A TPU multislice job's ICI slice: the slice count printed as 'N slice(s)' or 'N x v5p-128', the shape
    from the printed torus ('16x16 ICI torus') when it matches count / N chips, else meshplan's default slice of
    that many chips. None (the largest slice the pod allows) when the source names no slices."""
    if not _is_tpu(e):
        return None
    hw = e.get("hardware") or {}
    inter, intra = str(hw.get("inter_node") or "").lower(), str(hw.get("intra_node") or "").lower()
    # a slice count, not a slice's name: 'v6e-32 slice' is one slice of 32 chips
    m = re.search(r"(?<![-\w])(\d+)\s*slices?\b|(?<![-\w])(\d+)\s*slice\(s\)|(\d+)\s*x\s*v\d\w*-\d+",
                  inter + " " + intra)
    n = int(next(g for g in m.groups() if g)) if m else 1
    if n <= 1 or count % n:
        return None
    per = count // n
    printed = re.search(r"(\d+)x(\d+)(?:x(\d+))?", intra)
    if printed:
        shape = tuple(int(g) for g in printed.groups() if g)
        if math.prod(shape) == per:
            try:
                make_cluster(chip, count, shape)  # a printed shape the pod cannot hold is not used
                return shape
            except MeshplanError:
                pass
    return default_slice_shape(chip, per)


_FRACTION_KEYS = ("mfu", "hfu")


def _num(d: dict, *keys) -> float | None:
    """The first positive number under `keys`: a number, or the leading number of a string ('160 TFLOP/s',
    '1,543', '46.2%'). A utilisation printed as a percentage (46.2 or '46.2%') becomes a fraction."""
    for k in keys:
        v = d.get(k)
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, str):
            m = re.match(r"\s*~?\s*(\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?)\s*(%?)", v.lower())
            if not m:
                continue
            v = float(m.group(1).replace(",", "")) / (100.0 if m.group(2) else 1.0)
        if isinstance(v, (int, float)) and v > 0:
            return float(v) / 100.0 if k in _FRACTION_KEYS and v > 1 else float(v)
    return None


def convention_flops_per_step(e: dict) -> tuple[float, bool] | None:
    """FLOPs per step under the source's own convention (flops_conventions.md) and whether they count
    recompute (hardware FLOPs). None for an unknown convention."""
    conv = str(e.get("flops_convention") or "")
    m = model_of(e)
    B, s = global_batch_of(e), seq_len_of(e)
    L, h, V, a = m.n_layers, m.d_model, m.vocab_size, m.n_heads
    pc = tm.param_counts(m)
    tokens = B * s
    if conv == "megatron_eq3_hw_with_full_recompute":  # Narayanan et al. 2021 eq. (3)
        return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h)), True
    if conv == "korthikanti_model_eq7_hw_eq8":  # Korthikanti et al. 2022 appendix A, eq. (7) model FLOPs
        return 72 * B * L * s * h * h * (1 + s / (6 * h) + V / (12 * h * L)), False
    if conv == "mcore_r080_model_flops":  # Megatron-Core r0.8.0 num_floating_point_operations
        g = m.n_kv_heads
        k = m.experts_per_token if m.is_moe else 1
        gate = 1.5 if m.gated else 1.0
        per = (1 + g / a + s / h) * (m.head_dim * a / h) + (m.d_ff / h) * k * gate + V / (2 * L * h)
        return 12 * B * s * L * h * h * per, False
    if conv in ("palm_6N_plus_12LHQT", "torchtitan_6N_plus_12LHQT", "llama3_mfu_unspecified", "unspecified",
                "llama3_6N_plus_6LHQT_causal"):
        # 6N + 12·L·H·Q·T per token (PaLM appendix B); torchtitan's N leaves out the input embedding
        n = pc.total - (pc.embedding if conv == "torchtitan_6N_plus_12LHQT" else 0)
        if m.is_moe:
            n = pc.active
        # llama3_6N_plus_6LHQT_causal: Llama 3's TFLOPs/GPU read with causal attention (half of PaLM's term). Chu et
        # al. ISCA 2025 put the 131K job's exposed context-parallel time at 7.64% of the step (§7.3.2) and its CP
        # attention at >= 95% of one GPU's FlashAttention HFU (§7.2), the per-GPU GEMMs being the 8K job's (8K tokens
        # a rank), so its 380 TFLOPs/GPU against the 8K job's 400 leaves room for ~5% lost, not the ~29% that
        # counting the 131K job's attention non-causal would mean (4.06e12 against 5.68e12 FLOP a token). Read in
        # session 14 after seeing the row (benchmarks/README.md)
        attention = 6 if conv == "llama3_6N_plus_6LHQT_causal" else 12
        return tokens * (6 * n + attention * L * a * m.head_dim * s), False
    if conv == "nemo_model_flops_no_recompute":  # 6·N_non-embedding + 12·L·h·s per token (checked on the rows)
        return tokens * (6 * (pc.active if m.is_moe else pc.total - pc.embedding) + 12 * L * h * s), False
    if conv == "maxtext_6N_plus_attention":  # 6·N_total + 12·H·L·hd·s per token (non-causal, Nov 2023)
        # an MoE counts its routed FFN num_experts_per_tok times (MaxText maxtext_utils.calculate_tflops_training_
        # per_device): the active parameters; Mixtral 8x7B's printed 302 TFLOP/s at 3645 tok/s/chip is 83 GFLOP/token
        return tokens * (6 * (pc.active if m.is_moe else pc.total) + 12 * a * L * m.head_dim * s), False
    return None


def measured_step_time_s(e: dict) -> float:
    """Measured step time, or the source's own arithmetic turned into one (flops_conventions.md recipe):
    a published step time, then tokens/s, then TFLOP/s or MFU under the source's FLOP convention."""
    meas, der = e["measured"], e.get("derived") or {}
    for d in (meas, der):
        if _num(d, "step_time_s", "iteration_time_s"):
            return _num(d, "step_time_s", "iteration_time_s")
    chips = _int(e["hardware"]["count"])
    tokens = global_batch_of(e) * seq_len_of(e)
    for d in (meas, der):
        per_chip = _num(d, "tokens_per_s_per_gpu", "tokens_per_s_per_chip", "tokens_per_s_per_device")
        if per_chip:
            return tokens / (per_chip * chips)
        total = _num(d, "tokens_per_s")
        if total:
            return tokens / total
    conv = convention_flops_per_step(e)
    if conv is None:
        raise ValueError(f"{e['id']}: no step time, tokens/s or known FLOP convention in the source")
    flops, _hw = conv
    # MFU against the peak the source states, else the datasheet's dense bf16 peak of the matched chip
    peak = _num(e["hardware"], "peak_dense_tflops_per_chip") or chip_of(e).peak("bf16") / 1e12
    for d in (meas, der):
        tf = _num(d, "tflops_per_chip", "tflops_per_gpu", "model_tflops_per_gpu", "tflops_per_gpu_hw")
        if tf:
            return flops / (tf * 1e12 * chips)
        frac = _num(d, "mfu")
        if frac and peak:
            return flops / (frac * peak * 1e12 * chips)
        hfu = _num(d, "hfu")
        if hfu and peak:
            # HFU counts the recomputed forward too: one more forward of the 2N-per-token three (8N/6N) under full
            # recompute (Korthikanti et al. 2022 §5); a convention that already counts it is used as it is
            full = recompute_of(e) == "full" and not _hw
            return flops * (4 / 3 if full else 1.0) / (hfu * peak * 1e12 * chips)
    raise ValueError(f"{e['id']}: no throughput figure to turn into a step time")


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
