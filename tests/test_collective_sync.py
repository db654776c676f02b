"""Session 36, issue #14: the in-situ wait of a blocking collective in an inference step (serving.yaml
collective_sync_s), derived by benchmarks/collective_sync.py from Ladder-Residual's published pair of gpt-fast runs
with and without the all-reduces (data/ladder_gptfast_70b_tp.csv), and the measured Hopper custom all-reduce kernel
(data/aic_h100_vllm_custom_allreduce.csv). Expected values by hand from the published numbers."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshplan.cost.efficiency import default_efficiency
from meshplan.infer.config import ServeConfig, collective_sync_s, collective_sync_table, serving_constant
from meshplan.infer.step import _allreduce_s, decode_step, stage_parts
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import collective_sync  # noqa: E402

H100, V5E = load_chip("h100-sxm"), load_chip("tpu-v5e")


def test_serving_yaml_holds_the_derivation():
    assert collective_sync.main(["--check"]) == 0


def test_one_row_of_the_derivation_by_hand():
    # TP 4, batch 1 (plot-70b.py: standard 59.41 tok/s, upper bound 69.04 tok/s; 512 tokens a run)
    t_std, t_ub = 512 / 59.41, 512 / 69.04  # 8.6181 s, 7.4160 s
    # the prefill's 160 all-reduces of 1024 x 8192 x 2 B = 16 MiB at nccl-tests' 4-GPU time, 99.01 us
    prefill = 160 * 99.01e-6
    in_situ = (t_std - t_ub - prefill) / (511 * 160)
    assert in_situ == pytest.approx(14.51e-6, rel=1e-3)
    # the kernel alone, 16 KiB at TP 4 in a CUDA graph: 4.878 us (aic table row 4,16384)
    row = next(r for r in collective_sync.derive()["rows"] if (r["tp"], r["batch"]) == (4, 1))
    assert row["in_situ_s"] == pytest.approx(in_situ, rel=1e-9)
    assert row["kernel_s"] == pytest.approx(4.878e-6, rel=1e-9)
    assert row["excess_s"] == pytest.approx(in_situ - 4.878e-6, rel=1e-9)


def test_table_and_interpolation_in_log2_of_the_group():
    assert collective_sync_table(H100) == {2: 9.8e-6, 4: 10.9e-6, 8: 19.2e-6}
    assert collective_sync_s(H100, 1) == 0.0
    assert collective_sync_s(H100, 4) == pytest.approx(10.9e-6)
    # 6 GPUs: log2(6/4) = 0.585 of the way from 4 to 8
    assert collective_sync_s(H100, 6) == pytest.approx(10.9e-6 + math.log2(1.5) * (19.2e-6 - 10.9e-6))
    assert collective_sync_s(H100, 16) == pytest.approx(19.2e-6)  # clamped: measured up to 8
    assert collective_sync_s(V5E, 8) == 0.0  # nothing measured on TPU


@given(st.integers(min_value=1, max_value=4096), st.integers(min_value=1, max_value=4096))
def test_wait_never_falls_as_the_group_grows(a, b):
    lo, hi = sorted((a, b))
    assert 0.0 <= collective_sync_s(H100, lo) <= collective_sync_s(H100, hi) <= 19.2e-6


def test_decode_step_pays_the_wait_once_per_collective():
    # Llama 3.1 70B, TP 4, one decode sequence on H100 under vLLM: 160 all-reduces of 8192 x 2 B, each the one-shot
    # kernel (4.55 us + 16,384 x 3 / (450 GB/s x 0.645) = 4.72 us) plus the 10.9 us wait
    m, eff = load_model("llama3.1-70b"), default_efficiency(H100)
    cfg = ServeConfig(tp=4, engine="vllm")
    kernel = serving_constant("custom_allreduce_latency_s", H100) + 16384 * 3 / (450e9 * 0.645)
    assert _allreduce_s(H100, cfg, 16384, 4) == pytest.approx(kernel, rel=1e-9)
    parts = stage_parts(m, H100, cfg, eff, 1.0, 1000.0, 0.0, 0.0)
    assert parts["collectives"] == pytest.approx(160 * (kernel + 10.9e-6), rel=1e-9)
    # one GPU: no collective, no wait
    assert decode_step(load_model("llama3.1-8b"), H100, ServeConfig(tp=1), eff, 1, 1000).parts["collectives"] == 0.0


def test_meshplan_in_situ_all_reduce_within_the_pair_it_was_read_from():
    # the kernel model plus the wait against the in-situ time of the rows the wait was read from: the remaining
    # error is the kernel model's (and the mean over two batches), at most 15% here
    for r in collective_sync.derive()["rows"]:
        if r["used"]:
            assert r["meshplan_s"] == pytest.approx(r["in_situ_s"], rel=0.15), (r["tp"], r["batch"])
