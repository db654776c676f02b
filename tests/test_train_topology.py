"""Layouts whose parallel groups cannot map onto the physical topology are rejected, not crashes."""

from __future__ import annotations

from meshplan.cost.efficiency import default_efficiency
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.planner import plan
from meshplan.train.space import Pins, Problem


def test_nvl72_search_skips_groups_that_do_not_tile_the_domain():
    # 72 GPUs per NVLink domain: a 16-wide tensor group cannot tile it, a 2- or 8-wide one can.
    prob = Problem(load_model("llama3-8b"), load_chip("gb200-nvl72"), 144, 8192, 144)
    res = plan(prob, Pins(), default_efficiency(prob.chip), top=3)
    assert res.plans and all(p["step_time_s"] < float("inf") for p in res.plans)
    assert res.infeasible.get("a parallel group does not map onto the topology", 0) > 0
    for p in res.plans:
        assert 72 % p["config"]["tp"] == 0
