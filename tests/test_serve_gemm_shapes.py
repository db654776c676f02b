"""Serving GEMMs at their own shapes: the thin-dimension penalty of efficiency.yaml matmul_half_dim (which training
applies to every GEMM through Efficiency.matmul) also applies to a serving step's GEMMs, on their narrower weight
dimension after the TP split; a GEMM runs at the penalty of its most constraining dimension (rows or weight width)."""

import pytest

from meshplan.cost.efficiency import default_efficiency
from meshplan.infer.config import ServeConfig
from meshplan.infer.step import _dense_gemms, _matmul_fraction, stage_parts
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

H100 = load_chip("h100-sxm")
EFF = default_efficiency(H100)  # matmul_peak_fraction 0.75, matmul_half_dim 256, matmul_rows_half 128
M8 = load_model("llama3.1-8b")
M70 = load_model("llama3-70b")


def test_fraction_takes_the_most_constraining_dimension():
    assert (EFF.matmul_peak_fraction, EFF.matmul_half_dim, EFF.matmul_rows_half) == (0.75, 256.0, 128.0)
    # 8192 rows (8192/8320 = 0.985) of a 4096-wide weight (4096/4352 = 0.941): the weight side binds
    assert _matmul_fraction(EFF, "bf16", 8192, 4096) == pytest.approx(0.75 * 4096 / 4352, rel=1e-12)
    # 64 decode rows (64/192 = 0.333) of the same weight: the rows bind, as before
    assert _matmul_fraction(EFF, "bf16", 64, 4096) == pytest.approx(0.75 * 64 / 192, rel=1e-12)
    # no weight width given: the row penalty alone
    assert _matmul_fraction(EFF, "bf16", 8192) == pytest.approx(0.75 * 8192 / 8320, rel=1e-12)


def test_dense_gemm_shapes_after_the_tp_split():
    # Llama 3 70B (D 8192, 64 q / 8 kv heads of 128, F 28672) at TP 4: fused QKV 8192 -> 64·128/4 + 2·(8/4)·128 =
    # 2560 wide (8192 x 2560 = 20,971,520 weights); O 2048 -> 8192 (16,777,216); the MLP 3 x 8192 x 28672 / 4 =
    # 176,160,768 weights at F/tp = 7168, with the two norms (2 x 8192) riding on it (not on the attention: the
    # attention's own remainder is 0 for a bias-free model)
    got = [x for gemm in _dense_gemms(M70, 4) for x in gemm]
    assert got == pytest.approx([20_971_520, 2560, 16_777_216, 2048, 176_160_768 + 16_384, 7168], rel=1e-12)


def test_prefill_step_gemms_pay_the_thin_weight_penalty():
    # an 8192-token prefill of Llama 3.1 8B on one H100 (one prompt chunk): every dense GEMM's narrower weight
    # dimension is d_model = 4096 (fused QKV 4096 -> 6144, O 4096 -> 4096, MLP 4096 -> 14336), so they run at
    # 0.75 x 4096/4352 = 0.7059 of 989 TFLOP/s: 2 x 8192 x 32 layers x 218,112,000 weights = 1.14349e14 FLOPs ->
    # 163.80 ms; the output projection for the one sampled row: 2 x 4096 x 128256 x (1 + 128) / (989e12 x 0.75) =
    # 0.1827 ms. Before, everything ran at the rows' 0.75 x 8192/8320: 156.8 ms + the output projection.
    parts = stage_parts(M8, H100, ServeConfig(), EFF, 0.0, 0.0, 8192.0, 4096.0)
    dense = 2 * 8192 * 32 * 218_112_000 / (989e12 * 0.75 * 4096 / 4352)
    logits = 2 * 4096 * 128256 * 129 / (989e12 * 0.75)
    assert dense == pytest.approx(0.16380, rel=1e-4)
    assert parts["compute"] == pytest.approx(dense + logits, rel=1e-9)


def test_decode_step_unchanged_where_rows_bind():
    # 32 decode rows: 32/160 = 0.2 binds below every weight width, so the compute term is the row-penalty one
    parts = stage_parts(M8, H100, ServeConfig(), EFF, 32.0, 1000.0, 0.0, 0.0)
    assert parts["compute"] == 0.0  # weight-bound: 16 GB read dominates
    # the GEMM time behind max(weights, compute): 2 x 32 x (32 x 218,112,000 + 4096 x 128256) / (989e12 x 0.75 x 0.2)
    want = 2 * 32 * (32 * 218_112_000 + 4096 * 128256) / (989e12 * 0.75 * 0.2)
    assert want < parts["weights"]
