"""Megatron-Core's selective recompute of the MLA up-projections (`--recompute mla-up-proj`, recompute_modules
["mla_up_proj"]: multi_latent_attention.py runs the query/key-value up-projections and their RoPE under
CheckpointWithoutOutput and frees query, key and value after the attention core) and the mean layer's weights of a
model with leading dense layers (DeepSeek-V3), each against a hand calculation from the architecture's numbers."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import run_cli

from meshplan.cost.efficiency import default_efficiency
from meshplan.errors import MeshplanError
from meshplan.export import megatron as megatron_export
from meshplan.export import nemo as nemo_export
from meshplan.export.common import PlanToExport
from meshplan.math.transformer import activation_bytes_per_layer, recompute_flops_per_token
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import ModelConfig, load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.evaluate import evaluate
from meshplan.train.frameworks import framework_options
from meshplan.train.planner import plan
from meshplan.train.space import Pins, Problem

V3 = load_model("deepseek-v3")
# DeepSeek-V3 config.json: 128 heads, qk_nope 128 + RoPE 64, v 128, q_lora_rank 1536, kv_lora_rank 512
N, QK, R, V, QL, KVL = 128, 192, 64, 128, 1536, 512
# a small MLA MoE with a leading dense layer (the DeepSeek layout), for ledgers evaluated in milliseconds
TINY_MLA = ModelConfig(name="tiny-mla", n_layers=4, d_model=256, n_heads=4, n_kv_heads=4, head_dim=32, d_ff=128,
                       vocab_size=512, n_experts=8, experts_per_token=2, n_shared_experts=1, kv_lora_rank=64,
                       q_lora_rank=96, qk_rope_head_dim=16, v_head_dim=32, first_dense_layers=1, dense_d_ff=512)
CHIP = load_chip("h100-sxm")


def test_mla_up_proj_frees_query_key_value_and_keeps_the_latents() -> None:
    """One layer, 4096 tokens, bf16, TP 1: none saves query (N·192), key (N·192), value (N·128), the up-projections'
    inputs (the normed latents, 1536 + 512) and the latent norms' inputs (1536 + 512); mla-up-proj keeps the
    checkpoint's inputs (the normed latents and the RoPE key, 1536 + 512 + 64) and the norms' inputs."""
    sb, a = 4096, 2
    none = activation_bytes_per_layer(V3, 4096, 1, "none")
    up = activation_bytes_per_layer(V3, 4096, 1, "mla-up-proj")
    assert none["attn/qkv_out"] == a * sb * N * (QK + QK + V)
    assert none["attn/latents"] == a * sb * (QL + KVL)
    assert up["attn/latents"] == a * sb * (QL + KVL + R) and "attn/qkv_out" not in up
    assert up["attn/latent_norm_in"] == none["attn/latent_norm_in"] == a * sb * (QL + KVL)
    assert none["total"] - up["total"] == a * sb * (N * (2 * QK + V) - R)  # 536,346,624 B
    # under FP8 the up-projections' saved inputs are quantised (1 byte); the checkpoint's stay bf16
    fp8 = activation_bytes_per_layer(V3, 4096, 1, "none", gemm_input_bytes=1.0)
    assert fp8["attn/latents"] == sb * (QL + KVL)


def test_gemm_last_keeps_the_latents_as_down_projection_outputs() -> None:
    parts = activation_bytes_per_layer(V3, 4096, 1, "gemm-last")
    assert parts["attn/latents"] == 2 * 4096 * (QL + KVL + R)


def test_mla_up_proj_recompute_flops_are_the_up_projections() -> None:
    """2 FLOPs per weight of W_UQ (1536 × 128·192) and W_UKV (512 × 128·(128 + 128)), every one of the 61 layers."""
    hand = 2 * (QL * N * QK + KVL * N * (128 + V)) * 61
    assert recompute_flops_per_token(V3, 4096, "mla-up-proj") == hand == 6_652_166_144


def _ledger(cfg: ParallelConfig, seq_len: int = 256, batch: int = 8) -> tuple[dict, dict]:
    p = Problem(TINY_MLA, CHIP, cfg.chips, seq_len, batch)
    ev = evaluate(CostModel(p, default_efficiency(CHIP), Options()), LayoutArrays.from_configs([cfg]))
    return ev.ledger.plan(0), {k: float(v[0]) for k, v in ev.memory.items()}


def test_ledger_charges_the_up_projections_once_more() -> None:
    """DP 8, 2 sequences of 256 tokens per device (one micro-batch of 2): mla-up-proj adds one forward of the
    up-projections per layer, 2·512·(96·4·48 + 64·4·(32 + 32)) = 35,651,584 FLOPs a layer, 4 layers."""
    base, _ = _ledger(ParallelConfig(dp=8, microbatch=1))
    up, _ = _ledger(ParallelConfig(dp=8, microbatch=1, recompute="mla-up-proj"))
    t = 1 * 256  # tokens per micro-batch per device
    per_layer = 2 * t * (96 * 4 * 48 + 64 * 4 * (32 + 32))
    n_micro = 8 / 8  # global batch 8 over dp 8, micro-batch 1
    assert up["flops"]["matmul"] - base["flops"]["matmul"] == pytest.approx(n_micro * 4 * per_layer, rel=1e-12)


def test_mean_layer_weights_with_a_leading_dense_layer() -> None:
    """EP 8 on 8 devices holds every dense weight and 1/8 of the routed experts. By hand for TINY_MLA: per MoE layer
    routed 8 × 3·256·128 = 786,432, shared 98,304, router 8·256 = 2,048; the dense layer's MLP 3·256·512 = 393,216;
    attention (MLA) 256·96 + 96·4·48 + 256·(64 + 16) + 64·4·64 + 4·32·256 + 96 + 64 = 112,800; norms 2·256 per layer
    and the final one; embedding and output 2·512·256. Params are bf16 (2 B)."""
    attn, norms = 112_800, 512
    moe_layer = attn + 786_432 // 8 + 98_304 + 2_048 + norms
    dense_layer = attn + 393_216 + norms
    hand = 3 * moe_layer + dense_layer + 2 * 512 * 256 + 256
    _, mem = _ledger(ParallelConfig(dp=8, ep=8, microbatch=1))
    assert mem["params"] == pytest.approx(2 * hand, rel=1e-12)


def test_only_mla_models_take_mla_up_proj(capsys) -> None:
    llama = load_model("llama3-8b")
    prob = Problem(llama, CHIP, 8, 4096, 64)
    with pytest.raises(MeshplanError, match="no MLA"):
        plan(prob, Pins(recompute="mla-up-proj"), default_efficiency(CHIP), top=1)
    free = plan(prob, Pins(), default_efficiency(CHIP), top=50).plans
    assert all(p["config"]["recompute"] != "mla-up-proj" for p in free)
    code, _, err = run_cli(["train", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8",
                            "--seq-len", "4096", "--global-batch", "64", "--recompute", "mla-up-proj"], capsys)
    assert code == 2 and err.startswith("error:") and "no MLA" in err and len(err.strip().splitlines()) == 1


def test_a_free_search_on_an_mla_model_weighs_mla_up_proj() -> None:
    prob = Problem(TINY_MLA, CHIP, 8, 256, 8)
    plans = plan(prob, Pins(dp=8, ep=1, microbatch=1), default_efficiency(CHIP), top=10).plans
    assert "mla-up-proj" in {p["config"]["recompute"] for p in plans}


@pytest.mark.parametrize("fw, module", [("megatron", megatron_export), ("nemo", nemo_export)])
def test_megatron_and_nemo_files_say_mla_up_proj_and_read_it_back(fw, module) -> None:
    chip = load_chip("gb200-nvl72")
    prob = Problem(V3, chip, 256, 4096, 4096)
    opts = framework_options(fw, Options(), {})
    pins = Pins(dp=64, fsdp=1, tp=1, pp=4, vpp=4, cp=1, ep=64, microbatch=1, recompute="mla-up-proj", zero=1)
    pred = plan(prob, pins, default_efficiency(chip), replace(opts, headroom=-1e6), top=1).plans[0]
    cfg = ParallelConfig(**pred["config"])
    text = module.export(PlanToExport(prob, cfg, opts, pred, "meshplan train (test)", "deepseek-v3"))
    assert "mla_up_proj" in text
    job = module.load(text)
    assert job.pins.recompute == "mla-up-proj"
    # an NVL72 rack's node is a 4-GPU tray: 64 nodes of 4 processes (256 does not divide into 72-GPU nodes)
    assert job.chips == 256
