"""The third external serving check (benchmarks/tpu_engines.py, session 37): SGLang-JAX and vLLM on one TPU v6e-4. The
committed sweep is the source's table (checked against numbers typed from it here), each row becomes the two runs the
source made, the split follows the rule, and every row plans."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import split_by_rule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import serving_accuracy  # noqa: E402
import tpu_engines  # noqa: E402


def test_the_sweep_holds_the_source_table() -> None:
    rows = tpu_engines._rows()
    # 2 models x 3 input lengths x 6 client counts x 2 engines
    assert len(rows) == 72
    by = {(r["model"], r["engine"], r["isl"], r["concurrency"]): r for r in rows}
    # cells typed from the source's tables (qwen3_benchmark.md @ 24f84739): Qwen3-8B 1024/1024 at 64 clients, SGLang-JAX
    # TTFT 940.87 ms, ITL 11.11 ms, 5296.60 tok/s; Qwen3-32B 8192/1024 at 256 clients, vLLM ITL 144.88 ms, 193.41 tok/s
    a = by[("qwen3-8b", "sgl-jax", "1024", "64")]
    assert (float(a["ttft_ms"]), float(a["itl_ms"]), float(a["output_tok_s"])) == (940.87, 11.11, 5296.60)
    b = by[("qwen3-32b", "vllm", "8192", "256")]
    assert (float(b["itl_ms"]), float(b["output_tok_s"]), float(b["input_tok_s"])) == (144.88, 193.41, 1547.29)


def test_each_row_becomes_its_two_runs() -> None:
    entries = {e["id"]: e for e in tpu_engines.load()}
    assert len(entries) == 144
    itl = entries["tpu_sgljax_qwen3-32b_4096_1024_c16_itl"]
    ttft = entries["tpu_sgljax_qwen3-32b_4096_1024_c16_ttft"]
    assert (itl["engine"], itl["frontend"], itl["max_num_batched_tokens"]) == ("sglang", "sglang-http", 2048)
    assert itl["arrivals"] == {"requests": 48, "rate": float("inf"), "concurrency": 16, "max_num_seqs": 256}
    assert (itl["output_len"], ttft["output_len"], itl["tpot_measure"]) == (1024, 1, "pooled_itl")
    assert itl["measured"] == {"output_tokens_per_s": 626.42, "tpot_s": pytest.approx(0.02245), "ttft_s": None}
    assert ttft["measured"]["ttft_s"] == pytest.approx(3.14514)
    v = entries["tpu_vllm_qwen3-32b_4096_1024_c16_itl"]
    assert (v["engine"], v["frontend"], "max_num_batched_tokens" in v) == ("vllm", "vllm-openai", False)
    # the split by the rule, computed apart from _split.py
    assert {e["split"] for e in entries.values()} == {split_by_rule("sglang-jax-qwen3-benchmark:qwen3-8b"),
                                                      split_by_rule("sglang-jax-qwen3-benchmark:qwen3-32b")}


def test_runs_that_stopped_at_eos_keep_no_throughput() -> None:
    """vLLM's Qwen3-8B 1024/1024 run at 8 clients: 871.40 tok/s in but 815.38 out for equal lengths, so some requests
    ended early and its output rate is not the fixed-length run's; SGLang-JAX's equal pair is kept."""
    entries = {e["id"]: e for e in tpu_engines.load()}
    assert entries["tpu_vllm_qwen3-8b_1024_1024_c8_itl"]["measured"]["output_tokens_per_s"] is None
    assert entries["tpu_vllm_qwen3-8b_1024_1024_c8_itl"]["measured"]["tpot_s"] == pytest.approx(0.00902)
    assert entries["tpu_sgljax_qwen3-8b_1024_1024_c8_itl"]["measured"]["output_tokens_per_s"] == 1311.49
    # 4096 in, 1024 out: 1072.84 / 268.21 = 4.0 within 1%, kept
    assert entries["tpu_vllm_qwen3-32b_4096_1024_c8_itl"]["measured"]["output_tokens_per_s"] == 268.21


def test_every_row_plans() -> None:
    sample = [e for e in tpu_engines.load() if e["batch"] in (8, 256) and e["input_len"] == 8192]
    res = serving_accuracy.run(entries=sample)
    assert not [r for r in res["rows"] if "skipped" in r]
    for r in res["rows"]:
        p = r["predicted"]
        assert p["ttft_s"] > 0 and p["output_tokens_per_s"] > 0
        if r["id"].endswith("_itl"):
            assert p["tpot_s"] > 0


def test_vllm_on_tpu_caps_memory_at_its_own_default() -> None:
    """vLLM's TPU worker caps its memory at gpu_memory_utilization (0.9) of the chip's limit, not the 0.95 meshplan
    assumes for TPU engines without a figure (JetStream)."""
    from meshplan.infer.config import ServeConfig
    from meshplan.infer.memory import memory_budget_bytes
    from meshplan.specs.hardware import load_chip

    chip = load_chip("tpu-v6e")
    assert memory_budget_bytes(chip, ServeConfig(tp=8, engine="vllm"), 0.0) == pytest.approx(chip.usable_hbm_bytes * 0.9)
    assert memory_budget_bytes(chip, ServeConfig(tp=8), 0.0) == pytest.approx(chip.usable_hbm_bytes * 0.95)
