"""Model-state offload (issue #18): the optimizer (ZeRO-Offload, Ren et al. 2021, USENIX ATC) and the weights
(ZeRO-Infinity, Rajbhandari et al. 2021, SC) as searched dimensions, limited by the host link and host memory."""

from __future__ import annotations

import json

import pytest

from meshplan.cost.efficiency import resolve_efficiency
from meshplan.errors import InfeasibleError
from meshplan.math.transformer import param_counts
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel
from meshplan.train.evaluate import evaluate
from meshplan.train.planner import plan
from meshplan.train.space import Pins, Problem
from tests.conftest import run_cli

# A100 figures from the hardware YAML, restated by hand: PCIe Gen4 32 GB/s per direction (A100 datasheet); host DRAM
# 2 sockets x 204.8 GB/s (AMD EPYC 7742) / 8 GPUs = 51.2 GB/s per GPU (DGX A100)
PCIE_BYTES_PER_S = 32e9
HOST_DRAM_BYTES_PER_S = 2 * 204.8e9 / 8


def _one_chip(**flags):
    """llama3-8b on one a100-80gb, one 2048-token sequence, full recompute: every parameter is local (tp = pp = 1)."""
    chip = load_chip("a100-80gb")
    prob = Problem(load_model("llama3-8b"), chip, 1, 2048, 1)
    cm = CostModel(prob, resolve_efficiency(chip, None))
    cfgs = [ParallelConfig(recompute="full", **flags), ParallelConfig(recompute="full")]
    return evaluate(cm, LayoutArrays.from_configs(cfgs)), param_counts(prob.model).total


def test_optimizer_offload_moves_master_moments_and_gradients_to_host():
    """ZeRO-Offload §4.1 (Fig. 2): the fp32 master and Adam's two fp32 moments (4 + 8 = 12 B per parameter) leave
    the device, and so do the gradients (4 B, accumulated in fp32), copied out as the backward produces them: the
    device keeps one layer's bucket. The host holds 12 + 4 = 16 B per parameter. Per micro-batch 2 B per parameter go
    device→host (fp16 gradients), once a step 2 B come back (the updated fp16 weights), and the CPU's Adam streams
    30 B per parameter through host DRAM (read/write master, m, v: 24; gradient: 4; bf16 copy: 2)."""
    ev, n = _one_chip(offload_optimizer=1)
    layer = param_counts(load_model("llama3-8b")).per_layer
    mem = ev.memory  # layout 0 offloads, layout 1 does not
    assert mem["optimizer"][1] == pytest.approx(12 * n) and mem["optimizer"][0] == 0
    assert mem["grads"][1] == pytest.approx(4 * n) and mem["grads"][0] == pytest.approx(4 * layer)
    assert mem["total"][1] - mem["total"][0] == pytest.approx(12 * n + 4 * n - 4 * layer)  # HBM
    assert mem["host"][0] - mem["host"][1] == pytest.approx(16 * n)  # host
    led = ev.ledger.plan(0)["host_bytes"]
    assert led["device_to_host"] == pytest.approx(2 * n) and led["host_to_device"] == pytest.approx(2 * n)  # m = 1
    want_s = 2 * n / PCIE_BYTES_PER_S + 30 * n / HOST_DRAM_BYTES_PER_S  # 8.0e9 params: 0.5 s + 4.7 s
    assert ev.time["other/offload_optimizer"][0] == pytest.approx(want_s, rel=1e-9)
    assert ev.time["other/offload_optimizer"][1] == 0


def test_weight_offload_streams_every_layer_twice():
    """ZeRO-Infinity §5.1.1/§6.2: the weights live on the host (the device's 2 B bf16 copy moves there) and each layer
    is fetched before its forward and again before its backward; the device holds two layers (the one in use and the
    prefetched next). One 2,048-token sequence computes for far less than the 16 GB fetch takes on PCIe (0.5 s), so
    the step grows by the two fetches less the forward and backward compute they hide behind."""
    ev, n = _one_chip(offload_params=1)
    mem = ev.memory  # layout 0 offloads, layout 1 does not
    cfg = load_model("llama3-8b")
    layer = param_counts(cfg).per_layer
    assert mem["params"][1] == pytest.approx(2 * n) and mem["params"][0] == 0
    assert mem["other"][0] - mem["other"][1] == pytest.approx(2 * 2 * layer)  # two bf16 layers on the device
    assert mem["host"][0] - mem["host"][1] == pytest.approx(2 * n)
    assert ev.ledger.plan(0)["host_bytes"]["host_to_device"] == pytest.approx(2 * 2 * n)  # forward + backward
    fetch_s = 2 * n / PCIE_BYTES_PER_S
    compute_s = ev.time["compute"][1]  # forward + backward (+ recompute) of the one micro-batch, no collectives
    assert ev.time["other/offload"][0] == pytest.approx(2 * fetch_s - compute_s, rel=1e-9)
    assert ev.step_time_s[0] - ev.step_time_s[1] == pytest.approx(2 * fetch_s - compute_s, rel=1e-9)


def test_gpt3_175b_on_64_a100_40gb_fits_only_with_state_offload():
    """Issue #18: GPT-3 175B on 64 A100s. Its weights, gradients and Adam state take 16 B x 175e9 / 64 = 43.8 GB per
    chip even fully sharded, over the 40 GB A100's 38 GiB budget: no layout fit before. With the optimizer state and
    gradients on the host (ZeRO-Offload) plans fit; the host holds what moved within the DGX A100's 125 GB per GPU.
    (On a100-80gb layouts fit without offload.)"""
    chip = load_chip("a100-40gb")
    prob = Problem(load_model("gpt3-175b"), chip, 64, 2048, 1536)
    eff = resolve_efficiency(chip, None)
    with pytest.raises(InfeasibleError):
        plan(prob, Pins(offload_optimizer=0, offload_params=0), eff, top=1)
    best = plan(prob, Pins(), eff, top=1).plans[0]
    cfg = best["config"]
    assert cfg["offload_optimizer"] or cfg["offload_params"]
    assert best["memory_bytes_per_chip"]["total"] <= chip.usable_hbm_bytes
    assert 0 < best["ledger"]["host_bytes"]["memory"] <= chip.host_memory_bytes


def test_host_memory_bounds_state_offload():
    """The same case with 10 GB of host memory per chip: the offloaded state (≥ 12 B x 175e9 / 64 = 33 GB) cannot
    live there, so nothing fits, and the search says so in one error rather than failing on a candidate."""
    chip = load_chip("a100-40gb").with_overrides(host_memory_bytes=10e9)
    prob = Problem(load_model("gpt3-175b"), chip, 64, 2048, 1536)
    with pytest.raises(InfeasibleError):
        plan(prob, Pins(), resolve_efficiency(chip, None), top=1)


def test_offload_flags_cli(capsys):
    base = ["train", "-m", "llama3-8b", "--hardware", "a100-80gb", "--chips", "8", "--seq-len", "2048",
            "--global-batch", "64", "--fsdp", "8", "--microbatch", "1", "--recompute", "full", "--zero", "0"]
    code, out, err = run_cli(base + ["--offload-optimizer", "1", "--offload-params", "1", "--json"], capsys)
    assert code == 0, err
    p = json.loads(out)["plans"][0]
    assert p["config"]["offload_optimizer"] == 1 and p["config"]["offload_params"] == 1
    assert p["ledger"]["host_bytes"]["host_to_device"] > 0
    code, _, err = run_cli(base + ["--offload-optimizer", "2"], capsys)
    assert code == 2 and err.startswith("error:") and err.count("\n") == 1
    # a TPU hardware file has no host DRAM bandwidth figure to time the CPU's Adam: refused when pinned
    tpu = ["train", "-m", "llama3-8b", "--hardware", "tpu-v5e", "--chips", "8", "--seq-len", "2048",
           "--global-batch", "64", "--offload-optimizer", "1"]
    code, _, err = run_cli(tpu, capsys)
    assert code == 2 and "host_memory_bandwidth_bytes_per_s" in err


def test_delayed_update_hides_the_host_step_behind_the_next_compute():
    """ZeRO-Offload §4.2 (one-step delayed parameter update), only when asked: the host's part of step i runs beside
    step i+1's forward and backward, so the step pays only what exceeds them. One 2,048-token sequence of llama3-8b
    computes for far less than the host's 5.2 s (test above), so the excess is that time less the compute."""
    from dataclasses import replace

    ev, n = _one_chip(offload_optimizer=1)
    host_s = 2 * n / PCIE_BYTES_PER_S + 30 * n / HOST_DRAM_BYTES_PER_S
    cm = CostModel(Problem(load_model("llama3-8b"), load_chip("a100-80gb"), 1, 2048, 1),
                   resolve_efficiency(load_chip("a100-80gb"), None))
    cm.opt = replace(cm.opt, offload_delayed_update=True)
    delayed = evaluate(cm, ev.layouts)
    # one micro-batch, no collectives: compute is its forward + backward (+ recompute)
    assert delayed.time["other/offload_optimizer"][0] == pytest.approx(host_s - delayed.time["compute"][0], rel=1e-9)
    assert delayed.step_time_s[1] == pytest.approx(ev.step_time_s[1], rel=1e-12)  # no offload: unchanged


def test_13b_on_one_v100_fits_only_with_optimizer_offload():
    """ZeRO-Offload's headline (Ren et al. 2021, abstract and §6: a 13B model on a single 32 GB V100 of a DGX-2, the
    one job holding the node's 1.5 TB of host memory): llama2-13b's 16 B per parameter of model state (208 GB) does
    not fit 32 GB; with the optimizer and gradients on the host the device keeps the 2 B weights (26 GB). With the
    catalog's 1/16 share of host memory per GPU (94 GB) the offloaded state does not fit the host either: one error."""
    v100 = load_chip("v100-32gb")
    whole_node = v100.with_overrides(host_memory_bytes=1.5e12)
    eff = resolve_efficiency(v100, None)

    def best(chip, pins):
        return plan(Problem(load_model("llama2-13b"), chip, 1, 1024, 8), pins, eff, top=1).plans[0]

    with pytest.raises(InfeasibleError):
        best(whole_node, Pins(offload_optimizer=0, offload_params=0))
    assert best(whole_node, Pins())["config"]["offload_optimizer"] == 1
    with pytest.raises(InfeasibleError, match="host memory"):
        best(v100, Pins())


def test_activation_offload_keeps_the_rematerialised_layer_on_the_device():
    """Full recompute with every saved activation offloaded (offload 1.0) on a GPU: the device still holds the one
    layer the backward rematerialises (its no-recompute activations) and the loss buffer; the host gets the saved
    layer inputs only. Expected values by hand from the per-layer activation formula (Korthikanti et al. 2022) and
    Megatron's fused cross-entropy (bf16 logits + fp32 softmax: 6 B per logit), llama3-8b, T = 2048, one sequence."""
    from meshplan.math.transformer import activation_bytes_per_layer

    ev, _ = _one_chip(offload=1.0)
    m = load_model("llama3-8b")
    working = activation_bytes_per_layer(m, 2048, 1, "none")["total"]
    full_layer = activation_bytes_per_layer(m, 2048, 1, "full")["total"]  # the saved layer input, 2·T·D bytes
    assert full_layer == pytest.approx(2 * 2048 * 4096)
    logits = 6 * 2048 * 128256
    assert ev.memory["activations"][0] == pytest.approx(working + logits, rel=1e-6)
    assert ev.memory["offloaded"][0] == pytest.approx(32 * full_layer, rel=1e-6)
    # without offload the 32 saved inputs stay too
    assert ev.memory["activations"][1] == pytest.approx(32 * full_layer + working + logits, rel=1e-6)


def test_searched_count_does_not_depend_on_top(capsys, monkeypatch):
    # offload variants slower than the top-th plan are skipped unevaluated, but still counted as searched: the count is
    # the unpruned search's (QA session 21: 152,444 layouts at --top 1, 152,631 at --top 20)
    import meshplan.train.planner as planner

    args = ["train", "--model", "llama3-70b", "--hardware", "tpu-v5e", "--chips", "256", "--seq-len", "8192",
            "--global-batch", "256", "--json", "--top"]
    counts = []
    for top in ("1", "20"):
        code, out, _ = run_cli([*args, top], capsys)
        assert code == 0
        d = json.loads(out)
        counts.append((d["searched"], d["feasible"]))
    unpruned = planner._with_state_offload
    monkeypatch.setattr(planner, "_with_state_offload",
                        lambda problem, pins, cm, ev, free, top=None, keep_ledger=True: unpruned(problem, pins, cm, ev, free, None, keep_ledger))
    code, out, _ = run_cli([*args, "1"], capsys)
    assert code == 0
    d = json.loads(out)
    # searched and feasible alike: the untimed variants that fit are counted from their memory (session 23: feasible
    # had differed with --top)
    assert counts[0] == counts[1] == (d["searched"], d["feasible"])
    assert d["evaluated"] == d["searched"]  # nothing left untimed here
