"""TensorRT-LLM's DeepSeek-R1 best-practice blog, H200 max-throughput run, as issue #14 ground truth (session 39): an
attention-DP MoE serving run at a stated batch (1024 clients, 128 per rank), which splits the attention-DP error of
the v1.0 perf-overview tables (step time vs sequences held). The values are typed here from the source
(docs/source/blogs/Best_perf_practice_on_DeepSeek-R1_in_TensorRT-LLM.md @ 01c4ece9) and checked against the data file."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from conftest import split_by_rule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import serving_accuracy  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data"
ROW = "trtllm_dsr1_h200_tp8_ep8_adp_fp8_1024_2048_c1024"


def _row() -> dict:
    new = yaml.safe_load((DATA / "serving_measurements_new.yaml").read_text())["measurements"]
    return next(e for e in new if e["id"] == ROW)


def test_the_run_as_the_blog_prints_it() -> None:
    e = _row()
    # trtllm-bench ... --tp 8 --ep 8 --max_batch_size 128 --max_num_tokens 1151 --num_requests 5120 --concurrency 1024;
    # dataset --input-mean 1024 --output-mean 2048 (stdev 0); 'Total Output Throughput (tokens/sec): 11489.2671'
    assert (e["tp"], e["ep"], e["chips"], e["attention_dp"]) == (8, 8, 8, True)
    assert (e["input_len"], e["output_len"], e["batch"], e["benchmark_requests"]) == (1024, 2048, 1024, 5120)
    assert e["max_num_batched_tokens"] == 1151
    assert e["measured"]["output_tokens_per_s"] == 11489.2671
    assert e["hardware"] == "h200" and e["weight_dtype"] == "fp8" and e["kv_dtype"] == "bf16"
    assert e["split"] == split_by_rule(e["source"]["key"])


def test_it_prices_as_a_closed_loop_at_the_stated_batch() -> None:
    e = _row()
    assert serving_accuracy.mode(e) == "continuous"  # a concurrency source: 1024 clients, not a static batch
    pred = serving_accuracy.predict(e, serving_accuracy._assumptions())
    assert pred["batch"] == 1024 <= pred["max_batch"]  # the clients bound the batch, not meshplan's KV capacity
    assert pred["max_num_batched_tokens"] == 1151 and pred["kv_dtype"] == "bf16"
