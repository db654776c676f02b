"""Independent checks of meshplan.math.transformer: published parameter totals, a PaLM-style second
derivation of training FLOPs, the KV cache by hand, and Korthikanti et al. 2022's activation formulas.

Every expected number here is either a published figure or a formula written out in this file from the
config's fields; none calls the function under test to build its expectation.
"""

from __future__ import annotations

import pytest

from meshplan.math.transformer import (
    RECOMPUTE_POLICIES,
    activation_bytes_per_layer,
    flops_per_token,
    kv_cache_bytes_per_token,
    param_counts,
    recompute_flops_per_token,
)
from meshplan.specs.model import load_model

# --- parameter counts against published totals -----------------------------------------------------------

PUBLISHED_TOTALS = [
    ("llama3-8b", 8.03e9),  # Meta model card: 8.03B
    ("llama3-70b", 70.6e9),  # Meta model card: 70.6B
    ("llama3-405b", 405.9e9),  # Meta model card (Llama 3.1): 405.9B (commonly "405B")
    ("mixtral-8x7b", 46.7e9),  # Mistral AI, "Mixtral of experts": 46.7B total
    ("gpt3-175b", 175e9),  # Brown et al. 2020, Table 2.1: 175.0B
]


@pytest.mark.parametrize(("name", "published"), PUBLISHED_TOTALS)
def test_total_params_match_published(name: str, published: float) -> None:
    assert param_counts(load_model(name)).total == pytest.approx(published, rel=0.005)


def test_mixtral_active_params() -> None:
    """Mixtral 8x7B uses 12.9B parameters per token (2 of 8 experts)."""
    pc = param_counts(load_model("mixtral-8x7b"))
    assert pc.active == pytest.approx(12.9e9, rel=0.005)
    assert pc.active < pc.total


def test_dense_models_have_active_equal_total() -> None:
    pc = param_counts(load_model("llama3-70b"))
    assert pc.active == pc.total


# --- training FLOPs: a PaLM-style second derivation ------------------------------------------------------

def test_training_flops_llama3_70b_palm_style() -> None:
    """PaLM App. B: 6 × (matmul params) + 12·L·H·Q·T per token, halved for a causal mask. The matmul params
    are the attention and MLP weights of every layer plus the output projection (the embedding lookup is a
    gather, not a matmul); written out from the config here."""
    m = load_model("llama3-70b")
    L, D, N, K, Hd, F, V, T = (m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff,
                               m.vocab_size, 8192)
    q_and_o = 2 * D * N * Hd
    k_and_v = 2 * D * K * Hd
    mlp = 3 * D * F  # gated: W_in1, W_in2, W_out
    n_matmul = L * (q_and_o + k_and_v + mlp) + D * V
    palm = 6 * n_matmul + 12 * L * N * Hd * T / 2
    assert flops_per_token(m, T, causal=True).training == pytest.approx(palm, rel=1e-12)


def test_training_flops_llama3_70b_matches_nemo_published() -> None:
    """NeMo's Llama3-70B row (seq 8192, non-causal attention): 738e12 FLOP/s per GPU at 1533 tokens/s per
    GPU = 4.81e11 FLOPs per token (shared/reference/flops_conventions.md)."""
    m = load_model("llama3-70b")
    assert flops_per_token(m, 8192, causal=False).training == pytest.approx(738e12 / 1533, rel=0.005)


def test_training_is_three_forwards_and_causal_halves_attention() -> None:
    m = load_model("llama3-8b")
    full, causal = flops_per_token(m, 8192, causal=False), flops_per_token(m, 8192, causal=True)
    assert full.training == pytest.approx(3 * full.forward)
    assert causal.forward_attention == pytest.approx(full.forward_attention / 2)
    assert causal.forward_matmul == full.forward_matmul


# --- KV cache --------------------------------------------------------------------------------------------

def test_kv_cache_llama3_70b_bf16() -> None:
    """2 (K and V) · 80 layers · 8 KV heads · 128 head dim · 2 bytes."""
    m = load_model("llama3-70b")
    assert kv_cache_bytes_per_token(m, "bf16") == 2 * 80 * 8 * 128 * 2 == 327680
    assert kv_cache_bytes_per_token(m, "int8") == 327680 / 2


# --- activations: Korthikanti et al. 2022, Table 2 -------------------------------------------------------

S, B = 2048, 1  # GPT-3's sequence length, one sequence per micro-batch


@pytest.fixture(scope="module")
def gpt() -> object:
    return load_model("megatron-gpt-175b")


def _acts(m, recompute: str, t: int = 1, sp: bool = False) -> float:
    return activation_bytes_per_layer(m, S, B, recompute, tp=t, sequence_parallel=sp, flash_attention=False,
                                      dropout=True)["total"]


def _sbh(m) -> float:
    return S * B * m.d_model


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_korthikanti_tensor_parallel(gpt, t: int) -> None:
    a, h = gpt.n_heads, gpt.d_model
    sbh = _sbh(gpt)
    assert _acts(gpt, "none", t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * S / (h * t)), rel=1e-12)
    assert _acts(gpt, "selective", t) == pytest.approx(sbh * (10 + 24 / t), rel=1e-12)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_korthikanti_sequence_parallel(gpt, t: int) -> None:
    a, h = gpt.n_heads, gpt.d_model
    sbh = _sbh(gpt)
    assert _acts(gpt, "none", t, sp=True) == pytest.approx(sbh * (34 / t + 5 * a * S / (h * t)), rel=1e-12)
    assert _acts(gpt, "selective", t, sp=True) == pytest.approx(34 * sbh / t, rel=1e-12)


def test_korthikanti_no_parallelism_and_full_recompute(gpt) -> None:
    a, h = gpt.n_heads, gpt.d_model
    sbh = _sbh(gpt)
    assert _acts(gpt, "none") == pytest.approx(sbh * (34 + 5 * a * S / h), rel=1e-12)
    assert _acts(gpt, "full") == pytest.approx(2 * sbh, rel=1e-12)


def test_breakdown_sums_to_total(gpt) -> None:
    for policy in RECOMPUTE_POLICIES:
        parts = activation_bytes_per_layer(gpt, S, B, policy, tp=4, flash_attention=False, dropout=True)
        assert sum(v for k, v in parts.items() if k != "total") == pytest.approx(parts["total"])


@pytest.mark.parametrize("flash", [False, True])
def test_gemm_last_between_full_and_none(gpt, flash: bool) -> None:
    def total(policy: str) -> float:
        return activation_bytes_per_layer(gpt, S, B, policy, flash_attention=flash, dropout=True)["total"]

    assert total("full") < total("gemm-last") < total("none")


def test_recompute_flops(gpt) -> None:
    """gemm-last and none add no matmul FLOPs; full redoes each layer's forward, ≈ 2 × (layer matmul
    params) per token plus the attention core; selective redoes the attention core only."""
    h, L = gpt.d_model, gpt.n_layers
    assert recompute_flops_per_token(gpt, S, "gemm-last") == 0.0
    assert recompute_flops_per_token(gpt, S, "none") == 0.0
    layer_matmul_params = L * (4 * h * h + 2 * h * gpt.d_ff)  # QKVO + non-gated MLP
    attention_core = 4 * S / 2 * gpt.n_heads * gpt.head_dim * L  # QKᵀ and AV, causal
    full = recompute_flops_per_token(gpt, S, "full")
    assert full == pytest.approx(2 * layer_matmul_params + attention_core, rel=1e-12)
    assert full == pytest.approx(2 * param_counts(gpt).non_embedding, rel=0.02)
    assert recompute_flops_per_token(gpt, S, "selective") == pytest.approx(attention_core, rel=1e-12)
    # 6N → ≈ 8N with full recompute (book ch.4)
    train = flops_per_token(gpt, S).training
    assert (train + full) / train == pytest.approx(4 / 3, rel=0.02)
