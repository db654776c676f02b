"""`CostModel.activation_per_layer` keeps each policy's saved bytes in the evaluation's geometry `g`: one evaluation's
memory rules ask for the same policy several times (the XLA rules on a TPU, torchtitan's selective flavours), and
each is computed once, with the same result as without the cache."""

from __future__ import annotations

import numpy as np

from meshplan.cost.efficiency import default_efficiency
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.evaluate import evaluate
from meshplan.train.space import Problem

CHIP = load_chip("tpu-v5p")  # a TPU: the memory rules of the program XLA compiles (`_xla_saved_layer`, ...)
LAYOUTS = LayoutArrays.from_configs([ParallelConfig(dp=8, microbatch=2, recompute="none"),
                                     ParallelConfig(fsdp=8, microbatch=2, recompute="selective")])


def _model(**options) -> CostModel:
    return CostModel(Problem(load_model("llama3-8b"), CHIP, 8, 4096, 16), default_efficiency(CHIP), Options(**options))


def test_one_evaluation_computes_each_policy_once(monkeypatch):
    """torchtitan's per-op flavour on a TPU asks for: the layouts' own policies (none, selective), no recompute and
    full (the flavour's half-and-half), gemm-last (XLA's saved set) and no recompute again (XLA's rebuilt set in the
    layer backward): five asks, four policy arrays, four computations."""
    cm = _model(selective_flavor="op")
    asked, computed = [], []
    real_ask, real_compute = CostModel.activation_per_layer, CostModel._activation_per_layer
    monkeypatch.setattr(CostModel, "activation_per_layer",
                        lambda self, L, g, codes: asked.append(codes.tolist()) or real_ask(self, L, g, codes))
    monkeypatch.setattr(CostModel, "_activation_per_layer",
                        lambda self, L, codes: computed.append(codes.tolist()) or real_compute(self, L, codes))
    cached = evaluate(cm, LAYOUTS)
    assert sorted(asked) == [[0, 0], [0, 0], [0, 1], [2, 2], [3, 3]]
    assert sorted(computed) == [[0, 0], [0, 1], [2, 2], [3, 3]]
    # the cache bypassed: every ask computed again, the same memory and step time
    monkeypatch.setattr(CostModel, "activation_per_layer", lambda self, L, g, codes: real_compute(self, L, codes))
    uncached = evaluate(cm, LAYOUTS)
    for key in ("total", "activations"):
        assert np.array_equal(cached.memory[key], uncached.memory[key])
    assert np.array_equal(cached.step_time_s, uncached.step_time_s)


def test_cost_models_sharing_a_geometry_keep_their_own_values():
    """The cache is per cost model: two sets of options (materialised vs flash attention, whose saved bytes differ by
    the score matrix) reading one geometry each get their own."""
    a, b = _model(flash_attention=False), _model(flash_attention=True)
    g = a.geometry(LAYOUTS)
    none = np.zeros_like(LAYOUTS.recompute)
    got_a, got_b = a.activation_per_layer(LAYOUTS, g, none), b.activation_per_layer(LAYOUTS, g, none)
    assert np.array_equal(got_a, a._activation_per_layer(LAYOUTS, none))
    assert np.array_equal(got_b, b._activation_per_layer(LAYOUTS, none))
    assert (got_a > got_b).all()
