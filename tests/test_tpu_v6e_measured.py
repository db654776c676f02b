"""TPU v6e constants against the measurements Google publishes for the chip (issue #14, s8-tpu): the matmul and HBM
rates the training model uses for v6e reproduce tpu-recipes' single-chip microbenchmarks."""

from __future__ import annotations

import pytest

from meshplan.cost.efficiency import default_efficiency
from meshplan.specs.hardware import load_chip


def test_v6e_large_matmul_rate_matches_the_published_8192_cube_benchmark() -> None:
    # AI-Hypercomputer/tpu-recipes microbenchmarks/README.md (@2a33362): bf16 (8192, 8192, 8192) on a v6e-1 in
    # 1.328756094 ms (on-device trace time) -> 2 * 8192^3 / 1.328756094e-3 = 827.47e12 FLOP/s
    measured_flops_per_s = 2 * 8192**3 / 1.328756094e-3
    assert measured_flops_per_s == pytest.approx(827.474e12, rel=1e-5)
    chip = load_chip("tpu-v6e")
    eff = default_efficiency(chip)
    # model: 0.92 (matmul_peak_fraction) * 8192 / (8192 + 256) (matmul_half_dim, the 256-wide MXU) * 9.2e14
    #      = 0.92 * 0.969697 * 9.2e14 = 820.7e12 FLOP/s
    model_flops_per_s = eff.matmul(8192, 8192, 8192) * chip.peak("bf16")
    assert model_flops_per_s == pytest.approx(0.92 * 8192 / 8448 * 9.2e14, rel=1e-9)
    assert model_flops_per_s / measured_flops_per_s - 1 == pytest.approx(-0.0082, abs=0.002)


def test_v6e_hbm_rate_matches_the_published_copy_benchmark() -> None:
    # tpu-recipes microbenchmarks/README.md (@2a33362): a 33,554,432 B copy in 0.049359414 ms, reported as
    # 1359.6 GB/s = (read + write) 2 * 33554432 / 4.9359414e-5
    measured_bytes_per_s = 2 * 33_554_432 / 4.9359414e-5
    assert measured_bytes_per_s == pytest.approx(1359.596e9, rel=1e-5)
    chip = load_chip("tpu-v6e")
    # model: hbm_fraction 0.85 * 1.6e12 B/s = 1.36e12 B/s
    model_bytes_per_s = default_efficiency(chip).hbm_fraction * chip.hbm_bandwidth_bytes_per_s
    assert model_bytes_per_s == pytest.approx(1.36e12, rel=1e-9)
    assert model_bytes_per_s / measured_bytes_per_s - 1 == pytest.approx(0.0003, abs=0.002)
