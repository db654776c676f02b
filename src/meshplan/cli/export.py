"""`--export` and `--from` for `meshplan train` and `meshplan serve` (src/meshplan/export/ holds the frameworks).

train/serve call these from small blocks, so the commands themselves stay about planning.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from meshplan.cli.app import ARGV, console, err_console, fail, print_json
from meshplan.cost.efficiency import resolve_efficiency
from meshplan.cost.topology import default_slice_shape
from meshplan.errors import MeshplanError
from meshplan.export import PRESET, SERVE, TRAIN, export_train, load_train
from meshplan.export.common import Job, PlanToExport, check_model, relevant
from meshplan.export.serving import ServePlan, export_engine, hf_id, load_engine, preset_for
from meshplan.infer.config import LAUNCH_SERVER_PATHS, base_engine, check_context_window, engine_names
from meshplan.specs._load import read_text
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import ParallelConfig
from meshplan.train.costmodel import Options
from meshplan.train.frameworks import framework_options
from meshplan.train.planner import plan
from meshplan.train.space import Pins, Problem
from meshplan.units import fmt_time


def command_line() -> str:
    """The meshplan command being run (what every exported file records)."""
    return " ".join(shlex.quote(x) for x in ["meshplan", *ARGV])


def train_framework(export: str | None, framework: str | None) -> str | None:
    """The behaviour preset a plan is made with: --export X plans with X's behaviour."""
    if export is None:
        return framework
    if export not in TRAIN:
        fail(f"--export must be one of {', '.join(TRAIN)}, got '{export}'")
    preset = PRESET[export]
    if framework is not None and framework.partition("@")[0] not in (preset, "megatron" if export == "nemo" else preset):
        fail(f"--export {export} plans with {preset}'s behaviour: drop --framework {framework}")
    return framework or preset


def _out_dir(out: str | None) -> Path:
    if not out:
        fail("--export needs --out DIR (the folder the file is written to)")
    d = Path(out)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"cannot create --out {out}: {exc.strerror or exc}")
    return d


def framework_exporter(framework: str | None) -> str | None:
    """The exporter of a --framework preset (nemo@24.07 -> nemo), or None where the preset has none."""
    name = (framework or "").partition("@")[0]
    return name if name in TRAIN else None


def export_pins(export: str | None, pins: Pins) -> Pins:
    """Restrict the search to what the framework can run, where the user did not pin that degree."""
    if export is None:
        return pins
    fixed = {k: v for k, v in getattr(TRAIN[export], "PINS", {}).items() if getattr(pins, k) is None}
    # the values a free degree may take: those the framework's file can say (an exporter's CHOICES)
    choices = {k: v for k, v in getattr(TRAIN[export], "CHOICES", {}).items()
               if not k.endswith("_choices") or getattr(pins, k.removesuffix("_choices")) is None}
    return replace(pins, **fixed, **choices)


def expressible_plans(name: str, problem: Problem, result, opts: Options, model_arg: str,
                      more=None, want: int = 1) -> tuple[list[tuple[int, dict, str, str]], list[tuple[int, str]]]:
    """The ranked plans framework `name` can run, each as (rank among all plans, plan, file name, file text), and the
    refusals of the others, each as (rank, reason). The exporter is the judge (export_train: it writes the file,
    reads it back and refuses a file that would describe another plan), so `--framework` rankings, `--export` and the
    written file agree. `more(top)` ranks up to 100 plans when fewer than `want` of those shown can be run."""
    plans, start, out, refusals = result.plans, 0, [], []
    for attempt in (1, 2):
        for i in range(start + 1, len(plans) + 1):
            cfg = ParallelConfig(**plans[i - 1]["config"])
            try:
                fname, text = export_train(name, PlanToExport(problem, cfg, opts, plans[i - 1], command_line(),
                                                              model_arg))
            except MeshplanError as exc:
                refusals.append((i, str(exc)))
                continue
            out.append((i, plans[i - 1], fname, text))
        if len(out) >= want or attempt == 2 or more is None or len(plans) >= 100:
            break
        start, plans = len(plans), more(100).plans
    return out, refusals


def framework_plans(framework: str | None, problem: Problem, result, opts: Options, model_arg: str, more=None):
    """`result` with only the plans `--framework` can run, where the framework has an exporter (the others
    unchanged), and the note saying what was skipped; an error when none can run."""
    name = framework_exporter(framework)
    if name is None:
        return result, None
    # the layout is judged, not the behaviour: a release preset (nemo@24.07) or a flag the user gave (--no-pp-overlap)
    # changes how a plan runs, which the current release's file cannot say but the framework can still run; so the
    # exporter judges each layout under its own preset's behaviour
    own = framework_options(PRESET[name], Options(compute_dtype=opts.compute_dtype, headroom=opts.headroom), {})
    ok, refusals = expressible_plans(name, problem, result, own, model_arg, more, want=len(result.plans))
    if not ok:
        # the exporter's word on where such layouts run instead (deepspeed: Megatron-DeepSpeed's 3D layouts)
        hint = getattr(TRAIN[name], "TRAIN_HINT", "")
        raise MeshplanError((refusals[0][1] if refusals else f"no plan {name} can run") + (f". {hint}" if hint else ""))
    kept = replace(result, plans=[p for _, p, _, _ in ok][:max(len(result.plans), 1)])
    note = None
    if refusals:
        note = f"{len(refusals)} higher-ranked or listed layout(s) skipped: {name} cannot run them ({refusals[0][1]})"
    return kept, note


def write_train_export(export: str, out: str | None, rank: int | None, problem: Problem, result, opts: Options,
                       model_arg: str, more=None) -> Path:
    """Write plan number `rank` (1 = best) of `result` for `export`. Without --rank: the best plan the framework
    can express, saying which plans it passed over and why; `more(top)` ranks more plans when none shown can."""
    d = _out_dir(out)
    plans = result.plans
    if rank is not None and not 1 <= rank <= len(plans):
        fail(f"--rank must be between 1 and {len(plans)} (the plans shown; raise --top for more), got {rank}")
    if rank is not None:
        cfg = ParallelConfig(**plans[rank - 1]["config"])
        name, text = export_train(export, PlanToExport(problem, cfg, opts, plans[rank - 1], command_line(), model_arg))
        i, refusals = rank, []
    else:
        ok, refusals = expressible_plans(export, problem, result, opts, model_arg, more)
        if not ok:
            raise MeshplanError(refusals[0][1] if refusals else f"no plan to export to {export}")
        i, plan_, name, text = ok[0]
        cfg = ParallelConfig(**plan_["config"])
    path = d / name
    path.write_text(text)
    before = [(r, why) for r, why in refusals if r < i]  # the better-ranked plans passed over, not later ones
    which = "plan #1 uses" if i == 2 else f"plans #1-#{i - 1} use"
    skipped = f"; {which} what {export} cannot express (#{before[0][0]}: {before[0][1]})" if before else ""
    err_console.print(f"wrote {path} ({export}, plan #{i}: {cfg.describe()}{skipped})", markup=False,
                      highlight=False)
    return path


def _resolve_model(job_model: str | None, model: str | None, what: str):
    if model is None and job_model is None:
        fail(f"the {what} file does not name a model meshplan knows: give --model")
    m = load_model(model or job_model)
    if model and job_model and load_model(job_model) != m:
        other = load_model(job_model)
        if (other.n_layers, other.d_model, other.n_heads, other.d_ff) != (m.n_layers, m.d_model, m.n_heads, m.d_ff):
            fail(f"the {what} file names {job_model} but --model is {model}")
    return m


def _agree(what: str, from_file: Any, given: Any, job: Job) -> Any:
    if given is not None and from_file is not None and given != from_file:
        job.notes.append(f"{what}: the file says {from_file}, the command line {given} (used)")
    return given if given is not None else from_file


def train_from(path: str, *, model: str | None, hardware: str, chips: int | None, seq_len: int | None,
               global_batch: int | None, slice_shape: tuple[int, ...] | None, profile: str | None, headroom: float,
               top: int, json_out: bool, pins: Pins, explicit: dict[str, Any],
               check_flags: Callable[[Problem, Pins, str], None] | None = None) -> None:
    """Predict the job a framework file describes and show the planner's best layouts beside it; `check_flags`
    (problem, pins, matmul dtype) refuses command-line flags that cannot apply to the file's job."""
    job = load_train(Path(path), chips)
    m = _resolve_model(job.model, model, job.framework)
    job.finish(m)
    check_model(job, m)
    if chips is not None and job.chips is not None and chips != job.chips:
        fail(f"the {job.framework} file describes {job.chips} chips, not --chips {chips}")
    seq = _agree("sequence length", job.seq_len, seq_len, job)
    gb = _agree("global batch", job.global_batch, global_batch, job)
    if seq is None or gb is None:
        fail(f"the {job.framework} file does not say the " + ("sequence length: give --seq-len" if seq is None
                                                             else "global batch: give --global-batch"))
    chip = load_chip(hardware)
    if job.chip_kind and job.chip_kind != chip.kind:
        fail(f"the {job.framework} file is for {job.chip_kind.upper()}s but --hardware {hardware} is a {chip.kind}")
    n = job.chips or chips
    if slice_shape is None and job.slices and job.slices > 1 and chip.kind == "tpu":
        slice_shape = default_slice_shape(chip, n // job.slices)
    problem = Problem(m, chip, n, seq, gb, slice_shape)
    # the file's degrees, then any degree pinned on the command line
    mine = replace(job.pins, **{f.name: getattr(pins, f.name) for f in fields(Pins)
                                if getattr(pins, f.name) is not None and f.name != "sequence_parallel"})
    opts = job.resolved_options(Options(headroom=headroom), explicit)
    if check_flags is not None:
        check_flags(problem, mine, opts.compute_dtype)
    if opts.compute_dtype == "fp8":
        chip.peak("fp8")
    eff = resolve_efficiency(chip, profile)
    yours, why = None, None
    try:
        yours = plan(problem, mine, eff, opts, top=1).plans[0]
    except MeshplanError as exc:
        why = str(exc)
    best = runnable(job.framework, problem, opts, plan(problem, export_pins(job.framework, Pins()), eff, opts,
                                                       top=max(50, top)).plans)[:top]
    switches = _switches(job.framework, problem, mine, eff, opts, yours)
    report = {"framework": job.framework, "file": str(path), "model": m.name, "chips": n, "seq_len": seq,
              "switches": switches,
              "global_batch": gb, "yours": yours, "yours_error": why, "alternatives": best,
              "unknown_keys": job.unknown_keys, "unmodelled_keys": job.unmodelled_keys, "notes": job.notes,
              "differences": [difference(yours, b) for b in best] if yours else []}
    if json_out:
        print_json(report)
        return
    _show_train(report, opts, problem)


def _switches(framework: str, problem: Problem, pins: Pins, eff, opts: Options, yours: dict | None) -> list[dict]:
    """Each behaviour the framework's file can switch on that this job leaves off, predicted at the same layout."""
    if yours is None:
        return []
    out = []
    for changes, keys in getattr(TRAIN[framework], "SWITCHES", {}).values():
        cfg = ParallelConfig(**yours["config"])
        if all(getattr(opts, k) == v for k, v in changes.items()) or \
                not all(relevant(k, cfg, opts, problem) for k in changes):
            continue
        try:
            alt = plan(problem, pins, eff, replace(opts, **changes), top=1).plans[0]
        except MeshplanError:
            continue
        gain = yours["step_time_s"] / alt["step_time_s"] - 1
        if gain > 0.005:
            out.append({"set": keys, "step_time_s": alt["step_time_s"], "mfu": alt["mfu"], "gain": gain})
    return sorted(out, key=lambda x: -x["gain"])


def runnable(framework: str, problem: Problem, opts: Options, plans: list[dict]) -> list[dict]:
    """The plans a framework can express (its exporter accepts them), in their order."""
    keep = []
    for pl in plans:
        pe = PlanToExport(problem, ParallelConfig(**pl["config"]), opts, pl, "", problem.model.name)
        try:
            export_train(framework, pe)
        except MeshplanError:
            continue
        keep.append(pl)
    return keep


def difference(yours: dict, other: dict) -> str:
    """What another plan changes and what that does to the step, in words."""
    a, b = yours["config"], other["config"]
    changed = [f"{k} {a[k]}→{b[k]}" for k in a if a[k] != b[k] and k != "sequence_parallel"]
    gain = yours["step_time_s"] / other["step_time_s"] - 1
    terms = [f"{k} {fmt_time(yours['time_s'][k])}→{fmt_time(other['time_s'][k])}" for k in yours["time_s"]
             if abs(yours["time_s"][k] - other["time_s"][k]) > 0.02 * yours["step_time_s"]]
    what = ", ".join(changed) or "the same layout"
    return f"{gain:+.1%} tokens/s: {what}" + (f" ({'; '.join(terms)})" if terms else "")


def _show_train(r: dict, opts: Options, problem: Problem) -> None:
    from meshplan.cli.train import assumptions

    p = console.print
    p(f"{r['framework']} file {r['file']}: {r['model']} on {r['chips']} chips, seq {r['seq_len']}, global batch "
      f"{r['global_batch']}", markup=False, highlight=False)
    p(f"assumes: {assumptions(problem, opts)}", markup=False, highlight=False)
    if r["unknown_keys"]:
        p(f"unknown keys (not {r['framework']} keys; typos?): {', '.join(r['unknown_keys'])}", markup=False)
    if r["unmodelled_keys"]:
        p(f"keys meshplan does not model (no effect on the prediction): {', '.join(r['unmodelled_keys'])}",
          markup=False, highlight=False)
    for note in r["notes"]:
        p(f"note: {note}", markup=False, highlight=False)
    y = r["yours"]
    if y is None:
        p(f"yours: cannot run as written: {r['yours_error']}", markup=False, highlight=False)
    else:
        p(f"yours: {ParallelConfig(**y['config']).describe()}: step {fmt_time(y['step_time_s'])}, MFU {y['mfu']:.1%}, "
          f"{y['tokens_per_s_per_chip']:.0f} tok/s/chip; {y['bottleneck']}: {y['explanation']}",
          markup=False, highlight=False)
    for sw in r["switches"]:
        p(f"  set {sw['set']}: step {fmt_time(sw['step_time_s'])}, MFU {sw['mfu']:.1%} ({sw['gain']:+.1%} tokens/s)",
          markup=False, highlight=False)
    p("best layouts with the same framework behaviour:", markup=False)
    for i, b in enumerate(r["alternatives"], 1):
        diff = f" — {r['differences'][i - 1]}" if y else ""
        p(f"  #{i} {ParallelConfig(**b['config']).describe()}: step {fmt_time(b['step_time_s'])}, MFU {b['mfu']:.1%}"
          f"{diff}", markup=False, highlight=False)


# ---- serving --------------------------------------------------------------------------------------------------


def write_serve_export(export: str, out: str | None, result: dict, model_arg: str, mode: str, chip) -> list[Path]:
    if export not in SERVE:
        fail(f"--export must be one of {', '.join(SERVE)}, got '{export}'")
    d = _out_dir(out)
    # the budget the plan was timed with (an --engine preset's or --max-num-batched-tokens, else the default)
    sp = ServePlan(result, hf_id(model_arg), command_line(), mode, int(result["step_token_budget"]), chip.kind)
    paths = []
    for name, text in export_engine(export, sp).items():
        (d / name).write_text(text)
        paths.append(d / name)
    err_console.print("wrote " + ", ".join(map(str, paths)), markup=False, highlight=False)
    return paths


def serve_from(path: str, *, hardware: str, input_len: int, output_len: int, chips: int | None, model: str | None,
               profile: str | None, json_out: bool, engine: str | None = None) -> None:
    """`serve --from`: the server command line in `path` timed as its engine runs it (`engine`: a release of that
    engine, e.g. sglang@0.3, where the command line cannot tell which), with its server's own path between client and
    engine (infer/config.py LAUNCH_SERVER_PATHS: `vllm serve` is vLLM's OpenAI server, `sglang.launch_server` SGLang's
    HTTP server), beside the best layout for the same GPUs."""
    from meshplan.cli.serve import plan_serving

    sj = load_engine(read_text(Path(path), "serving command"))
    if engine is not None and base_engine(engine) != sj.framework:
        fail(f"--engine {engine} is not a release of {sj.framework}, which the command line runs: give "
             f"{sj.framework} or one of its releases ({', '.join(e for e in engine_names() if base_engine(e) == sj.framework)})")
    frontend = LAUNCH_SERVER_PATHS[sj.framework]
    name = model or preset_for(sj.model)
    if name is None:
        fail(f"the {sj.framework} command serves '{sj.model}', which is not a meshplan model: give --model")
    n = sj.tp * sj.pp * sj.replicas
    if chips is not None and chips != n:
        fail(f"the {sj.framework} command uses {n} GPUs (tp x pp x dp), not --chips {chips}")
    if sj.max_model_len is not None:
        # the engine refuses a command whose max_model_len exceeds the model's window (infer/config.py)
        check_context_window(load_model(name), sj.max_model_len,
                             f"the command's maximum context ({sj.max_model_len} tokens)",
                             "lower the command's --max-model-len/--context-length")
        if input_len + output_len > sj.max_model_len:
            fail(f"--input-len + --output-len = {input_len + output_len} exceeds the file's maximum context "
                 f"{sj.max_model_len}")
    # timed as the file's engine runs it: that engine's defaults (serve --engine) and the file's own step token budget
    # where it sets one (its replica-wide value: the engine preset says whether attention-DP ranks divide it, as
    # SGLang's server_args.py does, or each take it whole)
    budget = sj.chunk_tokens if sj.chunk_tokens and sj.mode == "continuous" else None
    kw = dict(quant=sj.quant, kv_quant=sj.kv_quant, mode=sj.mode, profile=profile, engine=engine or sj.framework,
              max_num_batched_tokens=budget, mixed_prompts=sj.mixed_prompts, frontend=frontend)
    yours = plan_serving(name, hardware, n, input_len, output_len, batch=sj.batch, tp=sj.tp, pp=sj.pp, ep=sj.ep,
                         attention_dp=sj.attention_dp, **kw)
    best = plan_serving(name, hardware, n, input_len, output_len, do_search=True, **kw)
    for o in (yours, best):
        o.pop("_objects", None)
    gain = best["throughput_tokens_per_s"] / yours["throughput_tokens_per_s"] - 1
    c, b = yours["config"], best["config"]
    changed = [f"{k} {c[k]}→{b[k]}" for k in ("tp", "pp", "ep", "replicas", "attention_dp") if c[k] != b[k]]
    if yours["batch"] != best["batch"]:
        changed.append(f"batch {yours['batch']}→{best['batch']}")
    diff = (f"{gain:+.1%} output tokens/s: {', '.join(changed) or 'the same layout'} (TPOT "
            f"{fmt_time(yours['tpot_s'])}→{fmt_time(best['tpot_s'])}, TTFT {fmt_time(yours['ttft_s'])}→"
            f"{fmt_time(best['ttft_s'])})")
    report = {"framework": sj.framework, "file": path, "model": yours["model"], "yours": yours, "best": best,
              "difference": diff, "unknown_keys": sj.unknown_keys, "unmodelled_keys": sj.unmodelled_keys,
              "notes": sj.notes}
    if json_out:
        print_json(report)
        return
    p = console.print
    p(f"{sj.framework} command {path}: {yours['model']} on {n} x {yours['hardware']}", markup=False)
    for label, keys in (("unknown flags (typos?)", sj.unknown_keys),
                        ("flags meshplan does not model", sj.unmodelled_keys)):
        if keys:
            p(f"{label}: {', '.join(keys)}", markup=False, highlight=False)
    for note in sj.notes:
        p(f"note: {note}", markup=False, highlight=False)
    for label, o in (("yours", yours), ("best", best)):
        cc = o["config"]
        adp = " attention-dp" if cc.get("attention_dp") else ""
        p(f"{label}: tp={cc['tp']} pp={cc['pp']} ep={cc['ep']}{adp} x {cc['replicas']}, batch {o['batch']}: TTFT "
          f"{fmt_time(o['ttft_s'])}, TPOT {fmt_time(o['tpot_s'])}, {o['throughput_tokens_per_s']:,.0f} output tok/s",
          markup=False, highlight=False)
    p(f"difference: {diff}", markup=False, highlight=False)
