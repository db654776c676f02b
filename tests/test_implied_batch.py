"""serving_accuracy.implied_batch: the batch at which meshplan's own step times give an offline row's measured
throughput. Checked by construction: a row whose 'measurement' is meshplan's throughput at a chosen batch must
give that batch back; one above meshplan's throughput at its largest batch gives None; rows that are not offline
max-throughput rows are not priced."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import serving_accuracy  # noqa: E402

from meshplan.infer.metrics import evaluate  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data"
ROW = "trtllm_v1_h200_llama31_8b_tp1_fp8_128_2048"  # an offline max-throughput cell (trtllm-bench)


@pytest.fixture(scope="module")
def row() -> dict:
    new = yaml.safe_load((DATA / "serving_measurements_new.yaml").read_text())["measurements"]
    return next(e for e in new if e["id"] == ROW)


def _tok_s(e: dict, batch: int) -> float:
    m, chip, cfg, eff, w, _, _ = serving_accuracy._setup(e, serving_accuracy._assumptions())
    return evaluate(m, chip, e["chips"], cfg, eff, w, batch, serving_accuracy.mode(e)).throughput_tokens_per_s


@pytest.mark.parametrize("batch", [37, 200])
def test_a_measurement_at_a_known_batch_gives_that_batch_back(row: dict, batch: int) -> None:
    e = copy.deepcopy(row)
    e["measured"]["output_tokens_per_s"] = _tok_s(e, batch)
    got = serving_accuracy.implied_batch(e, serving_accuracy._assumptions(), predicted_batch=400)
    assert got is not None and got["predicted_batch"] == 400
    assert got["implied"] == batch  # the first batch that reaches the measured rate is the one that produced it


def test_above_the_largest_batch_is_none(row: dict) -> None:
    e = copy.deepcopy(row)
    rules = serving_accuracy._assumptions()
    mb = serving_accuracy._setup(e, rules)[-1]
    e["measured"]["output_tokens_per_s"] = 1.01 * _tok_s(e, mb)
    got = serving_accuracy.implied_batch(e, rules, predicted_batch=mb)
    assert got == {"predicted_batch": mb, "max_batch": mb, "implied": None}


def test_only_offline_max_throughput_rows_are_priced(row: dict) -> None:
    rules = serving_accuracy._assumptions()
    fixed = dict(copy.deepcopy(row), batch=64)
    online = dict(copy.deepcopy(row), regime="server_qps")
    assert serving_accuracy.implied_batch(fixed, rules, 64) is None
    assert serving_accuracy.implied_batch(online, rules, 64) is None
