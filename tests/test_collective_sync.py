"""Session 36, issue #14: what a TP all-reduce costs inside a decode loop (Ladder-Residual's published gpt-fast pair
with and without the all-reduces, data/ladder_gptfast_70b_tp.csv) against the kernel alone (aiconfigurator's H100
table, data/aic_h100_vllm_custom_allreduce.csv), as benchmarks/collective_sync.py reports it; and the Hopper custom
all-reduce constants read from the kernel tables. Expected values by hand from the published numbers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from meshplan.infer.config import ServeConfig, serving_constant
from meshplan.infer.step import _allreduce_s
from meshplan.specs.hardware import load_chip

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import collective_sync  # noqa: E402

H100, A100 = load_chip("h100-sxm"), load_chip("a100-80gb")


def test_one_row_of_the_pair_by_hand():
    # TP 4, batch 1 (plot-70b.py: standard 59.41 tok/s, upper bound 69.04 tok/s; 512 tokens a run)
    t_std, t_ub = 512 / 59.41, 512 / 69.04  # 8.6181 s, 7.4160 s
    # the prefill's 160 all-reduces of 1024 x 8192 x 2 B = 16 MiB at nccl-tests' 4-GPU time, 99.01 us
    prefill = 160 * 99.01e-6
    in_situ = (t_std - t_ub - prefill) / (511 * 160)
    assert in_situ == pytest.approx(14.51e-6, rel=1e-3)
    row = next(r for r in collective_sync.derive()["rows"] if (r["tp"], r["batch"]) == (4, 1))
    assert row["in_situ_s"] == pytest.approx(in_situ, rel=1e-9)
    # the kernel alone, 16 KiB at TP 4 in a CUDA graph: 4.878 us (aic table row 4,16384)
    assert row["kernel_s"] == pytest.approx(4.878e-6, rel=1e-9)
    assert row["excess_s"] == pytest.approx(in_situ - 4.878e-6, rel=1e-9)
    assert row["prefill_share"] == pytest.approx(prefill / (t_std - t_ub), rel=1e-9)


def test_gpt_fast_all_reduce_costs_more_in_situ_than_the_kernel_alone():
    # the published pair: at batches 1 and 4 every TP pays 8-20 us per all-reduce beyond the engine kernel alone,
    # more at TP 8 than at TP 2 and 4
    ex = collective_sync.derive()["mean_excess_s_batches_1_4"]
    assert all(8e-6 < v < 20e-6 for v in ex.values())
    assert ex[8] > max(ex[2], ex[4])


def test_hopper_custom_all_reduce_constants_from_the_kernel_tables():
    # latency: median of the 15 smallest-message rows (256 B - 4 KiB, TP 2/4/8) of the CUDA-graph table
    rows = collective_sync._rows("aic_h100_vllm_custom_allreduce.csv")
    small = sorted(float(r["time_us"]) for r in rows if int(r["bytes"]) <= 4096)
    assert len(small) == 15 and small[7] == pytest.approx(4.553)
    assert serving_constant("custom_allreduce_latency_s", H100) == pytest.approx(4.55e-6)
    # NVLink fraction: SGLang PR #2904's 4 MiB two-shot at TP 4 (31.1 us) and TP 8 (33.8 us), less 2 x 4.55 us
    fr = [2 * (g - 1) / g * 4 * 2**20 / ((t - 9.1) * 1e-6) / 450e9 for g, t in ((4, 31.1), (8, 33.8))]
    assert fr == pytest.approx([0.636, 0.660], abs=1e-3)
    assert serving_constant("custom_allreduce_nvlink_fraction", H100) == pytest.approx(sum(fr) / 2, abs=1e-3)
    # other GPUs keep the estimate the two Hopper values replace
    assert serving_constant("custom_allreduce_latency_s", A100) == pytest.approx(6e-6)


def test_meshplan_kernel_term_near_the_kernel_alone_at_the_pair_sizes():
    # the serving step's all-reduce for the pair's decode messages (16-64 KiB) against the measured kernel alone
    for r in collective_sync.derive()["rows"]:
        if r["batch"] in (1, 4):
            assert r["meshplan_s"] == pytest.approx(r["kernel_s"], rel=0.15), (r["tp"], r["batch"])
            assert r["meshplan_s"] == pytest.approx(
                _allreduce_s(H100, ServeConfig(tp=r["tp"], engine="vllm"), r["message_bytes"], r["tp"]))
