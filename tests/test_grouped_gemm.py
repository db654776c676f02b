"""Session 29: a MoE layer's grouped expert GEMMs under the grouped kernel's own large-problem ceiling
(efficiency.yaml grouped_matmul_peak_fraction), measured for A100 from TensorRT-LLM 1.0's MoE layers
(benchmarks/data/aic_a100_trtllm_moe.csv). Values by hand from the constants: A100 matmul_peak_fraction 0.84,
grouped 0.54, matmul_half_dim 256, matmul_rows_half 128, 312 TFLOP/s bf16 (NVIDIA A100 datasheet)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import kernel_check  # noqa: E402

from meshplan.cost.efficiency import default_efficiency, load_profile  # noqa: E402
from meshplan.infer.config import ServeConfig  # noqa: E402
from meshplan.infer.step import routed_expert_gemm_s  # noqa: E402
from meshplan.specs.hardware import load_chip  # noqa: E402
from meshplan.specs.model import load_model  # noqa: E402

A100_BF16_FLOPS = 312e12


def test_the_grouped_ceiling_binds_large_problems_and_the_row_penalty_small_ones() -> None:
    eff = default_efficiency(load_chip("a100-80gb"))
    assert (eff.matmul_peak_fraction, eff.grouped_matmul_peak_fraction) == (0.84, 0.54)
    # a Mixtral expert at 4,096 rows: dense 0.84 x 4096/4352 = 0.7906, ceiling 0.54 x 4096/4352 = 0.5082
    assert eff.grouped_matmul(4096, 14336, 4096) == pytest.approx(0.54 * 4096 / 4352)
    # at 64 rows the tiles' penalty rules: 0.84 x 64/320 = 0.168, under the ceiling
    assert eff.grouped_matmul(64, 14336, 4096) == pytest.approx(0.84 * 64 / 320)
    # the ceiling alone, as the serving step takes it: an unbounded weight dimension has no penalty
    assert eff.grouped_ceiling(float("inf")) == pytest.approx(0.54)
    assert eff.grouped_ceiling(1792) == pytest.approx(0.54 * 1792 / 2048)
    # a chip without a grouped measurement times grouped GEMMs as dense ones
    h100 = default_efficiency(load_chip("h100-sxm"))
    assert h100.grouped_matmul_peak_fraction == h100.matmul_peak_fraction
    assert h100.grouped_matmul(4096, 14336, 4096) == pytest.approx(h100.matmul(4096, 14336, 4096))


def test_the_serving_steps_expert_gemms_on_a100_by_hand() -> None:
    """Mixtral 8x7B, 8,192 tokens on one A100: each of the 8 experts runs 8192 x 2 / 8 = 2048 rows; dense fraction
    0.84 x min(2048/2176, 4096/4352) = 0.7906, ceiling 0.54 x 4096/4352 = 0.5082, so 2 x 8192 x 2 x 3 x 4096 x 14336
    FLOPs at 0.5082 of 312 TFLOP/s."""
    m, chip = load_model("mixtral-8x7b"), load_chip("a100-80gb")
    flops = 2 * 8192 * 2 * 3 * 4096 * 14336
    hand = flops / (A100_BF16_FLOPS * 0.54 * 4096 / 4352)
    got = routed_expert_gemm_s(m, chip, ServeConfig(tp=1), default_efficiency(chip), 8192.0)
    assert got == pytest.approx(hand, rel=1e-6)


def test_the_a100_ceiling_is_the_measured_tables_median() -> None:
    """efficiency.yaml's 0.54 is the median, over the A100 table's layers of >= 2048 rows per touched expert, of the
    fraction each implies (kernel_check.format_fraction_implied), rounded to two places; the measured layers never
    beat the datasheet peak, and the table's dense GEMMs' 0.84 sits well above them."""
    chip = load_chip("a100-80gb")
    rows = kernel_check.a100_moe_rows()
    assert len(rows) == 720 and {r["model"] for r in rows} == {"mixtral-8x7b", "mixtral-8x22b", "qwen3-235b-a22b",
                                                                "deepseek-v3"}
    for r in rows:
        m = load_model(r["model"])
        flops = 2 * float(r["tokens"]) * m.experts_per_token * 3 * m.d_model * m.d_ff / int(r["moe_tp"])
        assert flops / (float(r["time_us"]) * 1e-6) < A100_BF16_FLOPS
    implied = [kernel_check.format_fraction_implied(r, chip) for r in rows if r["rows"] >= 2048]
    assert len(implied) == 99
    assert round(statistics.median(implied), 2) == default_efficiency(chip).grouped_matmul_peak_fraction
    # the step's MoE terms against the large layers: within 5% at the median
    res = kernel_check.a100_moe(chip)
    assert abs(res["2048+ rows"]["signed_median"]) < 0.05


def test_a_calibrated_dense_fraction_carries_to_a_chip_without_its_own_grouped_one(tmp_path: Path) -> None:
    for chip_name, expect_grouped in (("h100-sxm", 0.70), ("a100-80gb", 0.54)):
        chip = load_chip(chip_name)
        path = tmp_path / f"{chip_name}.json"
        path.write_text(json.dumps({"schema": "meshplan-profile/1", "chip": chip_name,
                                    "efficiency": {"matmul_peak_fraction": 0.70}}))
        eff = load_profile(path, chip)
        assert eff.matmul_peak_fraction == 0.70
        assert eff.grouped_matmul_peak_fraction == pytest.approx(expect_grouped)


# pytorch/ao torchao/prototype/moe_training/README.md @36027d82, 'Autograd function': torch._grouped_mm bf16 forward +
# backward (three GEMMs of 2·M·N·K) over 8 groups on a B200 (1000 W), microseconds
TORCHAO_BF16_FWD_BWD_US = {(128000, 2048, 7168): 14966.8, (128000, 8192, 5120): 37700.7}
B200_BF16_FLOPS = 2.25e15  # NVIDIA B200 datasheet, dense BF16 (the b200 preset's peak)


def test_torch_grouped_mm_ceiling_rederived_from_torchaos_table() -> None:
    """Each shape's measured rate over the peak and the narrower weight dimension's penalty d/(d + 256):
    DeepSeek-V3 6·128000·2048·7168 / 14,966.8 us = 753 TFLOP/s, 0.335 / (2048/2304) = 0.376; Llama 4 Scout
    854 TFLOP/s, 0.380 / (5120/5376) = 0.399; efficiency.yaml keeps their mean, 0.39."""
    eff = default_efficiency(load_chip("b200"))
    implied = [6 * m * n * k / (us * 1e-6) / B200_BF16_FLOPS / (min(n, k) / (min(n, k) + 256))
               for (m, n, k), us in TORCHAO_BF16_FWD_BWD_US.items()]
    assert implied == pytest.approx([0.376, 0.399], abs=0.001)
    assert eff.torch_grouped_matmul_peak_fraction == pytest.approx(statistics.mean(implied), abs=0.005)
    # the kernel's ceiling binds at 16,000 rows a group; the chip's own grouped fraction (its dense one) does not
    assert eff.grouped_matmul(16000, 2048, 7168, torch_kernel=True) == pytest.approx(0.39 * 2048 / 2304)
    assert eff.grouped_matmul(16000, 2048, 7168) == pytest.approx(eff.matmul(16000, 2048, 7168))
    # chips without a measurement of the torch kernel take their grouped fraction
    h100 = default_efficiency(load_chip("h100-sxm"))
    assert h100.grouped_matmul(4096, 2048, 7168, torch_kernel=True) == h100.grouped_matmul(4096, 2048, 7168)


def test_torchtitan_runs_its_experts_through_torch_grouped_mm() -> None:
    from meshplan.train.frameworks import preset

    assert preset("torchtitan")["grouped_mm_kernel"] == "torch"
    assert "grouped_mm_kernel" not in preset("megatron") and "grouped_mm_kernel" not in preset("nemo")
