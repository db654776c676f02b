"""`meshplan verify`: compile a layout as a sharded JAX training step and compare XLA with the prediction.

Two sides, kept apart:
- `plan_ledger` asks the planner's cost model (the one `meshplan train` ranks by) for its ledger of the program
  compiled: per-device FLOPs by kind, collective bytes by kind and mesh axes, memory — never from the compiled
  program. There is no second predictor.
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
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from meshplan.errors import MeshplanError
from meshplan.measure.hlo import COLLECTIVES, Collective, dot_flops, parse_collectives, read_module
from meshplan.measure.layout import Layout
from meshplan.specs.model import ModelConfig
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import Options
from meshplan.train.frameworks import PROGRAM_FACTS, framework_options
from meshplan.train.ledger import HLO_KIND, collective_totals
from meshplan.train.space import Problem

BYTES_PER_ELEMENT = 4.0  # the CPU reference model runs in float32 (program_options says so to the cost model)
# XLA's CPU backend schedules for concurrency by default, keeping more buffers live than a GPU/TPU program's
# memory-aware schedule; verify asks for its memory-minimising schedule, so that `memory_analysis()` temp bytes
# are a peak-memory figure the planner's rules can be held to (docs/verify.md, "Memory")
CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
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
    if "xla_cpu_enable_concurrency_optimized_scheduler" not in flags:
        flags = f"{flags} {CPU_SCHEDULER_FLAG}"
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


# what reference_model changes, in words (ModelConfig field -> what the compiled program builds instead)
_SIMPLIFIED = {"layer_windows": "sliding-window layers (full attention in every layer)",
               "n_shared_experts": "shared experts (routed experts only)",
               "first_dense_layers": "leading dense layers (every layer alike)",
               "qk_norm": "QK-norm", "attention_sinks": "attention sinks",
               "linear_bias": "linear biases", "qkv_bias": "QKV biases", "out_bias": "output-projection biases",
               "router_bias": "router bias", "lm_head_bias": "LM-head bias", "shared_expert_gate": "shared-expert gate",
               "norm": "its norm (RMSNorm instead)", "position": "its position encoding (RoPE instead)",
               "norms_per_layer": "its norms per layer (two instead)"}


def reference_simplifications(m: ModelConfig) -> list[str]:
    """What of `m`'s architecture the JAX reference leaves out (reference_model), so that `verify` says it checks the
    simplified model, not the named one (session 21, QA finding: a 64-token sliding window compiled as full
    attention and reported "match")."""
    ref = reference_model(m)
    return [words for field_name, words in _SIMPLIFIED.items() if getattr(m, field_name) != getattr(ref, field_name)]


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


# --- the planner's ledger of the compiled program ------------------------------------------------

VERIFY_HARDWARE = "tpu-v5p"  # the chip the ledger is costed on: an XLA target (bytes and FLOPs do not depend on it)
PROGRAM_FRAMEWORK = "jax"  # whose schedule the compiled program follows (MaxText's: train/frameworks.py)
# the shape the loss check runs the tiny twin at (sequence length T, global batch B): `meshplan verify`'s default T and B
LOSS_SEQ_LEN, LOSS_BATCH = 128, 16


def program_options(framework: str = PROGRAM_FRAMEWORK) -> Options:
    """The cost model's Options that describe the compiled reference program: a framework's schedule
    (train/frameworks.py; "jax" = MaxText's, the one XLA's program follows) with the program's own facts
    (PROGRAM_FACTS: fp32, materialised attention, all-gathered CP, no runtime reserve). Another framework shows
    where its schedule differs from the compiled one."""
    return replace(framework_options(framework, Options(), {}), **PROGRAM_FACTS)


def program_attention(layout: Layout, options: Options | None = None) -> str:
    """The attention core the program compiles (jaxmodel.ATTENTION_CORES) for the planner's option: "flash"
    (blockwise, online softmax, no score buffer) where `options.flash_attention` says so, except under CP, whose
    per-device query chunks (load-balanced order) would need per-device block skipping: CP layouts compile the
    materialised core, and their ledger is the planner's materialised one (`plan_ledger`)."""
    options = options or program_options()
    return "flash" if options.flash_attention and layout.cp == 1 else "materialized"


# Whether measure/jaxmodel.py loops over micro-batches (gradient accumulation, pipeline micro-batches) when
# Layout.microbatch is below the local batch (it does: Layout.microbatch 0 = the whole local batch at once)
PROGRAM_ACCUMULATES = True


def program_config(layout: Layout, global_batch: int) -> ParallelConfig:
    """The planner's config of the program compiled for `layout` — the one conversion between the two: the planner
    counts EP inside the data ranks (dp·fsdp·tp·pp·cp = chips) where the mesh gives experts their own axis (carved out
    of dp, or under `ep_in_fsdp` out of fsdp: Layout.from_config is the inverse); ZeRO-3
    over the data ranks is the planner's FSDP; the micro-batch is the program's (PROGRAM_ACCUMULATES)."""
    local = max(1, global_batch // layout.batch_shards)
    mb = layout.microbatch if PROGRAM_ACCUMULATES and 0 < layout.microbatch < local else local
    dp, fsdp, zero = layout.dp * layout.ep, layout.fsdp, layout.zero
    if zero == 3:  # ZeRO-3 shards over every data rank: the planner's FSDP group
        dp, fsdp, zero = layout.ep, layout.dp * layout.fsdp, 0
    if getattr(layout, "ep_in_fsdp", False):  # the expert ranks are FSDP ranks (the planner's `ep_fsdp`)
        dp, fsdp = dp // layout.ep, fsdp * layout.ep
    return ParallelConfig(dp=dp, fsdp=fsdp, tp=layout.tp, pp=layout.pp, vpp=getattr(layout, "vpp", 1), cp=layout.cp,
                          ep=layout.ep, microbatch=mb, recompute=layout.recompute, zero=zero,
                          offload=layout.offload, sequence_parallel=layout.sequence_parallel)


def plan_ledger(model: ModelConfig, layout: Layout, seq_len: int, global_batch: int,
                options: Options | None = None, hardware: str = VERIFY_HARDWARE) -> dict[str, Any]:
    """The planner's ledger (train/ledger.py) of exactly the program compiled: the same Problem, config and
    cost model `meshplan train` evaluates. Needs no JAX."""
    from meshplan.cost.efficiency import default_efficiency
    from meshplan.specs.hardware import load_chip
    from meshplan.train.costmodel import CostModel
    from meshplan.train.evaluate import evaluate

    chip = load_chip(hardware)
    problem = Problem(model, chip, layout.devices, seq_len, global_batch)
    options = options or program_options()
    if getattr(layout, "cp_impl", None):  # the CP form the program was built with
        options = replace(options, cp_impl=layout.cp_impl)
    options = replace(options, flash_attention=program_attention(layout, options) == "flash")
    cm = CostModel(problem, default_efficiency(chip), options)
    ev = evaluate(cm, LayoutArrays.from_configs([program_config(layout, global_batch)]))
    return ev.ledger.plan(0)


def ledger_quantities(ledger: dict[str, Any]) -> dict[str, float]:
    """The verify rows' predicted column, read from a plan ledger: FLOPs (all; and the matmuls, attention's QKᵀ
    and AV included, as XLA's dots are), bytes per collective kind and per kind and mesh axes, memory."""
    fl, mem = ledger["flops"], ledger["memory_bytes"]
    out = {"flops": sum(fl.values()), "matmul flops": fl["matmul"] + fl["attention"]}
    out.update({f"{k} bytes": v for k, v in collective_totals(ledger).items()})
    out.update({f"{k} bytes": v for k, v in ledger["collective_bytes"].items()})
    out["memory: arguments"] = mem["params"] + mem["optimizer"]
    out["memory: temp"] = mem["grads"] + mem["activations"] + mem["temp"]
    out["memory"] = mem["total"]
    return out

# --- the compiled side ---------------------------------------------------------------------------

def compiled_cost(compiled: Any) -> dict[str, float]:
    """cost_analysis() is a dict in new JAX and a list of one dict in older versions."""
    ca = compiled.cost_analysis()
    if isinstance(ca, list | tuple):
        ca = ca[0] if ca else {}
    return dict(ca or {})


def device_coords(mesh: Any) -> dict[int, tuple[int, ...]]:
    """Device id → its coordinates in the mesh (HLO replica groups name devices by id)."""
    import numpy as np

    return {int(d.id): tuple(int(i) for i in idx) for idx, d in np.ndenumerate(mesh.devices)}


def compile_step(model: ModelConfig, layout: Layout, seq_len: int, global_batch: int,
                 attention: str | None = None) -> tuple[Any, Any]:
    """Lower and compile the sharded train step on simulated CPU devices (nothing runs). (program, compiled);
    `attention`: the core (default `program_attention(layout)`)."""
    ensure_host_devices(layout.devices)
    jax = import_jax()
    from meshplan.measure import jaxmodel as jm

    prog = jm.build_program(model, layout, seq_len, global_batch, jax.devices("cpu"),
                            attention or program_attention(layout))
    compiled = prog.step.lower(*jm.abstract_inputs(prog, seq_len, global_batch)).compile()
    return prog, compiled


def measure_compiled(prog: Any, compiled: Any) -> dict[str, Any]:
    """Per-device FLOPs, collective bytes per kind and memory of a compiled step, read from XLA."""
    module = read_module(compiled.as_text())  # parsed once: the collectives and the dots are read from it
    colls = parse_collectives(module, device_coords(prog.mesh), tuple(prog.mesh.axis_names))
    mem = compiled.memory_analysis()
    out: dict[str, Any] = {"flops": float(compiled_cost(compiled).get("flops", 0.0)), "matmul flops": dot_flops(module)}
    for kind in COLLECTIVES:
        out[f"{kind} bytes"] = float(sum(c.bytes for c in colls if c.kind == kind))
    ledger_kind = {v: k for k, v in HLO_KIND.items()}
    for c in colls:  # per kind and mesh axes, keyed as the ledger keys them (`all_gather/tensor bytes`)
        key = f"{ledger_kind[c.kind]}/{'+'.join(c.axes) or '-'} bytes"
        out[key] = out.get(key, 0.0) + c.bytes
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
               reference: list[float] | None = None, attention: str | None = None) -> dict[str, Any]:
    """Run `steps` AdamW steps sharded and on one device (no recompute) from the same init and data; compare
    the losses. `compiled`: (program, executable) from `compile_step` to reuse; `reference`: one-device
    losses already computed for this model and shapes."""
    ensure_host_devices(layout.devices)
    jax = import_jax()
    from meshplan.measure import jaxmodel as jm

    devs = jax.devices("cpu")
    attention = attention or program_attention(layout)
    prog, exe = compiled or (jm.build_program(model, layout, seq_len, global_batch, devs, attention), None)
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
    """One row per quantity: predicted, compiled, relative error (compiled − predicted) / predicted. A collective
    (kind/axes) on one side only gets a row with 0 on the other."""
    per_axis = [q for q in measured if "/" in q and q.endswith(" bytes") and q not in predicted]
    predicted = {**predicted, **{q: 0.0 for q in per_axis}}
    rows = []
    for q, p in predicted.items():
        if q in measured or "/" in q:
            got = float(measured.get(q, 0.0))
            rows.append({"quantity": q, "predicted": p, "compiled": got, "rel_error": _rel(p, got)})
    return rows


def _dtype_note(colls: list[Collective], b: float) -> dict[str, Any]:
    """Element types on the wire vs the model's; a wider type is a backend upcast (reported, not hidden)."""
    from meshplan.measure.hlo import DTYPE_BYTES

    float_types = sorted({c.dtype for c in colls if c.dtype.startswith(("f", "bf"))})
    upcast = any(DTYPE_BYTES.get(t, b) > b for t in float_types)
    return {"model_bytes_per_element": b, "collective_float_dtypes": float_types, "upcast": upcast}


LOSS_SKIPPED_EP_IN_FSDP = ("XLA:CPU stops in an all-gather over `expert` when the steps of a layout with EP inside the "
                           "FSDP group run (the compiled program is compared in full)")


def run_verify(model: ModelConfig, layout: Layout, seq_len: int, global_batch: int, *,
               loss_model: ModelConfig | None = None, loss_seq_len: int = LOSS_SEQ_LEN, loss_batch: int = LOSS_BATCH,
               steps: int = 3, reference: list[float] | None = None, options: Options | None = None,
               hardware: str = VERIFY_HARDWARE, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Compile `model` under `layout`, compare with the planner's ledger of that program, and (unless loss_model
    is None) check the sharded loss of `loss_model` against one device. The `meshplan verify --json` object.
    `options`: the cost model's Options of the program (default `program_options()`); `progress`: called with a
    line before each slow phase."""
    say = progress or (lambda _msg: None)
    attention = program_attention(layout, options)
    if attention == "flash" and layout.resolved().fsdp > 1 and loss_model is not None:
        # measured (docs/verify.md, "Flash attention in the program"): running the FSDP8 program with the flash core
        # deadlocks XLA's CPU collectives (one device enters a later all-gather); compiling it is fine
        raise MeshplanError("--attention flash with FSDP runs into a deadlock of XLA's CPU collectives when the steps "
                            "are run; add --no-loss-check to compare the compiled program only")
    ledger = plan_ledger(model, layout, seq_len, global_batch, options, hardware)
    ensure_host_devices(layout.devices)
    import_jax()
    from meshplan.measure import jaxmodel as jm

    jm.check_supported(model, layout, seq_len, global_batch)  # a layout the program cannot build: refused first
    say(f"compiling {model.name} (L={model.n_layers}, D={model.d_model}) on {layout.devices} CPU devices ...")
    t0 = time.perf_counter()
    prog, compiled = compile_step(model, layout, seq_len, global_batch, attention)
    compile_s = time.perf_counter() - t0
    say(f"compiled in {compile_s:.1f} s; reading the HLO ...")
    measured = measure_compiled(prog, compiled)
    colls = measured["collectives"]
    out: dict[str, Any] = {
        "model": model.as_dict(), "layout": layout.as_dict(), "devices": layout.devices, "seq_len": seq_len,
        "global_batch": global_batch, "rows": compare(ledger_quantities(ledger), measured), "ledger": ledger,
        "collectives": summarize_collectives(colls),
        "reduce_scatters_from_all_reduce": sum(1 for c in colls if c.note == "all-reduce+dynamic-slice"),
        "all_reduces_folded": sum(1 for c in colls if c.note == "all-reduce+all-reduce"),
        "dtypes": _dtype_note(colls, BYTES_PER_ELEMENT), "compile_s": compile_s, "attention": attention,
    }
    if layout.cp > 1:
        out["cp_causal_balance"] = {"load_balanced": causal_balance(seq_len, layout.cp),
                                    "contiguous": causal_balance(seq_len, layout.cp, load_balanced=False)}
    out["loss_matches_unsharded"] = None
    if loss_model is not None and layout.ep_in_fsdp and layout.ep > 1:
        # measured (docs/verify.md, "EP inside the FSDP group"): running these programs' steps stops XLA:CPU in an
        # all-gather over `expert`, and its collectives' termination timeout aborts the process; compiling is fine
        out["loss_check_skipped"] = LOSS_SKIPPED_EP_IN_FSDP
        say(f"loss check skipped: {LOSS_SKIPPED_EP_IN_FSDP}")
        loss_model = None
    if loss_model is not None:
        say(f"running {steps} steps sharded and on one device to compare the losses ...")
        same = loss_model == model and (loss_seq_len, loss_batch) == (seq_len, global_batch)
        check = loss_check(loss_model, layout, loss_seq_len, loss_batch, steps,
                           compiled=(prog, compiled) if same else None, reference=reference, attention=attention)
        out["loss_check"] = check
        out["loss_matches_unsharded"] = check["matches"]
    return out
