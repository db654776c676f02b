"""Model architecture: the shape of a decoder-only transformer in the book's notation.

`load_model` takes a preset name (`llama3-70b`) or a path to a Hugging Face style `config.json` (the model types
in `SUPPORTED_MODEL_TYPES`; a multimodal config is read through its `text_config`), or a YAML/JSON file in
meshplan's own generic schema (`model_type: meshplan`, see `GENERIC_KEYS`). Presets are themselves HF-style JSON
files in `data/models/`, each with a `_source`. Missing keys get the model type's defaults (those of
transformers' configuration classes); contradictions are errors.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from meshplan.errors import MeshplanError
from meshplan.specs._load import DATA_DIR, find_spec, read_mapping
from meshplan.validate import MAX_PARAMS

MODELS_DIR = DATA_DIR / "models"
MLP_ACTS = ("swiglu", "geglu", "gelu", "relu", "silu")
GATED_ACTS = ("swiglu", "geglu")


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer. Book notation: L layers, D d_model, N query heads, K KV heads,
    H head dim, F MLP width (per expert for MoE), V vocab, E experts with k active per token."""

    name: str
    n_layers: int  # L
    d_model: int  # D
    n_heads: int  # N
    n_kv_heads: int  # K
    head_dim: int  # H
    d_ff: int  # F (dense MLP width; per-expert width for MoE)
    vocab_size: int  # V
    max_seq_len: int = 4096
    # whether the config names its context window (max_position_embeddings, n_positions or seq_length); where it
    # does not, max_seq_len is a default and nothing is refused for exceeding it
    context_declared: bool = True
    # the config.json key that declares it (named in the error that refuses a longer request)
    context_field: str = "max_position_embeddings"
    mlp_act: str = "swiglu"
    tied_embeddings: bool = False
    position: str = "rotary"  # rotary | learned | alibi
    # RoPE scaling of config.json `rope_scaling` (`rope_parameters` in newer transformers): its rope_type (or type),
    # e.g. "yarn" (gpt-oss, transformers models/gpt_oss/configuration_gpt_oss.py: factor 32), "llama3"; "" = none
    rope_scaling: str = ""
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    linear_bias: bool = False  # every linear layer has a bias (GPT-2/3, NeoX, BLOOM)
    qkv_bias: bool = False  # only the Q/K/V projections have biases (Qwen2)
    out_bias: bool = False  # the attention output projection has a bias too (attention_bias outside Qwen: Phi-3.5-MoE)
    n_experts: int = 0  # E; 0 means dense
    experts_per_token: int = 0  # k
    n_shared_experts: int = 0
    shared_expert_d_ff: int = 0
    # Multi-head latent attention (DeepSeek-V2 §2.1, arXiv:2405.04434): keys and values come from a shared
    # latent of width kv_lora_rank (plus one RoPE key of qk_rope_head_dim shared by all heads), queries from a
    # latent of width q_lora_rank (0: a full-rank W_Q); head_dim is the non-RoPE query/key width per head.
    kv_lora_rank: int = 0  # 0 = standard multi-head / grouped-query attention
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0  # value width per head (0 = head_dim)
    # MoE models whose first layers are dense (DeepSeek's first_k_dense_replace) with this MLP width
    # (DeepSeek's first_k_dense_replace, Llama 4's interleave_moe_layer_step, Qwen's mlp_only_layers: only their
    # number matters to the counts and to the mean layer the cost model times)
    first_dense_layers: int = 0
    dense_d_ff: int = 0
    moe_interleave: int = 0  # MoE on every n-th layer (Llama 4, Qwen's decoder_sparse_step); 0: dense layers lead
    # Attention span per layer, in tokens, 0 = full causal attention (one entry per layer, or empty: all full).
    # window_kind "sliding": a query sees the last w keys (Mistral, Gemma 2/3 local layers, gpt-oss); "chunked": a
    # query sees the keys of its own w-token chunk (Llama 4's local layers, attention_chunk_size).
    layer_windows: tuple[int, ...] = ()
    window_kind: str = "sliding"
    attn_logit_softcap: float = 0.0  # Gemma 2: tanh soft-capping of attention logits (0 = none)
    final_logit_softcap: float = 0.0  # Gemma 2: soft-capping of the output logits
    attention_sinks: bool = False  # gpt-oss: one learned sink logit per head and layer
    qk_norm: str = ""  # "": none; "head": RMSNorm over each head's H (Qwen3, Gemma 3); "full": over N·H and K·H (OLMo 2)
    norms_per_layer: int = 2  # pre-attention and pre-MLP; Gemma 2/3 add two post-norms; Cohere/Falcon-7B share one
    norm_bias: bool = True  # LayerNorm with a bias (False: Cohere's scale-only LayerNorm)
    router_bias: bool = False  # gpt-oss: the router has a bias
    # gpt-oss: the GLU's gate half clamped to at most this and its linear half to ±this before the activation
    # (config.json swiglu_limit; 0 = no clamp)
    glu_limit: float = 0.0
    lm_head_bias: bool = False  # Phi-3.5-MoE: the output projection has a bias
    shared_expert_gate: bool = False  # Qwen2-MoE: a sigmoid gate [D, 1] on the shared expert
    moe_norm_topk: bool = False  # routing weights renormalised over the top k (norm_topk_prob); no cost effect
    moe_n_groups: int = 0  # DeepSeek group/node-limited routing: experts in n_group groups,
    moe_topk_groups: int = 0  # a token's k experts drawn from topk_group of them (DeepSeek-V3: 8 and 4)
    expert_weight_dtype: str = ""  # the released checkpoint's expert weights, e.g. "mxfp4" (gpt-oss); "" = as the rest
    # the released checkpoint's linear weights where they ship quantized: "fp8" (config.json quantization_config
    # quant_method fp8: DeepSeek-V3/R1's 128x128 block-scaled E4M3); "" = the model dtype
    released_weight_dtype: str = ""
    # the FP8 checkpoint's scaling blocks: weights quantized in blocks of this many x this many elements with a scale
    # each (config.json quantization_config weight_block_size: [128, 128] for DeepSeek-V3 and Qwen3's FP8 releases);
    # 0 = one scale per tensor, or not an FP8 release
    released_weight_block: int = 0
    family: str = "llama"
    source: str = ""

    # --- derived shapes -------------------------------------------------------------------------
    @property
    def gated(self) -> bool:
        return self.mlp_act in GATED_ACTS

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 1

    @property
    def q_dim(self) -> int:
        """N·H, width of the query (and attention output) projection."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """K·H, width of each of the key and value projections."""
        return self.n_kv_heads * self.head_dim

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head: head_dim, plus the decoupled RoPE part under MLA."""
        return self.head_dim + self.qk_rope_head_dim

    @property
    def v_dim(self) -> int:
        """Value width per head (the attention output is N·v_dim wide)."""
        return self.v_head_dim or self.head_dim

    def mla_weights(self) -> dict[str, int]:
        """MLA projection weights of one layer (DeepSeek-V2 eqs. 1-10): down-projections shared by the heads,
        up-projections per head, and the output projection."""
        D, N = self.d_model, self.n_heads
        q_up = N * self.qk_head_dim
        return {
            "q_down": D * self.q_lora_rank,
            "q_up": (self.q_lora_rank or D) * q_up,  # full-rank W_Q when there is no query latent
            "kv_down": D * (self.kv_lora_rank + self.qk_rope_head_dim),
            "kv_up": self.kv_lora_rank * N * (self.head_dim + self.v_dim),
            "o": N * self.v_dim * D,
        }

    @property
    def has_windows(self) -> bool:
        return any(self.layer_windows)

    def windows(self) -> tuple[int, ...]:
        """The attention span of every layer (0 = full)."""
        return self.layer_windows or (0,) * self.n_layers

    @property
    def gqa_group(self) -> int:
        """G = N/K query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    def with_overrides(self, **changes: Any) -> ModelConfig:
        new = replace(self, **changes)
        validate_model(new)
        return new

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_SIZE_FIELDS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size", "max_seq_len",
                "n_experts", "experts_per_token", "n_shared_experts", "shared_expert_d_ff", "kv_lora_rank",
                "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "first_dense_layers", "dense_d_ff", "moe_interleave")
_MAX_SIZE = 2**53


def validate_model(m: ModelConfig) -> None:
    """Raise MeshplanError for sizes that cannot describe a transformer."""
    for f in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size", "max_seq_len"):
        v = getattr(m, f)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise MeshplanError(f"model '{m.name}': {f} must be a positive integer, got {v!r}")
    for f in _SIZE_FIELDS:
        # beyond 2**53 a size is no longer exact as a float and FLOP/byte products overflow float range
        if isinstance(getattr(m, f), int) and getattr(m, f) > _MAX_SIZE:
            raise MeshplanError(f"model '{m.name}': {f} is implausibly large (more than 2**53)")
    # each weight matrix family (embedding, attention, MLP/experts) bounded: products stay exact and in int64
    sizes = {"vocab_size x d_model": m.vocab_size * m.d_model,
             "n_layers x d_model x n_heads x head_dim": m.n_layers * m.d_model * m.n_heads * m.head_dim,
             "n_layers x d_model x d_ff x experts": m.n_layers * m.d_model * m.d_ff * max(1, m.n_experts)}
    for what, n in sizes.items():
        if n > MAX_PARAMS:
            raise MeshplanError(f"model '{m.name}': {what} = {n:.3g} parameters, more than {MAX_PARAMS:.0e} "
                                f"(500x the largest published model)")
    if m.n_heads % m.n_kv_heads:
        raise MeshplanError(f"model '{m.name}': {m.n_heads} query heads are not divisible by {m.n_kv_heads} KV heads")
    if m.mlp_act not in MLP_ACTS:
        raise MeshplanError(f"model '{m.name}': unknown MLP activation '{m.mlp_act}' (known: {', '.join(MLP_ACTS)})")
    if m.position not in ("rotary", "learned", "alibi"):
        raise MeshplanError(f"model '{m.name}': unknown position embedding '{m.position}'")
    if m.norm not in ("rmsnorm", "layernorm"):
        raise MeshplanError(f"model '{m.name}': unknown norm '{m.norm}'")
    if m.n_experts < 0 or m.experts_per_token < 0 or m.n_shared_experts < 0 or m.shared_expert_d_ff < 0:
        raise MeshplanError(f"model '{m.name}': expert counts must not be negative")
    for f in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "first_dense_layers", "dense_d_ff"):
        v = getattr(m, f)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise MeshplanError(f"model '{m.name}': {f} must be a non-negative integer, got {v!r}")
    if not m.is_mla and (m.q_lora_rank or m.qk_rope_head_dim):
        raise MeshplanError(f"model '{m.name}': q_lora_rank and qk_rope_head_dim need MLA (kv_lora_rank > 0)")
    if m.first_dense_layers and (m.first_dense_layers >= m.n_layers or not m.dense_d_ff or not m.is_moe):
        raise MeshplanError(f"model '{m.name}': first_dense_layers needs an MoE model, fewer than {m.n_layers} "
                            f"dense layers and their dense_d_ff")
    if m.layer_windows and (len(m.layer_windows) != m.n_layers or any(
            isinstance(w, bool) or not isinstance(w, int) or w < 0 for w in m.layer_windows)):
        raise MeshplanError(f"model '{m.name}': layer_windows needs one non-negative window per layer ({m.n_layers})")
    if m.window_kind not in ("sliding", "chunked"):
        raise MeshplanError(f"model '{m.name}': window_kind must be sliding or chunked, got '{m.window_kind}'")
    if m.qk_norm not in ("", "head", "full"):
        raise MeshplanError(f"model '{m.name}': qk_norm must be '', head or full, got '{m.qk_norm}'")
    if isinstance(m.norms_per_layer, bool) or not isinstance(m.norms_per_layer, int) or not 0 <= m.norms_per_layer <= 8:
        raise MeshplanError(f"model '{m.name}': norms_per_layer must be an integer from 0 to 8")
    if m.is_moe and not 1 <= m.experts_per_token <= m.n_experts:
        raise MeshplanError(
            f"model '{m.name}': experts per token must be between 1 and {m.n_experts}, got {m.experts_per_token}")


# --- Hugging Face config.json ---------------------------------------------------------------------

def _int(cfg: dict[str, Any], origin: str, *keys: str, default: Any = None) -> Any:
    """First present key among `keys` as a positive int (None/absent -> default)."""
    for k in keys:
        if k in cfg and cfg[k] is not None:
            v = cfg[k]
            if (isinstance(v, bool) or not isinstance(v, int | float)
                    or (isinstance(v, float) and not math.isfinite(v)) or v != int(v)):
                raise MeshplanError(f"{origin}: '{k}' must be an integer, got {v!r}")
            if v <= 0:
                raise MeshplanError(f"{origin}: '{k}' must be positive, got {v!r}")
            return int(v)
    if default is None:
        raise MeshplanError(f"{origin}: missing '{keys[0]}'")
    return default


def _act(name: Any, gated_family: bool) -> str:
    s = str(name or "").lower()
    if gated_family:
        return "geglu" if "gelu" in s else "swiglu"
    if "relu" in s:
        return "relu"
    if "silu" in s or "swish" in s:
        return "silu"
    return "gelu"


# Model types read with their own semantics (transformers' configuration_<type>.py defaults). Gated MLPs (three
# matrices) unless listed in _PLAIN_MLP; "meshplan" is the generic schema below.
_GATED_FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
                   "gemma3", "gemma3_text", "deepseek_v2", "deepseek_v3", "llama4", "llama4_text", "gpt_oss", "phi3",
                   "phimoe", "mistral3", "ministral3", "olmo2", "cohere", "granite")
_PLAIN_MLP = ("gpt2", "gpt_neox", "gpt_bigcode", "falcon")
SUPPORTED_MODEL_TYPES = _GATED_FAMILIES + _PLAIN_MLP + ("meshplan",)
_KNOWN_FAMILIES = SUPPORTED_MODEL_TYPES  # kept for callers of the old name
# Keys of meshplan's generic schema (`model_type: meshplan`, YAML or JSON): any decoder-only transformer the types
# above do not cover, described by its shapes.
GENERIC_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "max_position_embeddings", "mlp_act (swiglu|geglu|gelu|relu|silu)",
                "tie_word_embeddings", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "n_shared_experts", "layer_windows (one span per layer, 0 = full)", "window_kind (sliding|chunked)",
                "kv_lora_rank/q_lora_rank/qk_rope_head_dim/v_head_dim (MLA)")
_WRAPPERS = ("mistral3", "llama4", "gemma3")  # multimodal configs whose text model sits under text_config


def _unsupported(origin: str, family: str) -> MeshplanError:
    return MeshplanError(
        f"{origin}: model_type '{family}' is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)}); "
        f"describe it generically with model_type: meshplan and the keys {'; '.join(GENERIC_KEYS)}")


# Defaults of transformers' configuration classes for keys that released configs leave out (Gemma 3's multimodal
# configs give only the shapes that differ from Gemma3TextConfig's defaults)
_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {"vocab_size": 262208, "max_position_embeddings": 131072, "sliding_window": 4096,
                    "sliding_window_pattern": 6, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh"},
}


def _float(cfg: dict[str, Any], origin: str, key: str) -> float:
    v = cfg.get(key)
    if v is None:
        return 0.0
    # an int beyond float range (math.isfinite would overflow on it) is as wrong as inf
    if (isinstance(v, bool) or not isinstance(v, int | float) or (isinstance(v, int) and abs(v) > 2**53)
            or not math.isfinite(v) or v < 0):
        raise MeshplanError(f"{origin}: '{key}' must be a non-negative number, got {str(v)[:40]}")
    return float(v)


def _text_part(cfg: dict[str, Any], origin: str) -> tuple[dict[str, Any], str]:
    """The language model's config: a multimodal config's `text_config` (Llama 4, Gemma 3, Mistral 3 ...), with the
    outer file's provenance keys kept."""
    family = str(cfg.get("model_type", "llama")).lower()
    text = cfg.get("text_config")
    if isinstance(text, dict):
        inner = {k: v for k, v in cfg.items() if k.startswith("_")}
        inner.update(text)
        inner_family = str(text.get("model_type") or family).lower()
        inner.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", text.get("tie_word_embeddings")))
        return inner, inner_family
    if family in _WRAPPERS and family != "gemma3":
        raise MeshplanError(f"{origin}: a '{family}' config needs its text_config")
    return cfg, family


def _layer_windows(cfg: dict[str, Any], family: str, L: int, origin: str) -> tuple[tuple[int, ...], str]:
    """Per-layer attention span from the config's own layer schedule (transformers' semantics per model type)."""
    if "layer_windows" in cfg:  # meshplan's generic schema
        w = cfg["layer_windows"]
        if not isinstance(w, list) or len(w) != L or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                              for x in w):
            raise MeshplanError(f"{origin}: 'layer_windows' must list {L} non-negative spans (0 = full)")
        return tuple(w), str(cfg.get("window_kind", "sliding"))
    if family in ("llama4", "llama4_text"):
        C = _int(cfg, origin, "attention_chunk_size", default=0) if cfg.get("attention_chunk_size") else 0
        if not C:
            return (), "sliding"
        nope = cfg.get("no_rope_layers")
        # Llama 4 (modeling_llama4): RoPE layers use chunked attention, the NoPE layers (every 4th) see everything
        if isinstance(nope, list) and len(nope) == L:
            return tuple(C if x else 0 for x in nope), "chunked"
        return tuple(C if (i + 1) % 4 else 0 for i in range(L)), "chunked"
    W = cfg.get("sliding_window")
    if not W or cfg.get("use_sliding_window") is False:
        return (), "sliding"
    W = _int(cfg, origin, "sliding_window")
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != L:
            raise MeshplanError(f"{origin}: 'layer_types' must list the attention type of each of the {L} layers")
        return tuple(W if str(t).startswith("sliding") else 0 for t in types), "sliding"
    if family == "gemma2":
        # Gemma 2 (modeling_gemma2): even layers local (sliding), odd layers global
        return tuple(W if i % 2 == 0 else 0 for i in range(L)), "sliding"
    if family in ("gemma3", "gemma3_text"):
        # Gemma 3 report §2.2: 5 local layers for every global one; layer i is global when (i + 1) % pattern == 0
        pattern = _int(cfg, origin, "sliding_window_pattern", default=6)
        return tuple(0 if (i + 1) % pattern == 0 else W for i in range(L)), "sliding"
    if family == "gpt_oss":
        return tuple(W if i % 2 == 0 else 0 for i in range(L)), "sliding"  # alternating, sliding first
    if family in ("mistral", "mixtral", "phi3", "phimoe", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "meshplan"):
        seq = cfg.get("max_position_embeddings") or 0
        if isinstance(seq, int) and 0 < seq <= W:
            return (), "sliding"  # a window as long as the context is full attention
        if family in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
            # Qwen2/3 (use_sliding_window true): layers from max_window_layers on use the window
            first = _int(cfg, origin, "max_window_layers", default=L)
            return tuple(W if i >= first else 0 for i in range(L)), "sliding"
        return (W,) * L, "sliding"
    return (), "sliding"


def _layer_list(cfg: dict[str, Any], key: str, L: int, origin: str) -> set[int]:
    """A list of layer indices (Llama 4's moe_layers, Qwen's mlp_only_layers), each in 0..L-1."""
    value = cfg.get(key) or []
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < L
                                              for i in value):
        raise MeshplanError(f"{origin}: '{key}' must be a list of layer indices from 0 to {L - 1}")
    return set(value)


def _dense_layer_count(cfg: dict[str, Any], family: str, L: int, origin: str) -> int:
    """Layers of an MoE model that keep a dense MLP."""
    if cfg.get("first_k_dense_replace"):
        return _int(cfg, origin, "first_k_dense_replace")
    if family in ("llama4", "llama4_text"):
        moe_layers = _layer_list(cfg, "moe_layers", L, origin)
        if moe_layers:
            return L - len(moe_layers)
        step = _int(cfg, origin, "interleave_moe_layer_step", default=1)
        return L - L // step  # Llama 4: layers step-1, 2·step-1, ... are MoE
    if family in ("qwen2_moe", "qwen3_moe"):
        dense = _layer_list(cfg, "mlp_only_layers", L, origin)
        step = _int(cfg, origin, "decoder_sparse_step", default=1)
        return sum(1 for i in range(L) if i in dense or (i + 1) % step)  # Qwen MoE: MoE where (i+1) % step == 0
    return 0


def model_from_hf(cfg: dict[str, Any], name: str, origin: str) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json mapping (or meshplan's generic schema)."""
    family = str(cfg.get("model_type", "llama")).lower()
    if family not in SUPPORTED_MODEL_TYPES:
        raise _unsupported(origin, family)
    cfg, family = _text_part(cfg, origin)
    if family not in SUPPORTED_MODEL_TYPES:
        raise _unsupported(origin, family)
    cfg = {**_TYPE_DEFAULTS.get(family, {}), **cfg}
    gpt_style = family in ("gpt2", "gpt_bigcode")
    gemma = family.startswith("gemma")
    D = _int(cfg, origin, "hidden_size", "n_embd", "d_model")
    N = _int(cfg, origin, "num_attention_heads", "n_head")
    L = _int(cfg, origin, "num_hidden_layers", "n_layer")
    V = _int(cfg, origin, "vocab_size")
    mla = {}
    if cfg.get("kv_lora_rank"):
        # DeepSeek-V2/V3 multi-head latent attention: head_dim is the non-RoPE query/key width
        mla = dict(kv_lora_rank=_int(cfg, origin, "kv_lora_rank"),
                   q_lora_rank=_int(cfg, origin, "q_lora_rank", default=0) if cfg.get("q_lora_rank") else 0,
                   qk_rope_head_dim=_int(cfg, origin, "qk_rope_head_dim", default=0),
                   v_head_dim=_int(cfg, origin, "v_head_dim", default=0))
    if mla:
        H = _int(cfg, origin, "qk_nope_head_dim", "head_dim")
    elif "head_dim" in cfg and cfg["head_dim"] is not None:
        H = _int(cfg, origin, "head_dim")
    else:
        if D % N:
            raise MeshplanError(f"{origin}: {N} attention heads do not divide hidden size {D} (give head_dim to override)")
        H = D // N
    if family == "gpt_bigcode" and cfg.get("multi_query", True):
        K = 1
    elif family == "falcon" and not cfg.get("new_decoder_architecture") and cfg.get("multi_query", True):
        K = 1  # Falcon-7B: multi-query attention
    else:
        K = _int(cfg, origin, "num_key_value_heads", "n_kv_heads", "num_kv_heads", default=N)
    F = _int(cfg, origin, "intermediate_size", "n_inner", "ffn_hidden_size", default=4 * D)
    E = _int(cfg, origin, "num_local_experts", "num_experts", "n_routed_experts", default=0) if any(
        k in cfg and cfg[k] for k in ("num_local_experts", "num_experts", "n_routed_experts")) else 0
    k = _int(cfg, origin, "num_experts_per_tok", "moe_topk", "experts_per_token", default=2 if E else 0) if E else 0
    shared_F = 0
    n_shared = 0
    dense = {}
    if E:
        n_dense = _dense_layer_count(cfg, family, L, origin)
        if family in ("llama4", "llama4_text"):
            # Llama 4: experts and the always-on shared expert are intermediate_size wide; its dense layers'
            # MLPs intermediate_size_mlp
            n_shared, shared_F = 1, F
            if n_dense:
                dense = dict(first_dense_layers=n_dense, dense_d_ff=_int(cfg, origin, "intermediate_size_mlp"),
                             moe_interleave=_int(cfg, origin, "interleave_moe_layer_step", default=1))
        elif cfg.get("moe_intermediate_size"):
            if n_dense:
                dense = dict(first_dense_layers=n_dense, dense_d_ff=F,
                             moe_interleave=_int(cfg, origin, "decoder_sparse_step", default=0)
                             if family in ("qwen2_moe", "qwen3_moe") and cfg.get("decoder_sparse_step") else 0)
            F = _int(cfg, origin, "moe_intermediate_size")
    if cfg.get("shared_expert_intermediate_size"):
        shared_F = _int(cfg, origin, "shared_expert_intermediate_size")
        n_shared = 1
    if cfg.get("n_shared_experts"):
        n_shared = _int(cfg, origin, "n_shared_experts")
        shared_F = shared_F or F
    gated = family in _GATED_FAMILIES
    act = cfg.get("mlp_act") or _act(cfg.get("hidden_activation") or cfg.get("hidden_act")
                                     or cfg.get("activation_function"), gated)
    # tied embeddings: transformers' defaults per model type (Gemma, Cohere, Falcon and GPT-2 tie theirs)
    tied_default = gpt_style or gemma or family in ("cohere", "falcon")
    tied = cfg.get("tie_word_embeddings", tied_default)
    if tied is None:
        tied = tied_default
    if not isinstance(tied, bool):
        raise MeshplanError(f"{origin}: 'tie_word_embeddings' must be true or false, got {tied!r}")
    position = cfg.get("position") or ("learned" if gpt_style else "alibi" if cfg.get("alibi") else "rotary")
    layernorm = family in ("gpt2", "gpt_neox", "gpt_bigcode", "falcon", "cohere", "phimoe")
    norm = cfg.get("norm") or ("layernorm" if layernorm else "rmsnorm")
    linear_bias = bool(cfg.get("linear_bias", family in ("gpt2", "gpt_neox", "gpt_bigcode", "gpt_oss")
                           or (family == "falcon" and cfg.get("bias", False))))
    qkv_bias = bool(cfg.get("attention_bias", family in ("qwen2", "qwen2_moe")))
    if family == "gpt_oss":
        qkv_bias = True
    seq = _int(cfg, origin, "max_position_embeddings", "n_positions", "seq_length", default=4096)
    declared = [k for k in ("max_position_embeddings", "n_positions", "seq_length") if cfg.get(k) is not None]
    context_declared = bool(declared)
    windows, kind = _layer_windows(cfg, family, L, origin)
    norms_per_layer = 2
    if gemma and family != "gemma":
        norms_per_layer = 4  # Gemma 2/3: pre- and post-norms around attention and MLP
    elif family == "cohere" or (family == "falcon" and not cfg.get("new_decoder_architecture")):
        norms_per_layer = 1  # one input norm feeds the parallel attention and MLP
    elif family == "falcon" and cfg.get("num_ln_in_parallel_attn", 2) == 1:
        norms_per_layer = 1
    qk_norm = ""
    if family in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text"):
        qk_norm = "head"  # RMSNorm(head_dim) shared by the heads
    elif family == "olmo2" or (family == "cohere" and cfg.get("use_qk_norm")):
        qk_norm = "full"  # OLMo 2: RMSNorm over N·H and K·H; Cohere: a LayerNorm weight per (head, dim)
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    rope_scaling = str(rope.get("rope_type") or rope.get("type") or "").lower() if isinstance(rope, dict) else ""
    if family == "gpt_oss" and not rope:
        rope_scaling = "yarn"  # transformers' GptOssConfig default rope_parameters: rope_type "yarn", factor 32
    quant = cfg.get("quantization_config")
    method = str(quant.get("quant_method", "")) if isinstance(quant, dict) else ""
    block = quant.get("weight_block_size") if method == "fp8" else None
    if block is not None and not (isinstance(block, list) and block and all(isinstance(b, int) and b > 0 for b in block)):
        raise MeshplanError(f"{origin}: quantization_config.weight_block_size must be a list of positive integers, "
                            f"got {block!r}")
    expert_dtype = method if family == "gpt_oss" else ""
    m = ModelConfig(
        name=name, n_layers=L, d_model=D, n_heads=N, n_kv_heads=K, head_dim=H, d_ff=F, vocab_size=V,
        max_seq_len=seq, context_declared=context_declared,
        context_field=declared[0] if declared else "max_position_embeddings", mlp_act=act, tied_embeddings=tied, position=position, rope_scaling=rope_scaling, norm=norm,
        linear_bias=linear_bias, qkv_bias=qkv_bias and not linear_bias,
        # transformers: attention_bias gives Q, K, V and O biases (Llama, Phi-3.5-MoE, ...), Qwen2's only Q/K/V
        out_bias=qkv_bias and not linear_bias and family not in ("qwen2", "qwen2_moe"),
        n_experts=E, experts_per_token=k,
        n_shared_experts=n_shared, shared_expert_d_ff=shared_F, family=family,
        layer_windows=windows if any(windows) else (), window_kind=kind,
        attn_logit_softcap=_float(cfg, origin, "attn_logit_softcapping"),
        final_logit_softcap=_float(cfg, origin, "final_logit_softcapping"),
        attention_sinks=family == "gpt_oss", qk_norm=qk_norm, norms_per_layer=norms_per_layer,
        norm_bias=family != "cohere", router_bias=family == "gpt_oss",
        glu_limit=_float(cfg, origin, "swiglu_limit"),
        lm_head_bias=bool(cfg.get("lm_head_bias", family == "phimoe")),
        shared_expert_gate=family == "qwen2_moe" and bool(n_shared),
        moe_norm_topk=bool(cfg.get("norm_topk_prob", family in ("mixtral", "phimoe", "gpt_oss", "llama4_text"))),
        moe_n_groups=_int(cfg, origin, "n_group", default=0) if E and cfg.get("n_group") else 0,
        moe_topk_groups=_int(cfg, origin, "topk_group", default=0) if E and cfg.get("topk_group") else 0,
        expert_weight_dtype=expert_dtype, released_weight_dtype="fp8" if method == "fp8" else "",
        released_weight_block=int(block[0]) if block else 0,
        source=str(cfg.get("_source", origin)), **mla, **dense,
    )
    validate_model(m)
    return m


def preset_models() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


@lru_cache(maxsize=128)
def _load_path(path: str, name: str) -> ModelConfig:
    p = Path(path)
    cfg = read_mapping(p, "model config")
    return model_from_hf(cfg, str(cfg.get("_name", name)), f"model config '{p.name}'")


def load_model(name_or_path: str) -> ModelConfig:
    """A preset name or a path to a Hugging Face style config.json (or the folder holding it)."""
    p = find_spec(name_or_path, "model", MODELS_DIR, ".json", preset_models, "model config", dir_file="config.json")
    return _load_path(str(p.resolve()), p.parent.name if p.name == "config.json" else p.stem)
