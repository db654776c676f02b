"""Multi-head latent attention (DeepSeek-V2 §2.1, arXiv:2405.04434) and DeepSeek-V3's layout of dense and MoE
layers: parameters, KV cache, attention FLOPs, and the planners, against published figures and hand sums."""

from __future__ import annotations

import pytest

from meshplan.cost.efficiency import default_efficiency
from meshplan.errors import MeshplanError
from meshplan.infer.config import ServeConfig
from meshplan.infer.memory import kv_bytes_per_token_per_chip
from meshplan.math.transformer import attention_flops_per_token, kv_cache_bytes_per_token, param_counts
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.planner import plan
from meshplan.train.space import Pins, Problem

V3 = load_model("deepseek-v3")


def test_deepseek_v3_parameters_match_the_report() -> None:
    """DeepSeek-V3 report §4.2: 671B total, 37B activated per token (the MTP module aside)."""
    pc = param_counts(V3)
    assert pc.total == pytest.approx(671e9, rel=0.005)
    assert pc.active == pytest.approx(37e9, rel=0.02)


def test_deepseek_v2_parameters_match_the_report() -> None:
    """DeepSeek-V2 report §3.1.1: 236B total, 21B activated per token; its KV cache is (512 + 64) latent values per
    layer, 60 layers."""
    v2 = load_model("deepseek-v2")
    pc = param_counts(v2)
    assert pc.total == pytest.approx(236e9, rel=0.005)
    assert pc.active == pytest.approx(21e9, rel=0.03)
    assert kv_cache_bytes_per_token(v2, "bf16") == (512 + 64) * 60 * 2


def test_mla_attention_weights_by_hand() -> None:
    """D = 7168, 128 heads, q latent 1536, kv latent 512, RoPE 64, head 128, value 128: W_DQ + W_UQ + W_DKV(+W_KR)
    + W_UK + W_UV + W_O, plus the two latent RMSNorms."""
    D, N = 7168, 128
    hand = (D * 1536 + 1536 * N * (128 + 64) + D * (512 + 64) + 512 * N * (128 + 128) + N * 128 * D
            + 1536 + 512)
    assert param_counts(V3).per_layer_attention == hand


def test_mla_kv_cache_is_the_latent() -> None:
    """DeepSeek-V2 §2.1.2: (d_c + d_h^R)·l elements per token: (512 + 64)·61 in bf16 = 70,272 bytes, against
    2·128·128·61 elements for the same heads without the latent."""
    assert kv_cache_bytes_per_token(V3, "bf16") == (512 + 64) * 61 * 2
    # every TP chip needs the whole latent (it is shared by the heads)
    assert kv_bytes_per_token_per_chip(V3, ServeConfig(tp=8)) == (512 + 64) * 61 * 2


def test_mla_training_attention_flops() -> None:
    """K and V are up-projected in training: QKᵀ over 128 + 64 and AV over 128 per head, causal."""
    S = 4096
    assert attention_flops_per_token(V3, S) == pytest.approx(2 * (S / 2) * 128 * (192 + 128) * 61)


def test_deepseek_v3_plans_on_h800() -> None:
    """The published layout (EP64 × PP16 × ZeRO-1 DP over 2048 H800, book ch.12) plans without error, and its
    MFU is a fraction."""
    prob = Problem(V3, load_chip("h800"), 2048, 4096, 15360)
    pins = Pins(dp=128, fsdp=1, tp=1, pp=16, cp=1, ep=64, zero=1)
    best = plan(prob, pins, default_efficiency(prob.chip), top=1).plans[0]
    assert 0 < best["mfu"] < 1 and best["fits"]


def test_verify_refuses_mla_clearly() -> None:
    from meshplan.measure.verify import tiny_model

    with pytest.raises(MeshplanError, match="MLA"):
        tiny_model(V3)


def test_node_limited_routing_halves_the_cross_node_all_to_all() -> None:
    """DeepSeek-V3 §3.2.2: with k = 8 experts per token and at most M = 4 nodes, 4 copies of each token cross
    the network instead of 8 (the bandwidth term halves; the per-hop latency stays)."""
    from meshplan.train.costmodel import Options
    from meshplan.train.planner import search

    prob = Problem(V3, load_chip("h800"), 2048, 4096, 15360)
    pins = Pins(dp=128, fsdp=1, tp=1, pp=16, cp=1, ep=64, zero=1, vpp=1, microbatch=1, recompute="full",
                offload=0.0)
    eff = default_efficiency(prob.chip)
    plain, _, _ = search(prob, pins, eff, Options(headroom=-10))
    limited, _, _ = search(prob, pins, eff, Options(headroom=-10, moe_node_limit=4))
    ratio = float(limited.link_time["ep"][0]) / float(plain.link_time["ep"][0])
    assert ratio == pytest.approx(0.5, rel=0.02)


def test_implausibly_large_latent_rank_is_a_clear_error() -> None:
    """A kv_lora_rank past 2**53 overflowed the FLOP sums (found by the loader fuzz test); it is refused."""
    from meshplan.errors import MeshplanError
    from meshplan.specs.model import model_from_hf

    cfg = {"model_type": "deepseek_v3", "hidden_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 16,
           "intermediate_size": 8192, "vocab_size": 1000, "kv_lora_rank": 2**60, "qk_rope_head_dim": 64,
           "qk_nope_head_dim": 128, "v_head_dim": 128}
    with pytest.raises(MeshplanError, match="kv_lora_rank is implausibly large"):
        model_from_hf(cfg, "big", "test")
