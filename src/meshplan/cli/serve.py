"""`meshplan serve`: the inference planner (book ch.7, ch.8)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Annotated

import typer
from rich.table import Table

from meshplan.cli.app import Pin, app, console, fail, print_json
from meshplan.cost.efficiency import resolve_efficiency
from meshplan.export import SERVE as SERVE_EXPORTS
from meshplan.infer.config import (
    FRONTENDS,
    LAUNCH_SERVER_PATHS,
    WEIGHT_DTYPES,
    ServeConfig,
    Workload,
    base_engine,
    check_context_window,
    check_layout,
    check_workload,
    chunked_prefill,
    engine_grouped_kernel,
    engine_names,
    engine_token_budget,
    expert_gemm_format,
    mixes_prompts,
    native_weight_dtype,
    replica_token_budget,
    step_token_budget,
)
from meshplan.infer.disagg import disaggregate
from meshplan.infer.frontier import Targets, frontier, search
from meshplan.infer.harness import HARNESSES, harness_settings
from meshplan.infer.ideal import ideal_serving, print_ideal
from meshplan.infer.memory import max_batch_per_replica, require_fit
from meshplan.infer.metrics import MODES
from meshplan.infer.simulate import DISTRIBUTIONS, SIM_REQUESTS, SimSpec, load_length_trace, simulate
from meshplan.specs.hardware import load_chip, with_price
from meshplan.specs.model import load_model
from meshplan.units import fmt_bytes, fmt_time


def _choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        fail(f"{name} must be one of {', '.join(choices)}, got '{value}'")
    return value


def _pins(tp: int | None, pp: int | None, ep: int | None, do_search: bool) -> tuple:
    """--search or no --tp: search the unpinned degrees; a --tp alone pins pp=1, ep=1."""
    if do_search or tp is None:
        return tp, pp, ep
    return tp, pp or 1, ep or 1


def plan_serving(model: str, hardware: str, chips: int, input_len: int, output_len: int, *, batch: int | None = None,
                 tp: int | None = None, pp: int | None = None, ep: int | None = None, quant: str | None = None,
                 kv_quant: str = "bf16", tpot_target: float | None = None, ttft_target: float | None = None,
                 do_search: bool = False, mode: str = "continuous", profile: str | None = None,
                 engine: str = "default", max_num_batched_tokens: int | None = None,
                 price: float | None = None, clients: int | None = None, frontend: str | None = None,
                 attention_dp: bool | None = None, dense_kv_cache: int | None = None,
                 max_num_seqs: int | None = None, harness: str | None = None,
                 mixed_prompts: bool | None = None, requests: int | None = None) -> dict:
    """Everything `serve --json` prints except the simulation and disaggregation sections. `clients`: every candidate
    is ranked under a closed loop of that many clients (evaluate), the batch being the engine's limit per replica;
    `requests`: that loop is a benchmark of so many requests, whose first round the mean TTFT counts.
    `attention_dp`: attention data parallel pinned on (True) or off (False); None: a fully pinned layout (--tp alone,
    or --tp --pp --ep) runs without it, a search tries both for MoE models. `harness`: every layout runs with the
    limits that benchmark harness picks for it (infer/harness.py: trtllm-bench's max_batch_size, max_num_tokens and
    chunking)."""
    m, chip = load_model(model), with_price(load_chip(hardware), price)
    quant = quant or native_weight_dtype(m)  # unset: the weights as the released checkpoint ships them
    if base_engine(engine) in ("trtllm", "lmdeploy") and chip.kind == "tpu":  # CUDA engines (TensorRT-LLM: NVIDIA GPUs only;
        # LMDeploy's TurboMind and PyTorch backends: CUDA, Ascend); vLLM and SGLang have TPU backends
        fail(f"--engine {engine} runs on GPUs, not on {chip.name} (a TPU): use vllm, sglang or default")
    w = Workload(input_len, output_len)
    check_workload(w, m)
    if chips <= 0:
        fail(f"--chips must be positive, got {chips}")
    if batch is not None and batch <= 0:
        fail(f"--batch must be positive, got {batch}")
    for name, v in (("--tpot-target", tpot_target), ("--ttft-target", ttft_target)):
        if v is not None and v <= 0:
            fail(f"{name} must be positive seconds, got {v}")
    eff = resolve_efficiency(chip, profile)
    if max_num_batched_tokens is not None and max_num_batched_tokens <= 0:
        fail(f"--max-num-batched-tokens must be positive, got {max_num_batched_tokens}")
    if dense_kv_cache is not None:
        if dense_kv_cache <= 0:
            fail(f"--dense-kv-cache must be positive tokens, got {dense_kv_cache}")
        if engine != "default":
            fail(f"--dense-kv-cache models an engine with a fixed-length cache per sequence (JetStream); --engine "
                 f"{engine} pages its KV cache")
        if w.max_context > dense_kv_cache:
            fail(f"--dense-kv-cache {dense_kv_cache} is shorter than a request ({w.max_context} tokens, input + output)")
    if max_num_seqs is not None and max_num_seqs <= 0:
        fail(f"--max-num-seqs must be positive, got {max_num_seqs}")
    if harness is not None:
        _choice("--harness", harness, HARNESSES)
        if base_engine(engine) != "trtllm":
            fail(f"--harness {harness} drives TensorRT-LLM: add --engine trtllm (PyTorch backend) or trtllm@0.17 "
                 "(TensorRT engines)")
        if max_num_batched_tokens is not None or max_num_seqs is not None:
            fail(f"--harness {harness} sets max_num_tokens and max_batch_size itself: drop --max-num-batched-tokens "
                 "and --max-num-seqs, or the harness")
    # the step token budget: the user's, else the engine preset's default (serving.yaml); 'default' keeps None
    if max_num_batched_tokens is None and engine != "default":
        max_num_batched_tokens = engine_token_budget(engine, chip)
    base = ServeConfig(weight_dtype=quant, kv_dtype=kv_quant, max_num_batched_tokens=max_num_batched_tokens,
                       engine=engine, frontend=frontend, dense_kv_cache=dense_kv_cache, max_num_seqs=max_num_seqs,
                       mixed_prompts=mixed_prompts)
    tp, pp, ep = _pins(tp, pp, ep, do_search)
    if attention_dp and not m.is_moe:
        fail(f"--attention-dp needs a mixture-of-experts model; {m.name} is dense (a dense model runs data parallel "
             "as separate replicas)")
    if ep and ep > 1 and not m.is_moe:
        fail(f"--ep {ep} splits the experts of a mixture-of-experts model; {m.name} is dense: drop --ep")
    if tp and pp and ep:
        if attention_dp is None:
            attention_dp = False
        cfg = replace(base, tp=tp, pp=pp, ep=ep, attention_dp=attention_dp)
        check_layout(m, chip, chips, cfg)
        if batch:
            require_fit(m, chip, cfg, eff, w, batch)
    res = search(m, chip, chips, base, eff, w, Targets(tpot_target, ttft_target), mode, tp, pp, ep, batch, clients,
                 attention_dp, harness, requests)
    best = res.best
    mb = max_batch_per_replica(m, chip, best.config, eff, w)
    out = best.as_dict()
    out.update({
        "model": m.name, "hardware": chip.name, "chips": chips, "input_len": input_len, "output_len": output_len,
        "max_batch": mb * best.replicas, "max_batch_per_replica": mb,
        "engine": engine, "step_token_budget": step_token_budget(chip, best.config),
        "chunked_prefill": chunked_prefill(best.config, chip),  # whether prompts were timed in chunks
        "mixed_prompts": mixes_prompts(best.config, chip),  # decodes beside the prompts (False: prefill first)
        # tokens one step of a whole replica carries (step_token_budget x attention-DP ranks where the engine applies
        # it per rank: config.replica_token_budget)
        "replica_step_token_budget": replica_token_budget(chip, best.config),
        "targets": {"tpot_s": tpot_target, "ttft_s": ttft_target},
        "efficiency": eff.origin,
        "price": {"per_chip_hour": chip.price_per_chip_hour, "basis": chip.price_basis},
        "frontier": [p.as_dict() for p in frontier(m, chip, chips, best.config, eff, w, mode)],
        "layouts": [{"config": p.as_dict()["config"], "batch": p.batch, "tpot_s": p.tpot_s, "ttft_s": p.ttft_s,
                     "throughput_tokens_per_s": p.throughput_tokens_per_s} for p in res.ranked[:10]],
        "searched": res.searched,
        "skipped_layouts": res.skipped,  # layouts that cannot be placed on this cluster: reason -> count
    })
    if m.is_moe:  # the format the engine's MoE kernel runs the routed experts in, and its measured ceiling if any
        fmt = expert_gemm_format(m, best.config, chip)
        # engine_fraction / engine_rows_half / engine_half_dim: serving.yaml engine_grouped_matmul_peak_fraction's curve
        # for this engine, chip and format (fraction x rows / (rows + rows_half) x d / (d + half_dim) of the format's
        # peak, d the expert's narrower weight dimension); null: the generic GEMM rate under the chip's
        # efficiency.yaml grouped ceiling times them
        kernel = engine_grouped_kernel(best.config, chip, fmt)
        out["expert_gemms"] = {"format": fmt, "engine_fraction": kernel[0] if kernel else None,
                               "engine_rows_half": kernel[1] if kernel else None,
                               "engine_half_dim": kernel[2] if kernel else None}
    if harness is not None:  # what the harness set for the best layout
        out["harness"] = harness_settings(harness, m, chip, best.config, w).as_dict()
    if clients is not None:  # closed loop: `batch` is then the sequences running, the rest wait for a slot
        # running: the sequences that decode at once on every replica (the batch, or fewer where the step token
        # budget holds no more prompts: ServePoint.running_batch)
        running = best.running_batch * best.replicas
        out["clients"] = {"clients": clients, "running": running, "waiting": max(clients - running, 0),
                          "queue_wait_s": best.queue_wait_s, "requests": requests,
                          "first_round_ttft_s": best.first_round_ttft_s,
                          "rounds_in_phase": best.rounds_in_phase, "spread_ttft_s": best.spread_ttft_s}
    out["_objects"] = (m, chip, eff, w, best)
    return out


def _disagg_config(best: ServeConfig, layouts: list[dict], chips: int) -> ServeConfig:
    """The layout of both disaggregated pools: the best one, or when one replica of it takes more than half the chips
    (no room for a prefill and a decode instance) the best ranked layout that leaves room for both."""
    if 2 * best.chips_per_replica <= chips:
        return best
    for lay in layouts:
        c = lay["config"]
        cfg = replace(best, tp=c["tp"], pp=c["pp"], ep=c["ep"], attention_dp=c.get("attention_dp", False))
        if 2 * cfg.chips_per_replica <= chips:
            return cfg
    return best


@app.command()
def serve(
    # required unless --from FILE states them (checked below)
    model: Annotated[str | None, typer.Option("--model", "-m", help="Preset or HF config.json.")] = None,
    hardware: Annotated[str | None, typer.Option("--hardware", help="Chip preset or YAML.")] = None,
    chips: Annotated[int | None, typer.Option(help="Number of chips in the deployment.")] = None,
    input_len: Annotated[int | None, typer.Option(help="Prompt tokens per request.")] = None,
    output_len: Annotated[int | None, typer.Option(help="Generated tokens per request.")] = None,
    batch: Annotated[int | None, typer.Option(help="Sequences in flight per replica (default: best that fits).")] = None,
    tp: Pin = None, ep: Pin = None, pp: Pin = None,
    attention_dp: Annotated[bool | None, typer.Option(
        "--attention-dp/--no-attention-dp",
        help="MoE models: attention data parallel over the tp chips, experts over the same chips (SGLang "
             "--enable-dp-attention, TensorRT-LLM enable_attention_dp, vLLM --data-parallel-size with "
             "--enable-expert-parallel). Default: searched for MoE models, off for a pinned --tp.")] = None,
    quant: Annotated[str | None, typer.Option(help="Weights: bf16 | fp8 | int8 | int4 | mxfp4 (the experts of an "
                                                   "MXFP4 checkpoint, gpt-oss; the rest bf16). Default: the released "
                                                   "checkpoint's, from its config.json (mxfp4 for gpt-oss, fp8 for DeepSeek-V3 and qwen3-235b-a22b-fp8, else bf16).")] = None,
    kv_quant: Annotated[str, typer.Option(help="KV cache: bf16 | fp8 | int8.")] = "bf16",
    tpot_target: Annotated[float | None, typer.Option(help="Time per output token target (s).")] = None,
    ttft_target: Annotated[float | None, typer.Option(help="Time to first token target (s).")] = None,
    do_search: Annotated[bool, typer.Option("--search", help="Search layouts and batches.")] = False,
    batching: Annotated[str, typer.Option(help="continuous (chunked prefill) | static.")] = "continuous",
    do_simulate: Annotated[bool, typer.Option("--simulate", help="Poisson-arrival simulation.")] = False,
    rate: Annotated[float | None, typer.Option(help="Arrivals per second for --simulate (a Poisson process; inf sends "
                                                  "every request at t = 0). With --concurrency it defaults to inf, "
                                                  "and a request goes out at its arrival or when one of the clients' "
                                                  "requests finishes, whichever is later (vLLM benchmark_serving "
                                                  "--request-rate with --max-concurrency).")] = None,
    requests: Annotated[int | None, typer.Option(help="Requests the benchmark sends in all (vLLM bench --num-prompts, "
                                                      "aiperf --request-count). With --concurrency the closed form's "
                                                      "mean TTFT counts the first round apart, whose clients start "
                                                      "together (default: the steady state of a loop that runs on); "
                                                      "--simulate runs this many (default 200).")] = None,
    concurrency: Annotated[int | None, typer.Option(help="Closed-loop clients over the deployment (each finished "
                                                         "request is replaced at once): the closed form ranks every "
                                                         "layout under them (clients beyond the batch limit wait for a "
                                                         "slot; --json key 'clients'; on an engine that takes "
                                                         "whole prompts, e.g. trtllm, equal requests keep their rounds "
                                                         "in phase: prompts arrive in groups), and --simulate runs "
                                                         "them.")] = None,
    engine: Annotated[str, typer.Option(help="Serving engine preset: default | vllm | sglang | trtllm | lmdeploy "
                                             "(the engine's defaults: step token budget, KV sizing, kernel "
                                             "fusion, when the first token comes), or an older release whose "
                                             "defaults differ: sglang@0.3 (no overlap scheduler), trtllm@0.17 (the TensorRT "
                                             "engine path's serial C++ executor; trtllm is the PyTorch backend).")] = "default",
    max_num_batched_tokens: Annotated[int | None, typer.Option(help="Step token budget (vLLM max_num_batched_tokens, "
                                                                    "TRT-LLM max_num_tokens, SGLang chunked_prefill_size).")] = None,
    mixed_prompts: Annotated[bool | None, typer.Option("--mix-prompts/--prefill-first", help=(
        "Whether a step carries the running decodes beside the waiting prompts (--mix-prompts: vLLM, TensorRT-LLM, "
        "SGLang --enable-mixed-chunk) or prefills the prompts first, in steps of their own (--prefill-first: "
        "SGLang's default). Default: the engine's."))] = None,
    max_num_seqs: Annotated[int | None, typer.Option(help="Most sequences a whole replica runs at once, over its "
                                                          "pipeline micro-batches and attention-DP ranks (vLLM "
                                                          "--max-num-seqs x DP ranks, TRT-LLM max_batch_size x pp x "
                                                          "ranks, SGLang --max-running-requests); default: the "
                                                          "engine's, else what the KV cache holds.")] = None,
    harness: Annotated[str | None, typer.Option(help="Time each layout with the limits a benchmark harness picks for "
                                                     "itself: trtllm-bench (max_batch_size, max_num_tokens and "
                                                     "chunking from the model, GPUs and lengths, as TensorRT-LLM's "
                                                     "performance tables ran; with --engine trtllm or trtllm@0.17).")] = None,
    frontend: Annotated[str | None, typer.Option(help="The server path requests take, whose first-token latency the "
                                                      "clients' TTFT counts: triton-ensemble, vllm-openai, sglang-http (default: none, the "
                                                      "engine in process).")] = None,
    dense_kv_cache: Annotated[int | None, typer.Option(
        help="Tokens per sequence of a dense, fixed-length KV cache whose every slot each decode step reads (JetStream's "
             "cache length); default: a paged cache read only over the written context (vLLM, SGLang, "
             "TensorRT-LLM).")] = None,
    seed: Annotated[int, typer.Option(help="Simulation seed.")] = 0,
    input_dist: Annotated[str, typer.Option(help="fixed | exponential | uniform (mean --input-len).")] = "fixed",
    output_dist: Annotated[str, typer.Option(help="fixed | exponential | uniform (mean --output-len).")] = "fixed",
    length_trace: Annotated[str | None, typer.Option(
        help="--simulate replays these request lengths in order: a JSON file with 'input_lens' and 'output_lens' "
             "lists (vLLM benchmark_serving --save-result) or a CSV of input,output per line. --input-len and "
             "--output-len default to its means.")] = None,
    disaggregate_: Annotated[bool, typer.Option("--disaggregate", help="Size prefill and decode pools.")] = False,
    profile: Annotated[str | None, typer.Option(help="Calibrated profile JSON from `meshplan calibrate`.")] = None,
    plot: Annotated[str | None, typer.Option(help="Write the latency-throughput frontier to this PNG.")] = None,
    ideal: Annotated[bool, typer.Option("--ideal", help="Also the book's ideal answers (ch.7, ch.8) beside the "
                                                        "realistic plan; --json key 'book_ideal'.")] = False,
    price: Annotated[float | None, typer.Option(help="Dollars per chip-hour (default: the catalog's, with its "
                                                     "basis).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    html: Annotated[str | None, typer.Option(help="Write the result as a self-contained HTML page.")] = None,
    from_file: Annotated[str | None, typer.Option(
        "--from", help="Predict a vLLM or SGLang server command line (timed through that server's own path, as "
                       "its clients see it; --engine may name the release, e.g. sglang@0.3) and show the best layout "
                       "beside it.")] = None,
    export: Annotated[str | None, typer.Option(help="Write the plan's launch: vllm, sglang or trtllm.")] = None,
    out_dir: Annotated[str | None, typer.Option("--out", help="Folder --export writes to.")] = None,
) -> None:
    """Serve a model: layout, batch, TTFT/TPOT, throughput, memory and cost per million tokens."""
    trace: tuple[tuple[int, int], ...] = ()
    if length_trace is not None:
        if not do_simulate:
            fail("--length-trace goes with --simulate")
        trace = load_length_trace(length_trace)
        # the layout and batch are planned at the trace's mean lengths (the closed form's workload)
        input_len = input_len or max(round(sum(i for i, _ in trace) / len(trace)), 1)
        output_len = output_len or max(round(sum(o for _, o in trace) / len(trace)), 1)
    needed = (("--hardware", hardware), ("--input-len", input_len), ("--output-len", output_len))
    for flag, v in needed + ((("--model", model), ("--chips", chips)) if from_file is None else ()):
        if v is None:
            fail(f"missing option {flag}" + (" (or read a server command line with --from FILE)"
                                             if from_file is None else ""))
    if export is None and out_dir is not None:
        fail("--out goes with --export vllm|sglang|trtllm")
    if export is not None and dense_kv_cache is not None:
        fail("--export writes a vLLM, SGLang or TensorRT-LLM launch, whose KV cache is paged; drop --dense-kv-cache")
    if from_file is not None:
        from meshplan.cli.export import serve_from

        if export or plot or html or ideal or do_simulate or disaggregate_ or concurrency or requests is not None \
                or attention_dp is not None or mixed_prompts is not None \
                or frontend or dense_kv_cache is not None:
            fail("--from predicts a server command line; it does not combine with --export, --plot, --html, --ideal, "
                 "--simulate, --concurrency, --requests, --disaggregate, --frontend (the server's own path is timed), "
                 "--attention-dp, --dense-kv-cache or --mix-prompts/--prefill-first")
        if engine != "default":
            _choice("--engine", engine, engine_names())
        serve_from(from_file, hardware=hardware, input_len=input_len, output_len=output_len, chips=chips,
                   model=model, profile=profile, json_out=json_out, engine=None if engine == "default" else engine)
        return
    if requests is not None and concurrency is None and not do_simulate:
        fail("--requests counts a benchmark's requests: it needs --concurrency (a closed loop of clients, whose first "
             "round the mean TTFT counts) or --simulate")
    if quant is not None:
        _choice("--quant", quant, WEIGHT_DTYPES)
    _choice("--kv-quant", kv_quant, ("bf16", "fp8", "int8"))
    _choice("--batching", batching, MODES)
    _choice("--engine", engine, engine_names())
    if export is not None:
        # the launch's own engine times the plan: its defaults (step token budget, KV sizing, scheduler) are the ones
        # the written command runs with
        _choice("--export", export, SERVE_EXPORTS)
        if engine == "default":
            engine = export
        elif base_engine(engine) != export:
            fail(f"--export {export} writes a {export} launch, but --engine {engine} times another engine: drop "
                 f"--engine or export {base_engine(engine)}")
        # the written `vllm serve` / `sglang.launch_server` is an HTTP server: its clients' first token takes its path
        # (LAUNCH_SERVER_PATHS), as `serve --from` times the same launch
        if frontend is None:
            frontend = LAUNCH_SERVER_PATHS.get(export)
    if frontend is not None:
        _choice("--frontend", frontend, FRONTENDS)
    if plot:  # before the search: a path it cannot write fails now, not after it
        from meshplan.report.plots import plot_path

        plot_path(plot)
    if rate is not None and not do_simulate:
        fail("--rate sets the arrivals of --simulate; add --simulate (the closed form ranks layouts at the batch, or "
             "under --concurrency clients)")
    if mixed_prompts is not None and batching != "continuous":
        fail("--mix-prompts/--prefill-first choose how continuous batching schedules waiting prompts; static batching "
             "prefills the whole batch first: drop the flag or --batching static")
    if do_simulate and batching != "continuous":
        fail("--simulate runs the engine's iteration-level scheduler (continuous batching); drop --batching static")
    if do_simulate:
        _choice("--input-dist", input_dist, DISTRIBUTIONS)
        _choice("--output-dist", output_dist, DISTRIBUTIONS)
        if rate is None and concurrency is None:
            fail("--simulate needs --rate (requests per second) or --concurrency (closed-loop clients)")
        if rate is None:
            rate = math.inf  # closed loop at full speed: each client sends its next request as the last one ends
    if trace:  # before the search: a request the model cannot hold fails now (load_model is cached for the plan)
        longest = max(i + o for i, o in trace)
        check_context_window(load_model(model), longest,
                             f"the length trace's longest request ({longest} tokens, input + output)")
    out = plan_serving(model, hardware, chips, input_len, output_len, batch=batch, tp=tp, pp=pp, ep=ep,
                       quant=quant, kv_quant=kv_quant, tpot_target=tpot_target, ttft_target=ttft_target,
                       do_search=do_search, mode=batching, profile=profile, engine=engine,
                       max_num_batched_tokens=max_num_batched_tokens, price=price, clients=concurrency,
                       frontend=frontend, attention_dp=attention_dp, dense_kv_cache=dense_kv_cache,
                       max_num_seqs=max_num_seqs, harness=harness, mixed_prompts=mixed_prompts,
                       requests=requests if concurrency is not None else None)
    m, chip, eff, w, best = out.pop("_objects")
    if do_simulate:
        # the plan's batch is the replica's slots; its KV cache holds what memory gives it, whatever the slots
        out["simulation"] = simulate(m, chip, chips, best.config, eff, w, best.batch,
                                     SimSpec(rate, requests or SIM_REQUESTS, seed, input_dist, output_dist,
                                             concurrency, trace),
                                     kv_batch=max(best.batch, out["max_batch_per_replica"]))
        sim = out["simulation"]
        if concurrency and not trace and input_dist == output_dist == "fixed" and sim["ttft_s"]["p50"] > 2 * out["ttft_s"] \
                and not best.rounds_in_phase:
            # fixed lengths under a closed loop: the clients that start together finish together and send again
            # together, so their prompts keep reaching the engine in waves; the closed form's clients are at spread-out
            # ages. Said, not corrected: a real benchmark's lengths and timing spread the waves by an amount not known
            sim["note"] = ("every request has the same lengths, so the closed loop's clients stay in step and their "
                           "prompts reach the engine together each round (the closed form's clients are at spread-out "
                           "ages); outputs that end at EOS spread them: --output-dist exponential models that")
    if disaggregate_:
        out["disaggregated"] = disaggregate(m, chip, chips, *[_disagg_config(best.config, out["layouts"], chips)] * 2,
                                            eff, w, batch).as_dict()
    if export:
        from meshplan.cli.export import write_serve_export

        write_serve_export(export, out_dir, out, model, batching, chip)
    if plot:
        from meshplan.infer.plots import plot_frontier

        pts = frontier(m, chip, chips, best.config, eff, w, batching)
        plot_frontier(pts, plot, f"{m.name} on {chips} x {chip.name} (tp={best.config.tp}, pp={best.config.pp})")
        out["plot"] = plot
    if ideal:
        out["book_ideal"] = ideal_serving(m, chip, best.config, w, best.batch, tpot_target)
    if html:
        from meshplan.web.page import serve_view, write_html

        write_html(html, serve_view(out, dict(model=model, hardware=hardware, chips=chips, input_len=input_len,
                                              output_len=output_len, batch=batch, quant=quant, kv_quant=kv_quant,
                                              tp=tp, pp=pp, ep=ep)))
    if json_out:
        print_json(out)
        return
    _print_table(out)
    if ideal:
        print_ideal(out)


def _print_table(o: dict) -> None:
    c = o["config"]
    adp = " attention-dp" if c.get("attention_dp") else ""
    t = Table(title=f"{o['model']} on {o['chips']} x {o['hardware']}: tp={c['tp']} pp={c['pp']} ep={c['ep']}{adp} "
                    f"x {c['replicas']} replicas, {c['weight_dtype']} weights, {c['kv_dtype']} KV ({o['mode']})")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    cost = o["cost_per_million_tokens"]
    running = "" if o["running_batch"] == o["batch"] else \
        f"; {o['running_batch']} decode at once, the step budget of {o['replica_step_token_budget']:,} tokens " \
        "holds no more prompts: the rest wait"
    rows = [("batch per replica (max that fits)", f"{o['batch']} ({o['max_batch_per_replica']}){running}"),
            ("TTFT", fmt_time(o["ttft_s"])), ("TPOT", fmt_time(o["tpot_s"])),
            ("end-to-end latency", fmt_time(o["e2e_latency_s"])),
            ("output tokens/s (deployment)", f"{o['throughput_tokens_per_s']:,.0f}"),
            ("output tokens/s per chip", f"{o['throughput_tokens_per_s_per_chip']:,.1f}"),
            ("memory per chip", f"{fmt_bytes(o['memory_bytes_per_chip']['total'])} of "
                                f"{fmt_bytes(o['memory_bytes_per_chip']['budget'])}"),
            ("$ per M input / output tokens", f"${cost['input']:.3f} / ${cost['output']:.3f} (at "
                                              f"${o['price']['per_chip_hour']:g}/chip-hour, {o['price']['basis']})"),
            ("decode step bound by", o["decode_step"]["bound"])]
    if o.get("expert_gemms"):
        g = o["expert_gemms"]
        rate = (f"the engine's measured MoE kernel: {g['engine_fraction']:.2f} of the format's peak x rows / (rows + "
                f"{g['engine_rows_half']:g}) x d / (d + {g['engine_half_dim']:g})" if g["engine_fraction"] is not None
                else "no engine measurement: the chip's grouped-GEMM ceiling")
        rows.append(("MoE expert GEMMs", f"{g['format']}, {rate}"))
    if o.get("harness"):
        h = o["harness"]
        rows.append((f"{h['harness']} settings", f"max_batch_size {h['max_batch_size']:,}, max_num_tokens "
                     f"{h['max_num_tokens']:,}, chunked prefill {'on' if h['chunked_prefill'] else 'off'}"))
    if o.get("skipped_layouts"):
        rows.append(("layouts skipped (cannot be placed)", f"{sum(o['skipped_layouts'].values())}: "
                     + next(iter(o["skipped_layouts"]))))
    for k, v in rows:
        t.add_row(k, v)
    if "clients" in o:
        q = o["clients"]
        bench = (f"; a benchmark of {q['requests']:,} requests, its first round's mean TTFT "
                 f"{fmt_time(q['first_round_ttft_s'])} in the mean" if q.get("requests") else "")
        bench += (f"; rounds in phase (the engine takes whole prompts: the clients' prompts arrive in groups; TTFT "
                  f"{fmt_time(q['spread_ttft_s'])} were their phases spread)"
                  if q.get("rounds_in_phase") else "; steady state (the clients' phases spread)")
        t.add_row("closed-loop clients", f"{q['clients']:,} clients, {q['running']:,} running, {q['waiting']:,} "
                                         f"waiting; queue wait {fmt_time(q['queue_wait_s'])}{bench}")
    if "simulation" in o:
        s = o["simulation"]
        t.add_row("sim TTFT p50/p90/p99", " / ".join(fmt_time(s["ttft_s"][k]) for k in ("p50", "p90", "p99")))
        t.add_row("sim TPOT p50/p90/p99", " / ".join(fmt_time(s["tpot_s"][k]) for k in ("p50", "p90", "p99")))
        t.add_row("sim ITL mean (every token gap)", fmt_time(s["itl_s"]["mean"]))
        t.add_row("sim output throughput", f"{s['throughput_tokens_per_s']:,.0f} tok/s")
        if "note" in s:
            t.add_row("sim note", s["note"])
    if "disaggregated" in o:
        d = o["disaggregated"]
        pc, dc = d["prefill_config"], d["decode_config"]
        t.add_row("disaggregated prefill | decode pools",
                  f"{d['prefill_instances']} x tp={pc['tp']} pp={pc['pp']} ({d['prefill_chips']} chips) | "
                  f"{d['decode_instances']} x tp={dc['tp']} pp={dc['pp']} ({d['decode_chips']} chips), "
                  f"batch {d['decode_batch']}")
        # which pool sets the rate: the instances in hand against the ratio the two rates ask for (book ch.8)
        have = d["prefill_instances"] / d["decode_instances"]
        need = d["prefill_per_decode_ratio"]
        bound = "prefill-bound" if have < need else "decode-bound"
        t.add_row("disaggregated prefill:decode instances",
                  f"{d['prefill_instances']}:{d['decode_instances']} ({have:.2f}; the rates ask for {need:.2f}: "
                  f"{bound})")
        t.add_row("disaggregated TTFT / TPOT", f"{fmt_time(d['ttft_s'])} / {fmt_time(d['tpot_s'])}")
        t.add_row("disaggregated output tokens/s", f"{d['throughput_tokens_per_s']:,.0f}")
        t.add_row("KV transfer per request", fmt_time(d["kv_transfer_s"]))
    console.print(t)
