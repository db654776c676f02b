"""Issue #14, fine-grained MoE (second pass): the routed experts' gradient reduction over the expert-data-parallel
group, and force-balanced (benchmark) routing. Expected values are worked by hand from the model and chip files."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.cost.efficiency import default_efficiency
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import MOE_DISPATCHERS, CostModel, Options
from meshplan.train.frameworks import options_from_notes
from meshplan.train.space import Problem


def _cm(name: str, hardware: str, chips: int, ep: int, options: Options | None = None, zero: int = 1):
    prob = Problem(load_model(name), load_chip(hardware), chips, 4096, chips)
    cm = CostModel(prob, default_efficiency(prob.chip), options or Options())
    L = LayoutArrays.from_configs([ParallelConfig(dp=chips, ep=ep, microbatch=1, recompute="none", zero=zero)])
    return cm, L, cm.geometry(L)


def _f(x) -> float:
    return float(np.asarray(x).ravel()[0])


def test_expert_gradients_reduce_over_the_expert_data_parallel_group() -> None:
    """Qwen3-30B-A3B (48 layers, D 2048, expert F 768, SwiGLU, 128 experts) on 16 H100s, dp 16, EP 8: each rank
    holds 48·3·2048·768·128/8 = 3,623,878,656 expert parameters, 4 B fp32 gradients each = 14.4955 GB. They are
    reduce-scattered over the 16/8 = 2 ranks that hold the same experts, 8 ranks apart: the two nodes, over
    InfiniBand. A 2-rank ring reduce-scatter sends half of it: 0.5 · 14.4955e9 B / (50 GB/s NDR · 0.90, the
    collective_efficiency.yaml infiniband figure) + one 5 µs hop = 0.16107 s. Over the whole 16-rank DP ring (NVLink inside the
    node, then the 2-node ring) the same bytes would take 14.4955 · 3.2227 ms/GB (its rate at 1 GB) = 0.0467 s."""
    cm, L, g = _cm("qwen3-30b-a3b", "h100-sxm", 16, ep=8)
    expert_params = 48 * 3 * 2048 * 768 * 128 / 8
    assert expert_params == 3_623_878_656
    expert_bytes = 4.0 * expert_params
    stride = np.asarray(g["tp"])
    both = cm._replica_collective("reducescatter", expert_bytes, expert_bytes, g, stride)
    # less the (empty) dense part's latency, the expert part: bandwidth plus the 2-rank ring's one 5 µs hop
    only_expert = both - cm.comm.time("reducescatter", 0.0, g["replicas"], stride)
    assert _f(only_expert) == pytest.approx(0.5 * expert_bytes / (50e9 * 0.90) + 5e-6, rel=1e-6)
    assert _f(only_expert) == pytest.approx(0.16107, rel=1e-4)
    whole_ring = cm.comm.time("reducescatter", expert_bytes, g["replicas"], stride)
    assert _f(whole_ring) == pytest.approx(0.0467, rel=2e-3)
    # the dense rest still rides the whole DP ring: with no expert bytes the old single-group time comes back
    dense = cm._replica_collective("allgather", 1e9, 0.0, g, stride)
    assert _f(dense) == pytest.approx(_f(cm.comm.time("allgather", 1e9, g["replicas"], stride)))


def test_expert_group_of_one_rank_reduces_nothing() -> None:
    # dp 8 = EP 8 on one node: every rank holds its own experts, the expert-data-parallel group has 1 rank
    cm, L, g = _cm("qwen3-30b-a3b", "h100-sxm", 8, ep=8)
    stride = np.asarray(g["tp"])
    # all of the 1 GB is expert gradients: nothing moves, only the (empty) dense ring's latency is left
    t = cm._replica_collective("reducescatter", 1e9, 1e9, g, stride)
    assert _f(t) == pytest.approx(_f(cm.comm.time("reducescatter", 0.0, g["replicas"], stride)))
    assert _f(t) < 1e-4


def test_force_balanced_routing_has_no_busiest_rank_skew() -> None:
    """Random router logits (Megatron-Core --moe-router-force-load-balancing) route i.i.d. uniformly: the busiest EP
    rank carries the mean load (ratio 1, against 1 + 0.52/16 = 1.0325 with a learned router at E 128, EP 8), so the
    grouped GEMM of test_moe_overlap.test_fine_grained_experts_run_slower_per_flop loses its 1.0325:
    1e12 / (989e12 · 0.5625) + 16 · 2 · 4 µs = 1.7976 ms + 0.128 ms = 1.9256 ms."""
    cm, L, g = _cm("qwen3-30b-a3b", "h100-sxm", 8, ep=8, options=Options(moe_force_balance=True))
    assert cm._expert_load_ratio(g) == 1.0
    t = _f(cm._grouped_gemm_s(g, 1e12))
    assert t == pytest.approx(1e12 / (989e12 * 0.5625) + 16 * 2 * 4e-6, rel=1e-6)
    assert t == pytest.approx(1.9256e-3, rel=1e-4)
    learned, _, g2 = _cm("qwen3-30b-a3b", "h100-sxm", 8, ep=8)
    assert _f(learned._expert_load_ratio(g2)) == pytest.approx(1.0325)


def test_force_balance_read_from_a_table_footnote() -> None:
    note = "moe: force-balanced token distribution, token-dropless (table footnote)"
    assert options_from_notes(note)["moe_force_balance"] is True
    assert options_from_notes("moe: token-dropless, aux loss 1e-3")["moe_force_balance"] is False


def test_deepep_sends_a_token_once_per_destination_rank_or_node() -> None:
    """Uniform top-8 routing over 128 experts. In one node (EP 8, H100): a token lands on
    8·(1 - (7/8)^8) = 8·(1 - 0.34361) = 5.2511 distinct ranks, so DeepEP/HybridEP send 5.2511 copies where
    Megatron's alltoall dispatcher sends 8. Over two nodes (EP 16 on 16 H100s) the network leg carries one copy per
    node: 2·(1 - (1/2)^8) = 1.9922. On a GB200 NVL72 rack EP 64 stays in the NVLink domain: top-4,
    64·(1 - (63/64)^4) = 3.9070."""
    cm, _, g = _cm("qwen3-30b-a3b", "h100-sxm", 8, ep=8, options=Options(moe_dispatcher="deepep"))
    assert _f(cm._dispatch_copies(8, g["ep"], g["tp"])) == pytest.approx(5.2511, rel=1e-4)
    cm, _, g = _cm("qwen3-30b-a3b", "h100-sxm", 16, ep=16, options=Options(moe_dispatcher="hybridep"))
    assert _f(cm._dispatch_copies(8, g["ep"], g["tp"])) == pytest.approx(1.9922, rel=1e-4)
    cm, _, g = _cm("gpt-oss-120b", "gb200-nvl72", 64, ep=64, options=Options(moe_dispatcher="hybridep"))
    assert _f(cm._dispatch_copies(4, g["ep"], g["tp"])) == pytest.approx(3.9070, rel=1e-4)
    plain, _, g = _cm("qwen3-30b-a3b", "h100-sxm", 8, ep=8)
    assert plain._dispatch_copies(8, g["ep"], g["tp"]) == 8


def test_deepep_moves_fewer_all_to_all_bytes_in_the_ledger() -> None:
    # the ledger's all-to-all bytes scale with the copies: 5.2511 / 8 of the alltoall dispatcher's (one node)
    def a2a_bytes(dispatcher: str) -> float:
        prob = Problem(load_model("qwen3-30b-a3b"), load_chip("h100-sxm"), 8, 4096, 8)
        cm = CostModel(prob, default_efficiency(prob.chip), Options(moe_dispatcher=dispatcher))
        L = LayoutArrays.from_configs([ParallelConfig(dp=8, ep=8, microbatch=1, recompute="none")])
        g = cm.geometry(L)
        cm.comm_terms(L, g, cm.compute_terms(L, g))
        return sum(v for k, v in g["ledger"].plan(0)["collective_bytes"].items() if k.startswith("all_to_all"))
    assert a2a_bytes("deepep") / a2a_bytes("alltoall") == pytest.approx(5.2511 / 8, rel=1e-4)


def test_megatron_export_carries_force_balance_and_deepep() -> None:
    from meshplan.export import export_train, train_module
    from meshplan.export.common import PlanToExport
    from meshplan.train.planner import plan
    from meshplan.train.space import Pins

    chip = load_chip("h100-sxm")
    problem = Problem(load_model("qwen3-30b-a3b"), chip, 16, 4096, 64)
    from meshplan.train.frameworks import framework_options

    o = framework_options("megatron", Options(), {"moe_force_balance": True, "moe_dispatcher": "deepep"})
    cfg = ParallelConfig(dp=16, ep=16, microbatch=1, recompute="none", zero=1)
    pins = Pins(dp=16, fsdp=1, tp=1, pp=1, vpp=1, cp=1, ep=16, microbatch=1, recompute="none", zero=1)
    pr = plan(problem, pins, default_efficiency(chip), o, top=1).plans[0]
    _, text = export_train("megatron", PlanToExport(problem, cfg, o, pr, "meshplan train (test)", "qwen3-30b-a3b"))
    assert "--moe-router-force-load-balancing" in text and "--moe-enable-deepep" in text
    job = train_module("megatron").load(text, 16)
    back = job.resolved_options(Options())
    assert back.moe_force_balance and back.moe_dispatcher == "deepep"


def test_harness_reads_the_recipes_dispatcher_and_ep_overlap(monkeypatch) -> None:
    """benchmarks/data/mbridge_moe_dispatch.yaml (each Megatron-Bridge row's `moe_flex_dispatcher_backend` /
    `moe_a2a_overlap`, read from its release tag's presets) reaches Options; hand-written rows first, then two
    entries of the file: the 26.06 Qwen3-30B-A3B GB200 MXFP8 preset (v0.5.0, QWEN3_30B_A3B_PRETRAIN_CONFIG_GB200_FP8_MX_V1:
    hybridep, moe_a2a_overlap=True) and the 25.11 GPT-OSS-120B B200 one (v0.2.0: the builder takes no backend,
    alltoall, no overlap)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import _measurements as H

    table = {"hand_a": {"moe_dispatcher": "hybridep", "ep_overlap": True, "recipe": "hand-written"},
             "hand_b": {"moe_dispatcher": "deepep", "ep_overlap": False, "recipe": "hand-written"}}
    assert H.moe_dispatch_of({"id": "hand_a"}, table) == {"moe_dispatcher": "hybridep", "ep_overlap": True}
    assert H.moe_dispatch_of({"id": "hand_b"}, table) == {"moe_dispatcher": "deepep", "ep_overlap": False}
    assert H.moe_dispatch_of({"id": "not_listed"}, table) == {}
    # options_of passes them on (a reference-set row renamed to the hand-written ids)
    monkeypatch.setattr(H, "_mbridge_moe_dispatch", lambda: table)
    base = H.load_entries()[0]
    a, b, c = (H.options_of(dict(base, id=i)) for i in ("hand_a", "hand_b", "not_listed"))
    assert (a.moe_dispatcher, a.ep_overlap) == ("hybridep", True)
    assert (b.moe_dispatcher, b.ep_overlap) == ("deepep", False)
    assert (c.moe_dispatcher, c.ep_overlap) == ("alltoall", False)
    monkeypatch.undo()
    assert H.moe_dispatch_of({"id": "mbridge_26p06_qwen3-30b-a3b_gb200_8_mxfp8"}) == {"moe_dispatcher": "hybridep",
                                                                                       "ep_overlap": True}
    assert H.moe_dispatch_of({"id": "mbridge_25p11_gpt-oss-120b_b200_64_bf16"}) == {"moe_dispatcher": "alltoall",
                                                                                     "ep_overlap": False}
    for entry in H._mbridge_moe_dispatch().values():
        assert entry["moe_dispatcher"] in MOE_DISPATCHERS and isinstance(entry["ep_overlap"], bool)


def test_ep_folded_over_data_and_context_ranks() -> None:
    """Mixtral 8x7B (32 layers, D 4096, F 14336, SwiGLU, 8 experts) on 8 H100s, dp 2 cp 2 ep 4 pp 2 (ETP = TP = 1):
    Megatron-Core folds the expert grid over the stage's tp·cp·dp = 4 ranks (EP × expert-DP = 4 × 1), so each rank
    holds 2 whole experts of its 16 layers, 16·3·4096·14336·8/4 = 5,637,144,576 parameters, and no other rank holds
    them: under ZeRO-1 their fp32 master and Adam moments (12 B) are not sharded (expert DP 1), 67.6457 GB; the dense
    rest is sharded over the 4 dp × cp replicas. Their gradients reduce over no one (a group of 1: no bytes), the
    dense ones over data + context. Before, EP over dp × cp counted as not carved: the experts' state split 4 ways
    (16.9 GB) and their gradients reduced over all 4 replicas."""
    prob = Problem(load_model("mixtral-8x7b"), load_chip("h100-sxm"), 8, 4096, 64)
    cm = CostModel(prob, default_efficiency(prob.chip), Options())
    L = LayoutArrays.from_configs([ParallelConfig(dp=2, cp=2, pp=2, ep=4, microbatch=1, recompute="none", zero=1)])
    g = cm.geometry(L)
    experts = 16 * 3 * 4096 * 14336 * 8 / 4
    assert experts == 5_637_144_576
    assert _f(g["layers_stage"]) == 16 and _f(cm._expert_replicas(g)) == 1
    assert _f(cm._carved_experts(g)) == pytest.approx(experts)
    dense = _f(g["params_stage_local"]) - experts
    assert _f(cm._zero_local(g, np.array([True]))) == pytest.approx(dense / 4 + experts)
    mem = cm.memory_terms(L, g)
    assert 12.0 * experts == pytest.approx(67.6457e9, rel=1e-5)
    assert _f(mem["optimizer"]) >= 12.0 * experts
