"""Session 23: the search evaluates its layouts in pieces and keeps no per-layout ledger (a DeepSeek-V3 search on
2,048 GPUs peaked at 4.4 GB, now 2.4 GB); the numbers must be the ones a one-piece evaluation gives, and every
reported plan's ledger the one its own evaluation gives."""

from __future__ import annotations

from dataclasses import fields

import numpy as np

import meshplan.train.evaluate as E
from meshplan.cost.efficiency import default_efficiency
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.planner import _search, plan
from meshplan.train.space import Pins, Problem

H100 = load_chip("h100-sxm")
EFF = default_efficiency(H100)
PROBLEM = Problem(load_model("mixtral-8x7b"), H100, 64, 4096, 256)


def _arrays(ev) -> dict[str, np.ndarray]:
    n = len(ev.layouts)
    out = {f"layouts.{g.name}": getattr(ev.layouts, g.name) for g in fields(ev.layouts) if g.name != "sequence_parallel"}
    for f in fields(ev):
        x = getattr(ev, f.name)
        if isinstance(x, dict):
            out.update({f"{f.name}/{k}": np.broadcast_to(np.asarray(v, float), (n,)) for k, v in x.items()})
        elif isinstance(x, np.ndarray):
            out[f.name] = x
    return out


def test_pieces_give_the_one_piece_numbers(monkeypatch):
    whole, *_ = _search(PROBLEM, Pins(), EFF)
    monkeypatch.setattr(E, "EVALUATE_CHUNK", 1000)  # many pieces, the last one short
    pieces, *_ = _search(PROBLEM, Pins(), EFF)
    assert len(whole.layouts) > 3 * 1000
    a, b = _arrays(whole), _arrays(pieces)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_a_reported_plan_carries_its_own_ledger():
    res = plan(PROBLEM, Pins(), EFF, top=3)
    ranked, *_ = _search(PROBLEM, Pins(), EFF, keep_ledger=False)
    assert len(ranked.ledger) == 0  # the search itself keeps none
    cm = CostModel(PROBLEM, EFF, Options())
    assert len(res.plans) == 3
    for p in res.plans:
        own = E.evaluate(cm, LayoutArrays.from_configs([ParallelConfig(**p["config"])]))
        assert float(own.step_time_s[0]) == p["step_time_s"]
        assert own.ledger.plan(0) == p["ledger"] and p["ledger"]["flops"]


def test_a_search_without_per_axis_bytes_ranks_the_same():
    """Session 41: a search keeps no per-axis collective bytes (Ledger.collectives False): every number of the
    evaluation but the ledger is the one a full-ledger evaluation gives, on a MoE problem whose EP, FSDP and TP
    collectives fill many axes."""
    full, *_ = _search(PROBLEM, Pins(), EFF, keep_ledger=True)
    lean, *_ = _search(PROBLEM, Pins(), EFF, keep_ledger=False)
    a = {k: v for k, v in _arrays(full).items() if not k.startswith("ledger/")}
    b = {k: v for k, v in _arrays(lean).items() if not k.startswith("ledger/")}
    assert a.keys() == b.keys() and any(k.startswith("ledger/all_to_all") for k in _arrays(full))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
