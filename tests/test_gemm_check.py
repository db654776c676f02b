"""benchmarks/gemm_check.py: OpenXLA's measured sm_90 GEMM table and the fit that summarises it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gemm_check  # noqa: E402  (benchmark helper, not part of the package)


def test_the_transcribed_table_is_the_whole_grid_and_each_time_is_whole_nanoseconds() -> None:
    # XLA's table stores each dot's time as FLOP/s: 2*b*m*n*k / value is a whole number of nanoseconds for a value
    # copied digit for digit (a mistyped digit breaks it), and the grid b in {1,2,4} x m, n, k in {256..4096} is complete
    rows = gemm_check.load_table()
    dims = (256, 512, 1024, 2048, 4096)
    assert sorted((b, m, n, k) for b, m, n, k, _ in rows) == sorted(
        (b, m, n, k) for b in (1, 2, 4) for m in dims for n in dims for k in dims)
    for *_, t in rows:
        assert t * 1e9 == pytest.approx(round(t * 1e9), abs=1e-3)
    big = next(t for b, m, n, k, t in rows if (b, m, n, k) == (1, 4096, 4096, 4096))
    assert 2 * 4096**3 / big == pytest.approx(783.33e12, rel=1e-4)  # the source's entry: 783328793548203


def test_the_fit_recovers_a_known_latency_and_fraction() -> None:
    peak = 989e12
    rows = [(1, m, n, k, 7e-6 + 2.0 * m * n * k / (peak * 0.8)) for m in (256, 1024, 4096) for n in (512, 4096)
            for k in (256, 2048)]
    lat, frac = gemm_check.fit_latency_fraction(rows, peak)
    assert lat == pytest.approx(7e-6, rel=1e-6) and frac == pytest.approx(0.8, rel=1e-6)
