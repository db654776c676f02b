"""Session 23 QA: a hand-edited or damaged profile gets one `error:` line (exit 2), never a traceback, a hang or an
impossible plan; `measure` checks its inputs before it runs."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

TRAIN = ["train", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len", "4096",
         "--global-batch", "64", "--json"]


def _profile(tmp_path, efficiency) -> str:
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"schema": "meshplan-profile/1", "chip": "h100-sxm", "efficiency": efficiency})
                 .replace('"NAN"', "NaN"))
    return str(p)


@pytest.mark.parametrize(("efficiency", "says"), [
    (5, "efficiency must be an object"),
    (None, "efficiency must be an object"),
    ("abc", "efficiency must be an object"),
    ({"matmul_peak_fraction": 5.0}, "matmul_peak_fraction must be a finite number in (0, 1.05]"),  # MFU 149% before
    ({"hbm_fraction": "NAN"}, "hbm_fraction must be a finite number"),
    ({"hbm_fraction": 0}, "hbm_fraction must be a finite number in (0, 1.05]"),
    ({"kernel_overhead_s": -1e-6}, "kernel_overhead_s must be"),
    ({"bogus_field": 1}, "unknown efficiency field(s) bogus_field"),
])
def test_bad_profile_fields_are_refused(tmp_path, capsys, efficiency, says):
    code, out, err = run_cli(TRAIN + ["--profile", _profile(tmp_path, efficiency)], capsys)
    assert code == 2 and err.startswith("error:") and err.count("\n") == 1 and says in err, err


def test_a_valid_profile_field_moves_the_plan(tmp_path, capsys):
    code, out, err = run_cli(TRAIN, capsys)
    base = json.loads(out)["plans"][0]
    code, out, err = run_cli(TRAIN + ["--profile", _profile(tmp_path, {"matmul_peak_fraction": 0.3})], capsys)
    assert code == 0, err
    assert json.loads(out)["plans"][0]["step_time_s"] > base["step_time_s"]


def test_a_special_file_is_refused_not_read(capsys):
    code, out, err = run_cli(TRAIN + ["--profile", "/dev/zero"], capsys)
    assert code == 2 and "not a regular file" in err


def test_calibrate_show_names_the_efficiency_block(tmp_path, capsys):
    code, out, err = run_cli(["calibrate", "--show", _profile(tmp_path, 5)], capsys)
    assert code == 2 and "efficiency must be an object" in err


def test_measure_checks_its_profile_before_it_runs(tmp_path, capsys):
    pytest.importorskip("jax")
    # a missing or damaged profile is refused before JAX starts (it was read after the whole measurement)
    base = ["measure", "--model", "llama3.2-1b", "--layers", "1", "--seq-len", "64", "--steps", "1",
            "--hardware", "h100-sxm"]
    for prof, says in ((str(tmp_path / "missing.json"), "cannot read profile"),
                       (_profile(tmp_path, {"matmul_peak_fraction": 5.0}), "matmul_peak_fraction")):
        code, out, err = run_cli(base + ["--profile", prof], capsys)
        assert code == 2 and err.startswith("error:") and says in err, err
        assert "warning" not in err  # the CPU warning comes after every input check


def test_measure_refuses_a_bad_layout_with_one_line(capsys):
    pytest.importorskip("jax")
    # the CPU warning used to come first, wrapped over three lines, before the error
    code, out, err = run_cli(["measure", "--model", "llama3.2-1b", "--layers", "1", "--seq-len", "64", "--steps", "1",
                              "--tp", "3"], capsys)
    assert code == 2 and err.startswith("error:") and err.count("\n") == 1, err
