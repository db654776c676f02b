"""Issue #14: Megatron-Core's alltoall dispatcher regroups the tokens an all-to-all delivered by local expert
("Permutation 2" / "Unpermutation 2", token_dispatcher.py sort_chunks_by_idxs), and FP8 casts quantise every
routed copy of a token (Transformer Engine GroupedLinear); worked by hand."""

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


def _fp8(model: str = "qwen3-30b-a3b"):
    prob = Problem(load_model(model), load_chip("b200"), 8, 4096, 8)
    cm = CostModel(prob, default_efficiency(prob.chip), Options(compute_dtype="fp8", fp8_recipe="blockwise"))
    L = LayoutArrays.from_configs([ParallelConfig(dp=8, ep=8, microbatch=1, zero=1)])
    return cm, cm.geometry(L)


def test_fp8_casts_quantise_every_routed_copy(monkeypatch) -> None:
    """Transformer Engine's GroupedLinear quantises its permuted input, k copies of D per token, and the fc2 output
    gradient per copy, where a dense MLP has one row; none of the routed copies comes straight from the norm.
    Qwen3-30B-A3B (k 8, D 2048, no shared expert), 4096 tokens, blockwise (4 B per element cast-transposed,
    fp8_recipes.yaml): against a dense-shaped count, the forward casts (a_in - normed) grow by 7 + 1 rows of D,
    4 x 8 x 4096 x 2048 = 268,435,456 B; the backward (g_out + normed) by 7 - 1 rows, 4 x 6 x 4096 x 2048 =
    201,326,592 B."""
    cm, g = _fp8()
    assert cm._fp8_mlp_rows() == (8.0, 0.0)
    got = cm._fp8_cast_term(g)
    monkeypatch.setattr(CostModel, "_fp8_mlp_rows", lambda self: (1.0, 1.0))  # a dense MLP's rows
    before = cm._fp8_cast_term(g)
    assert _f(got["hbm_f"]) - _f(before["hbm_f"]) == pytest.approx(4 * 8 * 4096 * 2048)
    assert _f(got["hbm_b"]) - _f(before["hbm_b"]) == pytest.approx(4 * 6 * 4096 * 2048)


def test_fp8_mlp_rows_dense_and_shared_experts() -> None:
    """A dense model quantises one normed row per token. DeepSeek-V3 (top-8 and one shared expert; 3 of 61 layers
    dense) in the mean layer: 58/61 x (8 + 1) + 3/61 = 525/61 rows, of which 58/61 x 1 + 3/61 = 1 leaves the norm."""
    assert _fp8("llama3-8b")[0]._fp8_mlp_rows() == (1.0, 1.0)
    rows, normed = _fp8("deepseek-v3")[0]._fp8_mlp_rows()
    assert rows == pytest.approx(525 / 61)
    assert normed == pytest.approx(1.0)


def test_fp8_expert_row_padding_copies_by_hand() -> None:
    """Megatron-Core's eager TEGroupedMLP under fp8 pads every local expert's rows to a multiple of 16 (32 for MXFP8)
    by a copy (Transformer Engine Fp8Padding) and unpads the fc2 output by another, unless the dispatcher already
    aligned the counts (HybridEP's pad_multiple). Qwen3-30B-A3B, micro-batch 1 of 4096 tokens, EP 8, bf16 activations,
    top-8, D 2048: 2 copies x (read + write) x 8 routed rows x 2048 x 2 B = 2 B x 4096 x 32 x 2048 = 536,870,912 B a
    layer forward, and as much backward (the inverse copies of the gradients); two more launches in the expert scope."""
    prob = Problem(load_model("qwen3-30b-a3b"), load_chip("b200"), 8, 4096, 8)
    L = LayoutArrays.from_configs([ParallelConfig(dp=8, ep=8, microbatch=1, zero=1)])

    def model(**kw):
        cm = CostModel(prob, default_efficiency(prob.chip), Options(**kw))
        return cm, cm.geometry(L)

    fp8 = dict(compute_dtype="fp8", unfused_expert_bias=True, moe_dispatcher="alltoall")
    cm, g = model(**fp8)
    assert _f(cm._fp8_expert_padding_bytes(g)) == pytest.approx(536_870_912)
    # once each way in the pointwise term, beside the regroup copies of the alltoall dispatcher
    off, g_off = model(**{**fp8, "unfused_expert_bias": False})
    a, b = cm._pointwise_term(g), off._pointwise_term(g_off)
    assert _f(a["hbm"]) - _f(b["hbm"]) == pytest.approx(536_870_912)
    assert _f(a["hbm_b"]) - _f(b["hbm_b"]) == pytest.approx(536_870_912)
    # 16 local experts x 2 GEMMs + the padding and unpadding launches
    assert _f(cm.layer_kernels_fwd(g)["moe"]) == pytest.approx(16 * 2 + 2)
    assert _f(cm._fp8_expert_padding_bytes(model(**{**fp8, "moe_dispatcher": "deepep"})[1])) > 0
    # none: HybridEP pads inside its dispatch, bf16 has no padding, Transformer Engine's op fuser (flag off)
    for kw in ({**fp8, "moe_dispatcher": "hybridep"}, {**fp8, "compute_dtype": "bf16"},
               {**fp8, "unfused_expert_bias": False}):
        cm, g = model(**kw)
        assert cm._fp8_expert_padding_bytes(g) == 0.0
