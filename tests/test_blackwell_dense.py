"""Dense-model compute on Blackwell (issue #14, s7-dense-bw). Every expected number is worked out
by hand here from the cited figures, not read back from the data files."""

from __future__ import annotations

import pytest
from test_fp8_recipes import FUSED, GRAD_OUTS, NORMED, OTHERS, UNFUSED, WEIGHTS, _cast_seconds

from meshplan.cost.efficiency import default_efficiency
from meshplan.specs.hardware import load_chip
from meshplan.train.costmodel import Options

# The 12 GEMMs of one layer of TransformerEngine's gemm_profiling.rst example (hidden 4096, FFN 16384, 15,872 tokens):
# 3 passes x 2 x 15872 x (4096*12288 + 4096*4096 + 4096*16384 + 16384*4096) FLOP
TE_LAYER_FLOPS = 3 * 2 * 15872 * (4096 * 12288 + 4096 * 4096 + 4096 * 16384 + 16384 * 4096)
THIN = 4096 / (4096 + 256)  # Efficiency.matmul's thin-dimension factor: every one of those GEMMs has 4096 smallest


def test_te_layer_flops_by_hand() -> None:
    # 4096*12288 = 50,331,648; + 16,777,216 + 67,108,864 + 67,108,864 = 201,326,592; x 6 x 15872 = 1.9173e13
    assert TE_LAYER_FLOPS == pytest.approx(1.9173e13, rel=1e-4)


@pytest.mark.parametrize("chip, field, want", [
    # BF16: h100-sxm's 0.75 x (B300 13.102 ms of 2.25 PF) / (H200 NVL 31.968 ms of 835.5 TF)
    ("b200", "matmul_peak_fraction", 0.75 * (TE_LAYER_FLOPS / 13.102e-3 / 2.25e15) / (TE_LAYER_FLOPS / 31.968e-3 / 835.5e12)),
    # FP8: the gpu 0.62 x (B300 6.812 ms of 4.5 PF) / (H200 NVL 16.785 ms of 1670.5 TF)
    ("b200", "fp8_peak_fraction", 0.62 * (TE_LAYER_FLOPS / 6.812e-3 / 4.5e15) / (TE_LAYER_FLOPS / 16.785e-3 / 1670.5e12)),
    # GB200: B200's value times the MAMF ratio (1822/2500) / (1745/2250), FP8 (3615.6/5000) / (3432.5/4500)
    ("gb200-nvl72", "matmul_peak_fraction",
     0.75 * (TE_LAYER_FLOPS / 13.102e-3 / 2.25e15) / (TE_LAYER_FLOPS / 31.968e-3 / 835.5e12) * (1822 / 2500) / (1745 / 2250)),
    ("gb200-nvl72", "fp8_peak_fraction",
     0.62 * (TE_LAYER_FLOPS / 6.812e-3 / 4.5e15) / (TE_LAYER_FLOPS / 16.785e-3 / 1670.5e12)
     * (3615.6 / 5000) / (3432.5 / 4500)),
])
def test_blackwell_gemm_fractions_follow_their_sources(chip: str, field: str, want: float) -> None:
    """0.680, 0.567, 0.639, 0.538: the data file rounds to three places."""
    assert getattr(default_efficiency(load_chip(chip)), field) == pytest.approx(want, abs=6e-4)


@pytest.mark.parametrize("field, gpu", [("attention_fa2_fwd_fraction", 0.55), ("attention_fa2_bwd_fraction", 0.45),
                                        ("attention_sdpa_fwd_fraction", 0.55), ("attention_sdpa_bwd_fraction", 0.45)])
def test_gb200_attention_runs_at_the_clock_its_gemms_do(field: str, gpu: float) -> None:
    """FlashAttention-2 and SDPA (unmeasured on Blackwell): the generic GPU fraction times GB200's MAMF ratio to B200
    (1822/2500)/(1745/2250) = 0.9397: 0.517, 0.423."""
    assert getattr(default_efficiency(load_chip("gb200-nvl72")), field) == pytest.approx(
        gpu * (1822 / 2500) / (1745 / 2250), abs=6e-4)
    assert getattr(default_efficiency(load_chip("b200")), field) == gpu


@pytest.mark.parametrize("field", ["attention_fwd_fraction", "attention_bwd_fraction"])
def test_b200_cudnn_attention_is_gb200s_measured_rate_at_its_clock(field: str) -> None:
    """cuDNN's fused attention, measured on GB200 (0.630 forward, 0.533 backward of 2.5 PF at 8K causal), runs on a
    B200 at the same held clock: over the MAMF ratio 0.9397 of B200's 2.25 PF, 0.670 and 0.567."""
    gb200 = getattr(default_efficiency(load_chip("gb200-nvl72")), field)
    assert getattr(default_efficiency(load_chip("b200")), field) == pytest.approx(
        gb200 / ((1822 / 2500) / (1745 / 2250)), abs=6e-4)


def test_gb200_is_not_its_datasheet_ratio_faster_than_b200() -> None:
    """A large BF16 GEMM on GB200 runs 1822/1745 = 1.044x a B200's (MAMF), not the datasheet's 2.5/2.25 = 1.111x."""
    rate = {c: load_chip(c).peak("bf16") * default_efficiency(load_chip(c)).matmul(8192, 8192, 8192)
            for c in ("b200", "gb200-nvl72")}
    assert rate["gb200-nvl72"] / rate["b200"] == pytest.approx(1822 / 1745, rel=2e-3)


@pytest.mark.parametrize("recipe, fwd_per_elem, normed_bwd", [
    # Blackwell: per-tensor scales need no transposed copy. tensorwise: amax 2 + read 2 + write 1 = 5, norm outputs 5
    ("tensorwise", 5, 5),
    # delayed: read 2 + write 1 = 3; the norm's own fp8 output serves every GEMM: nothing more for it
    ("delayed", 3, 0),
])
def test_per_tensor_casts_on_blackwell_write_one_copy(recipe: str, fwd_per_elem: int, normed_bwd: int) -> None:
    chip = load_chip("b200")
    hbm = chip.hbm_bandwidth_bytes_per_s * default_efficiency(chip).hbm_fraction
    bf16_f, bf16_b, _ = _cast_seconds("b200", Options())
    f, b, _ = _cast_seconds("b200", Options(compute_dtype="fp8", fp8_recipe=recipe, fp8_fused_casts=True))
    assert f - bf16_f == pytest.approx(fwd_per_elem * (OTHERS + WEIGHTS) / hbm, rel=1e-9)
    assert b - bf16_b == pytest.approx((fwd_per_elem * GRAD_OUTS + normed_bwd * NORMED) / hbm, rel=1e-9)


@pytest.mark.parametrize("recipe, fused", [("rowwise", True), ("blockwise", True), ("tensorwise", False),
                                           ("delayed", False)])
def test_blackwell_keeps_both_copies_where_the_scales_or_casts_need_them(recipe: str, fused: bool) -> None:
    """Row/block scales run along one axis (the other copy is requantised), and torchao's unfused casts are not TE's:
    the same bytes as on Hopper (test_fp8_recipes' tables)."""
    chip = load_chip("b200")
    hbm = chip.hbm_bandwidth_bytes_per_s * default_efficiency(chip).hbm_fraction
    bf16_f, bf16_b, _ = _cast_seconds("b200", Options())
    f, b, _ = _cast_seconds("b200", Options(compute_dtype="fp8", fp8_recipe=recipe, fp8_fused_casts=fused))
    want_f, want_b = (FUSED if fused else UNFUSED)[recipe]
    assert (f - bf16_f, b - bf16_b) == pytest.approx((want_f / hbm, want_b / hbm), rel=1e-9)
