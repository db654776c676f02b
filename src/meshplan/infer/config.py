"""Serving layout and workload: tensor/expert/pipeline parallel degrees, quantization, sequence lengths.

A deployment of `n_chips` runs `replicas` independent copies of the model, each on tp x pp chips (book ch.7:
generation uses model parallelism only; more throughput comes from separate replicas, never DP inside one).
Expert parallelism shares the TP chips: MoE layers split their E experts ep ways and each expert tp/ep ways.
Attention data parallelism (`attention_dp`, MoE models only) runs the attention of a replica data-parallel over its
tp chips instead: each chip holds the whole attention weights and the KV cache of its own requests, and the MoE
layers see the tokens of all of them (TensorRT-LLM enable_attention_dp, SGLang --enable-dp-attention --dp-size tp,
vLLM --data-parallel-size with --enable-expert-parallel).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from meshplan.errors import InfeasibleError, MeshplanError
from meshplan.math.interp import log_interp
from meshplan.math.transformer import dtype_bytes
from meshplan.specs.hardware import Chip
from meshplan.specs.model import ModelConfig

# mxfp4: the routed experts of a checkpoint released in OCP MX FP4 (gpt-oss), every other weight in bf16, as the
# engines serve such a checkpoint as it ships (ModelConfig.expert_weight_dtype)
WEIGHT_DTYPES = ("bf16", "fp8", "int8", "int4", "mxfp4")
KV_DTYPES = ("bf16", "fp8", "int8")
SERVING_FILE = Path(__file__).resolve().parents[1] / "cost" / "data" / "serving.yaml"


@lru_cache(maxsize=1)
def _table() -> dict[str, Any]:
    return yaml.safe_load(SERVING_FILE.read_text())


def serving_constant(name: str, chip: Chip) -> float:
    """A sourced constant from cost/data/serving.yaml, by chip name then chip kind."""
    entry = _table()[name]
    hit = entry.get(chip.name) or entry.get(chip.kind)
    if hit is None:
        raise MeshplanError(f"no serving constant '{name}' for {chip.name} ({chip.kind})")
    return float(hit["value"])


@dataclass(frozen=True)
class ServeConfig:
    """One replica's layout and number formats."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    act_dtype: str = "bf16"
    # the engine's per-step token budget (vLLM max_num_batched_tokens, TensorRT-LLM max_num_tokens, SGLang
    # chunked_prefill_size); None = the engine preset's / serving.yaml default (step_token_budget)
    max_num_batched_tokens: int | None = None
    # the engine preset (ENGINES) whose defaults apply beyond the token budget (serving.yaml engine_*): how it sizes
    # the KV cache, whether it reserves a request's full length, chunks prompts, caps sequences in flight
    engine: str = "default"
    # whether the engine schedules step n+1 while step n runs (SGLang's overlap scheduler, TensorRT-LLM's PyTorch
    # overlap scheduler, vLLM --async-scheduling); None = the engine preset's default (serving.yaml
    # engine_overlap_scheduler)
    overlap_scheduling: bool | None = None
    # the server path a request and its streamed tokens take outside the engine (FRONTENDS, serving.yaml
    # frontend_first_token_s), e.g. 'triton-ensemble'; None = the engine measured in process, no server path
    frontend: str | None = None
    # attention data-parallel over the tp chips, the MoE layers tensor/expert-parallel over the same chips on the
    # tokens of all of them (TensorRT-LLM _torch/models/modeling_qwen3_moe.py: no attention all-reduce under
    # enable_attention_dp, the MoE's AllGatherReduceScatter dispatch/combine; SGLang layers/dp_attention.py)
    attention_dp: bool = False
    # a dense KV cache: every sequence slot holds this many tokens, allocated whole, and each decode step's attention
    # reads all of them under a mask, however few the sequence has written (JetStream-PyTorch 2024:
    # jetstream_pt/layers.py Attention.forward, einsum of the query with the whole cache from KVCacheGenerate.update;
    # its benchmarks' 'cache length'); None = a paged cache whose attention reads only the written tokens (vLLM
    # PagedAttention, TensorRT-LLM paged KV, SGLang RadixAttention)
    dense_kv_cache: int | None = None
    # whether the engine splits prompts over steps (vLLM always; TensorRT-LLM enable_chunked_context /
    # enable_chunked_prefill); None = the engine preset's default (serving.yaml engine_chunked_prefill)
    chunked_prefill: bool | None = None
    # whether a step carries the running decodes beside the waiting prompts (SGLang --enable-mixed-chunk); False: the
    # prompts are prefilled first, in steps of their own; None = the engine preset's (serving.yaml engine_mixed_batches)
    mixed_prompts: bool | None = None
    # the engine's cap on sequences one replica runs at once (vLLM --max-num-seqs, TensorRT-LLM --max_batch_size x pp,
    # SGLang --max-running-requests); None = the engine preset's default (serving.yaml engine_max_num_seqs), else the
    # KV cache alone
    max_num_seqs: int | None = None

    @property
    def chips_per_replica(self) -> int:
        return self.tp * self.pp

    @property
    def attention_dp_size(self) -> int:
        """Attention data-parallel ranks of a replica: every TP chip (attention TP 1 inside each) or 1."""
        return self.tp if self.attention_dp else 1

    @property
    def attention_tp(self) -> int:
        """The TP degree the attention (and the layers the engine runs with it) splits over: 1 under attention DP."""
        return 1 if self.attention_dp else self.tp

    @property
    def weight_bytes(self) -> float:
        """Bytes per weight, the routed experts' aside (expert_weight_bytes): an MXFP4 checkpoint keeps the rest bf16."""
        return dtype_bytes("bf16" if self.weight_dtype == "mxfp4" else self.weight_dtype)

    @property
    def expert_weight_bytes(self) -> float:
        """Bytes per routed-expert weight: 4.25 bits under mxfp4 (32 E2M1 values and one E8M0 scale, OCP MX v1.0)."""
        return dtype_bytes(self.weight_dtype)

    @property
    def kv_bytes(self) -> float:
        return dtype_bytes(self.kv_dtype)

    @property
    def act_bytes(self) -> float:
        return dtype_bytes(self.act_dtype)

    def compute_dtype(self, chip: Chip) -> str:
        """FLOP precision: fp8 weights run fp8 GEMMs where the chip has fp8 units; int8/int4 are weight-only
        quantization computing in bf16 (book ch.7 B_crit with beta = weight bits / activation bits, and ch.8
        'int8 weights, bf16 FLOPs')."""
        if self.weight_dtype == "fp8" and "fp8" in chip.peak_flops_per_s:
            return "fp8"
        return "bf16"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


ENGINES = ("default", "vllm", "sglang", "trtllm", "lmdeploy")
# engines with no switch for prefill-first scheduling, and why
ALWAYS_MIXED = {"vllm": "vLLM V1's scheduler fills each step's token budget with the running requests, then the "
                        "waiting ones", "trtllm": "TensorRT-LLM's in-flight batching"}
FRONTENDS = ("triton-ensemble", "vllm-openai", "sglang-http")
# the engine each server path drives: the TensorRT-LLM backend's ensemble (triton-inference-server/tensorrtllm_backend),
# vLLM's OpenAI-compatible server (`vllm serve`), SGLang's HTTP server (`sglang.launch_server` / `sglang serve`:
# tokenizer manager -> ZMQ -> scheduler -> ZMQ -> detokenizer -> HTTP stream)
FRONTEND_ENGINES = {"triton-ensemble": "trtllm", "vllm-openai": "vllm", "sglang-http": "sglang"}
# the path of the HTTP server a launch command starts, by engine (`serve --from` reads such a command, `--export` writes
# one): `vllm serve` and `sglang.launch_server`. TensorRT-LLM's launch is `trtllm-serve`, its own OpenAI server, not the
# Triton ensemble, and no measurement of its path is known: none
LAUNCH_SERVER_PATHS = {"vllm": "vllm-openai", "sglang": "sglang-http"}
# each engine's KV-cache dtype flag for meshplan's KV dtypes (the launch exports write them): vLLM --kv-cache-dtype
# auto|fp8|fp8_e4m3|fp8_e5m2 (vllm/config/cache.py CacheDType), SGLang --kv-cache-dtype auto|fp8_e5m2|fp8_e4m3
# (server_args.py), TensorRT-LLM KvCacheConfig.dtype auto|fp8 in trtllm-serve's extra options
ENGINE_KV_FLAGS = {"vllm": {"bf16": "auto", "fp8": "fp8"}, "sglang": {"bf16": "auto", "fp8": "fp8_e4m3"},
                   "trtllm": {"bf16": "auto", "fp8": "fp8"}}
# KV-cache dtypes an engine can allocate, where it cannot take them all: vLLM and SGLang have no int8 cache (their
# flags above are all they take); TensorRT-LLM's TensorRT engine path also builds an INT8 cache, so it is not limited
ENGINE_KV_DTYPES = {e: tuple(ENGINE_KV_FLAGS[e]) for e in ("vllm", "sglang")}


def engine_releases() -> tuple[str, ...]:
    """Older releases with their own defaults, `engine@release` (serving.yaml engine_releases; read when first asked,
    not at import)."""
    return tuple(sorted(_table().get("engine_releases") or {}))


def engine_names() -> tuple[str, ...]:
    """Every name --engine takes: the presets (ENGINES), then their listed releases."""
    return ENGINES + engine_releases()


def base_engine(engine: str) -> str:
    """The engine preset a name belongs to: `sglang@0.3` -> `sglang`."""
    return engine.split("@", 1)[0]


def check_engine(engine: str) -> str:
    """`engine` if it is a preset (ENGINES) or a listed release of one (engine_releases), else a MeshplanError."""
    names = engine_names()
    if engine not in names:
        raise MeshplanError(f"unknown engine '{engine}' (known: {', '.join(names)})")
    return engine


def default_token_budget(chip: Chip) -> int:
    """The step token budget when neither an engine preset nor the user sets one (serving.yaml max_num_tokens)."""
    return int(serving_constant("max_num_tokens", chip))


def engine_token_budget(engine: str, chip: Chip) -> int:
    """The engine's default step token budget on this chip (serving.yaml engine_max_num_batched_tokens, sourced
    from each engine's argument defaults); `default` is serving.yaml's max_num_tokens."""
    check_engine(engine)
    if engine == "default":
        return default_token_budget(chip)
    hit = _engine_entry("engine_max_num_batched_tokens", engine, chip)
    return default_token_budget(chip) if hit is None else int(hit)


def _engine_hit(key: str, engine: str, chip: Chip) -> dict | None:
    """An engine's entry in serving.yaml `key`, by chip name, then `gpu_large` (a GPU with >= 70 GiB that is not
    an A100: the split vLLM makes in vllm/engine/arg_utils.py get_batch_defaults), then chip kind; None if absent.
    A release (`sglang@0.3`) takes its own entry where serving.yaml engine_releases gives one, else its preset's."""
    release = (_table().get("engine_releases") or {}).get(engine) or {}
    table = release.get(key) or _table()[key].get(base_engine(engine)) or {}
    big = chip.kind == "gpu" and chip.hbm_bytes >= 70 * 2**30 and not chip.name.startswith("a100")
    return table.get(chip.name) or (table.get("gpu_large") if big else None) or table.get(chip.kind)


def _engine_entry(key: str, engine: str, chip: Chip) -> float | None:
    """An engine default's value from serving.yaml `key` (lookup as _engine_hit); None if absent."""
    hit = _engine_hit(key, engine, chip)
    return None if hit is None else float(hit["value"])


def engine_host_step_s(cfg: ServeConfig, chip: Chip) -> float:
    """Host seconds of one engine iteration outside the device step where serving.yaml engine_host_step_s measures it
    for this engine and chip kind (the JAX engines' scheduler and dispatch on TPU); 0 elsewhere."""
    return _engine_entry("engine_host_step_s", cfg.engine, chip) or 0.0


def decode_attention_kv_rate(cfg: ServeConfig, chip: Chip, units: float) -> float | None:
    """Bytes/s at which the engine's decode attention kernel streams the KV cache when `units` (decoding sequences x
    KV heads on the chip) are its parallel work, where serving.yaml engine_decode_attention_kv_rate measures it for
    this engine and chip: linear between its points in log2(units), the first point's rate below them; None beyond
    the last point or where nothing is measured (the HBM stream alone then times the read)."""
    hit = _engine_hit("engine_decode_attention_kv_rate", cfg.engine, chip)
    if hit is None:
        return None
    pts = hit["points"]
    return None if units > pts[-1][0] else log_interp(pts, units)


def engine_context_attention(cfg: ServeConfig, chip: Chip) -> tuple[float, float, float] | None:
    """(fixed_s, fraction, tile_k) of the engine's own prompt-attention op on this chip where serving.yaml
    engine_context_attention measures it (TensorRT-LLM's, vLLM's and SGLang's on H100 and H200); None elsewhere (the chip's cuDNN-class
    fraction and tile constant, efficiency.yaml, then time the prompt's attention)."""
    hit = _engine_hit("engine_context_attention", cfg.engine, chip)
    if hit is None:
        return None
    return float(hit["fixed_s"]), float(hit["fraction"]), float(hit["tile_k"])


EXPERT_GEMM_FORMATS = ("bf16", "fp8", "fp8_block", "mxfp4")


def expert_gemm_format(m: ModelConfig, cfg: ServeConfig, chip: Chip) -> str:
    """The number format the engine's MoE kernel runs the routed-expert GEMMs in (EXPERT_GEMM_FORMATS): 'mxfp4' for
    MXFP4 experts (gpt-oss: weights dequantized in the kernel, bf16 math on Hopper); 'fp8_block' for FP8 weights served
    as an FP8 release with block scales (config.json quantization_config weight_block_size: DeepSeek-V3, Qwen's FP8
    checkpoints; vLLM/SGLang run them through block-scaled FP8 kernels); 'fp8' for FP8 with one scale per tensor (an
    engine's own FP8 quantization of a bf16 checkpoint: vLLM --quantization fp8, per-tensor weight scales); else the
    GEMMs' compute dtype."""
    if cfg.weight_dtype == "mxfp4":
        return "mxfp4"
    cdt = cfg.compute_dtype(chip)
    if cdt == "fp8":
        return "fp8_block" if m.released_weight_dtype == "fp8" and m.released_weight_block else "fp8"
    return cdt


def engine_grouped_kernel(cfg: ServeConfig, chip: Chip, fmt: str) -> tuple[float, float, float] | None:
    """(fraction, rows_half, half_dim) of the engine's own MoE kernel on this chip for experts in format `fmt`, where
    serving.yaml engine_grouped_matmul_peak_fraction measures it (vLLM's FusedMoE and TensorRT-LLM's MoE, by release):
    each expert problem runs at fraction x rows / (rows + rows_half) x d / (d + half_dim) of the format's peak (fp8
    formats: the FP8 peak; bf16 and mxfp4: the bf16 peak), d the expert's narrower weight dimension on the chip; None
    elsewhere (the generic GEMM rate under the chip's efficiency.yaml grouped_matmul_peak_fraction then times the expert
    GEMMs, as in training)."""
    hit = _engine_hit("engine_grouped_matmul_peak_fraction", cfg.engine, chip)
    if hit is None or fmt not in hit:
        return None
    e = hit[fmt]
    return float(e["fraction"]), float(e["rows_half"]), float(e["half_dim"])


def kv_cache_free_fraction(cfg: ServeConfig, chip: Chip) -> float | None:
    """The fraction of the memory left after weights, activations and the runtime that the engine gives its KV cache,
    for engines that size the KV cache that way (TensorRT-LLM's free_gpu_memory_fraction); None for engines that
    cap all their memory at a fraction of the device (vLLM gpu_memory_utilization, SGLang mem_fraction_static:
    serving.yaml memory_utilization)."""
    return _engine_entry("engine_kv_cache_free_fraction", cfg.engine, chip)


def memory_utilization(cfg: ServeConfig, chip: Chip) -> float:
    """The fraction of the device an engine that caps all its memory that way may use: its own default where
    serving.yaml engine_memory_utilization lists it, else the chip kind's (serving.yaml memory_utilization)."""
    own = _engine_entry("engine_memory_utilization", cfg.engine, chip)
    return own if own is not None else serving_constant("memory_utilization", chip)


def chunked_prefill(cfg: ServeConfig, chip: Chip) -> bool:
    """Whether the engine splits prompts over steps: the layout's own setting, else serving.yaml
    engine_chunked_prefill (default: it does)."""
    if cfg.chunked_prefill is not None:
        return cfg.chunked_prefill
    hit = _engine_entry("engine_chunked_prefill", cfg.engine, chip)
    return True if hit is None else bool(hit)


def mixes_prompts(cfg: ServeConfig, chip: Chip) -> bool:
    """Whether a step carries the running decodes beside the waiting prompts (serving.yaml engine_mixed_batches;
    default: it does). An engine that does not prefills waiting prompts in a step of their own, first, and decodes
    in the steps without a waiting prompt (SGLang without --enable-mixed-chunk)."""
    if cfg.mixed_prompts is not None:
        return cfg.mixed_prompts
    hit = _engine_entry("engine_mixed_batches", cfg.engine, chip)
    return True if hit is None else bool(hit)


def fused_add_norm(cfg: ServeConfig, chip: Chip) -> bool:
    """Whether the engine runs each residual add inside the following RMSNorm's kernel (serving.yaml
    engine_fused_add_norm; default: separate kernels, as the training ledger counts them)."""
    return bool(_engine_entry("engine_fused_add_norm", cfg.engine, chip))


def custom_allreduce(cfg: ServeConfig, chip: Chip) -> bool:
    """Whether the engine reduces small TP messages with its own one-shot all-reduce kernel (vLLM, SGLang, TensorRT-LLM)
    rather than NCCL alone (serving.yaml engine_custom_allreduce; default: it does)."""
    hit = _engine_entry("engine_custom_allreduce", cfg.engine, chip)
    return True if hit is None else bool(hit)


def first_token_decode_step(cfg: ServeConfig, chip: Chip) -> bool:
    """Whether the engine's prefill pass stops one token short and the first output token comes from the next decode
    step (serving.yaml engine_first_token_decode_step: LMDeploy TurboMind's context decoder); default: the prefill
    pass samples the first token from its last position."""
    return bool(_engine_entry("engine_first_token_decode_step", cfg.engine, chip))


def schedules_ahead(cfg: ServeConfig, chip: Chip) -> bool:
    """Whether the engine picks the batch of step n+1 while step n runs (the layout's own choice, else serving.yaml
    engine_overlap_scheduler; default: it schedules each step after the previous one ends). Such an engine admits a
    request that arrives during step n into step n+2, one step later than a serial scheduler (SGLang v0.4 blog: 'the
    scheduler runs one batch ahead'; TensorRT-LLM docs, Overlap Scheduler: 'introduces one extra decoding step')."""
    if cfg.overlap_scheduling is not None:
        return cfg.overlap_scheduling
    return bool(_engine_entry("engine_overlap_scheduler", cfg.engine, chip))


def frontend_first_token_s(cfg: ServeConfig, chip: Chip) -> float:
    """Time the first token of a request spends outside the engine, on the server path (cfg.frontend): the request's
    way in (HTTP/gRPC, the tokenizer) and the first token's way out (detokenizer, streamed response), which the
    client's TTFT counts (vLLM benchmark_serving and genai-perf time TTFT from sending the request to the first
    streamed chunk) and no engine step does. Each later token takes the same way out, so inter-token gaps do not
    change by it (their host cost on the engine loop is frontend_token_s). Zero for an engine measured in process
    (cfg.frontend None: gptSessionBenchmark, trtllm-bench, LMDeploy profile_generation, MLPerf's in-process SUT).
    serving.yaml frontend_first_token_s."""
    if cfg.frontend is None:
        return 0.0
    hit = _frontend_entry("frontend_first_token_s", cfg.frontend, chip)
    if hit is None:
        raise MeshplanError(f"no first-token latency for the '{cfg.frontend}' server path on {chip.name} "
                            f"(known: {', '.join(FRONTENDS)}; triton-ensemble and sglang-http on GPUs only)")
    return float(hit["value"])


def frontend_token_s(cfg: ServeConfig, chip: Chip) -> float:
    """Host seconds each streamed token costs the engine's loop on the layout's server path (serving.yaml
    frontend_token_s): the per-token response an engine creates and hands to the server path while streaming. Zero
    in process (cfg.frontend None) and on a path with no published figure (the table lists only measured paths)."""
    if cfg.frontend is None:
        return 0.0
    hit = _frontend_entry("frontend_token_s", cfg.frontend, chip)
    return 0.0 if hit is None else float(hit["value"])


def _frontend_entry(key: str, frontend: str, chip: Chip) -> dict | None:
    """A server path's entry in serving.yaml `key`, by chip name, then chip kind; None if absent."""
    table = _table().get(key, {}).get(frontend) or {}
    return table.get(chip.name) or table.get(chip.kind)


def engine_max_num_seqs(cfg: ServeConfig, chip: Chip) -> int | None:
    """The engine's default cap on sequences in flight per replica (vLLM max_num_seqs); None where the KV cache alone
    limits it (serving.yaml engine_max_num_seqs). Under attention DP an engine that caps each rank (vLLM: one engine
    core per DP rank) caps the replica at ranks x its cap (attention_dp_limits_per_rank). The layout's own cap
    (ServeConfig.max_num_seqs) is already the replica's."""
    if cfg.max_num_seqs is not None:
        return cfg.max_num_seqs
    hit = _engine_entry("engine_max_num_seqs", cfg.engine, chip)
    if hit is None:
        return None
    ranks = cfg.attention_dp_size if attention_dp_limits_per_rank(cfg, chip) else 1
    return int(hit) * ranks


def kv_on_demand(cfg: ServeConfig, chip: Chip) -> bool:
    """Whether the engine allocates KV blocks as tokens are written (serving.yaml engine_kv_on_demand) instead of
    reserving a request's whole length at admission."""
    return bool(_engine_entry("engine_kv_on_demand", cfg.engine, chip))


def kv_reserved_per_sequence(cfg: ServeConfig, chip: Chip, w: Workload) -> float:
    """KV tokens the engine holds per running sequence when sizing its batch: the full input + output for engines
    that reserve a request's whole length at admission (TensorRT-LLM GUARANTEED_NO_EVICT, meshplan's default);
    the mean context input + output/2 of sequences at uniformly spread ages for engines that allocate KV blocks as
    tokens are written and preempt when full (serving.yaml engine_kv_on_demand)."""
    if cfg.dense_kv_cache is not None:  # a dense cache holds its whole length for every slot (ServeConfig)
        if w.max_context > cfg.dense_kv_cache:
            raise MeshplanError(f"a request of {w.max_context} tokens (input + output) does not fit a dense KV cache "
                                f"of {cfg.dense_kv_cache} tokens per sequence")
        return float(cfg.dense_kv_cache)
    return w.mean_decode_context if kv_on_demand(cfg, chip) else float(w.max_context)


def step_token_budget(chip: Chip, cfg: ServeConfig) -> int:
    """The engine's step token budget setting (decode tokens + prompt chunks): the layout's own budget, else the
    serving.yaml default. Under attention DP this is the engine's flag, per rank or per replica as the engine reads
    it (replica_token_budget)."""
    if cfg.max_num_batched_tokens is not None:
        return int(cfg.max_num_batched_tokens)
    return default_token_budget(chip)


def attention_dp_limits_per_rank(cfg: ServeConfig, chip: Chip) -> bool:
    """Whether the engine applies its step token budget and sequence cap to each attention-DP rank (every rank runs
    its own scheduler: TensorRT-LLM, vLLM) or to the whole replica, divided over the ranks (SGLang); serving.yaml
    engine_attention_dp_limits_per_rank, default per rank."""
    hit = _engine_entry("engine_attention_dp_limits_per_rank", cfg.engine, chip)
    return True if hit is None else bool(hit)


def replica_token_budget(chip: Chip, cfg: ServeConfig) -> int:
    """Tokens one step of the whole replica may carry: the budget setting, times the attention-DP ranks where the
    engine applies it per rank (attention_dp_limits_per_rank)."""
    budget = step_token_budget(chip, cfg)
    if cfg.attention_dp and attention_dp_limits_per_rank(cfg, chip):
        return budget * cfg.attention_dp_size
    return budget


def clients_per_replica(n_chips: int, cfg: ServeConfig, clients: int | None) -> int | None:
    """The closed-loop clients each replica serves when `clients` spread over the deployment's replicas (round-robin:
    simulate; the closed form, metrics.evaluate), at least one; None for no closed loop."""
    return None if clients is None else max(clients // max(n_chips // cfg.chips_per_replica, 1), 1)


def prefill_len(cfg: ServeConfig, chip: Chip, input_len: int) -> int:
    """Prompt tokens the prefill pass covers: all of them, or all but the last where the first output token comes
    from the following decode step (first_token_decode_step: LMDeploy TurboMind)."""
    return input_len - 1 if first_token_decode_step(cfg, chip) else input_len


def prefill_room(cfg: ServeConfig, chip: Chip, decodes: float) -> int:
    """Prompt tokens a step has room for beside `decodes` decode tokens: the engine schedules the decodes first and
    fills the rest of the step token budget with prompts (Sarathi-Serve, Agrawal et al. OSDI'24 §4.2; vLLM V1
    Scheduler.schedule: running requests, then waiting ones up to max_num_batched_tokens); at least one token.
    Under attention DP a request runs whole on one rank (TensorRT-LLM's ADP request queue and SGLang's DP controller
    hand each request to one rank), so a prompt's room is one rank's: (replica budget - decodes) / ranks."""
    return max(int((replica_token_budget(chip, cfg) - decodes) / cfg.attention_dp_size), 1)


def prompt_chunk(cfg: ServeConfig, chip: Chip, remaining: int, room: int) -> int:
    """Tokens of a prompt with `remaining` tokens left to prefill that its next step carries, given `room`
    (prefill_room): as many as fit where the engine chunks prompts (engine_chunked_prefill), else the whole rest of
    the prompt, which the caller schedules only in a step that has room for it (or as the step's first prompt)."""
    return min(remaining, room) if chunked_prefill(cfg, chip) else remaining


@dataclass(frozen=True)
class Workload:
    """Request shape: prompt (input) and generated (output) tokens per request."""

    input_len: int
    output_len: int

    @property
    def mean_decode_context(self) -> float:
        """Average KV length seen by a decode step: the prompt plus half the output."""
        return self.input_len + self.output_len / 2.0

    @property
    def max_context(self) -> int:
        return self.input_len + self.output_len


def check_workload(w: Workload, m: ModelConfig | None = None) -> None:
    if w.output_len <= 0:
        raise MeshplanError(f"output length must be at least 1 token, got {w.output_len}")
    if w.input_len <= 0:
        raise MeshplanError(f"input length must be at least 1 token, got {w.input_len}")
    if m is not None:
        check_context_window(m, w.max_context, f"a request of {w.max_context} tokens (input {w.input_len} + output "
                                               f"{w.output_len})")


def check_context_window(m: ModelConfig, tokens: int, what: str,
                         fix: str = "shorten --input-len/--output-len or give a config with a longer window") -> None:
    """Refuse `tokens` (a request's input + output) past the context window the model's config declares: the serving
    engines refuse a max_model_len above it (vLLM ModelConfig: 'User-specified max_model_len ... is greater than the
    derived max_model_len'; SGLang likewise; a TensorRT-LLM engine is built with max_seq_len), and a model with learned
    positions has no embedding for a later position."""
    if m.context_declared and tokens > m.max_seq_len:
        raise MeshplanError(f"{what} is longer than {m.name}'s context window of {m.max_seq_len} tokens "
                            f"({m.context_field} in its config.json): vLLM, SGLang and TensorRT-LLM refuse it; {fix}")


def kv_heads_per_chip(m: ModelConfig, tp: int) -> int:
    """KV heads each TP chip holds: K/tp, or one replicated head when tp > K (book ch.7 §sharding: shard
    KV heads up to K ways; beyond that heads are replicated)."""
    return max(m.n_kv_heads // tp, 1)


def check_layout(m: ModelConfig, chip: Chip, n_chips: int, cfg: ServeConfig) -> int:
    """Validate a layout; return the number of replicas."""
    if cfg.weight_dtype not in WEIGHT_DTYPES:
        raise MeshplanError(f"unknown weight quantization '{cfg.weight_dtype}' (known: {', '.join(WEIGHT_DTYPES)})")
    if cfg.kv_dtype not in KV_DTYPES:
        raise MeshplanError(f"unknown KV-cache quantization '{cfg.kv_dtype}' (known: {', '.join(KV_DTYPES)})")
    if cfg.weight_dtype == "mxfp4" and m.expert_weight_dtype != "mxfp4":
        raise MeshplanError(f"mxfp4 is the expert format of a checkpoint released in MXFP4 (gpt-oss); {m.name} ships "
                            "its weights in bf16: plan --quant fp8, int8 or int4")
    check_engine(cfg.engine)
    if cfg.frontend is not None and cfg.frontend not in FRONTENDS:
        raise MeshplanError(f"unknown server path '{cfg.frontend}' (known: {', '.join(FRONTENDS)})")
    base = base_engine(cfg.engine)
    if cfg.frontend is not None and cfg.engine != "default" and FRONTEND_ENGINES[cfg.frontend] != base:
        raise MeshplanError(f"the {cfg.frontend} server path drives {FRONTEND_ENGINES[cfg.frontend]}, not "
                            f"{cfg.engine}: drop --frontend or use --engine {FRONTEND_ENGINES[cfg.frontend]}")
    if cfg.kv_dtype not in ENGINE_KV_DTYPES.get(base, KV_DTYPES):
        raise MeshplanError(f"{cfg.engine} has no {cfg.kv_dtype} KV cache (it allocates "
                            f"{' or '.join(ENGINE_KV_DTYPES[base])}): use --kv-quant fp8")
    if cfg.mixed_prompts is False and base in ALWAYS_MIXED:
        raise MeshplanError(f"{cfg.engine} always runs the decodes beside the prompts ({ALWAYS_MIXED[base]}): "
                            "prefill-first scheduling is SGLang's default; drop --prefill-first")
    if cfg.max_num_batched_tokens is not None and cfg.max_num_batched_tokens <= 0:
        raise MeshplanError(f"max_num_batched_tokens must be positive, got {cfg.max_num_batched_tokens}")
    if cfg.max_num_seqs is not None and cfg.max_num_seqs <= 0:
        raise MeshplanError(f"max_num_seqs must be positive, got {cfg.max_num_seqs}")
    if cfg.dense_kv_cache is not None and cfg.dense_kv_cache <= 0:
        raise MeshplanError(f"dense KV cache length must be positive, got {cfg.dense_kv_cache}")
    for name, v in (("chips", n_chips), ("tp", cfg.tp), ("pp", cfg.pp), ("ep", cfg.ep)):
        if v <= 0:
            raise MeshplanError(f"{name} must be positive, got {v}")
    if cfg.attention_dp and not m.is_moe:
        raise InfeasibleError(f"attention data parallelism needs a mixture-of-experts model; {m.name} is dense "
                              "(a dense model runs data parallel as separate replicas)")
    if cfg.attention_dp and cfg.tp == 1:
        # attention DP spans a replica's tp ranks (SGLang --dp-size <= --tp-size, TensorRT-LLM over its tp_size)
        raise InfeasibleError("attention data parallelism runs over a replica's tp ranks; at tp=1 each GPU is a "
                              "replica of its own (plain data parallel): use --tp > 1 or drop --attention-dp")
    if m.n_heads % cfg.attention_tp:
        raise InfeasibleError(f"tp={cfg.tp} must divide the {m.n_heads} query heads of {m.name}")
    K, atp = m.n_kv_heads, cfg.attention_tp
    if (atp < K and K % atp) or (atp > K and atp % K):
        raise InfeasibleError(f"tp={cfg.tp} must divide the {K} KV heads of {m.name} or be a multiple of them "
                              f"(tp > K replicates KV heads)")
    if n_chips % cfg.chips_per_replica:
        raise InfeasibleError(f"{n_chips} chips cannot hold whole replicas of tp={cfg.tp} x pp={cfg.pp}")
    if cfg.pp > m.n_layers:
        raise InfeasibleError(f"pp={cfg.pp} exceeds the {m.n_layers} layers of {m.name}")
    _check_ep(m, cfg)
    return n_chips // cfg.chips_per_replica


def _check_ep(m: ModelConfig, cfg: ServeConfig) -> None:
    if cfg.ep == 1:
        return
    if not m.is_moe:
        raise InfeasibleError(f"ep={cfg.ep} needs a mixture-of-experts model; {m.name} is dense")
    if cfg.tp % cfg.ep or m.n_experts % cfg.ep:
        raise InfeasibleError(f"ep={cfg.ep} must divide tp={cfg.tp} and the {m.n_experts} experts")


def native_weight_dtype(m: ModelConfig) -> str:
    """The weight format a model's released checkpoint is served in, from its config.json `quantization_config`:
    mxfp4 where its experts ship in MXFP4 (gpt-oss), fp8 where its linear weights ship in FP8 (DeepSeek-V3/R1, which
    vLLM and SGLang serve with block-scaled FP8 GEMMs), else bf16."""
    if m.expert_weight_dtype == "mxfp4":
        return "mxfp4"
    return "fp8" if m.released_weight_dtype == "fp8" else "bf16"
