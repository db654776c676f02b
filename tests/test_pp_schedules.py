"""Pipeline schedules (`--pp-schedule`): the bubble and memory of 1F1B, zero-bubble ZB-H1 and DualPipe as the
DeepSeek-V3 report's Table 2 states them, with F + B the micro-batch's stage time and W its weight-gradient GEMMs."""

from __future__ import annotations

import pytest
from conftest import run_cli

from meshplan.cost.efficiency import default_efficiency
from meshplan.errors import MeshplanError
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.evaluate import evaluate
from meshplan.train.planner import plan
from meshplan.train.space import Pins, Problem, enumerate_layouts

PP = 8
PROB = Problem(load_model("llama3-70b"), load_chip("h100-sxm"), 64, 4096, 256)
LAYOUT = LayoutArrays.from_configs([ParallelConfig(tp=8, pp=PP, microbatch=1, recompute="full")])


def _eval(schedule: str):
    cm = CostModel(PROB, default_efficiency(PROB.chip), Options(pp_schedule=schedule))
    g = cm.geometry(LAYOUT)
    ct = cm.compute_terms(LAYOUT, g)
    return evaluate(cm, LAYOUT), ct, g


def test_bubbles_follow_the_published_formulas() -> None:
    one, ct, g = _eval("1f1b")
    zb, _, _ = _eval("zb1p")
    dual, _, _ = _eval("dualpipe")
    per_mb = float(one.time["bubble"][0]) / (PP - 1)  # 1F1B: (p - 1)(F + B)
    w = float(g["layers_stage"][0] * ct["layer_matmul_fwd"][0])  # weight-gradient GEMMs = forward GEMM FLOPs
    b = float(ct["bwd"][0])
    assert 0 < 2 * w < per_mb
    assert float(zb.time["bubble"][0]) == pytest.approx((PP - 1) * (per_mb - 2 * w), rel=1e-9)
    assert float(dual.time["bubble"][0]) == pytest.approx((PP / 2 - 1) * (per_mb + b - 3 * w), rel=1e-9)
    # under full recompute F + B is ~4 forward GEMM passes and W one: ZB-H1 removes well under the 2/3 it removes
    # when F = B = W, and DualPipe's halved depth removes more
    assert float(dual.time["bubble"][0]) < float(zb.time["bubble"][0]) < 0.8 * float(one.time["bubble"][0])
    # the rest of the step is the same work
    assert float(zb.time["compute"][0]) == pytest.approx(float(one.time["compute"][0]))


def test_dualpipe_doubles_model_state_and_keeps_one_more_micro_batch() -> None:
    one, _, _ = _eval("1f1b")
    dual, _, _ = _eval("dualpipe")
    for k in ("params", "grads", "optimizer"):
        assert float(dual.memory[k][0]) == pytest.approx(2 * float(one.memory[k][0]))
    # full recompute: the stage's saved inputs scale with the micro-batches in flight (p + 1 against p); the one
    # re-materialised layer and the logits do not
    cm = CostModel(PROB, default_efficiency(PROB.chip), Options())
    g = cm.geometry(LAYOUT)
    per_layer = float(cm.activation_per_layer(LAYOUT, g, LAYOUT.recompute)[0])
    stage = float(g["layers_stage"][0]) * per_layer
    assert float(dual.memory["activations"][0] - one.memory["activations"][0]) == pytest.approx(stage, rel=1e-9)


def test_schedules_constrain_the_search() -> None:
    layouts, reasons = enumerate_layouts(PROB, Pins(tp=8), pp_schedule="dualpipe")
    assert set(layouts.vpp.tolist()) == {1}
    assert not ((layouts.pp > 1) & (layouts.pp % 2 == 1)).any()
    with pytest.raises(MeshplanError, match="has no virtual stages"):
        enumerate_layouts(PROB, Pins(tp=8, pp=8, vpp=2), pp_schedule="zb1p")
    odd = Problem(load_model("llama3-70b"), load_chip("h100-sxm"), 40, 4096, 40)
    with pytest.raises(MeshplanError, match="must be even"):
        enumerate_layouts(odd, Pins(tp=8, pp=5), pp_schedule="dualpipe")
    with pytest.raises(MeshplanError, match="unknown pipeline schedule"):
        enumerate_layouts(PROB, Pins(), pp_schedule="pipedream")
    best = plan(PROB, Pins(tp=8, pp=8), default_efficiency(PROB.chip), Options(pp_schedule="zb1p"), top=1)
    assert best.plans[0]["config"]["vpp"] == 1


def test_cli_pp_schedule(capsys) -> None:
    base = ["train", "--model", "llama3-70b", "--hardware", "h100-sxm", "--chips", "64", "--seq-len", "4096",
            "--global-batch", "256", "--tp", "8", "--pp", "8", "--top", "1"]
    rc, _, err = run_cli([*base, "--pp-schedule", "pipedream"], capsys)
    assert rc == 2 and "--pp-schedule must be one of 1f1b, zb1p, dualpipe, gpipe" in err
    rc, out, _ = run_cli([*base, "--pp-schedule", "gpipe"], capsys)
    assert rc == 0 and "GPipe (all-forward-all-backward) pipeline" in " ".join(out.split())
    rc, out, _ = run_cli([*base, "--pp-schedule", "dualpipe"], capsys)
    assert rc == 0 and "DualPipe pipeline" in " ".join(out.split())
