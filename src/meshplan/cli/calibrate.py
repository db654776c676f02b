"""`meshplan calibrate` (microbenchmarks → a meshplan-profile/1 JSON) and `meshplan measure` (real training
steps beside the prediction). JAX is imported only inside the commands, after `jax.distributed.initialize`,
so the rest of the CLI runs without the jax extra."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from meshplan.cli.app import app, console, err_console, fail, print_json
from meshplan.cost.efficiency import PROFILE_SCHEMA, read_profile_json
from meshplan.errors import MeshplanError
from meshplan.math.transformer import RECOMPUTE_HELP
from meshplan.specs.hardware import Chip, load_chip
from meshplan.units import fmt_bytes, fmt_rate, fmt_time

CPU_WARNING = ("JAX sees no accelerator: running on the CPU with tiny shapes. CPU numbers say nothing about "
               "GPUs or TPUs; use this only to check that the tools run.")
Coordinator = Annotated[str | None, typer.Option(help="Multi-host: coordinator HOST:PORT for jax.distributed.")]
NumProcesses = Annotated[int | None, typer.Option(help="Multi-host: number of processes.")]
ProcessId = Annotated[int | None, typer.Option(help="Multi-host: this process's id (0 … N−1).")]


def require_jax(command: str) -> None:
    try:
        import jax  # noqa: F401  (importing does not start a backend; jax.distributed can still follow)
    except ImportError:
        fail(f"meshplan {command} needs the jax extra: pip install 'meshplan[jax]'")


def start_runtime(command: str, coordinator: str | None, num_processes: int | None,
                  process_id: int | None) -> dict[str, Any]:
    """jax.distributed first (when asked for), then the device summary."""
    require_jax(command)
    from meshplan.measure.cluster import init_distributed, local_device_summary

    init_distributed(coordinator, num_processes, process_id)
    return local_device_summary()


def is_main(summary: dict[str, Any]) -> bool:
    return summary["process_index"] == 0


# --- calibrate -------------------------------------------------------------------------------------

@app.command()
def calibrate(
    quick: Annotated[bool, typer.Option("--quick", help="A smaller grid: minutes on a GPU, seconds on a CPU.")] = False,
    out: Annotated[str, typer.Option(help="Where to write the profile JSON.")] = "profile.json",
    hardware: Annotated[str | None, typer.Option(help="Label the profile with this chip (default: detected).")] = None,
    show: Annotated[str | None, typer.Option(help="Print achieved vs peak from a profile file and exit.")] = None,
    model: Annotated[str | None, typer.Option(help="Model whose decoder layer is timed (default llama3.2-1b).")] = None,
    bench: Annotated[str | None, typer.Option(help="Comma list of benchmarks (default all): matmul, hbm, "
                                                   "attention, sdpa, norm, host, overhead, layer, collectives.")] = None,
    time_limit: Annotated[float | None, typer.Option(
        "--time-limit", help="Seconds: start no measurement after this; fit and write what was measured (the rest is "
                             "listed as skipped in the profile).")] = None,
    coordinator: Coordinator = None, num_processes: NumProcesses = None, process_id: ProcessId = None,
) -> None:
    """Microbenchmark the local accelerator(s) and fit meshplan's efficiency model (a --profile for train/serve)."""
    if show is not None:  # --show '' is a missing file, not a calibration run
        show_profile(show)
        return
    if time_limit is not None and not (math.isfinite(time_limit) and time_limit > 0):
        fail(f"--time-limit must be a positive number of seconds, got {time_limit}")
    names = parse_benchmarks(bench)
    require_jax("calibrate")
    from meshplan.measure.cluster import stdout_to_stderr

    with stdout_to_stderr():
        summary, chip, profile = _calibrate(names, quick, hardware, model, coordinator, num_processes, process_id,
                                            time_limit)
    if not is_main(summary):
        return
    Path(out).write_text(json.dumps(profile, indent=2, default=_json_default) + "\n")
    _print_efficiency(profile, chip)
    console.print(f"wrote {out} (use it as `meshplan train --hardware {chip.name} --profile {out}`)")


def _calibrate(names: list[str], quick: bool, hardware: str | None, model: str | None, coordinator: str | None,
               num_processes: int | None, process_id: int | None,
               time_limit_s: float | None = None) -> tuple[dict[str, Any], Chip, dict[str, Any]]:
    summary = start_runtime("calibrate", coordinator, num_processes, process_id)
    chip = _calibration_chip(hardware, summary)
    from meshplan.measure import calibrate as cal
    from meshplan.measure.cluster import now_utc, versions
    from meshplan.measure.fit import build_profile

    ctx = cal.make_context(chip, summary["platform"], quick, model, time_limit_s)
    meta = {"measured_at": now_utc(), "mode": "quick" if quick else "full", "platform": summary["platform"],
            "device_kind": summary["device_kind"], "devices": summary, "versions": versions()}
    records = _run_with_progress(cal, ctx, names, show_bar=is_main(summary))
    return summary, chip, build_profile(chip, records, meta)


def parse_benchmarks(text: str | None) -> list[str]:
    from_text = [b.strip() for b in (text or "").split(",") if b.strip()]
    known = ("matmul", "hbm", "attention", "sdpa", "norm", "host", "overhead", "layer", "collectives")
    bad = [b for b in from_text if b not in known]
    if bad:
        fail(f"unknown benchmark '{bad[0]}' (known: {', '.join(known)})")
    return from_text or list(known)


def _calibration_chip(hardware: str | None, summary: dict[str, Any]) -> Chip:
    from meshplan.measure.cluster import chip_for_device_kind, resolve_chip_name

    name = resolve_chip_name(hardware, summary["device_kind"], summary["platform"])
    chip = load_chip(name)
    if summary["platform"] == "cpu":
        err_console.print(f"warning: {CPU_WARNING} The profile is marked cpu_only and labelled "
                          f"{chip.name} only because --hardware said so.", markup=False, highlight=False)
    elif hardware and chip_for_device_kind(summary["device_kind"]) not in (None, chip.name):
        err_console.print(f"warning: measuring a '{summary['device_kind']}' but labelling it {chip.name} "
                          "(--hardware)", markup=False, highlight=False)
    return chip


def _run_with_progress(cal: Any, ctx: Any, names: list[str], show_bar: bool) -> list[dict]:
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=err_console, disable=not show_bar) as progress:
        task = progress.add_task(f"calibrating {ctx.chip.name}", total=len(names))

        t0 = last = time.monotonic()

        def done(name: str, count: int) -> None:
            nonlocal last
            progress.update(task, advance=1, description=f"{name}: {count} measurements")
            if not err_console.is_terminal:  # a log (the GPU suite, CI): one plain line per benchmark, timed
                now = time.monotonic()
                err_console.print(f"calibrate: {name} done, {count} measurements, {now - last:.1f} s "
                                  f"({now - t0:.1f} s in all)", markup=False, highlight=False)
                last = now

        return cal.run_benchmarks(ctx, names, done)


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def _print_efficiency(profile: dict[str, Any], chip: Chip | None) -> None:
    from meshplan.cost.efficiency import default_efficiency

    defaults = default_efficiency(chip).as_dict() if chip else {}
    t = Table(title=f"efficiency profile for {profile['chip']} ({profile.get('device_kind')})")
    for col in ("field", "value", "origin", "default"):
        t.add_column(col, justify="left" if col in ("field", "origin") else "right")
    origin = profile.get("efficiency_origin", {})
    for k, v in profile["efficiency"].items():
        t.add_row(k, f"{v:.4g}", origin.get(k, "?"), f"{defaults[k]:.4g}" if k in defaults else "")
    console.print(t)
    curves = profile.get("fitted_curves") or {}
    lines = [f"left out of the {bench} fit, bound by the host's dispatch rather than the device: {', '.join(names)}"
             for bench, names in (curves.get("dispatch_bound") or {}).items()]  # measure/fit.py DISPATCH_BOUND_FACTOR
    lines += [f"left out of the {key} fit, the backward lost in the forward's timing noise: {', '.join(c['bwd_unresolved'])}"
              for key, c in curves.items() if isinstance(c, dict) and c.get("bwd_unresolved")]  # fit.backward_resolved
    lines += [f"{field} kept its default: the fit gave {v['value']:.4g}, outside what a profile may hold"
              for field, v in (curves.get("out_of_range") or {}).items()]
    for line in lines:
        console.print(line, markup=False, highlight=False)
    if profile.get("cpu_only"):
        console.print(f"[bold]cpu_only[/bold]: {profile.get('warning', CPU_WARNING)}")


def load_profile_file(path: str) -> dict[str, Any]:
    data = read_profile_json(path)
    if not isinstance(data, dict) or data.get("schema") != PROFILE_SCHEMA:
        raise MeshplanError(f"profile '{path}' is not a {PROFILE_SCHEMA} file")
    if not isinstance(data.get("efficiency"), dict):
        raise MeshplanError(f"profile '{path}': efficiency must be an object of fields (as `meshplan calibrate` "
                            f"writes), got {json.dumps(data.get('efficiency'))[:40]}")
    return data


def show_profile(path: str) -> None:
    """Achieved vs peak for every benchmark of a profile, then its efficiency fields."""
    data = load_profile_file(path)
    t = Table(title=f"{path}: {data.get('chip')} measured on {data.get('device_kind')} at {data.get('measured_at')}")
    for col in ("benchmark", "case", "time", "achieved", "peak", "of peak"):
        t.add_column(col, justify="left" if col in ("benchmark", "case") else "right")
    for r in data.get("benchmarks", []):
        t.add_row(*_benchmark_row(r))
    console.print(t)
    try:
        chip = load_chip(str(data.get("chip")))
    except MeshplanError:
        chip = None
    _print_efficiency(data, chip)


def _benchmark_row(r: dict[str, Any]) -> tuple[str, ...]:
    if "skipped" in r:
        return r["benchmark"], r.get("name", ""), "skipped", r["skipped"][:60], "", ""
    unit = r.get("unit")
    rate = (lambda x: fmt_rate(x, unit)) if unit else (lambda x: "")
    achieved = r.get("achieved_per_s")
    peak = r.get("peak_per_s")
    frac = r.get("fraction")
    if r.get("per_kernel_s") is not None:
        achieved_s = f"{fmt_time(r['per_kernel_s'])}/kernel"
    elif r.get("bus_bytes_per_s") is not None:
        achieved_s = f"{rate(achieved)} (bus {rate(r['bus_bytes_per_s'])})"
    else:
        achieved_s = rate(achieved) if achieved is not None else ""
    return (r["benchmark"], r.get("name", ""), fmt_time(r["time_s"]), achieved_s,
            rate(peak) if peak else "", pct(frac) if frac is not None else "")


# --- measure ---------------------------------------------------------------------------------------

@app.command()
def measure(
    model: Annotated[str, typer.Option("--model", "-m", help="Preset or HF config.json.")],
    seq_len: Annotated[int, typer.Option(help="Sequence length.")] = 2048,
    global_batch: Annotated[int | None, typer.Option(help="Global batch in sequences (default: one per device).")] = None,
    dp: Annotated[int | None, typer.Option(help="Data-parallel degree (default: the devices left).")] = None,
    fsdp: Annotated[int | None, typer.Option(help="FSDP degree.")] = None,
    tp: Annotated[int | None, typer.Option(help="Tensor-parallel degree.")] = None,
    recompute: Annotated[str, typer.Option(help=RECOMPUTE_HELP)] = "none",
    steps: Annotated[int, typer.Option(help="Timed steps (after one warm-up step).")] = 5,
    layers: Annotated[int | None, typer.Option(help="Use only this many layers of the model.")] = None,
    hardware: Annotated[str | None, typer.Option(help="Chip to predict for (default: detected).")] = None,
    profile: Annotated[str | None, typer.Option(help="Calibrated profile for the second prediction.")] = None,
    param_dtype: Annotated[str, typer.Option(help="auto (bf16 on accelerators, fp32 on CPU), bf16, fp32.")] = "auto",
    attention: Annotated[str, typer.Option(help="materialized (the score matrix, as verify compiles it), dpa "
                                                "(jax.nn.dot_product_attention) or cudnn (its cuDNN flash kernel; "
                                                "predicted as flash attention).")] = "materialized",
    kernels: Annotated[bool, typer.Option("--kernels", help="After the timed steps, one more under JAX's profiler: "
                                                            "device time by kind of work (GEMM, attention, "
                                                            "collective, copy, pointwise). Accelerators only.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    coordinator: Coordinator = None, num_processes: NumProcesses = None, process_id: ProcessId = None,
) -> None:
    """Run real training steps of the JAX reference model and compare with meshplan's prediction."""
    from meshplan.specs.model import load_model

    m = load_model(model)
    if attention not in ("materialized", "dpa", "cudnn"):
        fail(f"--attention must be materialized, dpa or cudnn, got '{attention}'")
    if layers is not None:
        if layers < 1:
            fail(f"--layers must be positive, got {layers}")
        m = m.with_overrides(n_layers=layers, name=f"{m.name} ({layers} layers)")
    if seq_len <= 0:
        fail(f"--seq-len must be positive, got {seq_len}")
    if profile:  # a profile that cannot be used fails now, not after the run (session 23, QA finding)
        load_profile_file(profile)
        if hardware:
            from meshplan.cost.efficiency import load_profile

            load_profile(profile, load_chip(hardware))
    require_jax("measure")
    from meshplan.measure.cluster import stdout_to_stderr

    with stdout_to_stderr():
        summary = start_runtime("measure", coordinator, num_processes, process_id)
        chip = _measure_chip(hardware, summary)
        if profile and chip is None:
            fail("--profile needs --hardware on the CPU (the chip the profile is for)")
        from meshplan.measure import steps as st

        batch = global_batch or summary["devices"]
        layout = st.default_layout(summary["devices"], dp, fsdp, tp, recompute, batch)
        dtype = _param_dtype(param_dtype, summary["platform"])
        st.check_memory(m, layout, seq_len, dtype, attention)  # run_training checks it again; this one comes first
        if summary["platform"] == "cpu":  # after every input check: a refused input prints its one error line only
            err_console.print(f"warning: {CPU_WARNING}", markup=False, highlight=False)
        run = st.run_training(m, layout, seq_len, batch, steps, dtype,
                              attention=attention, profile_kernels=kernels,
                              progress=lambda msg: err_console.print(f"measure: {msg}", markup=False,
                                                                     highlight=False))
        result = _measure_result(m, chip, layout, seq_len, batch, run, profile, summary, attention)
    if not is_main(summary):
        return
    if json_out:
        print_json(result)
        return
    _print_measure(result)


def _param_dtype(name: str, platform: str) -> Any:
    import jax.numpy as jnp

    choices = {"bf16": jnp.bfloat16, "fp32": jnp.float32}
    if name == "auto":
        return jnp.float32 if platform == "cpu" else jnp.bfloat16
    if name not in choices:
        fail(f"--param-dtype must be auto, bf16 or fp32, got '{name}'")
    return choices[name]


def _measure_chip(hardware: str | None, summary: dict[str, Any]) -> Chip | None:
    """The chip to predict for; on the CPU only when --hardware names one."""
    from meshplan.measure.cluster import resolve_chip_name

    if summary["platform"] == "cpu":
        return load_chip(hardware) if hardware else None
    return load_chip(resolve_chip_name(hardware, summary["device_kind"], summary["platform"]))


def _measure_result(m, chip, layout, seq_len, batch, run, profile, summary, attention) -> dict[str, Any]:
    from meshplan.cost.efficiency import default_efficiency, load_profile
    from meshplan.measure import steps as st
    from meshplan.train.costmodel import Options

    measured = run.as_dict()
    out: dict[str, Any] = {"model": m.name, "seq_len": seq_len, "global_batch": batch, "layout": layout.as_dict(),
                           "device_kind": summary["device_kind"], "platform": summary["platform"],
                           "processes": summary["processes"], "measured": measured, "predicted": {}}
    if summary["platform"] == "cpu":
        out["cpu_only"] = True
    if chip is None:
        out["note"] = "no prediction: give --hardware to compare with a chip"
        return out
    out["chip"] = chip.name
    measured["mfu"] = run.mfu(chip)
    effs = {"defaults": default_efficiency(chip)}
    if profile:
        effs["profile"] = load_profile(profile, chip)
    for key, eff in effs.items():
        try:
            p = st.predict(m, chip, layout, seq_len, batch, eff, Options(flash_attention=attention != "materialized"))
        except MeshplanError as exc:
            out["predicted"][key] = {"error": str(exc)}
            continue
        out["predicted"][key] = {"step_time_s": p["step_time_s"], "mfu": p["mfu"],
                                 "memory_bytes_per_chip": p["memory_bytes_per_chip"]["total"],
                                 "step_time_error": p["step_time_s"] / run.step_time_s - 1,
                                 "time_s": p["time_s"], "origin": eff.origin}
    return out


def _print_measure(r: dict[str, Any]) -> None:
    meas = r["measured"]
    t = Table(title=f"{r['model']}, seq {r['seq_len']}, batch {r['global_batch']} on {meas['devices']}× "
                    f"{r['device_kind']} ({r['processes']} process(es))")
    t.add_column("")
    t.add_column("measured", justify="right")
    preds = r["predicted"]
    for key in preds:
        t.add_column(f"predicted ({key})", justify="right")
    t.add_row("step time", fmt_time(meas["step_time_s"]), *(_pred_cell(p, "step_time_s") for p in preds.values()))
    t.add_row("MFU", pct(meas["mfu"]) if "mfu" in meas else "—", *(_pred_cell(p, "mfu") for p in preds.values()))
    t.add_row("peak memory / chip", fmt_bytes(meas["peak_memory_bytes"]) if math.isfinite(meas["peak_memory_bytes"])
              else "—", *(_pred_cell(p, "memory_bytes_per_chip") for p in preds.values()))
    console.print(t)
    console.print(f"compile {fmt_time(meas['compile_s'])}; losses {', '.join(f'{x:.3f}' for x in meas['losses'])}; "
                  f"memory: {meas['memory_source']}")
    _print_kernels(meas.get("kernels") or {})
    if r.get("cpu_only"):
        console.print(f"[bold]cpu_only[/bold]: {CPU_WARNING}")
    if "note" in r:
        console.print(r["note"])


def _print_kernels(k: dict[str, Any]) -> None:
    """The profiled step's device time by kind of work (measure/kernels.py), where one was asked for and ran."""
    if "error" in k or "note" in k:
        console.print(f"kernels: {k.get('error') or k['note']}", markup=False)
    if not k.get("kernel_time_s"):
        return
    total = k["kernel_total_s"] or 1.0
    console.print("device time of one profiled step: " + ", ".join(
        f"{kind} {fmt_time(t)} ({t / total:.0%})" for kind, t in k["kernel_time_s"].items() if t > 0)
        + f"; {fmt_time(k['kernel_total_s'])} in all", markup=False)


def _pred_cell(p: dict[str, Any], key: str) -> str:
    if "error" in p:
        return p["error"][:50]
    v = p[key]
    if key == "step_time_s":
        return f"{fmt_time(v)} ({p['step_time_error']:+.0%})"
    return pct(v) if key == "mfu" else fmt_bytes(v)


def pct(v: float) -> str:
    """A percentage; tiny fractions (CPU measured against a GPU's peak) in scientific notation."""
    return f"{v:.1%}" if abs(v) >= 1e-3 else f"{v * 100:.2e}%"
