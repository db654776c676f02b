"""Transformer math for one device with no parallelism (book ch. 4; Korthikanti et al. 2022).

Everything here knows nothing of layouts: `train/` applies a layout on top. Notation is the book's:
L layers, D d_model, N query heads, K KV heads, H head dim, F MLP width, V vocab, E experts (k active),
T/S sequence length, b micro-batch in sequences. FLOPs count a multiply-add as 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshplan.errors import MeshplanError
from meshplan.specs.model import ModelConfig

# mxfp4: OCP Microscaling Formats v1.0 — blocks of 32 E2M1 (4-bit) elements sharing one E8M0 (8-bit) scale,
# 4.25 bits per element (gpt-oss's released expert weights)
BYTES_PER_DTYPE = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5, "mxfp4": 4.25 / 8}
# mla-up-proj: Megatron-Core's selective recompute of the MLA up-projections (recompute_modules ["mla_up_proj"],
# megatron/core/transformer/multi_latent_attention.py: `qkv_up_proj_and_rope_apply` run under
# CheckpointWithoutOutput, its query/key/value discarded once the attention core has read them and rebuilt before the
# core's backward); only meaningful for a model with multi-head latent attention (`check_recompute_for`)
RECOMPUTE_POLICIES = ("none", "selective", "full", "gemm-last", "mla-up-proj")
MLA_ONLY_POLICIES = ("mla-up-proj",)
# --recompute's help, wherever a command takes it
RECOMPUTE_HELP = (" | ".join(RECOMPUTE_POLICIES) + " (mla-up-proj: MLA models only, Megatron-Core's recompute of the "
                  "latent up-projections, --recompute-modules mla_up_proj)")


def check_recompute_for(m: ModelConfig, recompute: str) -> None:
    """One clear error for a recompute policy the model has nothing to apply to (mla-up-proj without MLA)."""
    if recompute in MLA_ONLY_POLICIES and not m.is_mla:
        raise MeshplanError(f"--recompute {recompute} recomputes the up-projections of multi-head latent attention; "
                            f"{m.name} has no MLA (use none, selective, full or gemm-last)")


def dtype_bytes(dtype: str) -> float:
    try:
        return BYTES_PER_DTYPE[dtype]
    except KeyError:
        raise MeshplanError(f"unknown dtype '{dtype}' (known: {', '.join(BYTES_PER_DTYPE)})") from None


# --- parameters ----------------------------------------------------------------------------------

def _mlp_params(m: ModelConfig, width: int) -> int:
    """One MLP of hidden width F: 3DF gated (W_in1, W_in2, W_out) or 2DF plain (book ch.4 table)."""
    weights = (3 if m.gated else 2) * m.d_model * width
    bias = (width * (2 if m.gated else 1) + m.d_model) if m.linear_bias else 0
    return weights + bias


def expert_params(m: ModelConfig) -> float:
    """One routed expert's weights: 3·D·F gated, 2·D·F otherwise (book ch.4 MoE)."""
    return (3 if m.gated else 2) * m.d_model * m.d_ff


def touched_experts(m: ModelConfig, tokens: float) -> float:
    """Expected distinct routed experts hit by `tokens` tokens choosing k of E uniformly:
    E * (1 - (1 - k/E)^tokens). Decode at small batch reads only these (the MoE memory-bound regime, book ch.7)."""
    if not m.is_moe or tokens <= 0:
        return 0.0
    return m.n_experts * (1.0 - (1.0 - m.experts_per_token / m.n_experts) ** tokens)


def _norm_params(m: ModelConfig, width: int | None = None) -> int:
    """RMSNorm has a scale (D); LayerNorm a scale and a bias (2D; Cohere's LayerNorm has no bias)."""
    return (width or m.d_model) * (2 if m.norm == "layernorm" and m.norm_bias else 1)


def _qk_norm_params(m: ModelConfig) -> int:
    """Norms on queries and keys: per head over H (Qwen3, Gemma 3: 2H) or over the whole projections (OLMo 2:
    N·H + K·H)."""
    if m.qk_norm == "head":
        return 2 * _norm_params(m, m.head_dim)
    if m.qk_norm == "full":
        return _norm_params(m, m.q_dim) + _norm_params(m, m.kv_dim)
    return 0


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts by part. `per_layer_*` are for one layer; totals cover the whole model."""

    embedding: int
    position: int
    per_layer_attention: int
    per_layer_mlp: int  # all experts (total) for MoE
    per_layer_mlp_active: int  # k routed + shared experts for MoE
    per_layer_router: int
    per_layer_norms: int
    final_norm: int
    unembedding: int  # 0 when tied
    n_layers: int
    n_dense_layers: int = 0  # leading dense layers of an MoE model (DeepSeek), counted apart
    per_dense_layer_mlp: int = 0

    @property
    def per_layer(self) -> int:
        return self.per_layer_attention + self.per_layer_mlp + self.per_layer_router + self.per_layer_norms

    @property
    def per_layer_active(self) -> int:
        return self.per_layer_attention + self.per_layer_mlp_active + self.per_layer_router + self.per_layer_norms

    @property
    def _dense_layers(self) -> int:
        """What the leading dense layers add over counting them as MoE layers (negative: they are smaller)."""
        dense = self.per_layer_attention + self.per_dense_layer_mlp + self.per_layer_norms
        return self.n_dense_layers * dense

    @property
    def total(self) -> int:
        moe_layers = self.n_layers - self.n_dense_layers
        return (self.embedding + self.position + moe_layers * self.per_layer + self._dense_layers
                + self.final_norm + self.unembedding)

    @property
    def active(self) -> int:
        moe_layers = self.n_layers - self.n_dense_layers
        return (self.embedding + self.position + moe_layers * self.per_layer_active + self._dense_layers
                + self.final_norm + self.unembedding)

    def breakdown(self) -> dict[str, int]:
        """Parameters by part, summing to `total`: the leading dense layers of an MoE model (DeepSeek) count their
        own MLP, not the experts."""
        moe_layers = self.n_layers - self.n_dense_layers
        return {
            "embedding": self.embedding, "position": self.position,
            "attention": self.per_layer_attention * self.n_layers,
            "mlp": self.per_layer_mlp * moe_layers + self.per_dense_layer_mlp * self.n_dense_layers,
            "router": self.per_layer_router * moe_layers,
            "norms": self.per_layer_norms * self.n_layers + self.final_norm,
            "unembedding": self.unembedding,
        }

    @property
    def non_embedding(self) -> int:
        """Parameters other than the token/position embeddings and untied output projection."""
        return self.total - self.embedding - self.position - self.unembedding


def param_counts(m: ModelConfig) -> ParamCounts:
    """Exact parameter count. Book ch.4: L·(3DF + 2D(N+K)H + 2D) + DV (tied) or 2DV (untied),
    extended with biases, LayerNorm biases, learned positions, MoE experts, router and shared experts."""
    D, H = m.d_model, m.head_dim
    attn = D * m.q_dim * 2 + D * m.kv_dim * 2  # W_Q, W_O [D, N·H] and W_K, W_V [D, K·H]
    if m.is_mla:
        # DeepSeek-V2 §2.1: the projections plus RMSNorms on the query and key-value latents
        attn = sum(m.mla_weights().values()) + m.q_lora_rank + m.kv_lora_rank
    elif m.linear_bias:
        attn += m.q_dim + 2 * m.kv_dim + D
    elif m.qkv_bias:
        attn += m.q_dim + 2 * m.kv_dim + (D if m.out_bias else 0)
    attn += _qk_norm_params(m) + (m.n_heads if m.attention_sinks else 0)  # gpt-oss: one sink logit per head
    if m.is_moe:
        mlp = m.n_experts * _mlp_params(m, m.d_ff)
        mlp_active = m.experts_per_token * _mlp_params(m, m.d_ff)
        shared = m.n_shared_experts * _mlp_params(m, m.shared_expert_d_ff or m.d_ff)
        shared += D if m.shared_expert_gate else 0  # Qwen2-MoE's sigmoid gate on the shared expert
        mlp, mlp_active = mlp + shared, mlp_active + shared
        router = D * m.n_experts + (m.n_experts if m.router_bias else 0)
    else:
        mlp = mlp_active = _mlp_params(m, m.d_ff)
        router = 0
    del H
    return ParamCounts(
        embedding=m.vocab_size * D,
        position=m.max_seq_len * D if m.position == "learned" else 0,
        per_layer_attention=attn,
        per_layer_mlp=mlp,
        per_layer_mlp_active=mlp_active,
        per_layer_router=router,
        per_layer_norms=m.norms_per_layer * _norm_params(m),
        final_norm=_norm_params(m),
        unembedding=(0 if m.tied_embeddings else m.vocab_size * D) + (m.vocab_size if m.lm_head_bias else 0),
        n_layers=m.n_layers,
        n_dense_layers=m.first_dense_layers,
        per_dense_layer_mlp=_mlp_params(m, m.dense_d_ff) if m.first_dense_layers else 0,
    )


def native_weight_bytes(m: ModelConfig, dtype: str = "bf16") -> float:
    """Bytes of the weights as released: routed-expert matrices in the checkpoint's expert format when it has one
    (gpt-oss: MXFP4), everything else (attention, router, embeddings, biases) in `dtype`; a checkpoint released in
    FP8 (DeepSeek-V3: 128x128 blocks of E4M3 with an fp32 scale each) keeps its linear weights in FP8 and its
    embeddings in `dtype`."""
    pc = param_counts(m)
    if m.released_weight_dtype == "fp8":
        tables = pc.embedding + pc.unembedding
        return (pc.total - tables) * dtype_bytes("fp8") + tables * dtype_bytes(dtype)
    if not (m.is_moe and m.expert_weight_dtype in BYTES_PER_DTYPE):
        return pc.total * dtype_bytes(dtype)
    experts = (m.n_layers - m.first_dense_layers) * m.n_experts * expert_params(m)
    return experts * dtype_bytes(m.expert_weight_dtype) + (pc.total - experts) * dtype_bytes(dtype)


def attention_matmul_weights(m: ModelConfig) -> int:
    """Attention projection weights of one layer that take part in matmuls."""
    if m.is_mla:
        return sum(m.mla_weights().values())
    return 2 * m.d_model * m.q_dim + 2 * m.d_model * m.kv_dim


def matmul_params_active(m: ModelConfig) -> int:
    """Weights that take part in a matmul for each token: every layer's active weights and the output
    projection (tied or not). The embedding lookup and position table are gathers, not matmuls."""
    D = m.d_model
    attn = attention_matmul_weights(m)
    width_mult = 3 if m.gated else 2
    if m.is_moe:
        mlp = m.experts_per_token * width_mult * D * m.d_ff
        mlp += m.n_shared_experts * width_mult * D * (m.shared_expert_d_ff or m.d_ff) + D * m.n_experts
    else:
        mlp = width_mult * D * m.d_ff
    dense = m.first_dense_layers
    return (m.n_layers - dense) * (attn + mlp) + dense * (attn + width_mult * D * m.dense_d_ff) + D * m.vocab_size


# --- FLOPs ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenFlops:
    """FLOPs per token. Forward = 2·(matmul params) + attention; training = 3× forward (book ch.4:
    backward is dL/dW plus dL/dX, each as costly as the forward)."""

    forward_matmul: float
    forward_attention: float

    @property
    def forward(self) -> float:
        return self.forward_matmul + self.forward_attention

    @property
    def training(self) -> float:
        return 3.0 * self.forward

    @property
    def training_matmul(self) -> float:
        return 3.0 * self.forward_matmul

    @property
    def training_attention(self) -> float:
        return 3.0 * self.forward_attention


def attended_keys(window: int, seq_len: float, causal: bool = True, kind: str = "sliding") -> float:
    """Mean keys a query attends to in one layer over a sequence of `seq_len` tokens (continuous in the position).
    Full causal attention: S/2 (book ch.4: the causal mask halves QKᵀ and AV). A sliding window w < S (Mistral,
    Gemma 2/3 local layers, gpt-oss): query p sees min(p, w) keys, mean (w²/2 + (S − w)·w)/S = w − w²/(2S).
    Chunked attention with chunks of w (Llama 4): a query sees the keys of its own chunk up to itself, mean
    (⌊S/w⌋·w²/2 + r²/2)/S with r = S mod w. Non-causal: min(S, w) keys (S for full attention)."""
    S = float(seq_len)
    if not window or window >= S:
        return S / 2.0 if causal else S
    w = float(window)
    if not causal:
        return w
    if kind == "chunked":
        whole, rest = divmod(S, w)
        return (whole * w * w / 2.0 + rest * rest / 2.0) / S
    return w - w * w / (2.0 * S)


def mean_attended_keys(m: ModelConfig, seq_len: float, causal: bool = True) -> float:
    """Keys per query averaged over the layers: S/2 (causal) for full attention everywhere; less where layers
    attend within a window or chunk (`attended_keys`). The attention core's FLOPs scale with it."""
    if not m.has_windows:
        return seq_len / 2.0 if causal else float(seq_len)
    spans = m.windows()
    return sum(attended_keys(w, seq_len, causal, m.window_kind) for w in spans) / len(spans)


def masked_tile_share(m: ModelConfig, seq_len: float) -> float:
    """Key tiles per query tile that a tiled attention kernel visits beyond the keys its queries attend, averaged over
    the layers (efficiency.attention_tile_factor's `diagonal`): 1/2 for full causal or chunked attention (the diagonal
    tile is half masked), 1 for a sliding window shorter than the sequence (its span of w + B - 1 keys straddles one
    more tile than w/B)."""
    if not m.has_windows:
        return 0.5
    spans = m.windows()
    slid = m.window_kind == "sliding"
    return sum(1.0 if slid and w and w < seq_len else 0.5 for w in spans) / len(spans)


def newest_query_keys(m: ModelConfig, queries: float, context_len: float) -> float:
    """Keys per query, averaged over the layers, of the newest `queries` queries of a causal context of
    `context_len` tokens (a prompt chunk after the earlier chunks, decode steps, the last shard): query p attends
    `attended_keys` of a p-token prefix, so the newest T of S attend (S·a(S) − (S − T)·a(S − T)) / T on average,
    a(n) the causal mean over n tokens. Full attention: S − T/2 (S for one decode token, S/2 for the whole
    sequence, book ch.4's causal halving)."""
    S, T = float(context_len), min(float(queries), float(context_len))
    if T <= 0:
        return 0.0
    spans = m.windows() if m.has_windows else [0]
    kind = m.window_kind if m.has_windows else "sliding"

    def total(n: float, w: int) -> float:  # keys attended by the first n queries, n·a(n)
        return n * attended_keys(w, n, True, kind) if n > 0 else 0.0

    return sum((total(S, w) - total(S - T, w)) / T for w in spans) / len(spans)


def causal_block_visit_ratio(seq_len: int, block_q: int, block_kv: int) -> float:
    """Score entries a block-sparse causal attention kernel computes over the S²/2 the causal mask keeps (the
    work `mean_attended_keys` counts). Splash attention on TPU (jax.experimental.pallas.ops.tpu.splash_attention,
    splash_attention_mask_info.py: a block of the mask is empty (0, skipped), partial (1) or full (2), and every
    block that is not empty is computed whole, the mask applied inside it) tiles the S×S scores into block_q ×
    block_kv blocks, each capped at S (MaxText layers/attentions.py: block_q = min(sa_block_q, S)); q block i
    reaches ceil((i+1)·block_q / block_kv) kv blocks. E.g. S 8192 in 2048 × 2048 blocks: 1 + 2 + 3 + 4 = 10 of
    16 blocks, 10·2048² / (8192²/2) = 1.25; in 512 × 512 blocks 136 of 256 (marin-community/marin#6332 counts
    the same), 1.0625. 1.0 when a block size is 0 (no block granularity: the kernel computes the causal half)."""
    if block_q <= 0 or block_kv <= 0 or seq_len <= 0:
        return 1.0
    bq, bkv = min(block_q, seq_len), min(block_kv, seq_len)
    n_q, n_kv = math.ceil(seq_len / bq), math.ceil(seq_len / bkv)
    blocks = sum(min(math.ceil((i + 1) * bq / bkv), n_kv) for i in range(n_q))
    return blocks * bq * bkv / (seq_len * seq_len / 2.0)


def kv_cached_tokens(m: ModelConfig, context_len: float) -> float:
    """Tokens of KV cache one sequence of `context_len` tokens keeps, averaged over the layers: every token for a
    full-attention layer, at most the window for a sliding-window layer (older keys are never read again: vLLM's
    and SGLang's sliding-window KV managers free them) and at most one chunk for a chunked layer."""
    if not m.has_windows:
        return float(context_len)
    spans = m.windows()
    return sum(min(float(context_len), w) if w else float(context_len) for w in spans) / len(spans)


def attention_flops_per_token(m: ModelConfig, context_len: float, causal: bool = True) -> float:
    """Forward QKᵀ and AV for one query token over `context_len` keys: 4·S·N·H per layer
    (book ch.4: 12BT²NH training = 3 × 4BT²NH forward). A causal mask with a proper kernel
    halves the useful work (the average query sees S/2 keys); windowed layers see fewer (`mean_attended_keys`)."""
    s = mean_attended_keys(m, context_len, causal)
    return 2.0 * s * m.n_heads * attention_pair_width(m) * m.n_layers


def attention_pair_width(m: ModelConfig, absorbed: bool = False) -> int:
    """Per head, per (query, key) pair: the QKᵀ contraction width plus the AV width, so that the forward
    attention costs 2·S·N·(this) FLOPs per token per layer: 2H for standard attention (book ch.4's 4·S·N·H);
    (head_dim + RoPE) + v_head_dim for MLA in training, where K and V are up-projected (DeepSeek-V2 §2.1).
    `absorbed`: MLA decoding in the latent space with the up-projections folded into Q and O (DeepSeek-V2
    §2.1.2): scores over kv_lora_rank + RoPE, values over kv_lora_rank."""
    if not m.is_mla:
        return 2 * m.head_dim
    return 2 * m.kv_lora_rank + m.qk_rope_head_dim if absorbed else m.qk_head_dim + m.v_dim


def flops_per_token(m: ModelConfig, seq_len: int | None = None, causal: bool = True) -> TokenFlops:
    """FLOPs per token at sequence length `seq_len` (default: the model's own)."""
    S = m.max_seq_len if seq_len is None else seq_len
    if S <= 0:
        raise MeshplanError(f"sequence length must be positive, got {S}")
    return TokenFlops(2.0 * matmul_params_active(m), attention_flops_per_token(m, S, causal))


def einsum_flops(dim_sizes: dict[str, int], contracted: bool = True) -> float:
    """Book ch.4: an einsum costs 2 × the product of all distinct dimension sizes when something is
    contracted (a multiply-add each), and 1 × for a purely elementwise product."""
    n = 1.0
    for size in dim_sizes.values():
        n *= size
    return 2.0 * n if contracted else n


# --- KV cache ------------------------------------------------------------------------------------

def kv_cache_bytes_per_token(m: ModelConfig, dtype: str = "bf16", context_len: float | None = None) -> float:
    """Keys and values for every layer: 2·L·K·H elements per token (book ch.4 §KV cache); MLA caches the
    latent and the shared RoPE key instead, L·(kv_lora_rank + qk_rope_head_dim) (DeepSeek-V2 §2.1.2).
    With `context_len`, the mean per token of a sequence that long: windowed layers keep at most their window."""
    full = m.n_layers * kv_cache_elements_per_layer(m) * dtype_bytes(dtype)
    if not context_len or not m.has_windows:
        return full
    return full * kv_cached_tokens(m, context_len) / context_len


def kv_cache_bytes_per_sequence(m: ModelConfig, context_len: float, dtype: str = "bf16") -> float:
    """KV cache of one sequence of `context_len` tokens: per-token bytes × the tokens each layer keeps."""
    return m.n_layers * kv_cache_elements_per_layer(m) * dtype_bytes(dtype) * kv_cached_tokens(m, context_len)


def kv_cache_elements_per_layer(m: ModelConfig) -> int:
    """Cached elements per token per layer: 2·K·H, or the MLA latent plus its RoPE key."""
    return m.kv_lora_rank + m.qk_rope_head_dim if m.is_mla else 2 * m.kv_dim


def pointwise_elements_per_token(m: ModelConfig, tp: float = 1, sp: float = 1, fused_add_norm: bool = False) -> float:
    """Elements one token moves through HBM in one layer's pointwise kernels, forward: two RMSNorms (read D, write
    D) and two residual adds (read 2·D, write D), 10·D split sp ways under sequence parallelism; RoPE on q and k
    (read and write (N + K)·H, split over TP); the gated activation (read 2 hidden vectors of F, write one: mult·F
    for each of the k experts a token visits, split over TP). The same tensors as the training ledger's pointwise
    term (train/costmodel.CostModel._pointwise_term); the kernels are HBM-bound (book ch.1: elementwise ops have
    arithmetic intensity ~1). tp and sp may be numpy arrays.
    `fused_add_norm`: each residual add runs inside the next RMSNorm's kernel (vLLM fused_add_rms_norm, FlashInfer
    fused_add_rmsnorm): it reads the sublayer output and the residual and writes the new residual and the normed
    input, 4·D per norm, 8·D per layer instead of 10·D."""
    mult = 3 if m.gated else 2
    k = m.experts_per_token if m.is_moe else 1
    residual_norm = 8 if fused_add_norm else 10
    return residual_norm * m.d_model / sp + 2 * (m.n_heads + m.n_kv_heads) * m.head_dim / tp + mult * m.d_ff * k / tp


# --- activations ---------------------------------------------------------------------------------

def attention_score_bytes(m: ModelConfig, seq_len: int, micro_batch: float, *, tp: float = 1, cp: float = 1,
                          act_bytes: float = 2.0) -> float:
    """Bytes of one layer's materialised attention score matrix on one device: [b, N/tp, s/cp, s] (the query rows
    this device holds against every key; Korthikanti et al. 2022 §4's 2·a·s²·b at 16 bits, per head group)."""
    return act_bytes * m.n_heads / tp * seq_len / cp * seq_len * micro_batch


def _mlp_width(m: ModelConfig) -> float:
    """The MLP width one token's activations span: F, or under MoE the k routed experts' k·F plus the shared ones'."""
    if m.is_moe:
        return m.d_ff * m.experts_per_token + m.n_shared_experts * (m.shared_expert_d_ff or m.d_ff)
    return m.d_ff


def mlp_up_out_bytes(m: ModelConfig, seq_len: int, micro_batch: float, *, tp: float = 1, cp: float = 1,
                     act_bytes: float = 2.0) -> float:
    """Bytes of one layer's MLP up-projection output on one device (gate and up of a gated MLP): [b, s/cp, (2)F/tp];
    its gradient in the backward has the same size."""
    return act_bytes * seq_len / cp * micro_batch * _mlp_width(m) / tp * (2 if m.gated else 1)


def activation_bytes_per_layer(
    m: ModelConfig,
    seq_len: int,
    micro_batch: int,
    recompute: str = "none",
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    cp: int = 1,
    flash_attention: bool = True,
    dropout: bool = False,
    act_bytes: float = 2.0,
    glu_saves_input: bool = False,
    gemm_input_bytes: float | None = None,
    distribute_saved: bool = False,
) -> dict[str, float]:
    """Bytes saved for the backward pass by one transformer layer, by tensor (sums to 'total').

    Korthikanti et al. 2022 §4: with 16-bit activations, 1-byte dropout masks, MHA, a 4h GeLU MLP and
    materialized attention this is s·b·h·(34 + 5as/h) with no recompute; 34sbh with selective
    recompute (the 5as²b attention-score terms recomputed); 2sbh with full recompute (layer input only).
    Generalised here to GQA (K·H-wide K and V), gated MLPs (the two up-projections, the activation
    output and the product: 4 tensors of F), flash attention (no s² terms) and TP/SP/CP sharding.

    `gemm-last` recomputes only the cheap ops between matmuls, so each recompute segment ends in a
    matmul: it keeps the layer input and every matmul's output (Q, K, V, attention output, O-projection
    output, MLP up-projections) and drops norm outputs, the activation output and the gated product,
    which the backward of the following matmul needs but which are cheap to rebuild. No matmul FLOPs
    are added.

    `glu_saves_input`: a fused gated activation that saves only its input (the two up-projections) and recomputes
    the activation in its backward (Megatron-Core `bias_swiglu_impl`: SwiGLUFunction.forward saves `input` alone,
    megatron/core/fusions/fused_bias_swiglu.py @d98e8a6); the product is kept once, as the down-projection's input.
    `gemm_input_bytes`: bytes per element of the copy a GEMM saves of its input when it saves a quantised one
    (Transformer Engine under FP8: Linear/LayerNormLinear keep the FP8 input in the one usage the backward needs,
    `update_usage(rowwise_usage=False)`, module/linear.py and layernorm_linear.py @d0067d0): the norm outputs that
    feed qkv and the up-projections and the down-projection's input take it; the attention output is saved twice,
    in bf16 by the attention kernel (its backward reads O) and quantised by the output projection.
    `distribute_saved`: under full recompute the checkpoint keeps 1/tp of the layer input on each TP rank and
    all-gathers it before the recomputed forward (Megatron-LM `--distribute-saved-activations`,
    megatron/core/tensor_parallel/random.py @004bfb5 CheckpointFunction: split_tensor_into_1d_equal_chunks in the
    forward, gather_split_1d_tensor in the backward; DeepSpeed `partition_activations`; metaseq
    `--distribute-checkpointed-activations`). Under SP the saved input is already 1/tp: the same bytes.
    """
    if recompute not in RECOMPUTE_POLICIES:
        raise MeshplanError(f"unknown recompute policy '{recompute}' (known: {', '.join(RECOMPUTE_POLICIES)})")
    if tp <= 0 or cp <= 0 or micro_batch <= 0 or seq_len <= 0:
        raise MeshplanError("sequence length, micro-batch, tp and cp must be positive")
    s = seq_len / cp  # tokens of one sequence held by this device
    sb = s * micro_batch
    a = act_bytes
    D = m.d_model
    rep = 1.0 / tp if sequence_parallel else 1.0  # layer-norm region: replicated under TP unless SP
    q = m.q_dim / tp
    kv = m.kv_dim * max(m.n_kv_heads / tp, 1.0) / m.n_kv_heads  # KV heads are replicated when K < tp
    latent = 0.0
    if m.is_mla:
        # MLA keeps the up-projected per-head queries, keys (N·(H+R)) and values (N·V) for the attention backward
        q = m.n_heads * m.qk_head_dim / tp
        kv = m.n_heads * attention_pair_width(m) / 2 / tp
        # and its latents, computed whole on every TP rank (the down-projections are not split over heads): the
        # query latent (q_lora_rank; none without one, W_Q then reads the normed layer input) and the key-value
        # latent (kv_lora_rank) that feed the up-projections (DeepSeek-V2 eqs. 1-10)
        latent = float(m.q_lora_rank + m.kv_lora_rank)
    f = _mlp_width(m) / tp
    mask = 1.0 if dropout else 0.0

    if recompute == "full":
        # the checkpointed layer input: sharded over TP under SP or when the checkpoint distributes it
        held = 1.0 / tp if sequence_parallel or distribute_saved else 1.0
        return {"layer_input": a * sb * D * held, "total": a * sb * D * held}

    parts: dict[str, float] = {}
    if recompute == "gemm-last":
        parts["layer_input"] = a * sb * D * rep
        parts["attn/qkv_out"] = a * sb * (q + 2 * kv)
        if latent:  # the down-projections' outputs: both latents and the shared RoPE key (R)
            parts["attn/latents"] = a * sb * (latent + m.qk_rope_head_dim)
        parts["attn/core_out"] = a * sb * q
        if not flash_attention:
            parts["attn/scores"] = attention_score_bytes(m, seq_len, micro_batch, tp=tp, cp=cp, act_bytes=a)
        parts["attn/o_proj_out"] = a * sb * D * rep
        parts["mlp/up_out"] = mlp_up_out_bytes(m, seq_len, micro_batch, tp=tp, cp=cp, act_bytes=a)
    else:
        g = a if gemm_input_bytes is None else gemm_input_bytes  # a GEMM's saved input
        parts["norm/inputs"] = 2 * a * sb * D * rep
        parts["attn/qkv_in"] = g * sb * D * rep
        if recompute == "mla-up-proj":
            # Megatron-Core's CheckpointWithoutOutput keeps only its inputs, the normed latents and the RoPE key
            # (bf16), and frees query/key/value after the core's forward; the up-projections save nothing (their
            # forward runs without autograd and again, with it, in the backward)
            parts["attn/latents"] = a * sb * (latent + m.qk_rope_head_dim)
        else:
            parts["attn/qkv_out"] = a * sb * (q + 2 * kv)
            if latent:  # the up-projections' saved inputs: the normed latents (quantised under FP8, like qkv_in)
                parts["attn/latents"] = g * sb * latent
        if latent:  # the latent RMSNorms save their inputs (q_a_layernorm, kv_a_layernorm)
            parts["attn/latent_norm_in"] = a * sb * latent
        if not flash_attention and recompute == "none":
            # softmax output (a·N·s²·b) and, with dropout, its mask and the dropped-out probabilities
            parts["attn/scores"] = (1 + mask * (1 + a) / a) * attention_score_bytes(m, seq_len, micro_batch, tp=tp, cp=cp,
                                                                                  act_bytes=a)
        parts["attn/o_proj_in"] = (a + (0.0 if gemm_input_bytes is None else g)) * sb * q
        parts["mlp/up_in"] = g * sb * D * rep
        # the activation's saved tensors (gated: gate and up outputs, the activation output; or only the two
        # up-projections when fused) and the down-projection's input
        before_down = (2 if glu_saves_input else 3) if m.gated else 1
        parts["mlp/hidden"] = (a * before_down + g) * sb * f
    if dropout:
        parts["dropout/masks"] = 2 * mask * sb * D * rep
    parts["total"] = sum(parts.values())
    return parts


def recompute_flops_per_token(m: ModelConfig, seq_len: int, recompute: str, causal: bool = True) -> float:
    """Extra forward FLOPs per token spent on recomputation in the backward pass.

    full: the whole layer forward again (≈ 2N per token: 6N → 8N, book ch.4); selective: the attention
    core only (Korthikanti et al. 2022: QKᵀ and AV recomputed); mla-up-proj: MLA's query and key-value
    up-projections; gemm-last and none: no matmul FLOPs (gemm-last rebuilds only elementwise ops)."""
    if recompute not in RECOMPUTE_POLICIES:
        raise MeshplanError(f"unknown recompute policy '{recompute}' (known: {', '.join(RECOMPUTE_POLICIES)})")
    tf = flops_per_token(m, seq_len, causal)
    layers_matmul = tf.forward_matmul - 2.0 * m.d_model * m.vocab_size  # the output projection is not redone
    if recompute == "full":
        return layers_matmul + tf.forward_attention
    if recompute == "selective":
        return tf.forward_attention
    if recompute == "mla-up-proj" and m.is_mla:
        # the query and key-value up-projections of every layer again (2 FLOPs per weight per token)
        w = m.mla_weights()
        return 2.0 * (w["q_up"] + w["kv_up"]) * m.n_layers
    return 0.0


# --- optimizer state -----------------------------------------------------------------------------

@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of training state (ZeRO, Rajbhandari et al. 2020 §3.1: mixed-precision
    Adam keeps 2 (fp16/bf16 params) + 2 (grads) + 12 (fp32 master, momentum, variance) = 16)."""

    params: float = 2.0
    grads: float = 2.0
    optimizer: float = 12.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def adam_state_bytes(param_dtype: str = "bf16", grad_dtype: str = "bf16", master_weights: bool = True) -> StateBytes:
    """Mixed-precision Adam: low-precision params and grads, fp32 moments (+ fp32 master copy)."""
    return StateBytes(dtype_bytes(param_dtype), dtype_bytes(grad_dtype), 8.0 + (4.0 if master_weights else 0.0))
