"""kernel_check.py's TensorRT-LLM 1.2 dense-GEMM section (session 38): the committed subset is NVIDIA's table
(values typed from the parquet checked here), the decode-row fit recovers what the README states, and the serving
GEMM term is compared in each row's own format."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import kernel_check  # noqa: E402

from meshplan.specs.hardware import load_chip  # noqa: E402


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return kernel_check.trtllm_dense_gemm_rows()


def test_the_subset_holds_the_source_rows(rows: list[dict]) -> None:
    assert len(rows) == 7610
    by = {(r["chip"], r["dtype"], r["m"], r["n"], r["k"]): r["time_s"] for r in rows}
    # a cell of the H100 table: fp8, m 4096, n 65536, k 12288 measured 4.94873 ms
    assert by[("h100-sxm", "fp8", 4096, 65536, 12288)] == pytest.approx(4948.73e-6)
    assert {r["dtype"] for r in rows} == {"bfloat16", "fp8", "fp8_block"}
    assert {r["m"] for r in rows} == {1, 8, 32, 64, 128, 192, 256, 512, 1024, 4096}


def test_decode_rows_stream_the_weights_and_fp8_pays_a_fixed_cost(rows: list[dict]) -> None:
    fits = kernel_check.dense_gemm_stream_fits(rows)
    for chip in ("h100-sxm", "h200"):
        bf16, fp8, block = (fits[(chip, d)] for d in ("bfloat16", "fp8", "fp8_block"))
        # every format streams its weights at 0.8-0.92 of the HBM peak once past the L2
        assert all(0.80 < f["stream_fraction"] < 0.92 for f in (bf16, fp8, block))
        # bf16 costs a few microseconds per GEMM besides the stream; both fp8 formats over 10 us more
        assert 2.0 < bf16["fixed_us"] < 7.0
        assert fp8["fixed_us"] > bf16["fixed_us"] + 10.0 and block["fixed_us"] > bf16["fixed_us"] + 10.0


def test_a_recovered_fit_is_the_lines_own() -> None:
    """Synthetic rows on a line give back its slope and intercept (the fit itself, apart from the table)."""
    chip = load_chip("h200")
    rate = 0.85 * chip.hbm_bandwidth_bytes_per_s
    synth = [{"chip": "h200", "dtype": "bfloat16", "m": 8, "n": n, "k": 8192,
              "time_s": 5e-6 + n * 8192 * 2.0 / rate} for n in (4096, 8192, 16384, 65536)]
    fit = kernel_check.dense_gemm_stream_fits(synth)[("h200", "bfloat16")]
    assert fit["stream_fraction"] == pytest.approx(0.85) and fit["fixed_us"] == pytest.approx(5.0)


def test_the_serving_term_reads_the_rows_format() -> None:
    """One fp8 decode GEMM reads half the weight bytes of the same bf16 GEMM: the serving term (weight-bound at m = 1)
    halves, less the fixed kernel overhead both pay."""
    chip = load_chip("h100-sxm")
    row = {"chip": "h100-sxm", "m": 1, "n": 16384, "k": 16384, "time_s": 1.0}
    t_bf16 = kernel_check.dense_gemm_predicted_s({**row, "dtype": "bfloat16"}, chip)
    t_fp8 = kernel_check.dense_gemm_predicted_s({**row, "dtype": "fp8"}, chip)
    from meshplan.cost.efficiency import default_efficiency

    overhead = default_efficiency(chip).kernel_overhead_s
    assert (t_fp8 - overhead) == pytest.approx((t_bf16 - overhead) / 2, rel=1e-3)
