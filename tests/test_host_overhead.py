"""Issue #14: the host (CPU issue) side of an eager step. Kernel counts by CUDA-graph scope, the per-layer host sync of
Megatron-Core's MoE dispatcher, and the phase maxima of host_bound_per_mb, worked by hand."""

from __future__ import annotations

import numpy as np
import pytest

import meshplan.train.costmodel as costmodel
from meshplan.cost.efficiency import default_efficiency, host_constant
from meshplan.errors import MeshplanError
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options, Terms
from meshplan.train.evaluate import evaluate
from meshplan.train.space import Problem


def _cm(name: str, hardware: str = "h100-sxm", chips: int = 8, ep: int = 1, recompute: str = "none",
        options: Options | None = None):
    prob = Problem(load_model(name), load_chip(hardware), chips, 4096, chips)
    cm = CostModel(prob, default_efficiency(prob.chip), options or Options())
    L = LayoutArrays.from_configs([ParallelConfig(dp=chips, ep=ep, microbatch=1, recompute=recompute, zero=1)])
    return cm, L, cm.geometry(L)


def _f(x) -> float:
    return float(np.asarray(x).ravel()[0])


def test_moe_layer_launch_count_by_graph_scope() -> None:
    """Qwen3-30B-A3B (128 experts) at EP 8: 15 dense kernels, routing 10 (router) + 5 (dispatcher preprocess) +
    5 (permute/unpermute) = 20 (moe_overlap.yaml), and 2 GEMMs for each of the 128/8 = 16 local experts = 32:
    67 launches a layer forward when eager. TE-scoped graphs of moe_router and moe_preprocess (the Megatron-Bridge
    Qwen3-30B recipes): 67 - 10 - 5 + 2 graph launches = 54; with attn as well: 54 - 15 + 1 = 40. A full-iteration
    graph: nothing issued per layer."""
    cm, L, g = _cm("qwen3-30b-a3b", ep=8)
    assert sum(cm.layer_kernels_fwd(g).values()) == pytest.approx(15 + 20 + 32)
    assert _f(cm.host_launches_fwd(g)) == pytest.approx(67)
    for scopes, launches in ((("moe_router", "moe_preprocess"), 54), (("attn", "moe_router", "moe_preprocess"), 40),
                             (("moe",), 15 + 1), (("full_iteration",), 0)):
        cm2, _, g2 = _cm("qwen3-30b-a3b", ep=8, options=Options(cuda_graph_scopes=scopes))
        assert _f(cm2.host_launches_fwd(g2)) == pytest.approx(launches), scopes
    assert cm.host_syncs()
    assert not _cm("qwen3-30b-a3b", ep=8, options=Options(cuda_graph_scopes=("full_iteration",)))[0].host_syncs()


def test_dense_layer_launch_count() -> None:
    """A dense layer: the 15 kernels of KERNELS_PER_LAYER_FWD; `attn` alone captures half of them (the other half is
    the MLP, scope `mlp`): 7.5 eager + 1 graph launch; both: 2 graph launches. No host sync in a dense layer."""
    cm, L, g = _cm("llama3-8b")
    assert _f(cm.host_launches_fwd(g)) == pytest.approx(15)
    assert not cm.host_syncs()
    cm2, _, g2 = _cm("llama3-8b", options=Options(cuda_graph_scopes=("attn",)))
    assert _f(cm2.host_launches_fwd(g2)) == pytest.approx(8.5)
    cm3, _, g3 = _cm("llama3-8b", options=Options(cuda_graph_scopes=("attn", "mlp")))
    assert _f(cm3.host_launches_fwd(g3)) == pytest.approx(2)


def test_unknown_graph_scope_is_refused() -> None:
    with pytest.raises(MeshplanError, match="unknown CUDA-graph scope 'everything'"):
        Options(cuda_graph_scopes=("everything",))


def _fake(L, g, nl: float, fwd: float, bwd: float):
    g = dict(g, layers_stage=np.array([nl]))
    return g, Terms(fwd=np.array([fwd]), bwd=np.array([bwd]))


def test_host_bound_phases_with_the_moe_sync(monkeypatch) -> None:
    """Host op 20 µs (patched, so the arithmetic is the test's), 48 layers of 67 launches, recompute none:
    CPU forward 48·67·20e-6 = 0.06432 s, backward twice that, 0.12864 s. A GPU micro-batch of 0.16 s split 1:2
    (forward 0.04, backward 0.08 of compute): gpu_f 0.05333, gpu_b 0.10667. The MoE dispatcher syncs in every
    forward layer, so the phases add: max(0.05333, 0.06432) + max(0.10667, 0.12864) = 0.19296 s."""
    monkeypatch.setattr(costmodel, "host_constant", lambda name, chip: 2e-5)
    cm, L, g = _cm("qwen3-30b-a3b", ep=8)
    g, ct = _fake(L, g, 48, 0.04, 0.08)
    bound, cpu = cm.host_bound_per_mb(L, g, ct, np.array([0.16]))
    assert _f(cpu) == pytest.approx(0.06432 + 0.12864)
    assert _f(bound) == pytest.approx(0.06432 + 0.12864)
    # a GPU-bound backward keeps its own time: per_mb 0.30 -> gpu_f 0.1, gpu_b 0.2: max(0.1, 0.06432) +
    # max(0.2, 0.12864) = 0.30, unchanged
    bound, _ = cm.host_bound_per_mb(L, g, ct, np.array([0.30]))
    assert _f(bound) == pytest.approx(0.30)
    # full recompute reissues the forward in the backward (RECOMPUTE_PARTS elem 1): CPU backward 3·0.06432
    cmr, Lr, gr = _cm("qwen3-30b-a3b", ep=8, recompute="full")
    gr, ctr = _fake(Lr, gr, 48, 0.04, 0.08)
    bound, cpu = cmr.host_bound_per_mb(Lr, gr, ctr, np.array([0.16]))
    assert _f(cpu) == pytest.approx(4 * 0.06432)
    assert _f(bound) == pytest.approx(0.06432 + 3 * 0.06432)


def test_host_bound_without_sync_lets_the_cpu_run_ahead(monkeypatch) -> None:
    """A dense layer (15 launches, no sync), host op 200 µs (patched), 48 layers: CPU forward 48·15·2e-4 = 0.144 s,
    backward 0.288 s. GPU micro-batch 0.30 s split 1:2: gpu_f 0.1, gpu_b 0.2. The GPU cannot run what the CPU has
    not issued: max(gpu_f + gpu_b, cpu_f + gpu_b, cpu_f + cpu_b) = max(0.30, 0.344, 0.432) = 0.432 s. With a sync in
    every forward layer the phases would add the same here (0.144 + 0.288); the difference shows when the CPU leads
    in one phase: host op 100 µs, cpu_f 0.072 < gpu_f 0.1 and cpu_b 0.144 < gpu_b 0.2: 0.30 (GPU-bound)."""
    monkeypatch.setattr(costmodel, "host_constant", lambda name, chip: 2e-4)
    cm, L, g = _cm("llama3-8b")
    g, ct = _fake(L, g, 48, 0.04, 0.08)
    bound, _ = cm.host_bound_per_mb(L, g, ct, np.array([0.30]))
    assert _f(bound) == pytest.approx(0.432)
    monkeypatch.setattr(costmodel, "host_constant", lambda name, chip: 1e-4)
    bound, _ = cm.host_bound_per_mb(L, g, ct, np.array([0.30]))
    assert _f(bound) == pytest.approx(0.30)


def test_sync_drains_the_cpu_lead(monkeypatch) -> None:
    """A GPU-bound forward and a host-bound backward: a CPU free to run ahead issues the backward while the GPU is
    still on the forward; a host sync in every forward layer stops it. MoE, 48 layers of 67 launches, host op 20 µs
    (patched): cpu_f 0.06432, cpu_b 0.12864. GPU micro-batch 0.21 s split fwd 0.20 : bwd 0.01.
    With the sync: max(0.20, 0.06432) + max(0.01, 0.12864) = 0.32864 s.
    Without: max(0.21, 0.06432 + 0.01, 0.06432 + 0.12864) = 0.21 s (the whole issue hides behind the forward).
    The other way round (fwd 0.01 : bwd 0.20) both give 0.06432 + 0.20 = 0.26432 s: the backward's GPU work cannot
    start before the forward's last launch."""
    monkeypatch.setattr(costmodel, "host_constant", lambda name, chip: 2e-5)
    cm, L, g = _cm("qwen3-30b-a3b", ep=8)
    g1, ct1 = _fake(L, g, 48, 0.01, 0.20)
    assert _f(cm.host_bound_per_mb(L, g1, ct1, np.array([0.21]))[0]) == pytest.approx(0.26432)
    g2, ct2 = _fake(L, g, 48, 0.20, 0.01)
    assert _f(cm.host_bound_per_mb(L, g2, ct2, np.array([0.21]))[0]) == pytest.approx(0.32864)
    monkeypatch.setattr(CostModel, "host_syncs", lambda self: False)
    assert _f(cm.host_bound_per_mb(L, g2, ct2, np.array([0.21]))[0]) == pytest.approx(0.21)


def test_tpu_has_no_host_issue_cost() -> None:
    """XLA launches one compiled program a step: host_op_s is 0 on TPUs, and the micro-batch keeps its GPU time."""
    cm, L, g = _cm("llama3-8b", hardware="tpu-v5p")
    assert host_constant("host_op_s", cm.p.chip) == 0.0
    g, ct = _fake(L, g, 32, 0.04, 0.08)
    assert _f(cm.host_bound_per_mb(L, g, ct, np.array([0.12]))[0]) == pytest.approx(0.12)


def test_evaluate_reports_the_host_wait() -> None:
    """End to end: the host wait is its own line (time['other/host']) and the step is never faster with it."""
    cm, L, g = _cm("qwen3-30b-a3b", hardware="b200", ep=8)
    ev = evaluate(cm, L)
    graphed = evaluate(CostModel(cm.p, cm.eff, Options(cuda_graph_scopes=("full_iteration",))), L)
    assert _f(graphed.time["other/host"]) == 0.0
    assert _f(ev.time["other/host"]) >= 0.0
    assert _f(ev.step_time_s) == pytest.approx(_f(graphed.step_time_s) + _f(ev.time["other/host"]), rel=1e-9)


def test_harness_reads_the_recipes_cuda_graphs() -> None:
    """benchmarks/data/mbridge_cuda_graphs.yaml, read from the Megatron-Bridge presets: the 26.06 Qwen3-30B-A3B GB200
    MXFP8 preset runs a full-iteration graph (commit bac3ffebf, 'Full-Iter CUDA Graphs for 26.06'); the 26.02 B200
    MXFP8 one TE-scoped graphs of the router and the dispatcher preprocess; a row without an entry runs eager."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import _measurements as H

    assert H.cuda_graph_scopes_of({"id": "mbridge_26p06_qwen3-30b-a3b_gb200_8_mxfp8"}) == ("full_iteration",)
    assert H.cuda_graph_scopes_of({"id": "mbridge_26p02_qwen3-30b-a3b_b200_8_mxfp8"}) == ("moe_router",
                                                                                         "moe_preprocess")
    assert H.cuda_graph_scopes_of({"id": "not_a_megatron_bridge_row"}) == ()
    for entry in H._mbridge_cuda_graphs().values():  # every scope the table names is one the cost model knows
        assert set(entry["cuda_graph_scopes"]) <= set(costmodel.CUDA_GRAPH_SCOPES)


def test_cli_cuda_graph_flag(capsys) -> None:
    """`--cuda-graph` sets the scopes; a full-iteration graph removes the host wait, an unknown scope is one error
    line and exit code 2. Qwen3-30B-A3B on 8 B200s at micro-batch 1: eager, the host wait shows under `other` and is
    all the difference to the graphed step (compute and communication are the same)."""
    import json

    from conftest import run_cli

    args = ["train", "--model", "qwen3-30b-a3b", "--hardware", "b200", "--chips", "8", "--seq-len", "4096",
            "--global-batch", "512", "--dp", "8", "--ep", "8", "--microbatch", "1", "--recompute", "none",
            "--dtype", "fp8", "--json"]
    rc, out, _ = run_cli(args, capsys)
    assert rc == 0
    eager = json.loads(out)["plans"][0]
    rc, out, _ = run_cli(args + ["--cuda-graph", "full_iteration"], capsys)
    graphed = json.loads(out)["plans"][0]
    assert graphed["time_s"]["compute"] == pytest.approx(eager["time_s"]["compute"])
    host_wait = eager["time_s"]["other"] - graphed["time_s"]["other"]
    assert host_wait > 0
    assert eager["step_time_s"] - graphed["step_time_s"] == pytest.approx(host_wait)
    rc, out, err = run_cli(args + ["--cuda-graph", "attn,everything"], capsys)
    assert rc == 2
    assert err.startswith("error: --cuda-graph must be one of")


def test_grace_host_issues_slower_than_x86() -> None:
    """A GB200's host is a Grace CPU: NVIDIA/TransformerEngine#2053 measured the CPU time of one torch.nn.Linear
    forward (same script) at 37.08 µs on GB200 against 13.48 µs on an H100 DGX (Xeon 8480C), a ratio of 2.7507.
    The x86 figure (HTA, 20 µs per launch) times that ratio: 55.0 µs. Qwen3-30B-A3B at EP 8 eager issues 67 launches
    a layer forward (test above), 48 layers, recompute none: CPU forward 48·67·55e-6 = 0.17688 s, backward twice that,
    0.35376 s; issue per micro-batch 0.53064 s on GB200 against 48·67·3·20e-6 = 0.19296 s on a DGX B200 (x86)."""
    gpu = host_constant("host_op_s", load_chip("b200"))
    grace = host_constant("host_op_s", load_chip("gb200-nvl72"))
    assert gpu == pytest.approx(20e-6)
    assert grace == pytest.approx(20e-6 * 37.08 / 13.48, rel=2e-3)
    for hw, issue in (("gb200-nvl72", 0.53064), ("b200", 0.19296)):
        cm, L, g = _cm("qwen3-30b-a3b", hardware=hw, ep=8)
        g, ct = _fake(L, g, 48, 0.04, 0.08)
        assert _f(cm.host_bound_per_mb(L, g, ct, np.array([0.12]))[1]) == pytest.approx(issue, rel=2e-3), hw


def test_fp8_expert_quantize_launches(monkeypatch) -> None:
    """Transformer Engine's GroupedLinear quantizes each local expert's input on its own (split_quantize: a fused
    multi-cast only for delayed scaling) in fc1 and fc2, forward; the backward quantizes the two output gradients the
    same way. Qwen3-30B-A3B at EP 8 (16 local experts) on Megatron-Core's eager path (unfused_expert_bias): current
    scaling 3 launches a quantize (amax, scale, cast): 2·16·3 = 96; block scaling (blockwise, MXFP8) 1: 32; delayed
    scaling one fused quantize per GEMM input: 2. Host: 48 layers, 20 µs a launch (patched), forward 67 + 2 (the FP8
    row padding and unpadding behind the alltoall dispatcher, _fp8_expert_padding_bytes) + 32 = 101 launches, the
    backward 2·69 + 32 (quantizes once, not twice) = 170: 48·(101 + 170)·20e-6 = 0.26016 s a micro-batch."""
    eager = dict(compute_dtype="fp8", unfused_expert_bias=True)
    for recipe, quant in (("tensorwise", 96), ("blockwise", 32), ("delayed", 2)):
        cm, L, g = _cm("qwen3-30b-a3b", ep=8, options=Options(fp8_recipe=recipe, **eager))
        assert _f(cm.layer_kernels_fwd(g)["moe_quant"]) == pytest.approx(quant), recipe
    # none in bf16, off the eager path (the TE op fuser, torchtitan), or when the whole MoE block is one CUDA graph
    for opts in (Options(unfused_expert_bias=True), Options(compute_dtype="fp8", fp8_recipe="blockwise")):
        cm, L, g = _cm("qwen3-30b-a3b", ep=8, options=opts)
        assert _f(cm.layer_kernels_fwd(g)["moe_quant"]) == 0.0
    cm, L, g = _cm("qwen3-30b-a3b", ep=8, options=Options(fp8_recipe="blockwise", cuda_graph_scopes=("moe",), **eager))
    assert _f(cm.host_launches_fwd(g)) == pytest.approx(15 + 1)  # the dense part eager, one graph for the MoE block
    monkeypatch.setattr(costmodel, "host_constant", lambda name, chip: 2e-5)
    cm, L, g = _cm("qwen3-30b-a3b", ep=8, options=Options(fp8_recipe="blockwise", **eager))
    assert _f(cm.host_launches_fwd(g)) == pytest.approx(67 + 2 + 32)
    g, ct = _fake(L, g, 48, 0.04, 0.08)
    _, cpu = cm.host_bound_per_mb(L, g, ct, np.array([0.01]))
    assert _f(cpu) == pytest.approx((48 * 101 + 48 * (2 * 69 + 32)) * 2e-5)
    assert _f(cpu) == pytest.approx(0.26016)
