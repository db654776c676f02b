"""Which fused attention kernel runs (`Options.attention_kernel`): FlashAttention-2 as PyTorch SDPA runs it
(torchtitan) against the chip's best fused kernel, checked against hand sums and the cited measurements."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from meshplan.cost.efficiency import default_efficiency
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.frameworks import framework_options
from meshplan.train.space import Problem

SEQ, LAYERS, N_HEADS, HEAD_DIM = 8192, 32, 32, 128  # Llama 3 8B


def _core(kernel: str, chip: str = "h100-sxm"):
    prob = Problem(load_model("llama3-8b"), load_chip(chip), 8, SEQ, 8)
    eff = default_efficiency(prob.chip)
    cm = CostModel(prob, eff, Options(attention_kernel=kernel))
    L = LayoutArrays.from_configs([ParallelConfig(fsdp=8, microbatch=1, recompute="none")])
    ct = cm.compute_terms(L, cm.geometry(L))
    return float(ct["layer_core_fwd"][0]), float(ct["layer_core_bwd"][0]), prob


def test_fa2_fractions_follow_the_cited_measurements() -> None:
    """h100-sxm: PyTorch SDPA's flash kernel ~310 TFLOP/s non-causal forward (pytorch/benchmark#2296: 287-304;
    pytorch/pytorch#142132: 329), times FA2's causal/non-causal ratio 335/370 (FA3 paper Fig. 5); backward FA2's
    322 TFLOP/s (Fig. 6) times the same two ratios. The 500 W part scales both by its GEMM cap, 0.68/0.75."""
    peak = load_chip("h100-sxm").peak("bf16")
    fwd = 310e12 * 335 / 370 / peak
    bwd = 322e12 * (310 / 370) * (335 / 370) / peak
    e = default_efficiency(load_chip("h100-sxm"))
    assert e.attention_fa2_fwd_fraction == pytest.approx(fwd, abs=0.01)
    assert e.attention_fa2_bwd_fraction == pytest.approx(bwd, abs=0.01)
    capped = default_efficiency(load_chip("h100-sxm-96gb"))
    assert capped.attention_fa2_fwd_fraction == pytest.approx(fwd * 0.68 / 0.75, abs=0.01)
    assert capped.attention_fa2_bwd_fraction == pytest.approx(bwd * 0.68 / 0.75, abs=0.01)
    # FA2 is about half FA3/cuDNN on Hopper (huggingface/transformers#48163: cuDNN 1.7-2.3x SDPA's default)
    assert 1.7 <= e.attention_fwd_fraction / e.attention_fa2_fwd_fraction <= 2.3
    # on Ampere FA2 is the best fused kernel: nothing changes
    a100 = default_efficiency(load_chip("a100-80gb"))
    assert a100.attention_fa2_fwd_fraction == a100.attention_fwd_fraction
    assert a100.attention_fa2_bwd_fraction == a100.attention_bwd_fraction


def test_fa2_attention_core_by_hand() -> None:
    """One layer's causal attention core at mb 1: 4·t·(S/2)·N·H FLOPs (book ch.4) at the FA2 fractions, the
    backward 2.5x (Dao 2023)."""
    fwd_s, bwd_s, prob = _core("fa2")
    e = default_efficiency(prob.chip)
    flops = 2 * SEQ * (SEQ / 2) * N_HEADS * 2 * HEAD_DIM
    peak = prob.chip.peak("bf16")
    assert fwd_s == pytest.approx(flops / (peak * e.attention_fa2_fwd_fraction), rel=1e-9)
    assert bwd_s == pytest.approx(2.5 * flops / (peak * e.attention_fa2_bwd_fraction), rel=1e-9)
    fused_f, fused_b, _ = _core("fused")
    assert fused_f == pytest.approx(flops / (peak * e.attention_fwd_fraction), rel=1e-9)
    assert fwd_s / fused_f == pytest.approx(e.attention_fwd_fraction / e.attention_fa2_fwd_fraction, rel=1e-9)


def test_torchtitan_runs_fa2_and_a_flag_overrides_it() -> None:
    assert framework_options("torchtitan", Options(), {}).attention_kernel == "fa2"
    assert framework_options("megatron", Options(), {}).attention_kernel == "fused"
    assert framework_options("torchtitan", Options(), {"attention_kernel": "fused"}).attention_kernel == "fused"


def test_cli_attention_kernel_flag(capsys) -> None:
    base = ["train", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len", "8192",
            "--global-batch", "64", "--json"]
    code, _, err = run_cli([*base, "--attention-kernel", "fa4"], capsys)
    assert code == 2 and "--attention-kernel must be fused or fa2, got 'fa4'" in err
    code, out, _ = run_cli(base, capsys)
    fused = json.loads(out)["plans"][0]["step_time_s"]
    code, out, _ = run_cli([*base, "--attention-kernel", "fa2"], capsys)
    fa2 = json.loads(out)["plans"][0]["step_time_s"]
    assert code == 0 and fa2 > fused  # the same layouts with a slower kernel can only be slower
