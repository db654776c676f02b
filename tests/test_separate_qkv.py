"""torchtitan's separate wq/wk/wv GEMMs (Options.separate_qkv): the same FLOPs as one fused QKV GEMM, each GEMM timed
at its own width, checked against a hand sum of the efficiency model (Efficiency.matmul: peak fraction times
d/(d + d_half) at the smallest dimension)."""

from __future__ import annotations

import pytest

from meshplan.cost.efficiency import default_efficiency
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.frameworks import preset
from meshplan.train.space import Problem

CHIP = load_chip("h100-sxm")
D, N, K, H = 4096, 32, 8, 128  # Llama 3 8B
T = 2 * 8192  # rows of one micro-batch (two sequences of 8192)


def gemm_s(n: float, k: float = D) -> float:
    """2·T·k·n FLOPs at p·d/(d + d_half), d the smallest dimension (Efficiency.matmul by hand)."""
    eff = default_efficiency(CHIP)
    d = min(T, n, k)
    return 2 * T * k * n / (CHIP.peak("bf16") * eff.matmul_peak_fraction * d / (d + eff.matmul_half_dim))


def _projections(separate: bool, tp: int, mb: int = 2, seq: int = 8192) -> tuple[float, float]:
    prob = Problem(load_model("llama3-8b"), CHIP, 8 * tp, seq, 8 * mb)
    cm = CostModel(prob, default_efficiency(CHIP), Options(separate_qkv=separate))
    L = LayoutArrays.from_configs([ParallelConfig(fsdp=8, tp=tp, microbatch=mb, recompute="none")])
    g = cm.geometry(L)
    s, f = cm._attention_projections(g["t_mb"], g["tp"])
    return float(s[0] if hasattr(s, "__len__") else s), float(f[0] if hasattr(f, "__len__") else f)


def test_separate_qkv_times_each_gemm_at_its_width() -> None:
    tp = 8
    out_s = gemm_s(D, N * H / tp)  # the output projection, unchanged
    fused_s, fused_f = _projections(False, tp)
    sep_s, sep_f = _projections(True, tp)
    assert sep_f == fused_f == pytest.approx(2 * T * D * (N + 2 * K) * H / tp + 2 * T * D * N * H / tp)
    assert fused_s == pytest.approx(gemm_s((N + 2 * K) * H / tp) + out_s, rel=1e-9)
    # Q 512 wide, K and V 128 wide each at TP 8
    assert sep_s == pytest.approx(gemm_s(N * H / tp) + 2 * gemm_s(K * H / tp) + out_s, rel=1e-9)
    assert sep_s > fused_s


def test_kv_heads_replicated_past_tp() -> None:
    """At TP 16 (> 8 KV heads) each rank keeps one whole KV head (H wide) for K and for V: the widths follow
    _qkv_width, as the fused GEMM's do."""
    sep_s, _ = _projections(True, 16)
    assert sep_s == pytest.approx(gemm_s(N * H / 16) + 2 * gemm_s(H) + gemm_s(D, N * H / 16), rel=1e-9)


def test_torchtitan_preset_has_separate_projections_megatron_not() -> None:
    assert preset("torchtitan")["separate_qkv"] is True
    for version in ("2024.12", "2025.06", "2025.10", "2026.02"):
        assert preset(f"torchtitan@{version}")["separate_qkv"] is True
    assert "separate_qkv" not in preset("megatron") and Options().separate_qkv is False
