"""Memory per GPU of Megatron-Core with Transformer Engine (issue #14: published layouts that ran must fit), against
hand sums: what TE's FP8 GEMMs save for the backward (one quantised usage of the input), Megatron's fused SwiGLU
(saves its input only), FP8 primary weights (`fp8_param_gather`), and the busiest pipeline stage when the embedding
and the loss take a layer's slot each (`account_for_*_in_pipeline_split`)."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.cost.efficiency import default_efficiency
from meshplan.math.transformer import activation_bytes_per_layer
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.frameworks import preset
from meshplan.train.space import Problem

GIB = 2**30
# Llama 3 8B shapes: D = 4096, 32 query heads and 8 KV heads of 128 (q 4096, kv 1024), gated F = 14336
D8, Q8, KV8, F8 = 4096, 4096, 1024, 14336


def _per_token(**kw) -> float:
    return activation_bytes_per_layer(load_model("llama3-8b"), 1, 1, "none", **kw)["total"]


def test_default_layer_is_unchanged() -> None:
    """bf16, unfused: norm inputs 2·2D + qkv input 2D + Q/K/V 2(q + 2kv) + attention output 2q + MLP input 2D + gate,
    up, activation, product 4·2F = 16384 + 8192 + 12288 + 8192 + 8192 + 114688 = 167,936 B per token."""
    assert _per_token() == 2 * 2 * D8 + 2 * D8 + 2 * (Q8 + 2 * KV8) + 2 * Q8 + 2 * D8 + 8 * F8 == 167_936


def test_fused_swiglu_keeps_its_input_and_the_down_projection_input() -> None:
    """Megatron's SwiGLUFunction saves the two up-projections (2·2F) and the down-projection its output (2F):
    6F = 86,016 B of MLP hidden instead of 8F = 114,688; the layer 167,936 − 28,672 = 139,264 B per token."""
    assert _per_token(glu_saves_input=True) == 167_936 - 2 * F8 == 139_264


def test_te_fp8_saves_quantised_gemm_inputs() -> None:
    """TE under FP8, fused SwiGLU: norm inputs 4D (bf16) + qkv and MLP inputs 1 B each (2 × 4096) + Q/K/V 12,288 +
    attention output 2q in bf16 (attention's) + 1q in FP8 (the projection's) = 12,288 + up-projections 4F = 57,344 +
    the down-projection input 1F = 14,336: 16384 + 8192 + 12288 + 12288 + 57344 + 14336 = 120,832 B per token.
    MXFP8 adds one scale byte per 32 elements of each quantised copy: (2D + q + F)/32 = 26,624/32 = 832 B."""
    fp8 = _per_token(glu_saves_input=True, gemm_input_bytes=1.0)
    assert fp8 == 120_832
    assert _per_token(glu_saves_input=True, gemm_input_bytes=1 + 1 / 32) == pytest.approx(fp8 + 832)


def _cm(model: str, chip: str, cfg: ParallelConfig, gbs: int, **opts) -> tuple[CostModel, LayoutArrays]:
    prob = Problem(load_model(model), load_chip(chip), cfg.chips, 8192, gbs)
    return CostModel(prob, default_efficiency(prob.chip), Options(**opts)), LayoutArrays.from_configs([cfg])


def _memory(cm: CostModel, L: LayoutArrays) -> dict[str, float]:
    g = cm.geometry(L)
    return {k: float(v[0]) for k, v in cm.memory_terms(L, g).items()}


# Megatron-Bridge LLAMA31_405B_PRETRAIN_CONFIG_GB200_FP8_CS_V2 (scripts/performance @v0.5.0): 256 GPUs, tp 4, pp 16,
# vpp 4, dp 4, micro-batch 1, global batch 1536, seq 8192, no recompute, FP8 current scaling (tensorwise), bf16
# gradient reduction, FP8 primary weights, the embedding and the loss in the pipeline split
CFG_405B = ParallelConfig(dp=4, tp=4, pp=16, vpp=4, microbatch=1, recompute="none", zero=1, sequence_parallel=True)
NEMO = {k: preset("nemo")[k] for k in ("grad_reduce_bytes", "glu_saves_input", "fp8_params", "fp8_recipe")}


def test_llama31_405b_gb200_fits_as_the_recipe_ran() -> None:
    """By hand (results file, section 'Megatron/TE memory'): a layer's parameters over tp 4, 3,187,671,040/4 + two
    norms 32,768 = 796,950,528; a middle stage (rank 1) holds 8 of them, 6,375,604,224 (the first and last stages
    hold 7 beside the embedding / output layer, 525 M each). FP8 weights on Blackwell 1 B, bf16 gradients 2 B, fp32
    master + Adam 12 B over dp 4 = 3 B: 5.94 + 11.87 + 17.81 GiB. Activations per token per layer (FP8, fused SwiGLU):
    65,536 + 16,384 + 36,864 + 49,152 + 16,384 + 266,240 = 450,560 B over tp 4 × 8192 tokens = 0.859 GiB a layer
    pass; in flight on rank 1: 2·(16 − 2) + 3·16 + 1 = 77 chunk forwards of 2 layers = 154 (rank 0's 79 chunks hold
    31 one-layer chunks: 127): 132.3 GiB; the fused loss's logits 6 B × 8192 × 128,256 / 4 = 1.47 GiB; the runtime
    reserve 3e9 B = 2.79 GiB. Total 172.2 GiB ≤ 186e9 B = 173.2 GiB: the layout the job ran fits."""
    cm, L = _cm("llama3-405b", "gb200-nvl72", CFG_405B, 1536, compute_dtype="fp8", pp_head_in_split=True, **NEMO)
    m = _memory(cm, L)
    stage_params = 8 * 796_950_528
    assert m["params"] == pytest.approx(1.0 * stage_params, rel=1e-9)
    assert m["grads"] == pytest.approx(2.0 * stage_params, rel=1e-9)
    assert m["optimizer"] == pytest.approx(12.0 * stage_params / 4, rel=1e-9)
    layer_pass = 450_560 / 4 * 8192
    logits = 6.0 * 8192 * 128_256 / 4
    assert m["activations"] == pytest.approx(154 * layer_pass + logits, rel=1e-9)
    assert m["total"] / GIB == pytest.approx(172.2, abs=0.05)
    assert m["total"] <= load_chip("gb200-nvl72").hbm_bytes


def test_head_in_split_relief_matches_megatron_ranks() -> None:
    """Without the embedding/loss in the split the count is rank 0's, layers_stage·p·(1 + (p−1)/(p·v)) = 8·16·(1 +
    15/64) = 158 layer passes; with it, rank 1's 154 is the busiest (rank 0: 79 chunks, 31 of them one layer short:
    127). Plain 1F1B (v = 1), p = 8, ceil(82/8) = 11 layers a stage: rank 0 holds 8 × 10 = 80, rank 1 7 × 11 = 77,
    the formula 8 × 11 = 88 → relief 8."""
    cm, L = _cm("llama3-405b", "gb200-nvl72", CFG_405B, 1536, pp_head_in_split=True)
    g = cm.geometry(L)
    assert float(cm._head_in_split_relief(g)[0]) == 4.0
    plain = ParallelConfig(dp=4, tp=4, pp=8, microbatch=1, recompute="none", zero=1, sequence_parallel=True)
    cm, L = _cm("llama3-70b", "h100-sxm", plain, 64, pp_head_in_split=True)
    g = cm.geometry(L)
    assert float(g["layers_stage"][0]) == 11.0
    assert float(cm._head_in_split_relief(g)[0]) == 8.0
    cm, L = _cm("llama3-70b", "h100-sxm", plain, 64)
    assert float(cm._head_in_split_relief(cm.geometry(L))[0]) == 0.0


@pytest.mark.parametrize("chip, recipe, per_param", [
    ("gb200-nvl72", "tensorwise", 1.0),      # Blackwell takes either layout: the row-wise FP8 copy alone
    ("h100-sxm", "tensorwise", 2.0),         # Hopper: FP8 GEMMs are TN only, the transposed copy too
    ("gb200-nvl72", "blockwise", 2 * (1 + 1 / 32)),  # MXFP8: row- and column-scaled copies with E8M0 scales
])
def test_fp8_primary_weights(chip: str, recipe: str, per_param: float) -> None:
    cfg = ParallelConfig(dp=4, tp=4, pp=16, vpp=4, microbatch=1, recompute="none", zero=1, sequence_parallel=True)
    cm, L = _cm("llama3-405b", chip, cfg, 1536, compute_dtype="fp8", fp8_params=True, fp8_recipe=recipe)
    bf16, _ = _cm("llama3-405b", chip, cfg, 1536, compute_dtype="fp8", fp8_recipe=recipe)
    assert _memory(cm, L)["params"] == pytest.approx(_memory(bf16, L)["params"] / 2.0 * per_param, rel=1e-12)


def test_bf16_and_torchao_fp8_keep_bf16_saved_inputs() -> None:
    """Only TE's fused casts save the FP8 copy (torchao's Float8Linear saves the high-precision input): the
    activations of an FP8 torchtitan-style run equal the bf16 run's."""
    cfg = ParallelConfig(dp=8, tp=1, microbatch=1, recompute="none")
    a, L = _cm("llama3-8b", "h100-sxm", cfg, 64, compute_dtype="fp8", fp8_fused_casts=False)
    b, _ = _cm("llama3-8b", "h100-sxm", cfg, 64)
    assert np.isclose(_memory(a, L)["activations"], _memory(b, L)["activations"])

