"""`meshplan verify`: compile a layout as a sharded JAX step on simulated CPU devices and check the plan's ledger."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from meshplan.cli.app import app, console, err_console, fail, print_json
from meshplan.cli.basic import JsonOpt
from meshplan.math.transformer import RECOMPUTE_POLICIES
from meshplan.measure import verify as mv
from meshplan.measure.layout import Layout, describe
from meshplan.specs._load import read_text
from meshplan.specs.model import load_model
from meshplan.units import fmt_bytes, fmt_flops
from meshplan.validate import CLI_RULES


def _fmt(quantity: str, v: float | None) -> str:
    if v is None:
        return "—"
    return fmt_flops(v) if "flops" in quantity else fmt_bytes(v)


def _print_table(report: dict) -> None:
    m = report["model"]
    t = Table(title=f"verify {m['name']} (L={m['n_layers']} D={m['d_model']}) on {report['devices']} CPU devices: "
                    f"{describe(Layout(**report['layout']))}")
    for col in ("quantity", "planner ledger", "compiled", "rel. error"):
        t.add_column(col, justify="left" if col == "quantity" else "right")
    for r in report["rows"]:
        err = "—" if r["rel_error"] is None else f"{r['rel_error']:+.1%}"
        if r["quantity"] == "flops":  # XLA's cost_analysis counts a loop body once (footnote below)
            err = f"({err}, not checked)"
        t.add_row(r["quantity"], _fmt(r["quantity"], r["predicted"]), _fmt(r["quantity"], r["compiled"]), err)
    console.print(t)
    if any(r["quantity"] == "flops" for r in report["rows"]):
        console.print("[dim]flops: XLA's cost_analysis() counts each loop body once (the layers' scan, the "
                      "micro-batches' scan), so the compiled total is low and not compared; 'matmul flops' counts every "
                      "dot at its loop's trip count (measure/hlo.py) and is the checked one (docs/verify.md)[/dim]")
    for c in report["collectives"]:
        console.print(f"  {c['kind']:<18} over {c['axes']:<14} ×{c['count']:<3} {fmt_bytes(c['bytes'])} ({c['dtype']})")
    if report["reduce_scatters_from_all_reduce"]:
        console.print(f"[dim]{report['reduce_scatters_from_all_reduce']} reduce-scatter(s) were emitted by the CPU "
                      "backend as all-reduce + dynamic-slice and are counted as reduce-scatters[/dim]")
    d = report["dtypes"]
    console.print(f"[dim]collective dtypes {', '.join(d['collective_float_dtypes']) or '—'}; model "
                  f"{d['model_bytes_per_element']:.0f} B/element; upcast: {d['upcast']}[/dim]")
    if report.get("architecture_simplified"):
        console.print("[yellow]compiled without:[/yellow] " + ", ".join(report["architecture_simplified"]) +
                      f" (the JAX reference builds a LLaMA-style {m['name']}; the ledger is checked on that model)")
    if report.get("not_built"):
        nb = {k: v for k, v in report["not_built"].items() if k != "why"}
        console.print(f"[yellow]not built:[/yellow] {_not_built_sentence(nb)}")
    if report.get("loss_check_skipped"):
        console.print(f"[yellow]loss check skipped:[/yellow] {report['loss_check_skipped']}")
    if report.get("loss_check"):
        lc = report["loss_check"]
        console.print(f"loss sharded {lc['sharded']} vs one device {lc['unsharded']}: "
                      f"{'match' if lc['matches'] else 'MISMATCH'} (max rel. diff {lc['max_rel_diff']:.1e})")


def read_plan(source: str, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(problem, config) of plan `rank` (1 = best) of a `meshplan train --json` object in a file or on stdin (-)."""
    text = read_text(Path(source), "--plan", "the UTF-8 JSON of `meshplan train --json`", stdin=True)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        fail(f"--plan: not a `meshplan train --json` object ({exc.msg} at line {exc.lineno})")
    except RecursionError:  # thousands of nested brackets
        fail("--plan: not a `meshplan train --json` object (nested too deeply)")
    plans = data.get("plans") if isinstance(data, dict) else None
    if not isinstance(plans, list) or not plans:
        fail("--plan: no \"plans\" list in the JSON (expected the output of `meshplan train --json`)")
    if not 1 <= rank <= len(plans):
        fail(f"--rank {rank} is outside the {len(plans)} plan(s) in the JSON")
    problem = data.get("problem")
    if not isinstance(problem, dict) or "model" not in problem:
        fail("--plan: the JSON has no \"problem\" (model, chips); rerun `meshplan train --json` with this version")
    if not isinstance(problem["model"], str) or not problem["model"]:
        fail(f"--plan: \"problem\".\"model\" must be a model name or config path, got {problem['model']!r:.40}")
    if problem.get("chips") is not None:  # the chips become simulated CPU devices: the --devices bound
        problem = {**problem, "chips": CLI_RULES["devices"].check(problem["chips"], "--plan: \"problem\".\"chips\"")}
    config = plans[rank - 1].get("config") if isinstance(plans[rank - 1], dict) else None
    if not isinstance(config, dict):
        fail(f"--plan: plan {rank} has no \"config\"")
    return problem, config


# the plan features that live on the host, outside the device program a CPU compile can check (docs/verify.md)
HOST_OFFLOAD_KEYS = ("offload", "offload_optimizer", "offload_params")
_NOT_BUILT_WHY = ("host offload is not in the program XLA:CPU compiles (it drops offloaded remat; optimizer and weight "
                  "offload run on the host): compiled and checked without it")


def _host_offload_of(config: dict[str, Any]) -> dict[str, float]:
    """The plan's host-offload settings that are on (activation fraction, optimizer state, weights)."""
    return {k: float(v) for k in HOST_OFFLOAD_KEYS
            if isinstance(v := config.get(k), (int, float)) and not isinstance(v, bool) and v > 0}


def _not_built_sentence(not_built: dict[str, float]) -> str:
    what = ", ".join(f"{k.replace('_', ' ')} {v:g}" for k, v in not_built.items())
    return f"the plan's {what}: {_NOT_BUILT_WHY}"


_LAYOUT = Layout()  # the layout flags' defaults are Layout's
# the flags --plan replaces (the JSON names the model and the layout): given with --plan at other than their defaults,
# they are refused
_PLAN_OWNS = ("model_name", "dp", "fsdp", "tp", "cp", "ep", "pp", "vpp", "microbatch", "recompute", "zero")


@app.command()
def verify(
    ctx: typer.Context,
    model_name: Annotated[str | None, typer.Option("--model", "-m", help="Preset name or HF config.json path.")] = None,
    plan_file: Annotated[str | None, typer.Option("--plan", help="A `meshplan train --json` file, or - for stdin: "
                                                                 "verify its plan --rank (model, chips, layout).")] = None,
    rank: Annotated[int, typer.Option(help="With --plan: which plan (1 = the best).")] = 1,
    devices: Annotated[int, typer.Option(help="Simulated CPU devices (= dp·fsdp·tp·cp·ep·pp).")] = 8,
    seq_len: Annotated[int, typer.Option(help="Sequence length T.")] = mv.LOSS_SEQ_LEN,
    global_batch: Annotated[int, typer.Option(help="Global batch B in sequences.")] = mv.LOSS_BATCH,
    dp: Annotated[int | None, typer.Option(help="Data parallel degree (default: what the other axes leave).")] = None,
    fsdp: Annotated[int, typer.Option(help="FSDP (ZeRO-3) degree.")] = _LAYOUT.fsdp,
    tp: Annotated[int, typer.Option(help="Tensor parallel degree (with sequence parallelism).")] = _LAYOUT.tp,
    cp: Annotated[int, typer.Option(help="Context parallel degree (load-balanced causal split).")] = _LAYOUT.cp,
    cp_impl: Annotated[str, typer.Option("--cp-impl", help="How CP runs attention: allgather (each layer gathers the "
                                         "sequence's K/V; Llama 3, MaxText) or ring (K/V blocks passed round the "
                                         "context ranks by ppermute).")] = _LAYOUT.cp_impl,
    ep: Annotated[int, typer.Option(help="Expert parallel degree (MoE models; its own mesh axis here).")] = _LAYOUT.ep,
    pp: Annotated[int, typer.Option(help="Pipeline stages (one SPMD loop over the `stage` axis, as MaxText's pipeline; "
                                         "--microbatch sets the micro-batches).")] = _LAYOUT.pp,
    vpp: Annotated[int, typer.Option(help="Virtual stages per pipeline rank (interleaving: MaxText's circular "
                                          "pipeline, num_pipeline_repeats); needs micro-batches >= pp.")] = _LAYOUT.vpp,
    microbatch: Annotated[int, typer.Option(
        help="Micro-batch (sequences; 0 = the whole local batch at once).")] = _LAYOUT.microbatch,
    recompute: Annotated[str, typer.Option(help=" | ".join(RECOMPUTE_POLICIES))] = _LAYOUT.recompute,
    zero: Annotated[int, typer.Option(help="ZeRO stage over the data axis: 1 optimizer state, 2 also gradients "
                                           "sharded; 3 compiles FSDP over the data ranks.")] = _LAYOUT.zero,
    attention: Annotated[str, typer.Option(
        help="Attention core of the program: materialized (scores in memory) or flash (blockwise, online softmax, "
             "FlashAttention-2's backward; the ledger is then the planner's flash one; CP layouts stay "
             "materialized).")] = "materialized",
    framework: Annotated[str, typer.Option(
        help="Whose schedule the planner's ledger assumes: jax (default; = maxtext, the one XLA's program follows), "
             "or megatron / nemo / torchtitan to see where theirs differs from the compiled program.")
    ] = mv.PROGRAM_FRAMEWORK,
    tiny: Annotated[bool, typer.Option("--tiny/--no-tiny", help="Shrink the model for a CPU (L=2, D=256, V=512).")] = True,
    layers: Annotated[int | None, typer.Option(help="With --no-tiny: keep the real widths, use this many layers.")] = None,
    no_loss: Annotated[bool, typer.Option("--no-loss-check", help="Skip running steps (compile only).")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Compile the layout as a sharded JAX training step and compare its FLOPs, collectives and memory with the
    planner's ledger (the numbers `meshplan train` ranks by)."""
    if importlib.util.find_spec("jax") is None:
        fail(mv.JAX_MISSING)
    if attention not in ("materialized", "flash"):
        fail(f"--attention must be materialized or flash, got '{attention}'")
    if plan_file is not None:
        defaults = {p.name: p for p in ctx.command.params}  # each flag's default, as the signature above declares it
        pinned = [defaults[n].opts[0] for n in _PLAN_OWNS if ctx.params[n] != defaults[n].default]
        if pinned:
            fail(f"--plan takes the model and the layout from the JSON; drop {', '.join(pinned)}")
        problem, config = read_plan(plan_file, rank)
        if problem.get("chips") and devices not in (defaults["devices"].default, problem["chips"]):
            fail(f"--plan runs the plan's {problem['chips']} chips as devices; drop --devices {devices}")
        model_name, devices = problem["model"], problem.get("chips") or devices
        layout = Layout.from_config(config, devices=devices)
        # a `train --json` plan does not say how CP runs attention: --cp-impl does, unless the JSON names another
        planned_cp = config.get("cp_impl") if isinstance(config, dict) else None
        if planned_cp not in (None, cp_impl) and ctx.params["cp_impl"] != defaults["cp_impl"].default:
            fail(f"--plan runs CP as its JSON says ({planned_cp}); drop --cp-impl {cp_impl}")
        if planned_cp is None:
            layout = Layout(**{**layout.as_dict(), "cp_impl": cp_impl})
        if ctx.params["global_batch"] == defaults["global_batch"].default:
            # the CPU batch: the default's sequences, rounded up to whole sequences on every batch shard of the plan
            # (QA session 22: a 32-shard plan failed on the default 16 "does not divide by 32")
            global_batch = layout.batch_shards * -(-global_batch // layout.batch_shards)
        if layout.microbatch * layout.batch_shards >= global_batch:  # the CPU batch is one micro-batch per rank
            layout = Layout(**{**layout.as_dict(), "microbatch": 0})
        not_built = _host_offload_of(config)
        if not_built:
            # the plan's host offload lives outside the device program (XLA:CPU drops offloaded remat; optimizer and
            # weight offload are host-side loops): the program is compiled without it, against the ledger of exactly
            # that program, and the report names what was left out (its FLOPs and collectives do not change)
            layout = Layout(**{**layout.as_dict(), "offload": 0.0})
            err_console.print(f"[yellow]note:[/yellow] {_not_built_sentence(not_built)}")
    else:
        if model_name is None:
            fail("verify needs --model (with layout flags) or --plan FILE|- (a `meshplan train --json`)")
        if rank != 1:
            fail("--rank goes with --plan FILE|- (which plan of a `meshplan train --json`)")
        not_built = {}
        rest = fsdp * tp * cp * ep * pp
        if devices <= 0 or devices % rest:
            fail(f"--devices {devices} is not a multiple of fsdp·tp·cp·ep·pp = {rest}")
        layout = Layout(dp=dp or devices // rest, fsdp=fsdp, tp=tp, cp=cp, ep=ep, pp=pp, microbatch=microbatch,
                        recompute=recompute, zero=zero, vpp=vpp, cp_impl=cp_impl)
    if layout.devices != devices:
        fail(f"the layout uses {layout.devices} devices, not {devices}")
    if layout.zero <= 1 and layout.fsdp == 1 and layout.n_micro(global_batch) > 1 and layout.batch_shards > 1 \
            and layout.devices > layout.batch_shards:
        # a known difference of the reference program, not of the plan (docs/verify.md, "ZeRO-1 (and ZeRO-0) x TP
        # with micro-batches"): say so beside the rows it moves
        err_console.print(f"[yellow]note:[/yellow] with {layout.n_micro(global_batch)} micro-batches and an axis "
                          "beside data, the JAX reference reduces the gradients over data every micro-batch, the "
                          "ledger once a step (MaxText's way): the data-axis reduce rows differ by about that "
                          "factor (docs/verify.md, 'ZeRO-1 (and ZeRO-0) x TP with micro-batches')")
    layout = layout.resolved()  # ZeRO-3 = FSDP over every data rank (it used to run plain DP silently)
    m = load_model(model_name)
    # the tiny twin keeps 2 layers, or one per (virtual) pipeline stage
    small = mv.tiny_model(m, layers=max(2, layout.pp * layout.vpp), min_kv_heads=layout.tp)
    big = small if tiny else mv.reference_model(m.with_overrides(n_layers=layers or m.n_layers))
    report = mv.run_verify(big, layout, seq_len, global_batch, loss_model=None if no_loss else small,
                           loss_seq_len=seq_len if tiny else mv.LOSS_SEQ_LEN,
                           loss_batch=global_batch if tiny else mv.LOSS_BATCH,
                           options=replace(mv.program_options(framework), flash_attention=attention == "flash"),
                           progress=lambda msg: err_console.print(f"[dim]{msg}[/dim]"))
    report["framework"] = framework
    simplified = mv.reference_simplifications(m)
    if simplified:
        report["architecture_simplified"] = simplified
    if not_built:
        report["not_built"] = {**not_built, "why": _NOT_BUILT_WHY}
    if json_out:
        print_json(report)
    else:
        _print_table(report)
