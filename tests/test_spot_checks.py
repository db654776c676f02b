"""The published runs outside shared/reference (benchmarks/data/spot_checks.yaml: NVIDIA's DGX Cloud recipes on H100,
MaxText on TPU v5p) stay within 25% of their published step time or MFU at their published layouts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import spot_checks  # noqa: E402  (the benchmark script, not part of the package)

RUNS = yaml.safe_load((spot_checks.DATA / "spot_checks.yaml").read_text())["runs"]


@pytest.mark.parametrize("run", RUNS, ids=[r["id"] for r in RUNS])
def test_published_run_within_25_percent(run: dict) -> None:
    row = spot_checks.evaluate_run(run)
    assert abs(row["rel_err"]) <= 0.25, row


def test_the_spot_check_script_prints_every_run(capsys) -> None:
    assert spot_checks.main([]) == 0
    out = capsys.readouterr().out
    assert all(r["id"] in out for r in RUNS) and f"{len(RUNS)} runs" in out
