"""Model architecture: the shape of a decoder-only transformer in the book's notation.

`load_model` takes a preset name (`llama3-70b`) or a path to a Hugging Face style `config.json`
(model_type llama, mistral, mixtral, qwen2, qwen2_moe, gpt2, gpt_neox, gpt_bigcode). Presets are
themselves HF-style JSON files in `data/models/`, each with a `_source`. Missing keys get the model
type's defaults; contradictions are errors.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from meshplan.errors import MeshplanError, unknown_name_error
from meshplan.specs._load import DATA_DIR, read_mapping

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
    mlp_act: str = "swiglu"
    tied_embeddings: bool = False
    position: str = "rotary"  # rotary | learned | alibi
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    linear_bias: bool = False  # every linear layer has a bias (GPT-2/3, NeoX, BLOOM)
    qkv_bias: bool = False  # only the Q/K/V projections have biases (Qwen2)
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
    first_dense_layers: int = 0
    dense_d_ff: int = 0
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
                "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "first_dense_layers", "dense_d_ff")
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


_GATED_FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "deepseek_v2",
                   "deepseek_v3")
_KNOWN_FAMILIES = _GATED_FAMILIES + ("gpt2", "gpt_neox", "gpt_bigcode", "meshplan")


def model_from_hf(cfg: dict[str, Any], name: str, origin: str) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json mapping."""
    family = str(cfg.get("model_type", "llama")).lower()
    if family not in _KNOWN_FAMILIES:
        raise MeshplanError(f"{origin}: model_type '{family}' is not supported (supported: {', '.join(_KNOWN_FAMILIES)})")
    gpt_style = family in ("gpt2", "gpt_bigcode")
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
    else:
        K = _int(cfg, origin, "num_key_value_heads", "n_kv_heads", default=N)
    F = _int(cfg, origin, "intermediate_size", "n_inner", "ffn_hidden_size", default=4 * D)
    moe_F = cfg.get("moe_intermediate_size")
    E = _int(cfg, origin, "num_local_experts", "num_experts", "n_routed_experts", default=0) if any(
        k in cfg and cfg[k] for k in ("num_local_experts", "num_experts", "n_routed_experts")) else 0
    k = _int(cfg, origin, "num_experts_per_tok", "moe_topk", default=2 if E else 0) if E else 0
    shared_F = 0
    n_shared = 0
    dense = {}
    if E and moe_F:
        if cfg.get("first_k_dense_replace"):
            # DeepSeek: the first k layers keep a dense MLP of intermediate_size
            dense = dict(first_dense_layers=_int(cfg, origin, "first_k_dense_replace"), dense_d_ff=F)
        F = _int(cfg, origin, "moe_intermediate_size")
    if cfg.get("shared_expert_intermediate_size"):
        shared_F = _int(cfg, origin, "shared_expert_intermediate_size")
        n_shared = 1
    if cfg.get("n_shared_experts"):
        n_shared = _int(cfg, origin, "n_shared_experts")
        shared_F = shared_F or F
    gated = family in _GATED_FAMILIES
    act = cfg.get("mlp_act") or _act(cfg.get("hidden_act") or cfg.get("activation_function"), gated)
    tied_default = gpt_style
    tied = cfg.get("tie_word_embeddings", tied_default)
    if not isinstance(tied, bool):
        raise MeshplanError(f"{origin}: 'tie_word_embeddings' must be true or false, got {tied!r}")
    position = cfg.get("position") or ("learned" if gpt_style else "rotary")
    norm = cfg.get("norm") or ("layernorm" if family in ("gpt2", "gpt_neox", "gpt_bigcode") else "rmsnorm")
    linear_bias = bool(cfg.get("linear_bias", family in ("gpt2", "gpt_neox", "gpt_bigcode")))
    qkv_bias = bool(cfg.get("attention_bias", family in ("qwen2", "qwen2_moe")))
    seq = _int(cfg, origin, "max_position_embeddings", "n_positions", "seq_length", default=4096)
    m = ModelConfig(
        name=name, n_layers=L, d_model=D, n_heads=N, n_kv_heads=K, head_dim=H, d_ff=F, vocab_size=V,
        max_seq_len=seq, mlp_act=act, tied_embeddings=tied, position=position, norm=norm,
        linear_bias=linear_bias, qkv_bias=qkv_bias and not linear_bias, n_experts=E, experts_per_token=k,
        n_shared_experts=n_shared, shared_expert_d_ff=shared_F, family=family,
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
    """A preset name or a path to a Hugging Face style config.json."""
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise MeshplanError("model name is empty")
    key = name_or_path.strip()
    preset = MODELS_DIR / f"{key.lower()}.json"
    if preset.is_file():
        return _load_path(str(preset), key.lower())
    p = Path(key)
    if p.suffix.lower() in (".json", ".yaml", ".yml") or p.is_file() or p.is_dir():
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise MeshplanError(f"model config '{key}' does not exist")
        return _load_path(str(p.resolve()), p.parent.name if p.name == "config.json" else p.stem)
    raise unknown_name_error("model", key, preset_models())
