"""Issue #14: Megatron-Core's alltoall dispatcher regroups the tokens an all-to-all delivered by local expert
("Permutation 2" / "Unpermutation 2", token_dispatcher.py sort_chunks_by_idxs); worked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.cost.efficiency import default_efficiency
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.space import Problem


def _cm(model: str = "qwen3-30b-a3b", ep: int = 8, dispatcher: str = "alltoall"):
    prob = Problem(load_model(model), load_chip("b200"), 8, 4096, 8)
    cm = CostModel(prob, default_efficiency(prob.chip), Options(moe_dispatcher=dispatcher))
    L = LayoutArrays.from_configs([ParallelConfig(dp=8, ep=ep, microbatch=1, zero=1)])
    return cm, cm.geometry(L)


def _f(x) -> float:
    return float(np.asarray(x).ravel()[0])


def test_alltoall_regroup_bytes_by_hand() -> None:
    """Qwen3-30B-A3B (D 2048, top-8 of 128 experts, every layer MoE), micro-batch 1 of 4096 tokens, EP 8 (16 local
    experts), bf16 activations: the sort after the dispatch and the unsort before the combine each read and write the
    rank's 8 routed copies: 2 B x 4096 x (2 x 2 x 8) x 2048 = 536,870,912 B a layer forward, and as much backward."""
    cm, g = _cm()
    assert _f(cm._moe_regroup_bytes(g)) == pytest.approx(2 * 4096 * 32 * 2048)
    assert _f(cm._moe_regroup_bytes(g)) == pytest.approx(536_870_912)


def test_regroup_adds_once_each_way_to_the_pointwise_term() -> None:
    """The copy's backward is the same copy with the inverse index: the pointwise forward and backward bytes each
    grow by exactly the regroup bytes (not the 2x mirror of the other pointwise work)."""
    cm, g = _cm()
    flex, gf = _cm(dispatcher="hybridep")
    r = _f(cm._moe_regroup_bytes(g))
    a, b = cm._pointwise_term(g), flex._pointwise_term(gf)
    # the router bytes and bias terms are dispatcher-independent for Qwen3 (no linear biases)
    assert _f(a["hbm"]) - _f(b["hbm"]) == pytest.approx(r)
    assert _f(a["hbm_b"]) - _f(b["hbm_b"]) == pytest.approx(r)


def test_no_regroup_without_several_ranks_or_local_experts_or_under_flex_dispatchers() -> None:
    """HybridEP permutes inside its dispatch/combine kernels and DeepEP's permute is the ordinary gather: nothing
    extra. EP 1 has no all-to-all to regroup after; a dense model has no experts."""
    for dispatcher in ("hybridep", "deepep"):
        cm, g = _cm(dispatcher=dispatcher)
        assert _f(cm._moe_regroup_bytes(g)) == 0.0
    cm, g = _cm(ep=1)
    assert _f(cm._moe_regroup_bytes(g)) == 0.0
    cm, g = _cm(model="llama3-8b", ep=1)
    assert _f(cm._moe_regroup_bytes(g)) == 0.0


def test_no_regroup_with_one_expert_per_rank() -> None:
    """Mixtral 8x7B at EP 8: one local expert per rank, nothing to sort (num_local_experts > 1 is the condition)."""
    cm, g = _cm(model="mixtral-8x7b", ep=8)
    assert _f(cm._moe_regroup_bytes(g)) == 0.0
    cm4, g4 = _cm(model="mixtral-8x7b", ep=4)  # 2 local experts: 2 B x 4096 x 4 x 2 x 4096 (D) = 268,435,456 B
    assert _f(cm4._moe_regroup_bytes(g4)) == pytest.approx(2 * 4096 * 4 * 2 * 4096)
