"""Serving engines: the vLLM and SGLang server command lines and a TensorRT-LLM `trtllm-serve` launch with its
extra-options YAML, written from a `meshplan serve` plan and (vLLM, SGLang) read back.

Flag names: vLLM's EngineArgs fields (vllm/engine/arg_utils.py; the CLI writes field_name as --field-name),
SGLang's ServerArgs fields (python/sglang/srt/server_args.py); data/vllm_keys.txt and data/sglang_keys.txt list
them. TensorRT-LLM: `trtllm-serve` options --tp_size, --pp_size, --ep_size, --max_batch_size, --max_num_tokens,
--max_seq_len, --extra_llm_api_options (tensorrt_llm/commands/serve.py) and the LLM API's `kv_cache_config.dtype`
and `enable_chunked_prefill` (tensorrt_llm/llmapi/llm_args.py).

A meshplan serving plan runs `replicas` independent copies of a tp x pp model (infer/config.py); the engines' data
parallel degree (vLLM --data-parallel-size, SGLang --dp-size) runs exactly that. Expert parallelism shares the TP
ranks (ep divides tp). Attention data parallelism (config attention_dp) is each engine's own switch: vLLM
--data-parallel-size tp --enable-expert-parallel with --tensor-parallel-size 1 (vLLM docs 'Data Parallel Deployment':
the attention layers data parallel, the MoE layers' experts over the DP x TP ranks), SGLang --enable-dp-attention
--dp-size tp (ServerArgs.enable_dp_attention; dp_size divides tp_size), TensorRT-LLM enable_attention_dp: true in the
extra LLM API options (LlmArgs.enable_attention_dp); one replica per launch, like TensorRT-LLM's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from meshplan import __version__
from meshplan.errors import MeshplanError
from meshplan.export.common import argv_lines, commented, framework_keys, split_command
from meshplan.infer.config import ENGINE_KV_FLAGS
from meshplan.units import fmt_bytes, fmt_time

# meshplan KV dtype -> each engine's KV-cache dtype flag (infer/config.py ENGINE_KV_FLAGS, with the sources)
KV = ENGINE_KV_FLAGS
# weights: fp8 is each engine's online FP8 quantization of a bf16 checkpoint; int8/int4 weight-only need a
# checkpoint quantized beforehand (AWQ/GPTQ/ModelOpt), whose method the file cannot choose for the user; mxfp4 is a
# checkpoint released in MXFP4 (gpt-oss), which every engine reads from its config.json with no flag
WEIGHTS = {"vllm": {"bf16": None, "fp8": "fp8", "mxfp4": None}, "sglang": {"bf16": None, "fp8": "fp8", "mxfp4": None},
           "trtllm": {"bf16": None, "mxfp4": None}}


@dataclass(frozen=True)
class ServePlan:
    """What `meshplan serve` chose, as the exporters need it."""

    out: dict  # the serve --json object
    model_arg: str
    command: str
    mode: str  # continuous | static
    budget_tokens: int  # the step token budget chunked prefill is timed with (cost/data/serving.yaml)
    chip_kind: str = "gpu"


@dataclass
class ServeJob:
    framework: str
    model: str | None = None
    tp: int = 1
    pp: int = 1
    ep: int = 1
    replicas: int = 1
    attention_dp: bool = False
    quant: str | None = None  # None: no --quantization, the checkpoint's own format (config.native_weight_dtype)
    kv_quant: str = "bf16"
    batch: int | None = None
    max_model_len: int | None = None
    mode: str = "continuous"
    chunk_tokens: int | None = None
    mixed_prompts: bool | None = None  # SGLang --enable-mixed-chunk (None: the engine's default)
    unknown_keys: list[str] = field(default_factory=list)
    unmodelled_keys: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _header(plan: ServePlan, framework: str) -> list[str]:
    o = plan.out
    c = o["config"]
    return [
        f"{framework} launch written by meshplan {__version__}",
        f"command: {plan.command}",
        f"plan: tp={c['tp']} pp={c['pp']} ep={c['ep']}{' attention-dp' if c.get('attention_dp') else ''} "
        f"x {c['replicas']} replicas on {o['chips']} x {o['hardware']}, "
        f"{o['model']}, {c['weight_dtype']} weights, {c['kv_dtype']} KV, batch {o['batch']} per replica "
        f"({o['input_len']}+{o['output_len']} tokens)",
        f"predicted: TTFT {fmt_time(o['ttft_s'])}, TPOT {fmt_time(o['tpot_s'])} ({o['tpot_s']:.6g} s), "
        f"{o['throughput_tokens_per_s']:,.0f} output tokens/s, memory "
        f"{fmt_bytes(o['memory_bytes_per_chip']['total'])} per chip",
    ] + ([f"read it back: meshplan serve --from FILE --hardware {o['hardware']} --input-len {o['input_len']} "
          f"--output-len {o['output_len']}"] if framework in _READ else [])


def _refuse(framework: str, what: str) -> MeshplanError:
    return MeshplanError(f"{framework} cannot express this plan: {what}")


def _common_checks(framework: str, plan: ServePlan) -> dict:
    c = plan.out["config"]
    if c["weight_dtype"] not in WEIGHTS[framework]:
        raise _refuse(framework, f"{c['weight_dtype']} weights come from a checkpoint quantized beforehand (AWQ, "
                                 "GPTQ, ModelOpt), whose method a launch line cannot choose; quantize it first or "
                                 "plan with " + ("--quant fp8 or bf16" if "fp8" in WEIGHTS[framework] else
                                                 "--quant bf16"))
    if c["kv_dtype"] not in KV[framework]:
        raise _refuse(framework, f"a {c['kv_dtype']} KV cache (its --kv-cache-dtype takes "
                                 f"{', '.join(v for v in KV[framework].values())})")
    return c


def _argv_vllm(plan: ServePlan, c: dict, role: str | None = None) -> list[str]:
    o = plan.out
    if c.get("attention_dp"):
        if c["ep"] != c["tp"]:
            raise _refuse("vllm", f"attention data parallel with ep {c['ep']} < tp {c['tp']} (--enable-expert-parallel "
                                  "spans every DP x TP rank)")
        # one engine core per attention-DP rank, TP 1 inside; the experts over the DP ranks; max_num_seqs per rank
        argv = ["vllm", "serve", plan.model_arg, "--tensor-parallel-size", 1, "--pipeline-parallel-size", c["pp"],
                "--data-parallel-size", c["tp"], "--enable-expert-parallel",
                "--max-num-seqs", -(-o["batch"] // c["tp"]), "--max-model-len", o["input_len"] + o["output_len"],
                "--kv-cache-dtype", KV["vllm"][c["kv_dtype"]]]
        return [str(a) for a in argv + _vllm_tail(plan, c, role)]
    if c["ep"] > 1 and (c["ep"] != c["tp"] or c["replicas"] > 1):
        raise _refuse("vllm", f"expert parallelism {c['ep']} inside tp {c['tp']} x {c['replicas']} replicas "
                              "(--enable-expert-parallel spans every TP x DP rank)")
    argv = ["vllm", "serve", plan.model_arg, "--tensor-parallel-size", c["tp"], "--pipeline-parallel-size", c["pp"],
            "--data-parallel-size", c["replicas"], "--max-num-seqs", o["batch"],
            "--max-model-len", o["input_len"] + o["output_len"], "--kv-cache-dtype", KV["vllm"][c["kv_dtype"]]]
    if c["ep"] > 1:
        argv.append("--enable-expert-parallel")
    return [str(a) for a in argv + _vllm_tail(plan, c, role)]


def _vllm_tail(plan: ServePlan, c: dict, role: str | None) -> list:
    argv: list = []
    if WEIGHTS["vllm"][c["weight_dtype"]]:
        argv += ["--quantization", WEIGHTS["vllm"][c["weight_dtype"]]]
    if plan.mode == "continuous":
        argv += ["--enable-chunked-prefill", "--max-num-batched-tokens", _budget(plan)]
    else:
        argv.append("--no-enable-chunked-prefill")
    if role:
        argv += ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})]
    return argv


def _argv_sglang(plan: ServePlan, c: dict, role: str | None = None) -> list[str]:
    o = plan.out
    # attention DP: --dp-size is the attention-DP degree inside the tp group (ServerArgs: tp_size % dp_size == 0)
    dp = c["tp"] if c.get("attention_dp") else c["replicas"]
    argv = ["python", "-m", "sglang.launch_server", "--model-path", plan.model_arg, "--tp-size", c["tp"],
            "--pp-size", c["pp"], "--dp-size", dp, "--ep-size", c["ep"],
            "--max-running-requests", o["batch"], "--context-length", o["input_len"] + o["output_len"],
            "--kv-cache-dtype", KV["sglang"][c["kv_dtype"]],
            "--chunked-prefill-size", _budget(plan, per_rank=False) if plan.mode == "continuous" else -1]
    if c.get("mixed_prompts") and plan.mode == "continuous":  # timed with the decodes beside the prompts
        argv += ["--enable-mixed-chunk"]
    if WEIGHTS["sglang"][c["weight_dtype"]]:
        argv += ["--quantization", WEIGHTS["sglang"][c["weight_dtype"]]]
    if c.get("attention_dp"):
        argv.append("--enable-dp-attention")
    if role:
        argv += ["--disaggregation-mode", role]
    return [str(a) for a in argv]


def _budget(plan: ServePlan, per_rank: bool = True) -> int:
    """The step token budget flag: under attention DP vLLM and TensorRT-LLM apply it to each rank (the replica's
    budget / ranks), SGLang to the replica (it divides chunked_prefill_size by dp_size itself)."""
    c = plan.out["config"]
    replica = plan.out.get("replica_step_token_budget")
    if not c.get("attention_dp") or replica is None:
        return plan.budget_tokens
    return -(-int(replica) // c["tp"]) if per_rank else int(replica)


def _lines(argv: list[str]) -> str:
    lead = next((i for i, a in enumerate(argv) if a.startswith("-") and a != "-m"), len(argv))
    return argv_lines(argv, lead)


def export_engine(framework: str, plan: ServePlan) -> dict[str, str]:
    """{file name: text}; a disaggregated plan gets a prefill and a decode launch."""
    c = _common_checks(framework, plan)
    head = commented(_header(plan, framework))
    build = {"vllm": _argv_vllm, "sglang": _argv_sglang}.get(framework)
    d = plan.out.get("disaggregated")
    if framework == "trtllm":
        if plan.chip_kind != "gpu":
            raise _refuse("trtllm", f"TensorRT-LLM runs on NVIDIA GPUs, not {plan.out['hardware']}")
        if d:
            raise _refuse("trtllm", "disaggregated pools (trtllm-serve disaggregated takes a cluster YAML meshplan "
                                    "does not write); drop --disaggregate or export to vllm or sglang")
        return _trtllm(plan, c, head)
    if not d:
        return {f"{framework}.sh": head + _lines(build(plan, c))}
    files = {}
    for role, n in (("prefill", d["prefill_instances"]), ("decode", d["decode_instances"])):
        rc = dict(c, **{k: v for k, v in d[f"{role}_config"].items() if k in ("tp", "pp", "ep")}, replicas=1)
        note = [f"{role} pool: run {n} instance(s) of this command (book ch.8 ratio "
                f"{d['prefill_per_decode_ratio']:.2f} prefill per decode), joined by the engine's PD router"]
        files[f"{framework}_{role}.sh"] = head + commented(note) + _lines(build(plan, rc, role))
    return files


def _trtllm(plan: ServePlan, c: dict, head: str) -> dict[str, str]:
    o = plan.out
    # prompts chunk as the plan was timed (the engine's default, the harness's or the layout's own: plan_serving's
    # 'chunked_prefill'); static batching never chunks
    extra = {"kv_cache_config": {"dtype": KV["trtllm"][c["kv_dtype"]]},
             "enable_chunked_prefill": plan.mode == "continuous" and bool(o.get("chunked_prefill", True))}
    if c.get("attention_dp"):
        extra["enable_attention_dp"] = True  # LlmArgs.enable_attention_dp (top level, not under cuda_graph_config)
    # max_batch_size holds per micro-batch (a replica runs pp of them: trtllm-bench's tuning.py sizes it as the KV
    # cache's requests / pp_size) and per attention-DP rank under enable_attention_dp (each rank's own scheduler)
    per = c["pp"] * (c["tp"] if c.get("attention_dp") else 1)
    argv = ["trtllm-serve", plan.model_arg, "--tp_size", c["tp"], "--pp_size", c["pp"], "--ep_size", c["ep"],
            "--max_batch_size", -(-o["batch"] // per),
            "--max_num_tokens", _budget(plan),
            "--max_seq_len", o["input_len"] + o["output_len"], "--extra_llm_api_options", "trtllm_extra.yml"]
    note = [f"one trtllm-serve per replica: launch {c['replicas']} of them behind a load balancer"] \
        if c["replicas"] > 1 else []
    import yaml

    return {"trtllm.sh": head + commented(note) + _lines([str(a) for a in argv]),
            "trtllm_extra.yml": head + yaml.safe_dump(extra, sort_keys=False)}


# ---- import -------------------------------------------------------------------------------------------------

_READ = {
    "vllm": {"--tensor-parallel-size": "tp", "-tp": "tp", "--pipeline-parallel-size": "pp", "-pp": "pp",
             "--data-parallel-size": "replicas", "-dp": "replicas", "--max-num-seqs": "batch",
             "--max-model-len": "max_model_len", "--kv-cache-dtype": "kv", "--quantization": "quant", "-q": "quant",
             "--max-num-batched-tokens": "chunk", "--model": "model"},
    "sglang": {"--tp-size": "tp", "--tp": "tp", "--pp-size": "pp", "--dp-size": "replicas", "--dp": "replicas",
               "--ep-size": "ep", "--max-running-requests": "batch", "--context-length": "max_model_len",
               "--kv-cache-dtype": "kv", "--quantization": "quant", "--chunked-prefill-size": "chunk",
               "--model-path": "model", "--model": "model"},
}
_SWITCHES = {"vllm": {"--enable-expert-parallel", "--enable-chunked-prefill", "--no-enable-chunked-prefill"},
             "sglang": {"--enable-dp-attention", "--enable-mixed-chunk"}}


def detect_engine(argv: list[str]) -> str | None:
    text = " ".join(argv[:4])
    if "sglang" in text:
        return "sglang"
    if "vllm" in text:
        return "vllm"
    return None


def load_engine(text: str) -> ServeJob:
    argv = split_command(text, "server")
    fw = detect_engine(argv)
    if fw is None:
        raise MeshplanError("not a vLLM or SGLang command line (expected 'vllm serve MODEL ...' or "
                            "'python -m sglang.launch_server ...')")
    job = ServeJob(fw)
    known = framework_keys(fw)
    vals: dict[str, str] = {}
    switches: set[str] = set()
    i = 0
    start = argv.index("serve") + 1 if fw == "vllm" and "serve" in argv else 0
    if fw == "vllm" and start and start < len(argv) and not argv[start].startswith("-"):
        job.model, i = argv[start], start + 1
    while i < len(argv):
        t = argv[i]
        if t.startswith("-") and not t.startswith("-m"):
            key, eq, val = t.partition("=")
            if key in _READ[fw] and not eq:
                if i + 1 >= len(argv):
                    raise MeshplanError(f"{fw} command line: {key} needs a value")
                val, i = argv[i + 1], i + 1
            if key in _READ[fw]:
                vals[_READ[fw][key]] = val
            elif key in _SWITCHES[fw]:
                switches.add(key)
            else:
                (job.unmodelled_keys if key in known else job.unknown_keys).append(key)
                if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                    i += 1  # its value
        i += 1

    def num(k: str, default: int | None) -> int | None:
        if k not in vals:
            return default
        try:
            return int(vals[k])
        except ValueError:
            raise MeshplanError(f"{fw} command line: the {k} value must be an integer, got '{vals[k]}'") from None

    job.model = vals.get("model", job.model)
    job.tp, job.pp, job.replicas = num("tp", 1), num("pp", 1), num("replicas", 1)
    job.ep = num("ep", 1) if fw == "sglang" else (job.tp if "--enable-expert-parallel" in switches else 1)
    job.batch, job.max_model_len = num("batch", None), num("max_model_len", None)
    if fw == "vllm" and "--enable-expert-parallel" in switches and job.replicas > 1:
        if job.tp != 1:
            raise MeshplanError("vllm --enable-expert-parallel with --data-parallel-size > 1 and --tensor-parallel-size "
                                f"{job.tp}: attention TP inside attention DP is not modelled (give tp 1)")
        # attention data parallel over the DP ranks, the experts over the same ranks; max_num_seqs per rank
        job.tp = job.ep = job.replicas
        job.replicas, job.attention_dp = 1, True
        job.batch = None if job.batch is None else job.batch * job.tp
    if fw == "sglang" and "--enable-dp-attention" in switches:
        if job.replicas != job.tp:
            raise MeshplanError(f"sglang --enable-dp-attention with --dp-size {job.replicas} < --tp-size {job.tp}: "
                                "attention TP inside attention DP is not modelled (give --dp-size equal to --tp-size)")
        job.replicas, job.attention_dp = 1, True  # --dp-size is the attention-DP degree inside the tp group
    kv = vals.get("kv", "auto")
    back_kv = {v: k for k, v in KV[fw].items()} | {"fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "fp8": "fp8"}
    if kv not in back_kv:
        raise MeshplanError(f"{fw} --kv-cache-dtype '{kv}' is not one meshplan models")
    job.kv_quant = back_kv[kv]
    q = vals.get("quant")
    if q not in (None, "fp8", "None", "mxfp4"):
        raise MeshplanError(f"{fw} --quantization {q}: the weight format of a pre-quantized checkpoint; give "
                            "--quant int8 or int4 to time it")
    job.quant = q if q in ("fp8", "mxfp4") else None
    chunk = num("chunk", None)
    job.mode = "static" if ("--no-enable-chunked-prefill" in switches or (fw == "sglang" and chunk == -1)) \
        else "continuous"
    job.chunk_tokens = chunk if chunk and chunk > 0 else None
    if fw == "sglang" and "--enable-mixed-chunk" in switches:
        job.mixed_prompts = True
    for k in ("tp", "pp", "ep", "replicas"):
        if getattr(job, k) < 1:
            raise MeshplanError(f"{fw} command line: {k} must be positive, got {getattr(job, k)}")
    return job


def _presets() -> dict[str, str]:
    """Hugging Face model id -> meshplan preset, from each preset's `_source` ('config.json of org/name')."""
    import re

    from meshplan.specs.model import MODELS_DIR

    out = {}
    for f in sorted(MODELS_DIR.glob("*.json")):
        src = json.loads(f.read_text()).get("_source", "")
        m = re.search(r"config\.json of ([\w.-]+/[\w.-]+)", src)
        if m:
            out.setdefault(m.group(1), f.stem)
    return out


def hf_id(model_arg: str) -> str:
    """What the engine loads: the Hugging Face id a preset was read from, the folder of a config.json, else what
    --model was given."""
    from pathlib import Path

    if model_arg.endswith(".json"):
        return str(Path(model_arg).parent)
    return next((k for k, v in _presets().items() if v == model_arg), model_arg)


def preset_for(model: str | None) -> str | None:
    """The meshplan model an engine's model argument names: a preset's Hugging Face id, a preset, or a config."""
    if model is None:
        return None
    if model in _presets():
        return _presets()[model]
    from pathlib import Path

    from meshplan.specs.model import load_model

    if (Path(model) / "config.json").is_file():  # a local checkpoint folder
        model = str(Path(model) / "config.json")
    try:
        load_model(model)
    except MeshplanError:
        return None
    return model
