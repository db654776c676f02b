"""Serving physics of issue #14 (load and prefill): the pointwise HBM term of a step, logits only for the sampled rows,
and TensorRT-LLM's free-memory rule for the KV cache. Expected values derived by hand in the comments."""

from __future__ import annotations

import math

import pytest

from meshplan.cost.efficiency import default_efficiency
from meshplan.errors import MeshplanError
from meshplan.infer.config import ServeConfig, Workload, check_layout, kv_cache_free_fraction
from meshplan.infer.memory import (
    activation_bytes_per_chip,
    max_batch_per_replica,
    memory_per_chip,
    weight_bytes_per_chip,
)
from meshplan.infer.step import stage_parts
from meshplan.math.transformer import pointwise_elements_per_token
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

H100 = load_chip("h100-sxm")
EFF = default_efficiency(H100)
M8, MIX, M70 = load_model("llama3.1-8b"), load_model("mixtral-8x7b"), load_model("llama3-70b")


def test_pointwise_elements_per_token_by_hand():
    # Llama 3.1 8B (D 4096, F 14336, 32 q / 8 kv heads of 128): norms+residuals 10·4096 = 40960, RoPE on q and k
    # 2·(32 + 8)·128 = 10240, SwiGLU read 2F write F = 3·14336 = 43008: 94208 elements
    assert pointwise_elements_per_token(M8) == 94208
    # TP 2: the norms and residuals are whole on every chip, RoPE and SwiGLU halve: 40960 + 5120 + 21504
    assert pointwise_elements_per_token(M8, 2) == 67584
    # Mixtral 8x7B: the same layer shape, the activation runs for each of the k = 2 experts: 40960 + 10240 + 86016
    assert pointwise_elements_per_token(MIX) == 137216


def test_prefill_step_pays_pointwise_hbm_traffic():
    # an 8192-token prefill of Llama 3.1 8B on one H100: 32 layers x 8192 tokens x 94208 elements x 2 B
    # = 49,392,123,904 B at 3.35 TB/s x hbm_fraction 0.8 = 2.68 TB/s -> 18.43 ms
    parts = stage_parts(M8, H100, ServeConfig(), EFF, 0.0, 0.0, 8192.0, 4096.0)
    assert EFF.hbm_fraction == 0.8
    assert parts["pointwise"] == pytest.approx(49_392_123_904 / 2.68e12, rel=1e-9)
    assert parts["pointwise"] == pytest.approx(0.01843, rel=1e-3)
    # one decode token: 32 x 94208 x 2 B = 6,029,312 B -> 2.25 us, negligible next to the 16 GB weight read
    dec = stage_parts(M8, H100, ServeConfig(), EFF, 1.0, 1000.0, 0.0, 0.0)
    assert dec["pointwise"] == pytest.approx(6_029_312 / 2.68e12, rel=1e-9)


def test_output_projection_only_for_sampled_rows():
    # four prompt chunks sample four rows; one chunk samples one. The output projection is its own GEMM of m sampled
    # rows, timed at its skinny-row factor m/(m + 128): 2·m·D·V / (peak·0.75·m/(m + 128)) = 2·D·V·(m + 128) /
    # (peak·0.75), so 3 more rows add 3 x 2 x 4096 x 128256 FLOPs = 3,152,019,456 at the full 989 TFLOP/s x 0.75
    T = 2048.0
    one = stage_parts(M8, H100, ServeConfig(), EFF, 0.0, 0.0, T, T / 2, prefill_seqs=1)
    four = stage_parts(M8, H100, ServeConfig(), EFF, 0.0, 0.0, T, T / 2, prefill_seqs=4)
    assert four["compute"] - one["compute"] == pytest.approx(3_152_019_456 / (989e12 * 0.75), rel=1e-9)
    # before, every prompt row paid it: 2048 rows would have cost 2 x 2048 x 4096 x 128256 FLOPs, 6.5% of the
    # step's 2 x 2048 x 8.03e9 FLOPs; now one row does
    assert one["compute"] < 2 * T * 7.6e9 / (989e12 * 0.75 * 2048 / 2176)


def test_trtllm_kv_cache_takes_a_fraction_of_the_free_memory():
    # Llama 3 70B in fp8 (weights and KV) on one H100 80GB, 1000 + 1000 tokens per sequence
    w = Workload(1000, 1000)
    trt = ServeConfig(weight_dtype="fp8", kv_dtype="fp8", max_num_batched_tokens=8192, engine="trtllm")
    vllm = ServeConfig(weight_dtype="fp8", kv_dtype="fp8", max_num_batched_tokens=8192, engine="vllm")
    assert kv_cache_free_fraction(trt, H100) == 0.9
    assert kv_cache_free_fraction(vllm, H100) is None
    U = 85.52e9  # h100-sxm usable HBM
    fixed0 = weight_bytes_per_chip(M70, trt) + activation_bytes_per_chip(M70, H100, trt, 0) + 3.0e9  # + runtime
    act1 = activation_bytes_per_chip(M70, H100, trt, 1) - activation_bytes_per_chip(M70, H100, trt, 0)
    per_token = 2 * 80 * 8 * 128 * 1.0  # 2 (K, V) x 80 layers x 8 heads x 128 x 1 B = 163,840 B
    # TensorRT-LLM reserves the full 2000 tokens (GUARANTEED_NO_EVICT): B (kv + 0.9 act1) <= 0.9 (U - fixed0)
    want_trt = math.floor(0.9 * (U - fixed0) / (2000 * per_token + 0.9 * act1))
    # vLLM allocates as tokens are written: the mean context 1000 + 1000/2 = 1500 tokens; B (kv + act1) <= 0.9 U - fixed0
    want_vllm = math.floor((0.9 * U - fixed0) / (1500 * per_token + act1))
    assert max_batch_per_replica(M70, H100, trt, EFF, w) == want_trt
    assert max_batch_per_replica(M70, H100, vllm, EFF, w) == want_vllm
    # 70.6 GB of fp8 weights: 0.9 of the ~10 GB left holds 28 full-length sequences; vLLM's cap at 0.9 x 85.5 GB
    # leaves ~1.5 GB, 6 sequences at their mean context
    assert (want_trt, want_vllm) == (28, 6)
    # the batch that the rule admits fits the breakdown's budget, one more does not
    assert memory_per_chip(M70, H100, trt, EFF, want_trt, w.max_context).fits
    assert not memory_per_chip(M70, H100, trt, EFF, want_trt + 1, w.max_context).fits


def test_vllm_caps_sequences_at_max_num_seqs():
    # Llama 3.1 8B bf16 on one H100, 128 in / 2048 out: KV alone would hold far more than vLLM's default
    # max_num_seqs (1024 on >= 70 GiB GPUs other than A100, 256 on A100: vllm/engine/arg_utils.py)
    w = Workload(128, 2048)
    vllm = ServeConfig(max_num_batched_tokens=8192, engine="vllm")
    # (0.9 x 85.52 GB - 16.1 GB weights - 3 GB) / (128 + 1024 tokens x 131,072 B) ~ 380 sequences at the mean context
    assert 300 < max_batch_per_replica(M8, H100, vllm, EFF, w) < 450
    w_short = Workload(64, 64)  # ~50 GB of KV / (96 tokens x 131,072 B) ~ 4,000 would fit; the engine runs 1024
    assert max_batch_per_replica(M8, H100, vllm, EFF, w_short) == 1024
    assert max_batch_per_replica(M8, load_chip("a100-80gb"), vllm, default_efficiency(load_chip("a100-80gb")),
                                 w_short) == 256
    assert max_batch_per_replica(M8, H100, ServeConfig(max_num_batched_tokens=8192), EFF, w_short) > 1024


def test_unknown_engine_in_a_layout_is_an_error():
    with pytest.raises(MeshplanError, match="unknown engine"):
        check_layout(M8, H100, 1, ServeConfig(engine="tgi"))
