"""PyTorch's all-gather context parallelism (`Options.cp_impl = "torch"`, torchtitan's default), checked against
hand sums: MHA-sized K/V (torchtitan's Llama repeats K/V heads before SDPA), an all-gather hidden behind the
diagonal block only, fp32 dK/dV passed block by block with the last one exposed, fp32 output merges as HBM
traffic, and the gathered K/V plus fp32 gradient accumulators held during a layer's attention backward."""

from __future__ import annotations

import pytest

from meshplan.cost.efficiency import default_efficiency
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.frameworks import framework_options
from meshplan.train.space import Problem

# Llama 3 8B at 262,144 tokens over CP 8 on one 8-GPU node: 32,768 local tokens, 32 query heads of 128
SEQ, CP, T_LOCAL, N_HEADS, HEAD_DIM, LAYERS = 262_144, 8, 32_768, 32, 128, 32
ELEMS = T_LOCAL * N_HEADS * HEAD_DIM  # local elements of Q (and of each repeated K and V)


def _model(impl: str, comm_bytes_per_s: float | None = None):
    prob = Problem(load_model("llama3-8b"), load_chip("h100-sxm"), CP, SEQ, 1)
    eff = default_efficiency(prob.chip)
    cm = CostModel(prob, eff, Options(cp_impl=impl))
    if comm_bytes_per_s is not None:  # a plain 100 GB/s, zero-latency network, so the sums are by hand
        cm.comm.time = lambda kind, nbytes, size, stride: (nbytes / comm_bytes_per_s) * (size > 1)
    L = LayoutArrays.from_configs([ParallelConfig(cp=CP, microbatch=1, recompute="full")])
    g = cm.geometry(L)
    return cm, L, g, cm.compute_terms(L, g), prob, eff


def test_fp32_merges_add_hbm_traffic_per_ring_step() -> None:
    _, _, _, ring, prob, eff = _model("ring")
    _, _, _, torch_cp, _, _ = _model("torch")
    hbm = prob.chip.hbm_bandwidth_bytes_per_s * eff.hbm_fraction
    steps = CP - 1
    assert float(torch_cp["layer_core_fwd"][0] - ring["layer_core_fwd"][0]) == pytest.approx(
        40.5 * ELEMS * steps / hbm, rel=1e-9)
    assert float(torch_cp["layer_core_bwd"][0] - ring["layer_core_bwd"][0]) == pytest.approx(
        58.5 * ELEMS * steps / hbm, rel=1e-9)


def test_allgather_ring_exposure_by_hand() -> None:
    """100 GB/s network: the forward gathers 8 × 512 MiB of repeated K/V (43 ms) behind the diagonal block only
    (1/8 of the attention), twice under full recompute; the backward's gather hides behind its own diagonal
    block, the fp32 dK/dV (1 GiB, 10.7 ms) behind each next block, the last one exposed."""
    bw = 1.0e11
    cm, L, g, ct, prob, eff = _model("torch", bw)
    kv_bytes = 2 * 2 * ELEMS  # bf16 K and V with every query head
    ag_s, dkv_s = CP * kv_bytes / bw, 2 * kv_bytes / bw
    # attention core seconds, by the book's causal FLOPs (4·t·(S/2)·N·H) at the flash fractions, times cuDNN's tile
    # factor for 131,072 keys per query in 8 launches (H100 k 3.15 forward, 5.00 backward; efficiency.
    # attention_tile_factor): 1 + (0.5 + 8·3.15)·128/131072 = 1.0250977 and 1 + (0.5 + 8·5)·128/131072 = 1.0395508,
    # each under its floor at the tables' longest shape, 16,384 keys in one launch: 1 + 3.65·128/16384 = 1.0285156 and
    # 1 + 5.5·128/16384 = 1.0429688; over the 8K anchors 1.1140625 and 1.171875; plus the merges
    hbm = prob.chip.hbm_bandwidth_bytes_per_s * eff.hbm_fraction
    flops = 2 * T_LOCAL * (SEQ / 2) * N_HEADS * 2 * HEAD_DIM
    tile_f, tile_b = 1.0285156 / 1.1140625, 1.0429688 / 1.171875
    core_f = flops / (prob.chip.peak("bf16") * eff.attention_fwd_fraction) * tile_f + 40.5 * ELEMS * (CP - 1) / hbm
    core_b = (2.5 * flops / (prob.chip.peak("bf16") * eff.attention_bwd_fraction) * tile_b
              + 58.5 * ELEMS * (CP - 1) / hbm)
    assert float(ct["layer_core_fwd"][0]) == pytest.approx(core_f, rel=1e-6)
    exposed_f = 2 * max(ag_s - core_f / CP, 0.0)  # forward and its recompute
    exposed_b = max(ag_s - core_b / CP, 0.0) + (CP - 2) * max(dkv_s - core_b / CP, 0.0) + dkv_s
    out = cm.comm_terms(L, g, ct)
    assert exposed_f > 0.04  # the gather is longer than the diagonal block here
    assert float(out["cp_mb"][0]) == pytest.approx(LAYERS * (exposed_f + exposed_b), rel=1e-6)
    assert float(out["cp_link_mb"][0]) == pytest.approx(LAYERS * (3 * ag_s + (CP - 1) * dkv_s), rel=1e-9)


def test_ring_impl_carries_gqa_sized_kv() -> None:
    """Ring Attention passes the 8 KV heads, a quarter of the repeated K/V: (cp - 1) sends forward, twice that
    backward, on the same fake network."""
    bw = 1.0e11
    cm, L, g, ct, _, _ = _model("ring", bw)
    kv_gqa = 2 * 2 * T_LOCAL * 8 * HEAD_DIM
    out = cm.comm_terms(L, g, ct)
    assert float(out["cp_link_mb"][0]) == pytest.approx(LAYERS * 3 * (CP - 1) * kv_gqa / bw, rel=1e-9)


def test_torch_cp_holds_the_gathered_kv_and_fp32_gradients() -> None:
    cm_r, L, g, _, _, _ = _model("ring")
    cm_t, _, _, _, _, _ = _model("torch")
    extra = float(cm_t.memory_terms(L, g)["other"][0] - cm_r.memory_terms(L, g)["other"][0])
    assert extra == pytest.approx(CP * 2 * 2 * ELEMS + 3 * 4 * ELEMS, rel=1e-9)  # 4.3 GB + 1.6 GB


def test_torchtitan_framework_selects_the_torch_impl() -> None:
    assert framework_options("torchtitan", Options(), {}).cp_impl == "torch"
    assert framework_options("megatron", Options(), {}).cp_impl == "ring"
    assert framework_options("torchtitan", Options(), {"cp_impl": "ring"}).cp_impl == "ring"


def test_exposed_torch_cp_names_the_ring_as_the_fix() -> None:
    """Llama 3 70B at 262k tokens, TP8 inside the node and CP8 across 8 nodes: the 8-way gather of K/V repeated to
    64 heads outruns the diagonal block over InfiniBand, and the explanation says what hides it."""
    from meshplan.train.planner import plan
    from meshplan.train.space import Pins

    prob = Problem(load_model("llama3-70b"), load_chip("h100-sxm"), 64, SEQ, 1)
    eff = default_efficiency(prob.chip)
    pins = Pins(tp=8, cp=8)
    torch_cp = plan(prob, pins, eff, Options(cp_impl="torch", fsdp_over_cp=True), top=1).plans[0]
    ring = plan(prob, pins, eff, Options(cp_impl="ring", fsdp_over_cp=True), top=1).plans[0]
    assert torch_cp["bottleneck"] == "comm/cp" and "--cp-impl ring" in torch_cp["explanation"]
    assert ring["time_breakdown_s"]["exposed_comm/cp"] < 0.1 * torch_cp["time_breakdown_s"]["exposed_comm/cp"]


def test_cli_cp_impl_flag(capsys) -> None:
    import json

    from conftest import run_cli

    base = ["train", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len", "131072",
            "--global-batch", "2", "--cp", "4", "--tp", "1", "--top", "1"]
    rc, out, err = run_cli([*base, "--cp-impl", "ulysses"], capsys)
    assert rc == 2 and "--cp-impl must be one of ring, torch, allgather" in err
    steps = {}
    for impl in ("ring", "torch"):
        rc, out, _ = run_cli([*base, "--cp-impl", impl, "--json"], capsys)
        assert rc == 0
        steps[impl] = json.loads(out)["plans"][0]["step_time_s"]
    assert steps["torch"] > steps["ring"]  # the fp32 merges at least, on the same layout
    # at 64K: torchtitan has no host offload, which 128K on 8 GPUs at CP 4 needs (the preset keeps the search to what
    # a torchtitan job can run, session 21)
    titan = [("65536" if a == "131072" else a) for a in base]
    rc, out, _ = run_cli([*titan, "--framework", "torchtitan"], capsys)
    assert rc == 0
    assert "CP by PyTorch all-gather" in " ".join(out.split())
