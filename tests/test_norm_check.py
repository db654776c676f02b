"""meshplan's memory-bound kernel time (bytes / (HBM x hbm_fraction) + one launch) against NVIDIA's measured cuDNN
RMSNorm/LayerNorm kernels on GB200, GB300 and H200 (benchmarks/norm_check.py, data/cudnn_norms.csv)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import norm_check  # noqa: E402

ROWS = norm_check.load_rows()


def test_bytes_are_the_tables_own() -> None:
    """Llama 3 8B's norm on GB200 (16,384 x 4,096): forward 2·16384·4096·2 = 268.4 MB, which the table's 0.042 ms at
    6,424.6 GB/s reproduces (269.8 MB, its ms column rounded); backward 3 tensors, 402.7 MB = 0.065 ms x 6,187.3 GB/s
    (402.2 MB)."""
    r = next(x for x in ROWS if x["system"] == "gb200" and x["shape"] == "llama3-8b")
    fwd, bwd = norm_check.kernel(r, "fwd"), norm_check.kernel(r, "bwd")
    assert fwd["bytes"] == 2 * 16384 * 4096 * 2 == pytest.approx(0.042e-3 * 6424.6e9, rel=0.01)
    assert bwd["bytes"] == pytest.approx(0.065e-3 * 6187.3e9, rel=0.01)
    assert fwd["measured_s"] == pytest.approx(0.042e-3, rel=0.01)


@pytest.mark.parametrize("system", ["gb200", "gb300", "h200"])
def test_large_norms_run_at_the_ledgers_hbm_rate(system: str) -> None:
    """Kernels moving 128 MB or more (where the launch is under 10% of the time): meshplan's time within 5% of the
    measured one in the signed median of the chip's 15 passes, within 12% in the absolute median."""
    s = norm_check.report(ROWS)[f"{system} 128 MB and more"]
    assert s["n"] == 15
    assert abs(s["signed_median"]) < 0.05 and s["median_abs"] < 0.12
