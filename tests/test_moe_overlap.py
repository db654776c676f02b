"""Issue #14 item 3: fine-grained MoE terms (grouped GEMM at the per-expert shape, busiest-rank load, routing
kernels) and the cost of overlap (NCCL channels' SMs, the collective's HBM traffic). Every expected value is worked
by hand from the published constants in cost/data/moe_overlap.yaml and the chip files."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.cost.efficiency import comm_hbm_share, default_efficiency, nccl_sm_slowdown
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.space import Problem


def _model(name: str, hardware: str, chips: int, ep: int, tokens: int = 4096):
    prob = Problem(load_model(name), load_chip(hardware), chips, tokens, chips)
    cm = CostModel(prob, default_efficiency(prob.chip), Options())
    L = LayoutArrays.from_configs([ParallelConfig(dp=chips, ep=ep, microbatch=1, recompute="none")])
    return cm, cm.geometry(L)


def test_busiest_rank_load_ratio() -> None:
    # the busiest rank holds the busiest expert at 1 + MaxVio = 1.52 of the mean (Wang et al. 2024 Table 1) and its
    # other E/ep - 1 experts at the mean: 1 + 0.52 / (E/ep)
    cm, g = _model("mixtral-8x7b", "h100-sxm", 8, ep=4)  # E = 8, 2 experts per rank: 1 + 0.52 / 2 = 1.26
    assert float(np.asarray(cm._expert_load_ratio(g)).ravel()[0]) == pytest.approx(1.26)
    cm, g = _model("qwen3-30b-a3b", "h100-sxm", 8, ep=8)  # E = 128, 16 per rank: 1 + 0.52 / 16 = 1.0325
    assert float(np.asarray(cm._expert_load_ratio(g)).ravel()[0]) == pytest.approx(1.0325)
    dense, g = _model("llama3-8b", "h100-sxm", 8, ep=1)
    assert dense._expert_load_ratio(g) == 1.0


def test_grouped_gemm_at_the_per_expert_shape() -> None:
    """Mixtral 8x7B (D 4096, F 14336, SwiGLU, top-2 of 8), 4096 tokens, EP 4 on H100: each expert's GEMM has
    4096·2·4/8 = 4096 rows; its smallest dimension 4096 runs at 0.75·4096/(4096 + 256) = 0.70588 of peak
    (efficiency.yaml: h100-sxm 0.75, gpu d_half 256). FLOPs 2·4096 tokens·(3·4096·14336·2) = 2.8862e12;
    time 2.8862e12 / (989e12·0.70588) = 4.1342 ms, times the busiest rank's 1.26 = 5.2091 ms, plus 2 local experts
    × 2 GEMMs × 4 µs launches = 16 µs: 5.2251 ms."""
    cm, g = _model("mixtral-8x7b", "h100-sxm", 8, ep=4)
    f_routed = 2 * 4096 * 3 * 4096 * 14336 * 2
    expected = 1.26 * f_routed / (989e12 * 0.75 * 4096 / (4096 + 256)) + 2 * 2 * 4e-6
    assert float(np.asarray(cm._grouped_gemm_s(g, f_routed)).ravel()[0]) == pytest.approx(expected, rel=1e-6)
    assert expected == pytest.approx(5.2251e-3, rel=1e-4)


def test_fine_grained_experts_run_slower_per_flop() -> None:
    """Qwen3-30B-A3B (E 128, top-8, expert F 768) at EP 8 with 4096 tokens: 4096·8·8/128 = 2048 rows per expert, but
    the expert width 768 is the thin dimension: 0.75·768/1024 = 0.5625 of peak against 0.75·2048/2304 = 0.667 for a
    GEMM as wide as D 2048; and 16 local experts pay 16·2 launches."""
    cm, g = _model("qwen3-30b-a3b", "h100-sxm", 8, ep=8)
    f = 1e12
    t = float(np.asarray(cm._grouped_gemm_s(g, f)).ravel()[0])
    assert t == pytest.approx(1.0325 * f / (989e12 * 0.5625) + 16 * 2 * 4e-6, rel=1e-6)


def test_nccl_channels_take_sms_from_compute() -> None:
    # 16 NCCL channels, one SM each (NVIDIA/nccl#689): H100 keeps 116 of 132 SMs -> 132/116 - 1 = 16/116 = 0.13793
    assert nccl_sm_slowdown(load_chip("h100-sxm")) == pytest.approx(16 / 116)
    assert nccl_sm_slowdown(load_chip("a100-80gb")) == pytest.approx(16 / 92)  # 108 SMs
    assert default_efficiency(load_chip("h100-sxm")).comm_compute_interference == pytest.approx(0.13793, rel=1e-4)
    assert nccl_sm_slowdown(load_chip("tpu-v5p")) is None  # ICI on DMA engines: efficiency.yaml's TPU value stays
    assert default_efficiency(load_chip("tpu-v5p")).comm_compute_interference == pytest.approx(0.03)


def test_collective_hbm_share() -> None:
    # 3 HBM bytes per link byte (NVIDIA/nccl#1428) at NVLink speed: H100 3·450 GB/s / 3.35 TB/s = 0.40299;
    # A100 80GB 3·300 / 2039 = 0.44139; TPUs 0
    assert comm_hbm_share(load_chip("h100-sxm")) == pytest.approx(0.40299, rel=1e-4)
    assert comm_hbm_share(load_chip("a100-80gb")) == pytest.approx(0.44139, rel=1e-4)
    assert comm_hbm_share(load_chip("tpu-v5p")) == 0.0


def test_hidden_collectives_slow_compute_by_sms_and_hbm(monkeypatch) -> None:
    """Llama 3 8B on 16 H100 with DP16 (gradient reduction hidden behind the backward): the contention added to
    the compute is the SM part 16/116 plus the HBM part hbm_bound·s/(1 - s), s = 0.40299, both over the same
    hidden seconds; so the HBM part over the SM part is hbm_bound·(0.40299/0.59701)/(16/116), with hbm_bound the
    share of the layer forward that is neither GEMM nor attention core."""
    from dataclasses import replace

    import meshplan.train.evaluate as ev

    prob = Problem(load_model("llama3-8b"), load_chip("h100-sxm"), 16, 4096, 64)
    L = LayoutArrays.from_configs([ParallelConfig(dp=16, microbatch=1, recompute="none")])
    eff = default_efficiency(prob.chip)
    compute = {}
    for name, interference, share in (("none", 0.0, 0.0), ("sm", eff.comm_compute_interference, 0.0),
                                      ("both", eff.comm_compute_interference, 0.40299)):
        monkeypatch.setattr(ev, "comm_hbm_share", lambda chip, s=share: s)
        cm = CostModel(prob, replace(eff, comm_compute_interference=interference), Options())
        compute[name] = float(ev.evaluate(cm, L).time["compute"][0])
    ct = cm.compute_terms(L, cm.geometry(L))
    hbm_bound = float((1 - (ct["layer_matmul_fwd"] + ct["layer_core_fwd"]) / ct["layer_fwd"])[0])
    sm_part, hbm_part = compute["sm"] - compute["none"], compute["both"] - compute["sm"]
    assert sm_part > 0
    assert hbm_part / sm_part == pytest.approx(hbm_bound * (0.40299 / 0.59701) / (16 / 116), rel=1e-6)


def test_dispatcher_sms_take_sms_from_compute() -> None:
    # the flex dispatcher's own kernels hold its configured SMs (moe_overlap.yaml dispatcher_sms): HybridEP 32
    # (Megatron-Bridge perf scripts), DeepEP 20 (Megatron-Core default); H100 132 SMs, B200/GB200 148
    from meshplan.cost.efficiency import dispatcher_sm_slowdown

    assert dispatcher_sm_slowdown("hybridep", load_chip("h100-sxm")) == pytest.approx(32 / 100)
    assert dispatcher_sm_slowdown("hybridep", load_chip("gb200-nvl72")) == pytest.approx(32 / 116)
    assert dispatcher_sm_slowdown("deepep", load_chip("h100-sxm")) == pytest.approx(20 / 112)
    assert dispatcher_sm_slowdown("alltoall", load_chip("h100-sxm")) is None  # NCCL's all-to-all: NCCL's channels
    assert dispatcher_sm_slowdown("hybridep", load_chip("tpu-v5p")) is None


def _overlap_model(dispatcher: str):
    prob = Problem(load_model("qwen3-30b-a3b"), load_chip("h100-sxm"), 8, 4096, 64)  # 8 micro-batches per rank
    return CostModel(prob, default_efficiency(prob.chip), Options(moe_dispatcher=dispatcher, ep_overlap=True))


def test_hidden_time_charges_each_family_its_own_sms() -> None:
    """1 ms hidden DP reduce-scatter (NCCL: 16 of 132 SMs) and 1 ms hidden HybridEP all-to-all (32 of 132 SMs) on
    H100: 16/116 · 1 ms + 32/100 · 1 ms = 0.13793 + 0.32 = 0.45793 ms of compute lost, i.e. a slow-down of
    0.45793 / 2 = 0.228966 over the 2 hidden ms. With the NCCL all-to-all both hold 16 SMs: 16/116."""
    from meshplan.train.costmodel import Terms
    from meshplan.train.evaluate import _hidden_sm_slowdown, comm_per_step

    def slowdown(dispatcher: str, cc: Terms) -> float:
        return float(_hidden_sm_slowdown(_overlap_model(dispatcher), *comm_per_step(cc, 2))[0])

    zero = np.zeros(1)
    cc = Terms({f"{k}_{s}": zero for k in ("tp", "cp", "ep", "pp", "fsdp") for s in ("mb", "link_mb")})
    cc.update(fsdp_step=zero, fsdp_link_step=zero, dp_step=zero, dp_link_step=np.array([1e-3]),
              ep_link_mb=np.array([0.5e-3]))  # two micro-batches of 0.5 ms each, nothing exposed
    s = slowdown("hybridep", cc)
    assert s * 2e-3 == pytest.approx(16 / 116 * 1e-3 + 32 / 100 * 1e-3)
    assert s == pytest.approx(0.228966, rel=1e-5)
    assert slowdown("alltoall", cc) == pytest.approx(16 / 116)
    # the exposed part of a family is not hidden: 0.3 ms of each EP micro-batch exposed leaves 0.4 ms hidden:
    # (16/116 · 1 + 32/100 · 0.4) / 1.4 = (0.137931 + 0.128) / 1.4 = 0.189951
    cc["ep_mb"] = np.array([0.3e-3])
    assert slowdown("hybridep", cc) == pytest.approx(0.189951, rel=1e-5)


def test_hybridep_overlap_slows_compute_by_its_sms(monkeypatch) -> None:
    """Qwen3-30B-A3B on 8 H100, EP 8 with the all-to-all overlapped: HybridEP's 32 SMs in place of NCCL's 16 add
    (32/100 - 16/116) of the hidden EP seconds (its link time less its exposed time) to the compute, nothing else."""
    import meshplan.train.evaluate as ev

    cm = _overlap_model("hybridep")
    L = LayoutArrays.from_configs([ParallelConfig(dp=8, ep=8, microbatch=1, recompute="none")])
    hybrid = float(ev.evaluate(cm, L).time["compute"][0])
    cc = cm.comm_terms(L, cm.geometry(L), cm.compute_terms(L, cm.geometry(L)))
    n_micro = float(np.asarray(cm.geometry(L)["n_micro"]).ravel()[0])
    hidden_ep = n_micro * float((cc["ep_link_mb"] - cc["ep_mb"])[0])
    assert hidden_ep > 0
    monkeypatch.setattr(ev, "dispatcher_sm_slowdown", lambda dispatcher, chip: None)  # as if NCCL's channels
    nccl = float(ev.evaluate(cm, L).time["compute"][0])
    assert hybrid - nccl == pytest.approx((32 / 100 - 16 / 116) * hidden_ep, rel=1e-6)
