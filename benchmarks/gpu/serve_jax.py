"""A reference serving loop in JAX for the GPU suite: prefill (one forward over the prompt that fills a KV
cache) and decode steps (one token per sequence against the cache), with the weights of the reference
training model (`meshplan.measure.jaxmodel`: fused QKV per KV group, fused gate/up, RMSNorm, RoPE).

Layers are a Python loop over per-layer weight arrays (no scan: a scan's dynamic slices could copy weights or
the cache each step, which would distort a memory-bound decode step). Prefill attention is
jax.nn.dot_product_attention (cuDNN flash attention on GPUs); decode attention reads the cache with two
einsums (QKᵀ and AV over the whole cache, later positions masked), as memory-bound as a decode kernel, the cache's
positions cut into splits that run in parallel (Flash-Decoding; `split_count`).
Only the last prompt position's logits are computed in prefill, as serving engines do. A mixed step
(`make_mixed_steps`) carries decode tokens and a prompt chunk through the same GEMMs, as a continuous-batching
engine's step does.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from meshplan.measure import jaxmodel as jm
from meshplan.specs.model import ModelConfig

Params = dict[str, Any]


def init_weights(model: ModelConfig, dtype: Any, seed: int = 0) -> Params:
    """Random weights (jaxmodel's init, one layer at a time so no second copy is ever held)."""
    one = model.with_overrides(n_layers=1)
    init = jax.jit(lambda k: jm.init_params(one, k, dtype))
    keys = jax.random.split(jax.random.key(seed), model.n_layers)
    first = init(keys[0])
    layers = [first["layers"][0]] + [init(k)["layers"][0] for k in keys[1:]]
    return {"embed": first["embed"], "final_norm": first["final_norm"], "layers": layers,
            **({"unembed": first["unembed"]} if "unembed" in first else {})}


def _mlp(lp: Params, h: jax.Array) -> jax.Array:
    gu = jnp.einsum("btd,dcf->btcf", h, lp["w_gate_up"])
    return (jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1]) @ lp["w_down"]


def _qkv(lp: Params, h: jax.Array, pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [B,T,N,H], k/v [B,T,K,H] with RoPE at absolute positions pos [T]."""
    qkv = jnp.einsum("btd,dkgh->btkgh", h, lp["wqkv"])
    B, T, K, G2, H = qkv.shape
    q = qkv[:, :, :, : G2 - 2].reshape(B, T, K * (G2 - 2), H)
    return jm.rotary(q, pos), jm.rotary(qkv[:, :, :, G2 - 2], pos), qkv[:, :, :, G2 - 1]


def _logits(params: Params, model: ModelConfig, x: jax.Array) -> jax.Array:
    x = jm.rmsnorm(x, params["final_norm"])
    w_out = params["embed"].T if model.tied_embeddings else params["unembed"]
    return (x @ w_out).astype(jnp.float32)


def make_prefill(model: ModelConfig, attention: str, capacity: int):
    """(params, tokens [B,T]) → (last-position logits [B,V], cache [L × (k, v) of [B, K, capacity, H]], heads-major)."""
    core = jm.ATTENTION_CORES[attention]

    def prefill(params, tokens):
        B, T = tokens.shape
        pos = jnp.arange(T, dtype=jnp.int32)
        x = jnp.take(params["embed"], tokens, axis=0)
        cache = []
        for lp in params["layers"]:
            q, k, v = _qkv(lp, jm.rmsnorm(x, lp["attn_norm"]), pos)
            o = core(q, k, v, pos, pos)
            x = x + jnp.einsum("btnh,nhd->btd", o, lp["wo"])
            x = x + _mlp(lp, jm.rmsnorm(x, lp["mlp_norm"]))
            pad = ((0, 0), (0, 0), (0, capacity - T), (0, 0))
            cache.append((jnp.pad(k.transpose(0, 2, 1, 3), pad), jnp.pad(v.transpose(0, 2, 1, 3), pad)))
        return _logits(params, model, x[:, -1:])[:, 0], cache

    return jax.jit(prefill)


def make_decode(model: ModelConfig):
    """(params, cache, tokens [B], pos scalar) → (logits [B,V], cache): one token per sequence at position
    `pos`, its K/V written into the cache in place (the cache is donated). The cache is heads-major [B, K, S, H]
    (vLLM's and TensorRT-LLM's KV blocks keep a head's positions together), so QKᵀ and AV contract it where it lies:
    a [B, S, K, H] cache made XLA transpose the whole cache of every layer at every step (the first H200 run,
    benchmarks/results/gpu_h200_2026-12-04.json: 45 ms for a 1B model's batch 64 × 8k step, ~11x the cache read)."""

    return jax.jit(_decode_fn(model), donate_argnums=(1,))


def make_decode_steps(model: ModelConfig, steps: int):
    """(params, cache, tokens [B], pos scalar) → (last tokens [B], cache): `steps` greedy decode steps in one program
    (lax.scan; each step's argmax is the next step's token), positions pos .. pos + steps − 1, the cache donated.
    One program per `steps` steps: the host dispatches once, so the time per step is the device's (the first H200
    run timed one program per step, and steps of a 1B model at batch 1 and 64 with a 1k context both took 3.2 ms
    against a 0.65 ms weight read: a floor that the cache size does not move, as a host-side cost would be)."""
    return _greedy_steps(_decode_fn(model), steps)


def _greedy_steps(step, steps: int):
    """`steps` greedy steps of `step` (params, cache, tokens, pos, *extra) → (logits, cache) in one program, each
    step's argmax over the first len(tokens) logit rows the next step's tokens; the cache donated."""

    def run(params, cache, tokens, pos, *extra):
        def body(carry, _):
            cache, tok, p = carry
            logits, cache = step(params, cache, tok, p, *extra)
            return (cache, jnp.argmax(logits[: tok.shape[0]], axis=-1).astype(tok.dtype), p + 1), None

        (cache, tok, _), _ = jax.lax.scan(body, (cache, tokens, pos), None, length=steps)
        return tok, cache

    return jax.jit(run, donate_argnums=(1,))


SPLIT_TARGET = 1024  # cache positions per split of a decode step's attention (split_count)
# Split only while a step attends fewer (sequence, KV head) rows than twice the GPU's SMs: with at least that many
# rows each SM already has two to work on (FlashInfer's decode scheduler splits the KV only to fill the SMs). On the
# H200 (132 SMs; benchmarks/results/gpu_h200_2026-12-04_s15.json against _s14.json) splitting sped up the rows
# of 8, 128 and 256 (batch 1 × 32k 2.05 → 1.70 ms, 16 × 4k 2.50 → 1.97, 32 × 32k 21.7 → 12.4) and slowed those
# of 512 and 2048 (64 × 8k 6.12 → 7.81 ms, 256 × 4k 10.8 → 16.6); the bound falls between 256 and 512
SPLIT_ROWS_PER_SM = 2
SMS_FALLBACK = 132  # H100/H200 SXM's SMs, where the device reports none (the CPU)


def split_rows_limit() -> int:
    """Rows (sequence × KV head) below which a decode step splits the cache: SPLIT_ROWS_PER_SM × the device's SMs
    (JAX's core_count on GPUs)."""
    sms = getattr(jax.devices()[0], "core_count", None) or SMS_FALLBACK
    return SPLIT_ROWS_PER_SM * int(sms)


def split_count(capacity: int, target: int = SPLIT_TARGET, rows: int = 1, max_rows: int | None = None) -> int:
    """How many equal splits a decode step cuts the cache's positions into (Flash-Decoding, Dao, Haziza, Massa and
    Sizov 2023: split the keys/values so that one query's attention runs in parallel over the long axis, then combine
    the splits' partial softmaxes): the divisor of `capacity` whose split length is nearest `target`, 1 where no split
    would be at least target/4 long. Without it XLA ran AV for a long context as one GEMM per (sequence, KV head)
    with the context as its reduction: the H200 rows at batch 32 × 32k, batch 16 × 4k and batch 1 × 32k took
    1.3-2.2x the cache read (benchmarks/results/gpu_h200_2026-12-04_s14.json) where batch 256 × 1k, with the same
    bytes in short rows, took 1.0x. `rows`: the (sequence, KV head) pairs the step attends; none split at
    `max_rows` or more (split_rows_limit)."""
    if max_rows is not None and rows >= max_rows:
        return 1
    best = 1
    for c in range(2, capacity // max(target // 4, 1) + 1):
        if capacity % c == 0 and abs(capacity / c - target) < abs(capacity / best - target):
            best = c
    return best


def _attend_cache(q: jax.Array, ck: jax.Array, cv: jax.Array, pos: jax.Array) -> jax.Array:
    """One query per sequence (q [B,1,N,H]) against its heads-major cache [B,K,S,H], positions after `pos` masked,
    the cache's positions cut into split_count splits (module values when traced: a test sets them)."""
    B, _, N, H = q.shape
    K, S = ck.shape[1], ck.shape[2]
    C = split_count(S, SPLIT_TARGET, B * K, split_rows_limit())
    qg = q.reshape(B, K, N // K, H)
    # the cache's positions as C splits of S/C (a free reshape of the heads-major cache)
    ks, vs = (x.reshape(B, K, C, S // C, H) for x in (ck, cv))
    s = jnp.einsum("bkgh,bkcsh->bkgcs", qg, ks).astype(jnp.float32) * (H ** -0.5)
    s = jnp.where(jnp.arange(S).reshape(C, S // C) <= pos, s, -jnp.inf)
    m = jnp.max(s, axis=(-2, -1), keepdims=True)  # one softmax over all positions: the splits share its max
    e = jnp.exp(s - m)
    den = jnp.sum(e, axis=(-2, -1))  # [B,K,G]
    part = jnp.einsum("bkgcs,bkcsh->bkgch", e.astype(cv.dtype), vs,
                      preferred_element_type=jnp.float32)  # each split's AV, the splits a batch dimension
    o = jnp.sum(part, axis=3) / den[..., None]
    return o.astype(cv.dtype).reshape(B, 1, N, H)


def _write_cache(ck: jax.Array, cv: jax.Array, k: jax.Array, v: jax.Array, pos: jax.Array) -> tuple:
    """Write each sequence's new K/V ([B,1,K,H]) at position `pos` of its heads-major cache, in place."""
    return (jax.lax.dynamic_update_slice_in_dim(ck, k.transpose(0, 2, 1, 3), pos, axis=2),
            jax.lax.dynamic_update_slice_in_dim(cv, v.transpose(0, 2, 1, 3), pos, axis=2))


def _decode_fn(model: ModelConfig):
    def decode(params, cache, tokens, pos):
        x = jnp.take(params["embed"], tokens[:, None], axis=0)  # [B,1,D]
        p = jnp.reshape(pos, (1,))
        new_cache = []
        for lp, (ck, cv) in zip(params["layers"], cache, strict=True):
            q, k, v = _qkv(lp, jm.rmsnorm(x, lp["attn_norm"]), p)
            ck, cv = _write_cache(ck, cv, k, v, pos)
            x = x + jnp.einsum("btnh,nhd->btd", _attend_cache(q, ck, cv, pos), lp["wo"])
            x = x + _mlp(lp, jm.rmsnorm(x, lp["mlp_norm"]))
            new_cache.append((ck, cv))
        return _logits(params, model, x)[:, 0], new_cache

    return decode


def _mixed_fn(model: ModelConfig, attention: str):
    """One engine step that carries B decode tokens and one prompt chunk of P tokens (continuous batching with
    chunked prefill: Orca, Yu et al. OSDI'22; Sarathi-Serve, Agrawal et al. OSDI'24): every GEMM runs once over the
    B + P rows of the step, the decode tokens attend their caches (_attend_cache) and the chunk attends itself
    causally (the training model's attention core, cuDNN flash attention on GPUs). The chunk's own K/V are not kept:
    a fresh prompt of P tokens every step."""
    core = jm.ATTENTION_CORES[attention]

    def mixed(params, cache, tokens, pos, prompt):
        B, P = tokens.shape[0], prompt.shape[1]
        pp = jnp.arange(P, dtype=jnp.int32)
        # the step's rows as one sequence of B + P tokens: the decode tokens at `pos`, the chunk at 0 .. P − 1
        x = jnp.concatenate([jnp.take(params["embed"], tokens[None, :], axis=0),
                             jnp.take(params["embed"], prompt, axis=0)], axis=1)  # [1, B+P, D]
        rows_pos = jnp.concatenate([jnp.full((B,), pos, jnp.int32), pp])
        new_cache = []
        for lp, (ck, cv) in zip(params["layers"], cache, strict=True):
            q, k, v = _qkv(lp, jm.rmsnorm(x, lp["attn_norm"]), rows_pos)  # one QKV GEMM over B + P rows
            N, K, H = q.shape[2], k.shape[2], q.shape[3]
            ck, cv = _write_cache(ck, cv, k[0, :B].reshape(B, 1, K, H), v[0, :B].reshape(B, 1, K, H), pos)
            o_dec = _attend_cache(q[0, :B].reshape(B, 1, N, H), ck, cv, pos).reshape(1, B, N, H)
            o_pre = core(q[:, B:], k[:, B:], v[:, B:], pp, pp)
            o = jnp.concatenate([o_dec, o_pre], axis=1)
            x = x + jnp.einsum("btnh,nhd->btd", o, lp["wo"])
            x = x + _mlp(lp, jm.rmsnorm(x, lp["mlp_norm"]))
            new_cache.append((ck, cv))
        # logits for the rows that sample, in one GEMM: every decode token and the chunk's last position
        return _logits(params, model, jnp.concatenate([x[:, :B], x[:, -1:]], axis=1))[0], new_cache

    return mixed


def make_mixed_steps(model: ModelConfig, attention: str, steps: int):
    """(params, cache, tokens [B], pos scalar, prompt [1, P]) → (last tokens [B], cache): `steps` mixed steps
    (_mixed_fn) in one program, as make_decode_steps; the same prompt chunk rides along every step."""
    return _greedy_steps(_mixed_fn(model, attention), steps)


def random_cache(model: ModelConfig, batch: int, capacity: int, dtype: Any, seed: int) -> list:
    """A filled cache (random values, never zeros) of `capacity` positions per sequence."""
    shape = (batch, model.n_kv_heads, capacity, model.head_dim)  # heads-major (make_decode)
    make = jax.jit(lambda k: tuple(jax.random.normal(kk, shape, jnp.float32).astype(dtype)
                                   for kk in jax.random.split(k, 2)))
    return [make(k) for k in jax.random.split(jax.random.key(seed), model.n_layers)]
