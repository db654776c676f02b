"""`meshplan verify`: compile a layout as a sharded JAX training step and compare XLA with the prediction.

Two sides, kept apart:
- `predict_verify_quantities` derives per-device FLOPs, collective bytes per kind and memory from meshplan's
  own math (meshplan.math.transformer; book ch.4–5; Korthikanti et al. 2022) and the layout — never from
  the compiled program.
- `measure_compiled` reads the compiled program: `cost_analysis()` FLOPs, the FLOPs of every dot in the
  optimized HLO, `memory_analysis()`, and every collective in the HLO text (see meshplan.measure.hlo).

JAX is imported only inside the functions that need it, after `ensure_host_devices` has set XLA_FLAGS.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections import defaultdict
from typing import Any

from meshplan.errors import MeshplanError
from meshplan.math import transformer as tm
from meshplan.measure.hlo import COLLECTIVES, Collective, dot_flops, parse_collectives
from meshplan.measure.layout import Layout, moe_capacity
from meshplan.specs.model import ModelConfig

BYTES_PER_ELEMENT = 4.0  # the CPU reference model runs in float32 (params, activations and collectives)
JAX_MISSING = "meshplan verify needs the jax extra: pip install 'meshplan[jax]'"


# --- setting up JAX ------------------------------------------------------------------------------

def ensure_host_devices(n: int) -> None:
    """Ask XLA for n simulated CPU devices. Must run before JAX is first imported."""
    if "jax" in sys.modules:
        import jax

        if len(jax.devices("cpu")) < n:
            raise MeshplanError(f"JAX was imported with {len(jax.devices('cpu'))} CPU devices; verify needs {n} "
                                f"(set XLA_FLAGS=--xla_force_host_platform_device_count={n} before importing jax)")
        return
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={max(n, 1)}".strip()


def import_jax() -> Any:
    try:
        import jax
    except ImportError:
        raise MeshplanError(JAX_MISSING) from None
    return jax


# --- models for a CPU ----------------------------------------------------------------------------

def reference_model(m: ModelConfig) -> ModelConfig:
    """The LLaMA-style architecture the JAX reference builds: RMSNorm, RoPE, no biases, no shared experts, full
    attention in every layer (no windows), two norms per layer, every layer alike."""
    return m.with_overrides(norm="rmsnorm", position="rotary", linear_bias=False, qkv_bias=False, out_bias=False,
                            n_shared_experts=0, shared_expert_d_ff=0, layer_windows=(), norms_per_layer=2,
                            norm_bias=True, qk_norm="", attention_sinks=False, router_bias=False,
                            lm_head_bias=False, shared_expert_gate=False, first_dense_layers=0, dense_d_ff=0)


def tiny_model(m: ModelConfig, layers: int = 2, d_model: int = 256, vocab: int = 512,
               min_kv_heads: int = 1) -> ModelConfig:
    """Shrink a model for a CPU, keeping its shape ratios: the GQA group N/K, F/D (rounded to 64), E and k.
    Defaults give L=2, D=256, V=512 and 8 query heads, or more when `min_kv_heads` (e.g. tp) asks for
    more KV heads: K = max(8/G, min_kv_heads), N = G·K, H = D/N."""
    if m.is_mla:
        raise MeshplanError(f"{m.name}: the JAX model builds standard attention; multi-head latent attention "
                            f"(MLA) is not in it yet, so verify cannot compile this model")
    group = max(1, min(m.gqa_group, 8))
    n_kv = max(8 // group, min_kv_heads, 1)
    d_ff = max(64, round(d_model * m.d_ff / m.d_model / 64) * 64)
    experts = min(m.n_experts, 8) if m.is_moe else 0
    return reference_model(m).with_overrides(
        name=f"{m.name}-tiny", n_layers=layers, d_model=d_model, n_heads=group * n_kv, n_kv_heads=n_kv,
        head_dim=d_model // (group * n_kv), d_ff=d_ff, vocab_size=vocab, max_seq_len=max(m.max_seq_len, 128),
        n_experts=experts, experts_per_token=min(m.experts_per_token, experts) if experts else 0)


# --- the prediction (formulas only) --------------------------------------------------------------

def _weight_bytes(m: ModelConfig, layout: Layout, b: float) -> dict[str, float]:
    """Bytes of each weight group on one device after TP/EP sharding (before FSDP), from param_counts."""
    pc = tm.param_counts(m)
    tp, ep = layout.tp, layout.ep
    kv_tp = tp if m.n_kv_heads % tp == 0 else 1
    D = m.d_model
    attn = (2 * D * m.q_dim) / tp + (2 * D * m.kv_dim) / kv_tp
    experts = m.n_experts * (3 if m.gated else 2) * D * m.d_ff if m.is_moe else 0
    mlp = experts / ep + pc.per_layer_router if m.is_moe else pc.per_layer_mlp / tp
    norms = pc.per_layer_norms
    return {"layers": b * m.n_layers * (attn + mlp + norms), "embedding": b * pc.embedding / tp,
            "unembedding": b * pc.unembedding / tp, "final_norm": b * pc.final_norm,
            "norms": b * (m.n_layers * norms + pc.final_norm),
            "experts": b * m.n_layers * experts / ep}


def predict_flops(m: ModelConfig, layout: Layout, devices: int, seq_len: int, global_batch: int) -> float:
    """Per-device FLOPs of one step: 3 × forward (2·matmul params + attention) per token, plus recompute.

    Attention is counted over the full S×S score matrix, because the reference program materialises masked
    softmax attention and XLA executes (and counts) every masked entry: the causal halving in
    meshplan.math.transformer applies to kernels that skip masked blocks, not to this program. MoE experts
    run C = capacity-factor·T·k/E slots each, so expert FLOPs scale by the capacity factor."""
    tf = tm.flops_per_token(m, seq_len, causal=False)
    matmul = tf.forward_matmul
    if m.is_moe:
        per_expert = 2.0 * (3 if m.gated else 2) * m.d_model * m.d_ff
        slots = moe_capacity(m, seq_len) * m.n_experts / seq_len  # ≈ CAPACITY_FACTOR · k
        matmul += m.n_layers * per_expert * (slots - m.experts_per_token)
    per_token = 3.0 * (matmul + tf.forward_attention) + _recompute_flops_per_token(m, seq_len, layout.recompute)
    return per_token * global_batch * seq_len / devices


def _recompute_flops_per_token(m: ModelConfig, seq_len: int, recompute: str) -> float:
    """Extra forward FLOPs in the backward.

    full: the layers' forward again (tm.recompute_flops_per_token, full attention) minus each dense layer's
    MLP down-projection (2·D·F per token): a JAX remat recomputes only what the backward needs, and that
    matmul's output only feeds the residual sum, which the backward never reads. (Megatron's checkpointed
    layer reruns the whole forward, so tm's term is right for it; for MoE the expert outputs are needed to
    weight the combine, so nothing is dropped.)
    selective: QKᵀ again, half of the full attention forward (a policy-based remat keeps AV's output and
    rebuilds only the softmax input; tm's selective term reruns the whole core, as Megatron's module does).
    gemm-last and none: no matmuls."""
    if recompute == "full":
        down = 0.0 if m.is_moe else 2.0 * m.d_model * m.d_ff * m.n_layers
        return tm.recompute_flops_per_token(m, seq_len, "full", causal=False) - down
    if recompute == "selective":
        return tm.attention_flops_per_token(m, seq_len, causal=False) / 2.0
    return 0.0


def _activation_bytes(m: ModelConfig, layout: Layout, seq_len: int, global_batch: int, b: float) -> float:
    """A = B_loc·(T/cp)·D·bytes: one [B, T, D] activation of this device's sequences (book ch.5)."""
    return global_batch / layout.batch_shards * seq_len / layout.cp * m.d_model * b


def _tp_bytes(m: ModelConfig, layout: Layout, A: float, b: float, tokens: float) -> dict[str, float]:
    """Megatron TP (Korthikanti et al. 2022 §4.2.2). With SP, per layer: forward all-gathers the attention and
    MLP inputs and reduce-scatters both outputs (2 AG + 2 RS of A); the backward re-gathers both inputs,
    gathers both output gradients and reduce-scatters both input gradients (4 AG + 2 RS); full recompute
    reruns the attention output's reduce-scatter (+1 RS). Outside the layers: the vocab-parallel embedding
    reduce-scatters its rows (fwd) and gathers their gradient (bwd); the final norm output is gathered
    (fwd) and its gradient reduce-scattered (bwd). Without SP every pair becomes one all-reduce.
    Vocab-parallel cross-entropy all-reduces 3 numbers per token (max, Σexp, target logit); under SP the
    replicated norm scales' gradients are all-reduced ((2L+1)·D)."""
    L = m.n_layers
    if layout.tp == 1:
        return {}
    ce = 3 * tokens * b
    if not layout.sp:
        return {"all-reduce": (4 * L + 2) * A + ce}
    full = L * A if layout.recompute == "full" else 0.0
    return {"all-gather": (6 * L + 2) * A, "reduce-scatter": (4 * L + 2) * A + full,
            "all-reduce": ce + (2 * L + 1) * m.d_model * b}


def _cp_bytes(m: ModelConfig, layout: Layout, seq_len: int, global_batch: int, b: float) -> dict[str, float]:
    """CP with all-gathered K/V: per layer the forward gathers K and V over `context` (2·B_loc·T·K·H/tp),
    the backward reduce-scatters their gradients; full recompute gathers them again. Positions (int32) are
    gathered once per step."""
    if layout.cp == 1:
        return {}
    kv_tp = layout.tp if m.n_kv_heads % layout.tp == 0 else 1
    kv = 2 * global_batch / layout.batch_shards * seq_len * m.kv_dim / kv_tp * b
    gathers = 2 if layout.recompute == "full" else 1
    return {"all-gather": m.n_layers * gathers * kv + seq_len * 4, "reduce-scatter": m.n_layers * kv}


def _ep_bytes(m: ModelConfig, layout: Layout, seq_len: int, global_batch: int, b: float) -> dict[str, float]:
    """EP: every MoE layer sends each sequence's E·C expert slots (≈ k·T tokens) to the experts and back in
    the forward (2 all-to-alls) and again in the backward; full and gemm-last recompute redo both."""
    if layout.ep == 1:
        return {}
    slots = global_batch / layout.batch_shards * m.n_experts * moe_capacity(m, seq_len) * m.d_model * b
    n = 6 if layout.recompute in ("full", "gemm-last") else 4
    return {"all-to-all": m.n_layers * n * slots}


def _grad_bytes(m: ModelConfig, layout: Layout, W: dict[str, float]) -> dict[str, float]:
    """Gradient reduction (book ch.5). FSDP: reduce-scatter every weight over `fsdp`. Then an all-reduce of
    each device's shard over the other axes that hold different tokens: data, context and, for the
    non-expert weights, expert. The loss mean adds one 4-byte all-reduce."""
    total = W["layers"] + W["embedding"] + W["unembedding"] + W["final_norm"]
    out = {"reduce-scatter": total if layout.fsdp > 1 else 0.0}
    shard = 1.0 / layout.fsdp
    dense = (total - W["experts"]) * shard if layout.dp * layout.cp * layout.ep > 1 else 0.0
    experts = W["experts"] * shard if layout.dp * layout.cp > 1 else 0.0
    loss = 4.0 if layout.devices > 1 else 0.0
    out["all-reduce"] = dense + experts + loss
    return out


def _fsdp_gather_bytes(layout: Layout, W: dict[str, float]) -> float:
    """FSDP / ZeRO-3: every weight is gathered for the forward; the layers' weights again for the backward
    (the embedding, final norm and unembedding are gathered once and kept)."""
    if layout.fsdp == 1:
        return 0.0
    return 2 * W["layers"] + W["embedding"] + W["unembedding"] + W["final_norm"]


def predict_collective_bytes(m: ModelConfig, layout: Layout, seq_len: int, global_batch: int,
                             b: float = BYTES_PER_ELEMENT) -> dict[str, float]:
    """Per-device bytes (full array size X, the `meshplan collective` convention) of each collective kind
    in one training step, summed over the parallelisms in a fixed order: FSDP, TP, CP, EP, gradients."""
    W = _weight_bytes(m, layout, b)
    A = _activation_bytes(m, layout, seq_len, global_batch, b)
    tokens = global_batch / layout.batch_shards * seq_len / layout.cp
    out = {k: 0.0 for k in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")}
    parts = [{"all-gather": _fsdp_gather_bytes(layout, W)}, _tp_bytes(m, layout, A, b, tokens),
             _cp_bytes(m, layout, seq_len, global_batch, b), _ep_bytes(m, layout, seq_len, global_batch, b),
             _grad_bytes(m, layout, W)]
    for part in parts:
        for kind, v in part.items():
            out[kind] += v
    return out


def predict_memory(m: ModelConfig, layout: Layout, seq_len: int, global_batch: int,
                   b: float = BYTES_PER_ELEMENT) -> dict[str, float]:
    """Arguments: params (b bytes) and AdamW m, v (fp32) in their shardings, plus the int32 batch.
    Temp: gradients (b bytes, before their reduce-scatter) plus the saved activations of every layer
    (tm.activation_bytes_per_layer, materialised attention) plus the logits and their gradient."""
    W = _weight_bytes(m, layout, b)
    params = (W["layers"] + W["embedding"] + W["unembedding"] + W["final_norm"])
    tokens = global_batch / layout.batch_shards * seq_len / layout.cp
    args = params / layout.fsdp * (1 + 8 / b) + 2 * tokens * 4 + seq_len / layout.cp * 4 + 4
    act = tm.activation_bytes_per_layer(m, seq_len, int(global_batch / layout.batch_shards), layout.recompute,
                                        tp=layout.tp, sequence_parallel=layout.sp, cp=layout.cp,
                                        flash_attention=False, act_bytes=b)["total"]
    temp = params + m.n_layers * act + 2 * tokens * m.vocab_size / layout.tp * 4
    return {"memory: arguments": args, "memory: temp": temp, "memory": args + temp}


def predict_verify_quantities(model: ModelConfig, layout: Layout, devices: int, seq_len: int,
                              global_batch: int, bytes_per_element: float = BYTES_PER_ELEMENT) -> dict[str, float]:
    """The planner-side prediction of every compared quantity, per device per step, from formulas only."""
    if devices != layout.devices:
        raise MeshplanError(f"layout uses {layout.devices} devices, not {devices}")
    flops = predict_flops(model, layout, devices, seq_len, global_batch)
    out = {"flops": flops, "matmul flops": flops}
    out.update({f"{k} bytes": v for k, v in
                predict_collective_bytes(model, layout, seq_len, global_batch, bytes_per_element).items()})
    out.update(predict_memory(model, layout, seq_len, global_batch, bytes_per_element))
    return out

# --- the compiled side ---------------------------------------------------------------------------

def _cost(compiled: Any) -> dict[str, float]:
    """cost_analysis() is a dict in new JAX and a list of one dict in older versions."""
    ca = compiled.cost_analysis()
    if isinstance(ca, list | tuple):
        ca = ca[0] if ca else {}
    return dict(ca or {})


def device_coords(mesh: Any) -> dict[int, tuple[int, ...]]:
    """Device id → its coordinates in the mesh (HLO replica groups name devices by id)."""
    import numpy as np

    return {int(d.id): tuple(int(i) for i in idx) for idx, d in np.ndenumerate(mesh.devices)}


def compile_step(model: ModelConfig, layout: Layout, seq_len: int, global_batch: int) -> tuple[Any, Any]:
    """Lower and compile the sharded train step on simulated CPU devices (nothing runs). (program, compiled)"""
    ensure_host_devices(layout.devices)
    jax = import_jax()
    from meshplan.measure import jaxmodel as jm

    prog = jm.build_program(model, layout, seq_len, global_batch, jax.devices("cpu"))
    compiled = prog.step.lower(*jm.abstract_inputs(prog, seq_len, global_batch)).compile()
    return prog, compiled


def measure_compiled(prog: Any, compiled: Any) -> dict[str, Any]:
    """Per-device FLOPs, collective bytes per kind and memory of a compiled step, read from XLA."""
    text = compiled.as_text()
    colls = parse_collectives(text, device_coords(prog.mesh), tuple(prog.mesh.axis_names))
    mem = compiled.memory_analysis()
    out: dict[str, Any] = {"flops": float(_cost(compiled).get("flops", 0.0)), "matmul flops": dot_flops(text)}
    for kind in COLLECTIVES:
        out[f"{kind} bytes"] = float(sum(c.bytes for c in colls if c.kind == kind))
    out["memory: arguments"] = float(mem.argument_size_in_bytes)
    out["memory: temp"] = float(mem.temp_size_in_bytes)
    out["memory"] = float(mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                          + mem.temp_size_in_bytes)
    out["collectives"] = colls
    return out


def summarize_collectives(colls: list[Collective]) -> list[dict[str, Any]]:
    """Group collectives by (kind, mesh axes, dtype): count, bytes, wire bytes."""
    groups: dict[tuple, dict[str, Any]] = defaultdict(lambda: {"count": 0, "bytes": 0.0, "wire_bytes": 0.0})
    for c in colls:
        g = groups[(c.kind, "+".join(c.axes) or "-", c.dtype, c.group_size)]
        g["count"] += 1
        g["bytes"] += c.bytes
        g["wire_bytes"] += c.wire_bytes
    return [{"kind": k, "axes": a, "dtype": d, "group_size": n, **v} for (k, a, d, n), v in sorted(groups.items())]


# --- checks and the report -----------------------------------------------------------------------

def causal_balance(seq_len: int, cp: int, load_balanced: bool = True) -> float:
    """max/mean causal work (query-key pairs kept by the mask) over the context ranks: 1.0 is even. The
    contiguous split gives (2cp−1)/cp; the load-balanced order (chunks i and 2cp−1−i) gives 1."""
    import numpy as np

    if load_balanced:
        chunks = np.arange(seq_len).reshape(2 * cp, seq_len // (2 * cp))
        order = np.concatenate([np.concatenate([chunks[i], chunks[2 * cp - 1 - i]]) for i in range(cp)])
    else:
        order = np.arange(seq_len)
    work = (order + 1).reshape(cp, -1).sum(axis=1)
    return float(work.max() / work.mean())


def loss_check(model: ModelConfig, layout: Layout, seq_len: int, global_batch: int, steps: int = 3,
               rtol: float = 1e-4, compiled: tuple[Any, Any] | None = None,
               reference: list[float] | None = None) -> dict[str, Any]:
    """Run `steps` AdamW steps sharded and on one device (no recompute) from the same init and data; compare
    the losses. `compiled`: (program, executable) from `compile_step` to reuse; `reference`: one-device
    losses already computed for this model and shapes."""
    ensure_host_devices(layout.devices)
    jax = import_jax()
    from meshplan.measure import jaxmodel as jm

    devs = jax.devices("cpu")
    prog, exe = compiled or (jm.build_program(model, layout, seq_len, global_batch, devs), None)
    sharded = jm.run_steps(prog, seq_len, global_batch, steps, compiled=exe)
    if reference is None:
        reference = jm.run_steps(jm.build_program(model, Layout(), seq_len, global_batch, devs), seq_len,
                                 global_batch, steps)
    err = max(abs(a - b) / abs(b) for a, b in zip(sharded, reference, strict=True))
    return {"sharded": sharded, "unsharded": reference, "max_rel_diff": err, "matches": err <= rtol}


def _rel(pred: float, got: float) -> float | None:
    if pred == 0:
        return 0.0 if got == 0 else None
    return (got - pred) / pred


def compare(predicted: dict[str, float], measured: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per quantity: predicted, compiled, relative error (compiled − predicted) / predicted."""
    return [{"quantity": q, "predicted": p, "compiled": measured[q], "rel_error": _rel(p, measured[q])}
            for q, p in predicted.items() if q in measured]


def _dtype_note(colls: list[Collective], b: float) -> dict[str, Any]:
    """Element types on the wire vs the model's; a wider type is a backend upcast (reported, not hidden)."""
    from meshplan.measure.hlo import DTYPE_BYTES

    float_types = sorted({c.dtype for c in colls if c.dtype.startswith(("f", "bf"))})
    upcast = any(DTYPE_BYTES.get(t, b) > b for t in float_types)
    return {"model_bytes_per_element": b, "collective_float_dtypes": float_types, "upcast": upcast}


def run_verify(model: ModelConfig, layout: Layout, seq_len: int, global_batch: int, *,
               loss_model: ModelConfig | None = None, loss_seq_len: int = 128, loss_batch: int = 16,
               steps: int = 3, reference: list[float] | None = None) -> dict[str, Any]:
    """Compile `model` under `layout`, compare with the prediction, and (unless loss_model is None) check
    the sharded loss of `loss_model` against one device. The `meshplan verify --json` object."""
    t0 = time.perf_counter()
    prog, compiled = compile_step(model, layout, seq_len, global_batch)
    compile_s = time.perf_counter() - t0
    measured = measure_compiled(prog, compiled)
    predicted = predict_verify_quantities(model, layout, layout.devices, seq_len, global_batch)
    colls = measured["collectives"]
    out: dict[str, Any] = {
        "model": model.as_dict(), "layout": layout.as_dict(), "devices": layout.devices, "seq_len": seq_len,
        "global_batch": global_batch, "rows": compare(predicted, measured),
        "collectives": summarize_collectives(colls),
        "reduce_scatters_from_all_reduce": sum(1 for c in colls if c.note),
        "dtypes": _dtype_note(colls, BYTES_PER_ELEMENT), "compile_s": compile_s,
    }
    if layout.cp > 1:
        out["cp_causal_balance"] = {"load_balanced": causal_balance(seq_len, layout.cp),
                                    "contiguous": causal_balance(seq_len, layout.cp, load_balanced=False)}
    out["loss_matches_unsharded"] = None
    if loss_model is not None:
        same = loss_model == model and (loss_seq_len, loss_batch) == (seq_len, global_batch)
        check = loss_check(loss_model, layout, loss_seq_len, loss_batch, steps,
                           compiled=(prog, compiled) if same else None, reference=reference)
        out["loss_check"] = check
        out["loss_matches_unsharded"] = check["matches"]
    return out
