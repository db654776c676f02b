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
