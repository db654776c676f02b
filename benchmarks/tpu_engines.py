"""Closed-loop serving on TPU v6e by two JAX/XLA engines, SGLang-JAX and vLLM's TPU backend, side by side: a third
external check beside aic_silicon.py and nim_dli.py (issue #14, session 37; the serving_tpu family).

Source: the SGLang-JAX project's Qwen3 benchmark (sgl-project/sglang-jax docs/performance/qwen3_benchmark.md @ 24f84739,
PR #172, 2025-09-13), copied verbatim into data/tpu_engines_qwen3_sweep.csv (its header names the engines' commits,
both server commands and the client). Qwen3-8B and Qwen3-32B in bf16 on one v6e-4 (TP 4), fixed lengths 1024 / 4096 /
8192 in and 1024 out, 8-256 clients, 3 x clients requests sent at once, one client program (sgl_jax.bench_serving)
for both engines. The figures carry over; no code of that project does.

Rules, the same for every row (fixed before any prediction was compared with these rows):
  - source key (the split's unit, benchmarks/_split.py): one per model table, 'sglang-jax-qwen3-benchmark:' + model
    (both engines' columns are one table); both keys fall in the tuning half;
  - each table row gives two entries per engine: the output-1024 run (mean ITL, every gap pooled, compared with the
    simulation's pooled ITL; output tokens/s) and the separate output-1 run of the same clients and requests (its
    mean TTFT), each replayed by meshplan's simulator with the benchmark's arrivals (3 x clients requests at t = 0,
    `clients` in flight);
  - engines: vLLM -> the `vllm` preset (V1 scheduler, its TPU step budget default, serial steps: async scheduling was
    opt-in) behind `vllm serve` (frontend vllm-openai); SGLang-JAX -> the `sglang` preset (its scheduler is SGLang's:
    overlap scheduler on and mixed chunks off by default in server_args.py at the engine's commit 10f32e49) with the
    command's --chunked-prefill-size 2048 as the step budget and --max-running-requests 256, behind its HTTP server
    (frontend sglang-http: SGLang's tokenizer-manager / scheduler / detokenizer processes, which SGLang-JAX keeps);
  - output tokens/s is left out where the run's input and output throughput disagree with its lengths by more than
    1% (some requests stopped at EOS: the script passes no ignore-eos), as in the vLLM Qwen3-8B columns.

    python benchmarks/tpu_engines.py     # the rows by engine, model and lengths (serving_accuracy.py reports the halves)
"""

from __future__ import annotations

import csv
import statistics
import sys
from pathlib import Path

from _split import closed_loop_entry, split_of

DATA = Path(__file__).resolve().parent / "data"
SWEEP = DATA / "tpu_engines_qwen3_sweep.csv"
URL = ("https://github.com/sgl-project/sglang-jax/blob/24f8473995c9c4cfda030c439e3b580960fe9645/docs/performance/"
       "qwen3_benchmark.md")
TITLE = "SGLang-JAX Qwen3 benchmark: SGLang-JAX and vLLM (TPU) on one TPU v6e-4, closed loop, fixed lengths"
# engine column -> (meshplan engine preset, server path, step token budget from the source's command or None)
ENGINES = {"vllm": ("vllm", "vllm-openai", None), "sgl-jax": ("sglang", "sglang-http", 2048)}
MAX_RUNNING = 256  # SGLang-JAX --max-running-requests 256; vLLM's TPU max_num_seqs default (serving.yaml engine_max_num_seqs)
EOS_TOLERANCE = 0.01


def _rows(path: Path = SWEEP) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def _ran_full_length(r: dict) -> bool:
    """Whether the output-1024 run generated its full lengths: input / output throughput = ISL / OSL within 1%."""
    ratio = float(r["input_tok_s"]) / float(r["output_tok_s"])
    return abs(ratio / (int(r["isl"]) / int(r["osl"])) - 1) <= EOS_TOLERANCE


def _row_entries(r: dict) -> list[dict]:
    """One sweep row's two runs as closed-loop entries (_split.closed_loop_entry): the output-1024 run (ITL, output
    tok/s) and the output-1 run (TTFT)."""
    engine, frontend, budget = ENGINES[r["engine"]]
    c = int(r["concurrency"])
    key = f"sglang-jax-qwen3-benchmark:{r['model']}"
    name = f"tpu_{r['engine'].replace('-', '')}_{r['model']}_{r['isl']}_{r['osl']}_c{c}"
    where = f"table '{r['model']} Performance Results', row {r['isl']}/{r['osl']} batch {c}, {r['engine']} columns"
    row = {"split": split_of(key), "model": r["model"], "hardware": "tpu-v6e", "tp": 4, "weight_dtype": "bf16",
           "input_len": r["isl"], "concurrency": c}
    extra = {"frontend": frontend,
             "arrivals": {"requests": 3 * c, "rate": float("inf"), "concurrency": c, "max_num_seqs": MAX_RUNNING}}
    if budget:
        extra["max_num_batched_tokens"] = budget
    runs = (("itl", int(r["osl"]), "ITL, output tok/s",
             {"output_tokens_per_s": float(r["output_tok_s"]) if _ran_full_length(r) else None,
              "tpot_s": float(r["itl_ms"]) / 1e3, "ttft_s": None},
             "mean ITL (pooled gaps) compared as TPOT", {"tpot_measure": "pooled_itl"}),
            ("ttft", 1, "TTFT, output-1 run",
             {"output_tokens_per_s": None, "tpot_s": None, "ttft_s": float(r["ttft_ms"]) / 1e3},
             "the sweep's TTFT column comes from runs of one output token", {}))
    return [closed_loop_entry({**row, "id": f"{name}_{suffix}", "output_len": output_len},
                              families=["serving_ttft_itl_under_load", "serving_tpu"],
                              source={"key": key, "title": TITLE, "url": URL, "where": f"{where} ({what})",
                                      "date": "2025-09"},
                              engine=engine, measured=measured, notes=notes, **extra, **more)
            for suffix, output_len, what, measured, notes, more in runs]


def load(path: Path = SWEEP) -> list[dict]:
    """The sweep as serving_measurements_new.yaml entries (serving_accuracy.predict reads them unchanged)."""
    return [e for r in _rows(path) for e in _row_entries(r)]


def main(argv: list[str] | None = None) -> int:
    import serving_accuracy

    entries = load()
    res = serving_accuracy.run(entries=entries)
    by_id = {e["id"]: e for e in entries}
    print("| engine | model | in | clients | ITL pred / meas (ms) | err | tok/s pred / meas | err | TTFT pred / meas (ms) | err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    groups: dict[tuple, list[float]] = {}
    rows = {r["id"]: r for r in res["rows"]}
    for e in entries:
        if not e["id"].endswith("_itl"):
            continue
        r, t = rows[e["id"]], rows[e["id"][:-4] + "_ttft"]
        if "error" not in r or "error" not in t:
            print(f"| {e['id']} | skipped: {r.get('skipped') or t.get('skipped')} |")
            continue
        p, m = r["predicted"], r["measured"]
        err_itl, err_tok, err_ttft = r["error"]["tpot_s"], r["error"]["output_tokens_per_s"], t["error"]["ttft_s"]
        groups.setdefault((e["engine"], e["model"], "ITL"), []).append(err_itl)
        groups.setdefault((e["engine"], e["model"], "TTFT"), []).append(err_ttft)
        tok = (f"{p['output_tokens_per_s']:.0f} / {m['output_tokens_per_s']:.0f} | {err_tok:+.0%}"
               if err_tok is not None else f"{p['output_tokens_per_s']:.0f} / - | -")
        print(f"| {e['engine']} | {e['model']} | {e['input_len']} | {e['batch']} | {p['tpot_s'] * 1e3:.1f} / "
              f"{m['tpot_s'] * 1e3:.1f} | {err_itl:+.0%} | {tok} | {t['predicted']['ttft_s'] * 1e3:.0f} / "
              f"{by_id[t['id']]['measured']['ttft_s'] * 1e3:.0f} | {err_ttft:+.0%} |")
    print("\n| engine | model | quantity | n | median abs err | signed median |")
    print("|---|---|---|---|---|---|")
    for (eng, model, q), errs in sorted(groups.items()):
        print(f"| {eng} | {model} | {q} | {len(errs)} | {statistics.median(abs(x) for x in errs):.1%} | "
              f"{statistics.median(errs):+.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
