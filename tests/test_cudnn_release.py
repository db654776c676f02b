"""cuDNN's fused attention as release 9.10 ran it (`--attention-kernel cudnn-9.10`, the nemo@25.04 preset): NVIDIA's
B200 table at that release (NVIDIA/cudnn-frontend@f937055, benchmarks/data/cudnn_sdpa_b200_9_10.csv) against the
rates meshplan gives it, by hand from the table's own times, including rows the constants were not read from."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from conftest import run_cli

from meshplan.cost.efficiency import attention_tile_factor, default_efficiency
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.costmodel import Options
from meshplan.train.frameworks import preset, version_at
from meshplan.train.planner import plan
from meshplan.train.space import Pins, Problem

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "cudnn_sdpa_b200_9_10.csv"


def _table() -> dict[tuple[int, int], tuple[float, float]]:
    with DATA.open() as fh:
        rows = csv.DictReader(line for line in fh if not line.startswith("#"))
        return {(int(r["batch_size"]), int(r["q_seqlen"])): (float(r["forward_time"]) * 1e-3,
                                                             float(r["backward_time"]) * 1e-3) for r in rows}


def _causal_fwd_flops(batch: int, seq: int) -> float:
    # 4·b·h·S·(S/2)·d: QKᵀ and AV over the causal half, 128 query heads of width 128
    return 4.0 * batch * 128 * seq * (seq / 2) * 128


def _meshplan_s(seq: int, direction: str, batch: int = 1) -> float:
    chip = load_chip("b200")
    eff = default_efficiency(chip)
    frac = eff.attention_cudnn910_fwd_fraction if direction == "fwd" else eff.attention_cudnn910_bwd_fraction
    flops = _causal_fwd_flops(batch, seq) * (1.0 if direction == "fwd" else eff.attention_bwd_flops_ratio)
    return flops / (chip.peak("bf16") * frac) * attention_tile_factor(eff, direction, seq / 2, 0.5, kernel="cudnn-9.10")


def test_the_anchor_is_the_tables_8k_row() -> None:
    # 8,192 tokens: 1.816 ms forward = 4 x 128 x 8192 x 4096 x 128 / 1.816e-3 = 1,211 TFLOP/s of B200's 2.25 PF
    fwd_s, bwd_s = _table()[(1, 8192)]
    assert _causal_fwd_flops(1, 8192) / fwd_s / 2.25e15 == pytest.approx(0.538, abs=5e-4)
    assert _meshplan_s(8192, "fwd") == pytest.approx(fwd_s, rel=2e-3)
    assert _meshplan_s(8192, "bwd") == pytest.approx(bwd_s, rel=2e-3)


@pytest.mark.parametrize(("batch", "seq"), [(1, 65536), (1, 131072), (2, 131072)])
def test_rows_past_the_fit_within_ten_percent(batch: int, seq: int) -> None:
    # the tile constants were read from the 8K-32K rows; the longer ones were not used
    fwd_s, bwd_s = _table()[(batch, seq)]
    assert _meshplan_s(seq, "fwd", batch) == pytest.approx(fwd_s, rel=0.10)
    assert _meshplan_s(seq, "bwd", batch) == pytest.approx(bwd_s, rel=0.10)


def test_the_release_is_slower_than_todays_cudnn_on_b200() -> None:
    # the current B200 fractions (0.670 / 0.567, cuDNN 9.22 via GB200) against 9.10's 0.538 / 0.420
    eff = default_efficiency(load_chip("b200"))
    assert eff.attention_cudnn910_fwd_fraction < eff.attention_fwd_fraction
    assert eff.attention_cudnn910_bwd_fraction < eff.attention_bwd_fraction


def _step_s(chip: str, kernel: str) -> float:
    prob = Problem(load_model("llama3-8b"), load_chip(chip), 8, 32768, 64)
    opts = Options(attention_kernel=kernel, compute_dtype="bf16")
    return plan(prob, Pins(), default_efficiency(prob.chip), opts, top=1).plans[0]["step_time_s"]


def test_a_chip_without_a_910_table_takes_the_current_kernel() -> None:
    eff = default_efficiency(load_chip("h100-sxm"))
    assert eff.attention_cudnn910_fwd_fraction == eff.attention_fwd_fraction
    assert eff.attention_cudnn910_tile_bwd == eff.attention_tile_bwd
    assert _step_s("h100-sxm", "cudnn-9.10") == pytest.approx(_step_s("h100-sxm", "fused"), rel=1e-12)


def test_a_long_sequence_step_is_slower_under_the_old_release_on_b200() -> None:
    assert _step_s("b200", "cudnn-9.10") > 1.05 * _step_s("b200", "fused")


def test_nemo_2504_preset_names_the_release() -> None:
    assert preset("nemo@25.04")["attention_kernel"] == "cudnn-9.10"
    assert "attention_kernel" not in preset("nemo")


def test_cli_takes_the_kernel_and_the_preset(capsys) -> None:
    for flags in (["--attention-kernel", "cudnn-9.10"], ["--framework", "nemo@25.04"]):
        code, out, err = run_cli(["train", "-m", "llama3-8b", "--hardware", "b200", "--chips", "8", "--seq-len", "32768",
                                  "--global-batch", "64", *flags], capsys)
        assert code == 0, err
        assert "cuDNN 9.10" in out


def test_a_nemo_release_takes_its_preset() -> None:
    # the harness reads the release from a source key ('nemo-long-sequence-25.04:...'): the newest listed preset not
    # after it, the oldest for a release before them all (NeMo 1.x's 24.03)
    assert version_at("nemo", 202403) == "nemo@24.07"
    assert version_at("nemo", 202407) == "nemo@24.07"
    assert version_at("nemo", 202504) == "nemo@25.04"
    assert version_at("nemo", 202606) == "nemo@26.06"
