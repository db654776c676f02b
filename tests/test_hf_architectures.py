"""Released Hugging Face configs of every supported architecture (tests/data/configs/, sources in SOURCES.md):
parameter counts against the published figures, the architecture's semantics (windows, soft-capping, sinks, shared
experts, dense layers, text_config), KV cache and attention FLOPs of windowed layers by hand, and the serving batch
a sliding window buys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

from meshplan.cost.efficiency import default_efficiency
from meshplan.cost.roofline import layer_ops
from meshplan.errors import MeshplanError
from meshplan.infer.config import ServeConfig, Workload
from meshplan.infer.memory import activation_bytes_per_chip, max_batch_per_replica, memory_per_chip
from meshplan.math import transformer as tm
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model, model_from_hf

CONFIGS = Path(__file__).parent / "data" / "configs"


def cfg(name: str):
    return load_model(str(CONFIGS / f"{name}.json"))


# Vision encoders of the multimodal models, counted by hand from their vision_config (the published totals include
# them; meshplan models the text part). Llama 4 Scout (transformers' Llama4VisionModel): patch linear 3·14²·1408,
# class embedding 1408, positions 577·1408, two LayerNorms 4·1408, 34 layers × (Q/K/V/O with biases 4·(1408²+1408)
# + MLP with biases 2·1408·5632 + 5632 + 1408 + two LayerNorms 4·1408), pixel-shuffle MLP 5632·4096 + 4096², projector
# 4096·5120.
LLAMA4_SCOUT_VISION = (588 * 1408 + 1408 + 577 * 1408 + 4 * 1408
                       + 34 * (4 * (1408**2 + 1408) + 2 * 1408 * 5632 + 5632 + 1408 + 4 * 1408)
                       + 5632 * 4096 + 4096**2 + 4096 * 5120)
# Mistral Small 3.1 (Pixtral, transformers' PixtralVisionModel + Mistral3MultiModalProjector): patch conv 3·14²·1024,
# ln_pre 1024, 24 layers × (Q/K/V/O 4·1024² + gated MLP 3·1024·4096 + two RMSNorms 2·1024), projector norm 1024,
# patch merger 4·1024·1024, linear_1 1024·5120, linear_2 5120².
MISTRAL_SMALL_VISION = (3 * 14 * 14 * 1024 + 1024 + 24 * (4 * 1024**2 + 3 * 1024 * 4096 + 2 * 1024)
                        + 1024 + 4 * 1024 * 1024 + 1024 * 5120 + 5120**2)


# (model, quantity, published figure, extra params counted outside the text model, source)
PUBLISHED = [
    ("gemma-2b", "total", 524_550_144 + 1_981_884_416, 0, "Gemma report arXiv:2403.08295 Table 2 (emb + non-emb)"),
    ("gemma-7b", "total", 786_825_216 + 7_751_248_896, 0, "Gemma report arXiv:2403.08295 Table 2 (emb + non-emb)"),
    ("gemma2-9b", "total", 917_962_752 + 8_324_201_984, 0, "Gemma 2 report arXiv:2408.00118 Table 1"),
    ("gemma3-1b", "total", 302e6 + 698e6, 0, "Gemma 3 report arXiv:2503.19786 Table 1 (1B: no vision encoder)"),
    ("gemma3-27b", "total", 1_416e6 + 25_600e6, 0, "Gemma 3 report Table 1: embedding + non-embedding, 417M vision apart"),
    ("qwen1.5-moe-a2.7b", "total", 14.3e9, 0, "Qwen/Qwen1.5-MoE-A2.7B model card: 14.3B total"),
    ("qwen1.5-moe-a2.7b", "active", 2.7e9, 0, "Qwen/Qwen1.5-MoE-A2.7B model card: 2.7B activated"),
    ("qwen3-8b", "total", 8.2e9, 0, "Qwen/Qwen3-8B model card: 8.2B"),
    ("qwen3-8b", "non_embedding", 6.95e9, 0, "Qwen/Qwen3-8B model card: 6.95B non-embedding"),
    ("qwen3-30b-a3b", "total", 30.5e9, 0, "Qwen/Qwen3-30B-A3B model card: 30.5B total"),
    ("qwen3-30b-a3b", "non_embedding", 29.9e9, 0, "Qwen/Qwen3-30B-A3B model card: 29.9B non-embedding"),
    ("qwen3-235b-a22b", "total", 235e9, 0, "Qwen/Qwen3-235B-A22B model card: 235B total"),
    ("qwen3-32b", "non_embedding", 31.2e9, 0, "Qwen/Qwen3-32B model card: 31.2B non-embedding"),
    ("deepseek-v2-lite", "total", 15.7e9, 0, "DeepSeek-V2 report arXiv:2405.04434 App. B: 15.7B total"),
    ("deepseek-v3", "total", 671e9, 0, "DeepSeek-V3 report arXiv:2412.19437 §4.2: 671B (MTP module apart)"),
    ("llama4-scout-17b-16e", "total", 109e9, LLAMA4_SCOUT_VISION, "Llama 4 model card: Scout 109B total"),
    ("llama4-maverick", "total", 400e9, 0, "Llama 4 model card: Maverick 400B total"),
    ("gpt-oss-120b", "total", 116.83e9, 0, "gpt-oss model card (OpenAI 2025) Table 1: 116.83B"),
    ("gpt-oss-20b", "total", 20.91e9, 0, "gpt-oss model card Table 1: 20.91B"),
    ("phi-3-medium-4k", "total", 14e9, 0, "Phi-3 report arXiv:2404.14219: phi-3-medium, 14B"),
    ("phi-3.5-moe", "total", 41.9e9, 0, "microsoft/Phi-3.5-MoE-instruct model card: 41.9B"),
    ("mistral-small-3.1", "total", 24e9, MISTRAL_SMALL_VISION, "Mistral Small 3.1 model card: 24B"),
    ("mixtral-8x7b", "total", 46.7e9, 0, "Mistral AI, 'Mixtral of experts' (2023): 46.7B total"),
    ("mixtral-8x7b", "active", 12.9e9, 0, "Mistral AI, 'Mixtral of experts': 12.9B per token"),
    ("olmo2-13b", "total", 54_864_793_600 / 4, 0, "OLMo-2-1124-13B model.safetensors.index.json: fp32 bytes / 4"),
    ("aya-23-8b", "total", 8e9, 0, "Aya 23 report arXiv:2405.15032: 8B"),
    ("command-r", "total", 35e9, 0, "CohereForAI/c4ai-command-r-v01 model card: 35 billion"),
]


def _model(name: str):
    return cfg(name) if (CONFIGS / f"{name}.json").is_file() else load_model(name)


@pytest.mark.parametrize(("name", "quantity", "published", "outside", "source"), PUBLISHED,
                         ids=[f"{p[0]}-{p[1]}" for p in PUBLISHED])
def test_parameter_count_matches_the_published_figure(name, quantity, published, outside, source) -> None:
    pc = tm.param_counts(_model(name))
    assert getattr(pc, quantity) + outside == pytest.approx(published, rel=0.005), source


def test_gpt_oss_active_parameters_as_the_model_card_counts_them() -> None:
    """gpt-oss model card Table 1 counts the unembedding but not the embedding in the active parameters:
    5.13B (120b) and 3.61B (20b); its per-part figures are MLP 114.71B, attention 0.96B, embed + unembed 1.16B."""
    for name, active in (("gpt-oss-120b", 5.13e9), ("gpt-oss-20b", 3.61e9)):
        pc = tm.param_counts(_model(name))
        assert pc.active - pc.embedding == pytest.approx(active, rel=0.005)
    parts = tm.param_counts(cfg("gpt-oss-120b")).breakdown()
    assert parts["mlp"] == pytest.approx(114.71e9, rel=0.005)
    assert parts["attention"] == pytest.approx(0.96e9, rel=0.01)
    assert parts["embedding"] + parts["unembedding"] == pytest.approx(1.16e9, rel=0.005)


def test_gemma_ties_its_embeddings() -> None:
    """Issue #18: Gemma-7B counted 9.32B (an untied output projection); the released config has no
    tie_word_embeddings key and transformers' GemmaConfig defaults it to true: 8.54B."""
    assert "tie_word_embeddings" not in json.loads((CONFIGS / "gemma-7b.json").read_text())
    m = cfg("gemma-7b")
    assert m.tied_embeddings
    assert tm.param_counts(m).total == pytest.approx(8.54e9, rel=0.001)


def test_deepseek_v3_breakdown_sums_to_the_total(capsys) -> None:
    """Issue #18: params_breakdown summed to 703.8B. The 3 dense layers hold 3·(3·7168·18432) MLP weights and the
    58 MoE layers 58·(256 routed + 1 shared)·3·7168·2048, routers 58·7168·256."""
    m = load_model("deepseek-v3")
    parts = tm.param_counts(m).breakdown()
    assert sum(parts.values()) == tm.param_counts(m).total
    assert parts["mlp"] == 3 * 3 * 7168 * 18432 + 58 * 257 * 3 * 7168 * 2048
    assert parts["router"] == 58 * 7168 * 256
    out = json.loads(run_cli(["model", "deepseek-v3", "--json"], capsys)[1])
    assert sum(out["params_breakdown"].values()) == out["params_total"]


# --- semantics read from each config --------------------------------------------------------------------------

def test_gemma2_alternates_local_and_global_layers_and_soft_caps() -> None:
    m = cfg("gemma2-9b")
    assert m.windows() == (4096, 0) * 21  # modeling_gemma2: even layers slide
    assert (m.attn_logit_softcap, m.final_logit_softcap) == (50.0, 30.0)
    assert m.norms_per_layer == 4 and m.tied_embeddings and m.mlp_act == "geglu"


def test_gemma3_has_one_global_layer_in_six_and_qk_norm() -> None:
    m = cfg("gemma3-1b")
    assert [i for i, w in enumerate(m.windows()) if w == 0] == [5, 11, 17, 23]
    assert set(m.windows()) == {0, 512} and m.qk_norm == "head"
    big = load_model("gemma3-27b")  # multimodal: read through text_config, Gemma3TextConfig's vocab default
    assert (big.n_layers, big.d_model, big.vocab_size, big.windows()[:6]) == (62, 5376, 262208, (1024,) * 5 + (0,))


def test_gpt_oss_sinks_windows_biases_and_mxfp4() -> None:
    m = cfg("gpt-oss-120b")
    assert m.windows() == (128, 0) * 18 and m.attention_sinks and m.expert_weight_dtype == "mxfp4"
    assert m.linear_bias and m.router_bias and m.n_experts == 128 and m.experts_per_token == 4
    # MXFP4 (OCP MX v1.0): 4.25 bits per expert weight; the rest bf16. Experts 36·128·3·2880² = 114.65B
    experts = 36 * 128 * 3 * 2880 * 2880
    native = tm.native_weight_bytes(m)
    assert native == pytest.approx(experts * 4.25 / 8 + (tm.param_counts(m).total - experts) * 2)
    assert 60e9 < native < 70e9  # the released checkpoint is about 65 GB


def test_llama4_chunked_attention_shared_expert_and_interleave() -> None:
    scout = cfg("llama4-scout-17b-16e")
    assert scout.window_kind == "chunked" and scout.windows() == (8192, 8192, 8192, 0) * 12
    assert (scout.n_shared_experts, scout.shared_expert_d_ff, scout.first_dense_layers) == (1, 8192, 0)
    maverick = load_model("llama4-maverick")  # MoE on every second layer, the others dense of 16384
    assert (maverick.first_dense_layers, maverick.dense_d_ff, maverick.n_experts) == (24, 16384, 128)


def test_moe_routing_fields() -> None:
    v3 = cfg("deepseek-v3")
    assert (v3.moe_n_groups, v3.moe_topk_groups, v3.first_dense_layers, v3.moe_norm_topk) == (8, 4, 3, True)
    lite = cfg("deepseek-v2-lite")
    assert lite.q_lora_rank == 0 and lite.is_mla  # q_lora_rank null: a full-rank W_Q
    q3 = cfg("qwen3-30b-a3b")
    assert q3.moe_norm_topk and q3.qk_norm == "head" and q3.n_shared_experts == 0
    q15 = cfg("qwen1.5-moe-a2.7b")
    assert (q15.n_shared_experts, q15.shared_expert_d_ff, q15.shared_expert_gate) == (1, 5632, True)
    assert not q15.moe_norm_topk and q15.qkv_bias


def test_other_families_read_their_own_defaults() -> None:
    assert cfg("phi-3-medium-4k").windows() == (2047,) * 40  # released with sliding_window 2047 < 4096 positions
    assert cfg("phi-3.5-moe").lm_head_bias and cfg("phi-3.5-moe").norm == "layernorm"
    assert not cfg("phi-3.5-moe").has_windows  # its window (131072) covers the whole context
    aya = cfg("aya-23-8b")
    assert aya.tied_embeddings and aya.norms_per_layer == 1 and not aya.norm_bias
    assert cfg("olmo2-13b").qk_norm == "full"
    falcon = cfg("falcon-7b")
    assert (falcon.n_kv_heads, falcon.norms_per_layer, falcon.mlp_act, falcon.tied_embeddings) == (1, 1, "gelu", True)
    granite = cfg("granite-3.0-8b")
    assert granite.tied_embeddings and granite.n_kv_heads == 8
    mini = cfg("ministral-3-3b")  # mistral3 wrapper, text model under text_config
    assert (mini.d_model, mini.n_layers, mini.tied_embeddings, mini.family) == (3072, 26, True, "ministral3")


def test_hand_counted_parameters_of_granite_and_falcon() -> None:
    """Their published figures are rounded ('8.1B', '7B'); the count is checked by hand instead.
    Granite 3.0 8B: 40·(Q/O 2·4096² + K/V 2·4096·1024 + SwiGLU 3·4096·12800 + 2 RMSNorms) + final norm + tied
    embedding 49155·4096. Falcon-7B: 32·(Q 4544² + MQA K/V 2·4544·64 + O 4544² + GELU MLP 2·4544·18176 + one
    LayerNorm 2·4544) + final LayerNorm + tied embedding 65024·4544."""
    granite = 40 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 12800 + 2 * 4096) + 4096 + 49155 * 4096
    assert tm.param_counts(cfg("granite-3.0-8b")).total == granite
    falcon = 32 * (2 * 4544**2 + 2 * 4544 * 64 + 2 * 4544 * 18176 + 2 * 4544) + 2 * 4544 + 65024 * 4544
    assert tm.param_counts(cfg("falcon-7b")).total == falcon


# --- windows in the math ------------------------------------------------------------------------------------------

def test_kv_cache_of_a_sliding_window_model_by_hand(capsys) -> None:
    """Gemma 2 9B at 8192 tokens: a layer caches 2·K·H = 2·8·256 values = 8192 bytes (bf16) per token; the 21 global
    layers keep all 8192 tokens, the 21 local layers their 4096-token window: 8192·(21·8192 + 21·4096) bytes
    = 2,113,929,216 per sequence, 258,048 per token against 344,064 with full attention everywhere."""
    m = cfg("gemma2-9b")
    assert tm.kv_cache_bytes_per_sequence(m, 8192) == 8192 * (21 * 8192 + 21 * 4096) == 2_113_929_216
    assert tm.kv_cache_bytes_per_token(m, "bf16", 8192) == 258_048
    assert tm.kv_cache_bytes_per_token(m, "bf16") == 2 * 42 * 8 * 256 * 2 == 344_064  # no context: every layer
    # gpt-oss-120b: 2·8·64·2 = 2048 bytes per layer per token; 18 full layers keep 8192 tokens, 18 keep 128
    assert tm.kv_cache_bytes_per_sequence(cfg("gpt-oss-120b"), 8192) == 2048 * (18 * 8192 + 18 * 128)
    out = json.loads(run_cli(["model", str(CONFIGS / "gemma2-9b.json"), "--json"], capsys)[1])
    assert out["kv_cache_bytes_per_token"]["bf16"] == 258_048  # at the model's own 8192 positions


def test_kv_cache_of_an_mla_model_by_hand() -> None:
    """DeepSeek-V2-Lite caches the 512-wide latent and the 64-wide RoPE key per layer (DeepSeek-V2 §2.1.2):
    27·(512 + 64)·2 bytes = 31,104 bytes per token in bf16, however long the sequence (no windows)."""
    m = cfg("deepseek-v2-lite")
    assert tm.kv_cache_bytes_per_token(m, "bf16") == 27 * 576 * 2 == 31_104
    assert tm.kv_cache_bytes_per_sequence(m, 4096) == 4096 * 31_104


def test_attention_flops_at_the_real_windows() -> None:
    """Gemma 2 9B at S = 8192: a local layer's query sees min(p, 4096) keys, mean 4096 − 4096²/(2·8192) = 3072;
    global layers S/2 = 4096; mean over the 42 layers 3584. Forward attention = 2·3584·N·2H·L.
    Llama 4 Scout at S = 16384, chunks of 8192: a chunked layer's mean is 8192/2 = 4096, a global layer's 8192;
    36 chunked + 12 global layers: 5120."""
    g = cfg("gemma2-9b")
    assert tm.mean_attended_keys(g, 8192) == 3584
    assert tm.attention_flops_per_token(g, 8192) == 2 * 3584 * 16 * 512 * 42
    assert tm.mean_attended_keys(cfg("llama4-scout-17b-16e"), 16384) == (36 * 4096 + 12 * 8192) / 48 == 5120
    # shorter than every window: the same as full attention
    assert tm.mean_attended_keys(g, 2048) == 1024
    assert tm.attended_keys(128, 8192) == 128 - 128**2 / (2 * 8192)


def test_training_attention_core_uses_the_window(monkeypatch) -> None:
    """The training cost model's attention core (CostModel.compute_terms) follows mean_attended_keys: the same
    Gemma 2 layout with and without its windows spends attention-core time in the ratio 3584 : 4096 at S = 8192, each
    side times cuDNN's tile factor (efficiency.attention_tile_factor, H100 k = 3.15 forward, 5.00 backward): keys/B +
    masked share + k tile-widths per query row, the windowed layers' share (1 + 1/2) / 2 = 0.75, the full model's 1/2;
    Gemma 2's heads are 256 + 256 wide, so the forward's fixed time per query tile is k·256/512 = 1.575 of its tiles.
    Forward (3584 + 2.325·128) / (4096 + 2.075·128) = 3881.6 / 4361.6; backward (3584 + 5.75·128) / (4096 + 5.50·128)
    = 4320 / 4800."""
    from meshplan.train.costmodel import CostModel, Options
    from meshplan.train.planner import search
    from meshplan.train.space import Pins, Problem

    seen = []
    original = CostModel.compute_terms

    def spy(self, L, g):
        terms = original(self, L, g)
        seen.append((terms["layer_core_fwd"].copy(), terms["layer_core_bwd"].copy()))
        return terms

    monkeypatch.setattr(CostModel, "compute_terms", spy)
    windowed = cfg("gemma2-9b")
    chip = load_chip("h100-sxm")
    pins = Pins(dp=8, fsdp=1, tp=1, pp=1, cp=1, ep=1, zero=1, vpp=1, microbatch=1, recompute="full", offload=0.0)
    for m in (windowed, windowed.with_overrides(layer_windows=())):
        search(Problem(m, chip, 8, 8192, 64), pins, default_efficiency(chip), Options(headroom=-10))
    (wf, wb), (ff, fb) = seen[0], seen[-1]
    assert wf / ff == pytest.approx(3881.6 / 4361.6, rel=1e-9) and wb / fb == pytest.approx(4320 / 4800, rel=1e-9)


def test_moe_roofline_counts_the_shared_experts() -> None:
    """Issue #18: DeepSeek-V3's shared expert (3·7168·2048 weights) sees every token: 2·T·7168·4096 FLOPs up
    (gate and up) and 2·T·2048·7168 down."""
    m = load_model("deepseek-v3")
    ops = {op.name: op for op in layer_ops(m, 4096, 4096)}
    assert ops["mlp/shared_up"].flops == 2 * 4096 * 7168 * 2 * 2048
    assert ops["mlp/shared_down"].flops == 2 * 4096 * 2048 * 7168


# --- serving --------------------------------------------------------------------------------------------------------

def test_serving_batch_grows_by_what_the_window_implies(tmp_path, capsys) -> None:
    """Gemma 2 9B on one H100 with 7168-token prompts and 1024 output tokens (8192 in all): a sequence keeps
    (21·8192 + 21·4096)/42 = 6144 tokens per layer instead of 8192, so at 2·42·8·256·2 = 344,064 bytes per
    cached token a sequence needs 6144·344,064 B (plus its logits workspace) instead of 8192·344,064 B, and the
    free memory holds 8192/6144 = 4/3 as many."""
    m, chip = cfg("gemma2-9b"), load_chip("h100-sxm")
    full = m.with_overrides(layer_windows=())
    eff, sc, w = default_efficiency(chip), ServeConfig(tp=1), Workload(7168, 1024)
    empty = memory_per_chip(m, chip, sc, eff, 0, w.max_context)
    free = empty.budget - empty.total
    logits = activation_bytes_per_chip(m, chip, sc, 1) - activation_bytes_per_chip(m, chip, sc, 0)
    kv_token = 2 * 42 * 8 * 256 * 2
    windowed_batch, full_batch = max_batch_per_replica(m, chip, sc, eff, w), max_batch_per_replica(
        full, chip, sc, eff, w)
    assert windowed_batch == int(free // (6144 * kv_token + logits))
    assert full_batch == int(free // (8192 * kv_token + logits))
    assert windowed_batch / full_batch == pytest.approx(8192 / 6144, rel=0.02)
    # the CLI reports the same batches (the full-attention variant: the released config without its window)
    raw = json.loads((CONFIGS / "gemma2-9b.json").read_text())
    raw.pop("sliding_window")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    batches = []
    for model in (str(CONFIGS / "gemma2-9b.json"), str(tmp_path / "config.json")):
        code, stdout, _ = run_cli(["serve", "--model", model, "--hardware", "h100-sxm", "--chips", "1", "--tp", "1",
                                   "--input-len", "7168", "--output-len", "1024", "--json"], capsys)
        out = json.loads(stdout)
        batches.append(out["max_batch"])
    assert batches == [windowed_batch, full_batch]


# --- what is not supported ----------------------------------------------------------------------------------------

def test_unknown_model_type_lists_what_is_supported_and_the_generic_keys(tmp_path, capsys) -> None:
    with pytest.raises(MeshplanError) as err:
        model_from_hf({"model_type": "mamba", "hidden_size": 64}, "x", "config.json")
    text = str(err.value)
    assert "'mamba' is not supported" in text and "gemma2" in text and "gpt_oss" in text
    assert "model_type: meshplan" in text and "layer_windows" in text
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "rwkv", "hidden_size": 64}))
    code, _, err = run_cli(["model", str(p)], capsys)
    assert code == 2 and err.strip().startswith("error:") and len(err.strip().splitlines()) == 1


def test_generic_yaml_model_in_meshplans_own_schema(tmp_path) -> None:
    """Anything else is described by its shapes: 4 layers, alternately windowed (256) and full."""
    p = tmp_path / "mine.yaml"
    p.write_text("model_type: meshplan\nhidden_size: 1024\nnum_hidden_layers: 4\nnum_attention_heads: 8\n"
                 "num_key_value_heads: 2\nintermediate_size: 4096\nvocab_size: 32000\n"
                 "max_position_embeddings: 4096\nmlp_act: swiglu\nlayer_windows: [256, 0, 256, 0]\n")
    m = load_model(str(p))
    assert m.windows() == (256, 0, 256, 0) and m.mlp_act == "swiglu"
    # per layer 2·K·H·2 bytes = 2·2·128·2 = 1024 per token; at 4096 tokens 2 layers keep 4096, 2 keep 256
    assert tm.kv_cache_bytes_per_sequence(m, 4096) == 1024 * (2 * 4096 + 2 * 256)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_type: meshplan\nhidden_size: 1024\nnum_hidden_layers: 4\nnum_attention_heads: 8\n"
                   "intermediate_size: 4096\nvocab_size: 32000\nlayer_windows: [256, 0]\n")
    with pytest.raises(MeshplanError, match="layer_windows"):
        load_model(str(bad))


def test_decode_reads_only_the_window_of_cached_keys() -> None:
    """A decode step at 8192 tokens of context reads each layer's cached keys and values: Gemma 2 9B's local layers
    read 4096 of them, so the KV term is (21·8192 + 21·4096)/(42·8192) = 3/4 of the full-attention model's."""
    from meshplan.infer.step import decode_step

    m, chip = cfg("gemma2-9b"), load_chip("h100-sxm")
    eff = default_efficiency(chip)
    windowed = decode_step(m, chip, ServeConfig(tp=1), eff, 16, 8192).parts
    full = decode_step(m.with_overrides(layer_windows=()), chip, ServeConfig(tp=1), eff, 16, 8192).parts
    assert windowed["kv_cache"] / full["kv_cache"] == pytest.approx(0.75, rel=1e-12)


def test_roofline_attention_at_the_window() -> None:
    """Gemma 2 9B, one 8192-token sequence: the attention core costs 4·T·(mean keys 3584)·N·H FLOPs."""
    ops = {op.name: op for op in layer_ops(cfg("gemma2-9b"), 8192, 8192)}
    assert ops["attn/core"].flops == 4 * 8192 * 3584 * 16 * 256
    full = {op.name: op for op in layer_ops(cfg("gemma2-9b").with_overrides(layer_windows=()), 8192, 8192)}
    assert full["attn/core"].flops == 4 * 8192 * 8192 * 16 * 256 / 2


def test_olmo2_count_is_exact() -> None:
    """The released OLMo-2-1124-13B checkpoint holds 54,864,793,600 bytes of fp32 tensors (its safetensors index):
    13,716,198,400 parameters, every one accounted for (Q/K/V/O, the QK-norms over N·H and K·H, SwiGLU, the two
    post-norms per layer, the final norm, untied embedding and output projection)."""
    assert tm.param_counts(cfg("olmo2-13b")).total == 54_864_793_600 // 4


def test_serving_weights_count_dense_layers_as_dense() -> None:
    """Llama 4 Maverick's 24 dense layers (MLP 16384) and DeepSeek-V3's 3 were served as MoE layers (784B and 710B of
    weights for 401B and 671B models). On one chip the served weights are the model's parameters, 2 bytes each."""
    from meshplan.infer.memory import weight_bytes_per_chip

    for name in ("llama4-maverick", "deepseek-v3"):
        m = load_model(name)
        assert weight_bytes_per_chip(m, ServeConfig(tp=1)) == pytest.approx(2 * tm.param_counts(m).total, rel=1e-12)


def test_layer_types_must_cover_every_layer() -> None:
    raw = json.loads((CONFIGS / "gpt-oss-120b.json").read_text())
    raw["layer_types"] = raw["layer_types"][:-1]
    with pytest.raises(MeshplanError, match="layer_types"):
        model_from_hf(raw, "x", "config.json")


def test_disaggregated_kv_transfer_ships_the_window() -> None:
    """A 7168-token prompt of Gemma 2 9B leaves (21·7168 + 21·4096)/42 = 5632 tokens of KV per layer to ship from
    the prefill to the decode instance, 5632/7168 of the full-attention model's bytes."""
    from meshplan.infer.disagg import kv_transfer_s

    m, chip = cfg("gemma2-9b"), load_chip("h100-sxm")
    hop = chip.links.scale_out_hop_latency_s
    windowed = kv_transfer_s(m, chip, ServeConfig(tp=1), 7168) - hop
    full = kv_transfer_s(m.with_overrides(layer_windows=()), chip, ServeConfig(tp=1), 7168) - hop
    assert windowed / full == pytest.approx(5632 / 7168, rel=1e-9)


def test_attention_bias_is_q_k_v_and_o_outside_qwen() -> None:
    """transformers: Qwen2's attention_bias covers Q, K and V; Llama-style models (Phi-3.5-MoE) bias O as well:
    4096 + 1024 + 1024 + 4096 per layer for Phi-3.5-MoE (N·H = 4096, K·H = 1024)."""
    phi = cfg("phi-3.5-moe")
    no_bias = phi.with_overrides(qkv_bias=False, out_bias=False)
    assert tm.param_counts(phi).per_layer_attention - tm.param_counts(no_bias).per_layer_attention == 4096 * 2 + 2048
    q = cfg("qwen1.5-moe-a2.7b")
    assert q.qkv_bias and not q.out_bias
