"""Issue #14, gpt-oss: the architecture the cost model had treated as a plain MoE. Head dim 64 attention at the
published cuDNN rate (FlashAttention-3 paper Fig. 5), Megatron-Core's unfused expert/attention bias adds
(megatron/core/transformer/moe/experts.py `_apply_bias`), and the benchmark harness reading the sliding windows,
sinks and biases from the catalog config. Every expected value is worked by hand in the comments."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from meshplan.cost.efficiency import attention_head_dim_rate, attention_tile_factor, default_efficiency
from meshplan.math import transformer as tm
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.frameworks import FRAMEWORKS
from meshplan.train.space import Problem

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _cm(model, hardware: str, chips: int, ep: int, mb: int, opts: Options, seq: int = 4096):
    prob = Problem(model, load_chip(hardware), chips, seq, chips * mb)
    cm = CostModel(prob, default_efficiency(prob.chip), opts)
    L = LayoutArrays.from_configs([ParallelConfig(dp=chips, ep=ep, microbatch=mb, recompute="none")])
    return cm, cm.geometry(L)


def _first(x) -> float:
    return float(np.asarray(x, dtype=float).ravel()[0])


def test_attention_rate_by_head_dim() -> None:
    h100 = load_chip("h100-sxm")
    # FA3 paper Figs. 5-6, H100, no causal mask, 4k: cuDNN forward 408 TFLOP/s at head dim 64 against 609 at 128
    # -> 0.670, backward 417 / 499 -> 0.836; FA2 forward 321 / 368 -> 0.872, backward 279 / 310 -> 0.900
    assert attention_head_dim_rate(h100, 64) == pytest.approx(0.670)
    assert attention_head_dim_rate(h100, 64, "fused", "bwd") == pytest.approx(0.836)
    assert attention_head_dim_rate(h100, 64, "fa2") == pytest.approx(0.872)
    assert attention_head_dim_rate(h100, 64, "fa2", "bwd") == pytest.approx(0.900)
    # linear between the points: 96 is half-way, (0.670 + 1) / 2 = 0.835; 1 at and above 128; the 64 rate below it
    assert attention_head_dim_rate(h100, 96) == pytest.approx(0.835)
    assert attention_head_dim_rate(h100, 128) == 1.0
    assert attention_head_dim_rate(h100, 256) == 1.0
    assert attention_head_dim_rate(h100, 32) == pytest.approx(0.670)
    assert attention_head_dim_rate(h100, 64, "sdpa") == 1.0  # no published points for that kernel
    assert attention_head_dim_rate(load_chip("tpu-v5p"), 64) == 1.0  # TPUs: the MXU fill instead


def test_the_fused_forward_rate_point_only_without_a_tile_constant() -> None:
    """gpt-oss (head dim 64) forward on cuDNN: on H100 (tile constant 3.15) the tile factor takes the width and the
    rate point is not applied; on A100 (no tile constant) the forward runs at 0.670 of the head-dim-128 fraction."""
    m = load_model("gpt-oss-120b")
    for chip, rate in (("h100-sxm", 1.0), ("a100-80gb", 0.670)):
        cm, g = _cm(m, chip, 8, ep=8, mb=1, opts=Options())
        core = cm._attention_core_term(g)
        eff = cm.eff
        per_flop = _first(core["f_s"]) / _first(core["flops_f"])
        keys, diag = tm.mean_attended_keys(m, 4096), tm.masked_tile_share(m, 4096)
        factor = attention_tile_factor(eff, "fwd", keys, diag, width=128)
        assert per_flop == pytest.approx(factor / (cm.p.chip.peak("bf16") * eff.attention_fwd_fraction * rate),
                                         rel=1e-9)


def test_gptoss_attention_core_time() -> None:
    """gpt-oss-120b (N 64 heads, head dim 64, alternating 128-token windows) at 4096 tokens, one sequence on H100:
    mean attended keys over the two layer kinds = (S/2 + (w - w²/(2S))) / 2 = (2048 + 128 - 2) / 2 = 1087;
    forward FLOPs 2·4096·1087·64·(64 + 64) = 7.2947e10; at 989e12 · 0.62 (h100 fused fwd): 7.2947e10 / 6.1318e14 =
    0.11897 ms. Backward 2.5× the FLOPs (attention_bwd_flops_ratio) at 989e12 · 0.48 · 0.836 (head dim 64):
    1.8237e11 / 3.9686e14 = 0.45953 ms. Times cuDNN's tile factor (efficiency.attention_tile_factor, H100 k = 3.15
    forward, 5.00 backward): masked tiles (1/2 full + 1 windowed) / 2 = 0.75 per query tile; the forward's fixed work
    a fixed time, k·256/128 = 6.30 visits of these 64 + 64-wide tiles, so forward (1 + 7.05·128/1087) /
    (1 + 3.65·128/4096) = 1.83017 / 1.11406 = 1.64280 -> 0.19544 ms; backward (1 + 5.75·128/1087) /
    (1 + 5.50·128/4096) = 1.67709 / 1.17188 = 1.43112 -> 0.65763 ms."""
    cm, g = _cm(load_model("gpt-oss-120b"), "h100-sxm", 8, ep=8, mb=1, opts=Options())
    f_core = 2 * 4096 * 1087 * 64 * 128
    core = cm._attention_core_term(g)
    assert _first(core["flops_f"]) == pytest.approx(f_core)
    assert f_core / (989e12 * 0.62) == pytest.approx(0.11897e-3, rel=1e-4)
    assert 2.5 * f_core / (989e12 * 0.48 * 0.836) == pytest.approx(0.45953e-3, rel=1e-4)
    assert _first(core["f_s"]) == pytest.approx(0.19544e-3, rel=1e-4)
    assert _first(core["b_s"]) == pytest.approx(0.65763e-3, rel=1e-4)


def test_unfused_expert_bias_bytes() -> None:
    """gpt-oss-120b, micro-batch 4 of 4096 tokens (t = 16384), D 2880, top-4. Per routed copy and element, under
    HybridEP (fp32 probabilities, P = 4, A = 2): b·p writes 4, the add reads 2 + 4 and writes 4, cat reads and
    writes 4, the cast reads 4 and writes 2: 28 B; four copies, plus the attention bias add (read and write D in
    bf16, 4 B): 16384·2880·(4·28 + 4) = 5.4736e9 B forward. Backward: two casts 2·6, the split's cat 4, b's and p's
    gradients 12 each = 40 B a copy, plus the attention bias gradient's read (2 B): 16384·2880·(4·40 + 2) = 7.6441e9.
    With NCCL's all-to-all the probabilities stay bf16 (P = A = 2, no casts): forward 2 + 6 + 4 = 12 B a copy,
    16384·2880·(4·12 + 4) = 2.4536e9; backward 4 + 6 + 6 = 16 B a copy, 16384·2880·(4·16 + 2) = 3.1142e9."""
    on = Options(unfused_expert_bias=True, moe_dispatcher="hybridep")
    cm, g = _cm(load_model("gpt-oss-120b"), "gb200-nvl72", 64, ep=64, mb=4, opts=on)
    fwd, bwd = (_first(x) for x in cm._expert_bias_bytes(g))
    assert (fwd, bwd) == (pytest.approx(16384 * 2880 * 116), pytest.approx(16384 * 2880 * 162))
    assert 16384 * 2880 * 116 == pytest.approx(5.4736e9, rel=1e-4)
    assert 16384 * 2880 * 162 == pytest.approx(7.6441e9, rel=1e-4)
    # the pointwise term carries them: backward = 2 × the rest of the forward bytes + the bias backward (and the
    # clamp's, _glu_clamp_bytes, counted the same way)
    elem = cm._pointwise_term(g)
    clamp_f, clamp_b = (_first(x) for x in cm._glu_clamp_bytes(g))
    rest = _first(elem["hbm"]) - fwd - clamp_f
    assert _first(elem["hbm_b"]) == pytest.approx(2 * rest + bwd + clamp_b)
    cm, g = _cm(load_model("gpt-oss-120b"), "gb200-nvl72", 64, ep=64, mb=4,
                opts=replace(on, moe_dispatcher="alltoall"))
    fwd, bwd = (_first(x) for x in cm._expert_bias_bytes(g))
    assert (fwd, bwd) == (pytest.approx(16384 * 2880 * 52), pytest.approx(16384 * 2880 * 66))
    # launches: 128/64 = 2 local experts × (2 GEMMs + b·p and the add) + cat + cast (fp32 probabilities) = 10, and
    # the GLU clamp's two clamps and cat (_glu_clamp_bytes): 13
    cm, g = _cm(load_model("gpt-oss-120b"), "gb200-nvl72", 64, ep=64, mb=4, opts=on)
    assert _first(cm.layer_kernels_fwd(g)["moe"]) == pytest.approx(2 * (2 + 2) + 2 + 3)
    # off: not a Megatron-Core run, or a model without linear biases (Qwen3-30B-A3B)
    cm, g = _cm(load_model("gpt-oss-120b"), "gb200-nvl72", 64, ep=64, mb=4, opts=Options(moe_dispatcher="hybridep"))
    assert cm._expert_bias_bytes(g) == (0.0, 0.0)
    cm, g = _cm(load_model("qwen3-30b-a3b"), "gb200-nvl72", 64, ep=64, mb=4, opts=on)
    assert cm._expert_bias_bytes(g) == (0.0, 0.0)
    assert FRAMEWORKS["nemo"]["unfused_expert_bias"] and FRAMEWORKS["megatron"]["unfused_expert_bias"]


def test_glu_clamp_outside_the_fused_activation() -> None:
    """gpt-oss clamps its GLU (config.json swiglu_limit 7.0); Megatron-Core's eager TEGroupedMLP does it outside the
    fused activation (fused_bias_geglu.weighted_bias_quick_geglu_impl: two clamps and a cat). gpt-oss-120b, micro-batch
    4 of 4096 tokens (t = 16384), top-4, expert width F 2880, bf16 (2 B): per routed copy the clamps read and write F
    each and the cat reads and writes 2F, 8F elements forward: 16384·4·2880·8·2 = 3.0199e9 B; backward the two clamp
    gradients (read gradient and input, write: 3F each) and chunk's gradient cat (read and write 2F), 10F:
    16384·4·2880·10·2 = 3.7749e9 B."""
    assert load_model("gpt-oss-120b").glu_limit == 7.0 and load_model("qwen3-30b-a3b").glu_limit == 0.0
    on = Options(unfused_expert_bias=True, moe_dispatcher="hybridep")
    cm, g = _cm(load_model("gpt-oss-120b"), "gb200-nvl72", 64, ep=64, mb=4, opts=on)
    fwd, bwd = (_first(x) for x in cm._glu_clamp_bytes(g))
    assert fwd == pytest.approx(16384 * 4 * 2880 * 8 * 2) and fwd == pytest.approx(3.0199e9, rel=1e-4)
    assert bwd == pytest.approx(16384 * 4 * 2880 * 10 * 2) and bwd == pytest.approx(3.7749e9, rel=1e-4)
    # a pointwise-only recompute (gemm-last, Megatron's moe_act module) reruns the forward clamps with the rest
    L = LayoutArrays.from_configs([ParallelConfig(dp=64, ep=64, microbatch=4, recompute="gemm-last")])
    g2 = cm.geometry(L)
    with_clamp = _first(cm.compute_terms(L, g2)["layer_recompute"])
    off = CostModel(cm.p, cm.eff, replace(on, unfused_expert_bias=False))
    bias_f = _first(cm._expert_bias_bytes(g2)[0])
    # the flag also removes the bias adds; both are pointwise forward bytes, rerun by gemm-last's elem share (1.0);
    # their launches sit in the "moe" scope (the grouped GEMM's term), which gemm-last does not rerun
    from meshplan.train.costmodel import RECOMPUTE_PARTS
    share = RECOMPUTE_PARTS["gemm-last"]["elem"]
    assert with_clamp - _first(off.compute_terms(L, off.geometry(L))["layer_recompute"]) == pytest.approx(
        share * (fwd + bias_f) / cm.hbm, rel=1e-6)
    # off: Transformer Engine's op fuser (Options.unfused_expert_bias False), or a model without the clamp
    assert CostModel(cm.p, cm.eff, replace(on, unfused_expert_bias=False))._glu_clamp_bytes(g) == (0.0, 0.0)
    cm, g = _cm(load_model("qwen3-30b-a3b"), "gb200-nvl72", 64, ep=64, mb=4, opts=on)
    assert cm._glu_clamp_bytes(g) == (0.0, 0.0)


def test_benchmark_model_reads_catalog_architecture() -> None:
    """A measurement entry's model block has no field for windows, sinks or biases; the harness takes them from the
    catalog config of the same name when every size agrees, and leaves a differently sized model alone."""
    from _measurements import model_of

    block = dict(name="gpt-oss-120b", layers=36, d_model=2880, heads=64, kv_heads=8, head_dim=64, ffn=2880,
                 ffn_act="swiglu", vocab=201088, seq_len=4096,
                 moe=dict(num_local_experts=128, num_experts_per_tok=4, intermediate_size=2880))
    entry = {"id": "x", "model": block, "training": {"seq_len": 4096}}
    m = model_of(entry)
    assert m.layer_windows[:4] == (128, 0, 128, 0) and len(m.layer_windows) == 36
    assert m.attention_sinks and m.linear_bias and m.router_bias
    other = model_of({"id": "y", "model": dict(block, layers=24), "training": {"seq_len": 4096}})
    assert other.layer_windows == () and not other.linear_bias
