"""Closed-loop NIM (TensorRT-LLM) serving sweeps from NVIDIA's LLM inference sizing course: import and load (issue #14,
session 31), a second external check beside aic_silicon.py.

Source: wbing520/ai-performance-engineering at commit 0e25b2e2, code/ch10_inference/inference_gpu_cluster_sizing/
dataset/nim.csv: the "pre-collected NIM benchmarks" the course's notebooks explore ("Benchmarking Throughput/Latency
Tradeoffs", GenAI-Perf), 787 rows, each one GenAI-Perf run of NIM with its TensorRT-LLM backend (execution type
NIM_TRT-LLM) on one model, GPU type, GPU count and precision, a closed loop of `concurrency` clients at fixed synthetic
lengths (input stddev 0, max_tokens = the output length): the mean TTFT, mean inter-token latency and output tokens/s.
Llama 3 8B and 70B Instruct on A100-SXM4-80GB and H100 80GB HBM3, 1-8 GPUs, fp16/bf16 and fp8, 1-250 clients. The
figures carry over; no code of that project does.

    python benchmarks/nim_dli.py --upstream path/to/nim.csv   # rewrites data/nim_dli_sizing.csv

Rules, the same for every row (fixed before any prediction was compared with these rows):
  - source key (the split's unit, benchmarks/_split.py): one measurement campaign per GPU type and model,
    'nim-dli-sizing:' + GPU / backend / model, as aic_silicon.py keys its campaigns by system, backend, release and
    model (this source names no release). A finer key by GPU count and precision was computed first and not used:
    the campaign convention of the first external check decides;
  - kept: rows whose mean output and input token counts are within 1% of the configured lengths (the client asked
    for exactly that many tokens and got them);
  - weights: fp8 -> fp8; fp16 and bf16 -> bf16 (the same bytes and the same tensor-core peak on A100 and H100); the KV
    dtype is unstated (serving_assumptions.yaml missing_kv_dtype);
  - layout: the GPU count is the TP degree of one engine (NIM's TensorRT-LLM profiles shard one engine over the
    profile's GPUs);
  - engine: trtllm@0.17, TensorRT-LLM's TensorRT engine path with the C++ executor, which NIM's TensorRT-LLM backend
    ran in 2024 (Llama 3, not 3.1, dates the sweep); server path unstated (none charged);
  - clients: a closed loop of `concurrency` clients at fixed lengths; the request count is unstated (GenAI-Perf's
    perf_analyzer measures windows of the sustained loop), so the steady state alone is compared.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from _split import (  # sibling module: benchmarks/ is on the path of every script and test that loads this
    closed_loop_entry,
    import_main,
    read_subset_csv,
    repeat_id,
    split_of,
    write_subset_csv,
)

DATA = Path(__file__).resolve().parent / "data"
SUBSET = DATA / "nim_dli_sizing.csv"
COMMIT = "0e25b2e236211ad01ed2221bd2c1cfa5b3f47b55"
URL = ("https://github.com/wbing520/ai-performance-engineering/blob/0e25b2e236211ad01ed2221bd2c1cfa5b3f47b55/code/"
       "ch10_inference/inference_gpu_cluster_sizing/dataset/nim.csv")
TITLE = ("NVIDIA LLM inference sizing course dataset (nim.csv, as published in wbing520/ai-performance-engineering): "
         "GenAI-Perf closed-loop sweeps of NIM with TensorRT-LLM")
MODELS = {"meta-llama3-8b-instruct": "llama3-8b", "meta-llama3-70b-instruct": "llama3-70b"}
GPUS = {"A100-SXM4-80GB": ("a100-80gb", "a100_sxm4_80gb"), "H100_80GB_HBM3": ("h100-sxm", "h100_80gb_hbm3")}
WEIGHTS = {"fp16": "bf16", "bf16": "bf16", "fp8": "fp8"}
ENGINE = "trtllm@0.17"
LENGTH_TOLERANCE = 0.01
FIELDS = ("id", "source_key", "split", "model", "hardware", "weight_dtype", "tp", "input_len", "output_len",
          "concurrency", "ttft_ms", "itl_ms", "output_tokens_per_s", "upstream_row", "upstream_precision")
NS_PER_MS = 1e6


def select(upstream: Path) -> list[dict]:
    """The rows kept (module docstring), in the upstream order, with their source key and split."""
    out, seen = [], {}
    with upstream.open() as f:
        for i, r in enumerate(csv.DictReader(f), start=2):  # upstream line number (the header is line 1)
            if (r["task_inputs-execution_type"] != "NIM_TRT-LLM" or r["task_inputs-model"] not in MODELS
                    or r["task_inputs-GPU"] not in GPUS or r["task_inputs-precision"] not in WEIGHTS):
                continue
            isl, osl = int(r["input_config-synthetic_input_tokens_mean"]), int(r["input_config-output_tokens_mean"])
            if (abs(float(r["num_input_token-avg"]) / isl - 1) > LENGTH_TOLERANCE
                    or abs(float(r["num_output_token-avg"]) / osl - 1) > LENGTH_TOLERANCE):
                continue
            model = MODELS[r["task_inputs-model"]]
            hw, gpu = GPUS[r["task_inputs-GPU"]]
            key = f"nim-dli-sizing:{gpu}/nim_trt-llm/{model}"
            tp, c = int(r["task_inputs-n_gpus"]), int(r["input_config-concurrency"])
            prec = r["task_inputs-precision"]
            rid = f"nim_dli_{gpu}_{model}_{prec}_tp{tp}_{isl}_{osl}_c{c}".replace(".", "p").replace("-", "_")
            out.append({
                "id": repeat_id(seen, rid), "source_key": key, "split": split_of(key),
                "model": model, "hardware": hw, "weight_dtype": WEIGHTS[prec], "tp": tp, "input_len": isl,
                "output_len": osl, "concurrency": c,
                "ttft_ms": round(float(r["time_to_first_token-avg"]) / NS_PER_MS, 4),
                "itl_ms": round(float(r["inter_token_latency-avg"]) / NS_PER_MS, 4),
                "output_tokens_per_s": round(float(r["output_token_throughput-avg"]), 3), "upstream_row": i,
                "upstream_precision": prec})
    return out


def write_subset(rows: list[dict], path: Path = SUBSET) -> None:
    write_subset_csv(path, f"# Subset of {URL}\n# (figures measured with NVIDIA NIM; mapped by benchmarks/nim_dli.py, "
                     "whose docstring states the rules): ttft_ms / itl_ms are the upstream time_to_first_token-avg /\n"
                     "# inter_token_latency-avg (ns) / 1e6, output_tokens_per_s the upstream "
                     "output_token_throughput-avg, tp the upstream task_inputs-n_gpus, lengths and concurrency the "
                     "upstream input_config values; upstream_row is the line in the upstream file.\n", FIELDS, rows)


def load(path: Path = SUBSET) -> list[dict]:
    """The subset as serving_measurements_new.yaml entries (serving_accuracy.predict reads them unchanged)."""
    return [closed_loop_entry(
        r, families=["serving_ttft_itl_under_load", "serving_nim_dli"],
        source={"key": r["source_key"], "title": TITLE, "url": URL,
                "where": f"line {r['upstream_row']} ({r['upstream_precision']}, {r['tp']} GPU(s)): closed loop, "
                         f"concurrency {r['concurrency']}",
                "date": "2024 (Llama 3 NIM)"},
        engine=ENGINE,
        measured={"output_tokens_per_s": float(r["output_tokens_per_s"]), "tpot_s": float(r["itl_ms"]) / 1e3,
                  "ttft_s": float(r["ttft_ms"]) / 1e3},
        notes="NIM sizing-course sweep (GenAI-Perf); mean ITL compared as TPOT") for r in read_subset_csv(path)]


def main(argv: list[str] | None = None) -> int:
    return import_main(argv, __doc__, "the course's nim.csv", select, write_subset, SUBSET)


if __name__ == "__main__":
    sys.exit(main())
