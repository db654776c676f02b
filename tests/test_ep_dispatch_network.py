"""The network leg of a DeepEP/HybridEP dispatch across nodes at the dispatcher's measured rate (issue #14, s11):
collective_efficiency.yaml `ep_dispatch_scale_out`, CostModel._dispatcher_network_s. Values by hand below."""

from __future__ import annotations

import math

import numpy as np
import pytest

from meshplan.cost.collectives import ep_dispatch_scale_out_efficiency
from meshplan.cost.efficiency import default_efficiency
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.space import Problem


def test_measured_points_and_their_derivation() -> None:
    # HybridEP README (H100, 16 SMs, Torch API): the printed GB/s count the token's own node too; under uniform
    # routing (M - 1)/M of those bytes leave the node: 2 nodes (54.47 + 53.35)/2 x 1/2 / 50 = 0.5391
    assert (54.47 + 53.35) / 2 * (1 / 2) / 50 == pytest.approx(0.539, abs=5e-4)
    assert (47.36 + 52.53) / 2 * (3 / 4) / 50 == pytest.approx(0.749, abs=5e-4)
    assert (41.24 + 46.57) / 2 * (7 / 8) / 50 == pytest.approx(0.768, abs=5e-4)
    # DeepEP README (H800, CX7 400G): 2 nodes 43 x 1/2 / 50 = 0.43; 4 nodes (58 + 57)/2 x 3/4 / 50 = 0.8625
    assert 43 * (1 / 2) / 50 == pytest.approx(0.430)
    assert (58 + 57) / 2 * (3 / 4) / 50 == pytest.approx(0.863, abs=5e-4)
    assert (51 + 50) / 2 * (7 / 8) / 50 == pytest.approx(0.884, abs=5e-4)
    assert ep_dispatch_scale_out_efficiency("hybridep", 2) == pytest.approx(0.539)
    assert ep_dispatch_scale_out_efficiency("hybridep", 8) == pytest.approx(0.768)
    assert ep_dispatch_scale_out_efficiency("deepep", 4) == pytest.approx(0.863)


def test_interpolated_in_log_nodes_and_clamped() -> None:
    # 3 nodes: halfway-ish in log between 2 and 4: 0.539 + ln(3/2)/ln(2) x (0.749 - 0.539) = 0.539 + 0.58496 x 0.21
    assert ep_dispatch_scale_out_efficiency("hybridep", 3) == pytest.approx(0.539 + math.log(1.5) / math.log(2) * 0.21)
    assert ep_dispatch_scale_out_efficiency("hybridep", 3) == pytest.approx(0.66184, rel=1e-4)
    assert ep_dispatch_scale_out_efficiency("hybridep", 32) == pytest.approx(0.768)  # clamped beyond 8 nodes
    assert ep_dispatch_scale_out_efficiency("alltoall", 2) is None  # NCCL: no such measurement


def _ep_link_s(dispatcher: str, chips: int, ep: int, chip: str = "h100-sxm") -> float:
    prob = Problem(load_model("qwen3-30b-a3b"), load_chip(chip), chips, 4096, chips)  # 4096 tokens a rank
    cm = CostModel(prob, default_efficiency(prob.chip), Options(moe_dispatcher=dispatcher, moe_force_balance=True))
    L = LayoutArrays.from_configs([ParallelConfig(dp=chips, ep=ep, microbatch=1, recompute="none")])
    g = cm.geometry(L)
    cc = cm.comm_terms(L, g, cm.compute_terms(L, g))
    return float(np.asarray(cc["ep_link_mb"]).ravel()[0])


def test_qwen3_30b_ep16_on_two_h100_nodes() -> None:
    """Qwen3-30B-A3B (48 layers, D 2048, top-8 of 128) at EP 16 over two 8-GPU H100 nodes, 4096 tokens, HybridEP:
    a token goes once to each node it hits, 2·(1 - 0.5^8) = 1.9921875 copies; one dispatch sends
    2 B · 4096 · 1.9921875 · 2048 = 33,423,360 B, half of it (16,711,680 B) through the GPU's 50 GB/s NIC at 0.539:
    0.620100 ms (the generic model: at 0.90, 0.371371 ms). 4 all-to-alls a layer (dispatch, combine, and their
    backward), 48 layers: 192 · 0.620100 ms = 119.06 ms a micro-batch."""
    leaves = 2 * 4096 * 2 * (1 - 0.5 ** 8) * 2048 / 2
    assert leaves == 16_711_680
    one = leaves / (50e9 * 0.539)
    assert one == pytest.approx(0.620100e-3, rel=1e-5)
    assert _ep_link_s("hybridep", 16, 16) == pytest.approx(192 * one, rel=1e-9)
    assert _ep_link_s("deepep", 16, 16) == pytest.approx(192 * leaves / (50e9 * 0.430), rel=1e-9)


def test_inside_one_node_and_nccl_unchanged() -> None:
    """EP 8 inside one H100 node never touches the NIC; the alltoall dispatcher (NCCL) keeps the generic model;
    a GB200 NVL72 domain holds EP 16 whole."""
    with_leg = _ep_link_s("hybridep", 8, 8)
    assert with_leg > 0
    import meshplan.train.costmodel as cmod

    orig = cmod.CostModel._dispatcher_network_s
    try:
        cmod.CostModel._dispatcher_network_s = lambda self, sent, ep, stride: np.zeros_like(np.asarray(sent, float))
        assert _ep_link_s("hybridep", 8, 8) == with_leg
        nccl_generic = _ep_link_s("alltoall", 16, 16)
        nvl72_generic = _ep_link_s("hybridep", 16, 16, "gb200-nvl72")
    finally:
        cmod.CostModel._dispatcher_network_s = orig
    assert _ep_link_s("alltoall", 16, 16) == nccl_generic
    assert _ep_link_s("hybridep", 16, 16, "gb200-nvl72") == nvl72_generic
