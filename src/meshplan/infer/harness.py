"""Engine settings a benchmark harness picks for itself, so that a plan can be timed as the published run was.

`trtllm-bench throughput`, the harness of TensorRT-LLM's Performance Overview tables, sets max_batch_size and
max_num_tokens from the model, the GPUs and the dataset's mean input/output lengths when the command sets neither
(tensorrt_llm/bench/build/tuning.py calc_engine_setting and finetune_setting; tensorrt_llm/bench/benchmark/utils/
general.py get_settings for the PyTorch backend). Its estimate of the KV capacity is its own (the whole device memory
less the weights), not the engine's, so the settings follow it rather than meshplan's memory model. Which release
does what (chunked prefill, the prompt floor on max_num_tokens, the KV fraction of the estimate) is data:
serving.yaml harness_trtllm_bench, one entry per engine preset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from meshplan.errors import InfeasibleError, MeshplanError
from meshplan.infer.config import ServeConfig, Workload, _table, attention_dp_limits_per_rank, kv_cache_free_fraction
from meshplan.math.transformer import param_counts
from meshplan.specs.hardware import Chip
from meshplan.specs.model import ModelConfig

HARNESSES = ("trtllm-bench",)
GIB = 1024**3
# bytes per weight / KV element in trtllm-bench's estimate: QuantAlgo FP8 and FP8_BLOCK_SCALES 1, NVFP4 0.5, anything
# else (no quantization, weight-only int8/int4) 2 (tuning.py BYTES_PER_ELEM, .get(algo, 2))
_ESTIMATE_BYTES = {"fp8": 1.0}


@dataclass(frozen=True)
class HarnessSettings:
    """What the harness passes the engine: sequences per micro-batch, tokens per step, whether prompts chunk."""

    harness: str
    max_batch_size: int
    max_num_tokens: int
    chunked_prefill: bool
    kv_cache_max_requests: float  # the harness's own estimate, before its rounding

    def apply(self, cfg: ServeConfig, chip: Chip) -> ServeConfig:
        """The layout with the harness's engine settings. max_batch_size holds per micro-batch (a replica runs pp of
        them) and, where the engine applies its limits per attention-DP rank, per rank
        (config.attention_dp_limits_per_rank); max_num_tokens is the engine's flag as it reads it."""
        ranks = cfg.attention_dp_size if attention_dp_limits_per_rank(cfg, chip) else 1
        return replace(cfg, max_num_batched_tokens=self.max_num_tokens,
                       max_num_seqs=self.max_batch_size * cfg.pp * ranks, chunked_prefill=self.chunked_prefill)

    def as_dict(self) -> dict:
        return {"harness": self.harness, "max_batch_size": self.max_batch_size, "max_num_tokens": self.max_num_tokens,
                "chunked_prefill": self.chunked_prefill, "kv_cache_max_requests": self.kv_cache_max_requests}


def _entry(engine: str) -> dict:
    table = _table().get("harness_trtllm_bench") or {}
    hit = table.get(engine)
    if hit is None:
        raise MeshplanError(f"trtllm-bench drives TensorRT-LLM: no harness settings for engine '{engine}' "
                            f"(known: {', '.join(sorted(table))})")
    return {k: v["value"] for k, v in hit.items()}


def finetune_setting(kv_cache_max_requests: float, input_len: float, output_len: float, pp: int) -> tuple[int, int]:
    """(max_batch_size, max_num_tokens) from the estimated requests the KV cache holds: at most 4096 requests over the
    pp stages, and max_num_tokens = requests x (1 + ISL/OSL), the tokens a step carries when each finishing request
    is replaced by a new prompt (at most 32768); both rounded up to a grid, max_batch_size at least 64 and
    max_num_tokens at least 2048 (tensorrt_llm/bench/build/tuning.py finetune_setting)."""
    raw_bs = min(kv_cache_max_requests, 4096) / pp
    raw_token = min(raw_bs * (1 + input_len / output_len), 32768)
    return (_round_up(raw_bs, ((256, 32), (1024, 128), (math.inf, 256)), 64),
            _round_up(raw_token, ((4096, 256), (8192, 512), (math.inf, 1024)), 2048))


def _round_up(x: float, tiers: tuple[tuple[float, int], ...], floor: int) -> int:
    """`x` rounded up to the step of the first tier whose bound it is below, at least `floor` in the first tier
    (finetune_setting's grids)."""
    for i, (bound, step) in enumerate(tiers):
        if x < bound:
            up = step * math.ceil(x / step)
            return int(max(floor, up) if i == 0 else up)
    raise AssertionError("the last tier is unbounded")


def trtllm_bench_settings(m: ModelConfig, chip: Chip, cfg: ServeConfig, w: Workload) -> HarnessSettings:
    """trtllm-bench's max_batch_size and max_num_tokens for this model, layout and workload (tuning.py
    calc_engine_setting): the KV cache holds (devices x device memory - weights) x fraction bytes, each token
    2 x layers x max(tp, KV heads) x head width x bytes per element, each request ISL + OSL tokens; finetune_setting
    turns the request count into the two settings. Where the run does not chunk prompts (the PyTorch backend's
    default), max_num_tokens is raised to hold the longest prompt beside a full batch (general.py get_settings)."""
    e = _entry(cfg.engine)
    n_gpus = cfg.tp * cfg.pp
    # the estimate counts every weight at the checkpoint's bytes per element (its own ModelConfig.param_count)
    engine_gib = param_counts(m).total * _ESTIMATE_BYTES.get(cfg.weight_dtype, 2.0) / GIB
    available_gib = chip.usable_hbm_bytes / GIB * n_gpus - engine_gib  # NVML total memory per device, in GiB
    kv_heads = max(cfg.tp, m.n_kv_heads)  # 'each GPU in TP group has at least 1 kv head'
    # head_size as the harness reads it from config.json: head_dim, else hidden_size / heads (MLA models included,
    # whose latent cache the estimate does not know)
    width = m.d_model // m.n_heads if m.is_mla else m.head_dim
    per_token_gib = 2 * m.n_layers * kv_heads * width * _ESTIMATE_BYTES.get(cfg.kv_dtype, 2.0) / GIB
    frac = e.get("kv_fraction") or kv_cache_free_fraction(cfg, chip)
    requests = available_gib * frac / (per_token_gib * w.max_context)
    if available_gib <= 0:
        raise InfeasibleError(f"trtllm-bench refuses this run: the weights ({engine_gib:.1f} GiB by its count) exceed "
                              f"the memory of {n_gpus} x {chip.name} ({chip.usable_hbm_bytes / GIB * n_gpus:.1f} GiB)")
    if requests < 1:
        raise InfeasibleError(f"trtllm-bench refuses this run: its estimate leaves room for {requests:.2f} requests of "
                            f"{w.max_context} tokens (weights {engine_gib:.1f} GiB on {n_gpus} x {chip.name})")
    max_bs, max_tokens = finetune_setting(requests, w.input_len, w.output_len, cfg.pp)
    chunked = bool(e["chunked_prefill"])
    if not chunked and e.get("tokens_cover_prompt"):
        max_tokens = max(max_tokens, w.input_len + max_bs)
    return HarnessSettings("trtllm-bench", max_bs, max_tokens, chunked, requests)


def harness_settings(harness: str, m: ModelConfig, chip: Chip, cfg: ServeConfig, w: Workload) -> HarnessSettings:
    """The settings `harness` (HARNESSES) picks for this run."""
    if harness not in HARNESSES:
        raise MeshplanError(f"unknown harness '{harness}' (known: {', '.join(HARNESSES)})")
    return trtllm_bench_settings(m, chip, cfg, w)
