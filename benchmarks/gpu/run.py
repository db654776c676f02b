"""The GPU measurement suite (issue #15): calibrate, then training steps, prefill and decode on one GPU,
measured beside meshplan's predictions with the default efficiencies and with the calibrated profile.

    python benchmarks/gpu/run.py [--quick] [--out DIR] [--budget-s S] [--parts calibrate,train,serve,torch]
    python benchmarks/gpu/run.py --cpu-smoke      # every code path at toy sizes on the CPU (tests use it)

Parts, in order (a global time budget; whatever does not fit is skipped with a note in the results):
  calibrate  `meshplan calibrate` (the quick grid; --full-calibrate: the full grid) → profile_<chip>_<date>.json
  train      JAX reference model (cuDNN flash attention, bf16 compute on fp32 master weights, AdamW): step
             time, MFU and device memory, one process per case
  serve      prefill at 512-16k tokens, decode steps at batch 1-256, context 1k-32k (KV cache), and mixed steps
             (decodes + a prompt chunk in one step), JAX
  torch      the same model in PyTorch (torch.compile per block, SDPA), where torch is installed
Results: gpu_<chip>_<date>.json (rows of case, measured, predicted with defaults and calibrated, errors) under
--out, else $OUT, else ./out/gpu. `report.py FILE` prints the markdown table for benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import cases as cs  # noqa: E402
import report  # noqa: E402
from predict import COMPARED, Case, case_model, errors, predict_case  # noqa: E402

from meshplan.cost.efficiency import default_efficiency, load_profile  # noqa: E402
from meshplan.errors import MeshplanError  # noqa: E402
from meshplan.measure.cluster import chip_for_device_kind  # noqa: E402
from meshplan.specs.hardware import Chip, load_chip  # noqa: E402

PARTS = ("calibrate", "train", "serve", "torch")
# shares of the budget; each part ends by the running sum of the chosen parts' shares (time a part leaves unused
# passes to the next)
PART_SHARE = {"calibrate": 0.33, "train": 0.35, "serve": 0.20, "torch": 0.12}
# what the suite calibrates: everything a one-GPU prediction reads (host transfers and collectives are not). The
# GEMMs last: on the H200 (session 14) the quick grid's GEMMs took 186 s of calibrate's 222 s and the others 36 s,
# so under calibrate's --time-limit the GEMM grid loses its smallest shapes (calibrate.matmul_shapes) and nothing else
CALIBRATE_BENCH = "overhead,hbm,norm,attention,sdpa,layer,matmul"
SMOKE_BENCH = "overhead,hbm,norm,attention,matmul"
CALIBRATE_MARGIN_S = 45.0  # JAX's start before calibrate's clock, one last measurement (a compile), the fit
SCHEMA = "meshplan-gpu-results/1"


class Budget:
    def __init__(self, total_s: float, min_case_s: float, parts: list[str]):
        self.t0, self.total_s, self.min_case_s = time.monotonic(), total_s, min_case_s
        chosen = [p for p in PARTS if p in parts]
        total = sum(PART_SHARE[p] for p in chosen)
        self.end_s = {p: total_s * sum(PART_SHARE[q] for q in chosen[: i + 1]) / total for i, p in enumerate(chosen)}

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left_for(self, part: str) -> float:
        return self.end_s[part] - self.elapsed()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def env_for_workers() -> dict[str, str]:
    """Workers import this checkout's meshplan; JAX takes memory as it needs it (no 75% preallocation), so the
    device memory it holds is the case's own and PyTorch can share the card with a JAX calibration. Without
    preallocation JAX still caps its allocator at XLA_PYTHON_CLIENT_MEM_FRACTION of the card (default 0.75: 104.9 GiB
    on the H200, where the 8B case cut to what fits in cases.FIT_FRACTION of usable HBM needed 106.7 GiB; session 14),
    so the cap is raised to 0.95."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(XLA_PYTHON_CLIENT_PREALLOCATE="false", XLA_PYTHON_CLIENT_MEM_FRACTION="0.95", PYTHONUNBUFFERED="1",
               TF_CPP_MIN_LOG_LEVEL="2")
    return env


def run_process(cmd: list[str], timeout_s: float) -> tuple[int | None, str]:
    """(exit code, stderr) of a command in its own process group; at the time limit the whole group is killed
    (a worker's own children too, such as calibrate's PyTorch process or torch.compile's compile workers, so
    nothing left behind runs beside the next measurement). Exit code None: stopped at the limit."""
    proc = subprocess.Popen(cmd, env=env_for_workers(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        return None, err or ""


def run_worker(kind: str, payload: Any, timeout_s: float, tmp: Path) -> dict[str, Any]:
    """One worker process; whatever it wrote is returned, also after a timeout (then with a note)."""
    out = tmp / f"{kind}_{time.monotonic_ns()}.json"
    cmd = [sys.executable, str(HERE / "worker.py"), kind, json.dumps(payload), str(out)]
    note = None
    code, err = run_process(cmd, timeout_s)
    if code is None:
        note = f"stopped at its time limit ({timeout_s:.0f} s)"
    elif code:
        note = f"worker exit {code}: {err.strip().splitlines()[-1][:300] if err.strip() else ''}"
    data = json.loads(out.read_text()) if out.exists() else {"results": []}
    if note:
        data["note"] = note
    return data


# --- rows ------------------------------------------------------------------------------------------

def describe(case: Case) -> str:
    name = case_model(case).name
    if case["kind"] == "train":
        return (f"{case['framework']} train {name} seq {case['seq_len']} batch {case['batch']} "
                f"recompute {case['recompute']} attention {case['attention']} {case.get('compute_dtype', 'bf16')}")
    if case["kind"] == "prefill":
        return f"prefill {name} {case['prompt_len']} tokens batch {case['batch']}"
    if case["kind"] == "mixed":
        return f"mixed {name} decode batch {case['batch']} context {case['context']} + prompt chunk {case['prompt_len']}"
    return f"decode {name} batch {case['batch']} context {case['context']}"


def make_row(case: Case, measured: dict[str, Any], chip: Chip, effs: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"id": describe(case), "case": case, "measured": measured}
    if "error" in measured:
        return row
    if case["kind"] == "train":
        from meshplan.measure.steps import model_flops_per_step

        flops = model_flops_per_step(case_model(case), case["seq_len"], case["batch"])
        measured["mfu"] = flops / (measured["step_time_s"] * chip.peak("bf16"))
    for key, eff in effs.items():
        try:
            pred = predict_case(case, chip, eff)
        except MeshplanError as exc:  # e.g. the planner finds that a case which ran does not fit
            row[f"predicted_{key}"] = {"error": str(exc)}
            continue
        row[f"predicted_{key}"] = pred
        row[f"errors_{key}"] = errors(case["kind"], measured, pred)
    return row


# --- parts -----------------------------------------------------------------------------------------

def part_calibrate(args, ctx: dict[str, Any]) -> None:
    """`meshplan calibrate` (the quick grid, unless --full-calibrate: on the first H200 run the full grid overran its
    142 s share and the quick grid took 89 s); if the full grid overruns its share, the quick grid once
    more within the next part's time, so that calibrated predictions exist (the results say which grid)."""
    if args.profile:
        ctx["notes"].append(f"calibrate: not run; profile {args.profile} given")
        return
    left = ctx["budget"].left_for("calibrate")
    if left < ctx["budget"].min_case_s:
        ctx["notes"].append("calibrate: skipped, no time left")
        return
    quick = args.quick or args.cpu_smoke or not args.full_calibrate
    if not _calibrate(args, ctx, quick, left) and not quick and ctx["calibration"]["timed_out"]:
        ctx["notes"].append(f"calibrate: the full grid overran its {left:.0f} s; the quick grid was run instead")
        rest = ctx["budget"].total_s - ctx["budget"].elapsed()
        _calibrate(args, ctx, True, min(120.0, rest / 3))  # a third of what is left, so the parts after still run


def _calibrate(args, ctx: dict[str, Any], quick: bool, limit_s: float) -> bool:
    path = ctx["out"] / f"profile_{ctx['chip_tag']}_{ctx['date']}.json"
    cmd = [sys.executable, "-c", "from meshplan.cli import main; main()", "calibrate", "--out", str(path),
           "--hardware", ctx["chip"].name, "--bench", SMOKE_BENCH if args.cpu_smoke else CALIBRATE_BENCH]
    if quick:
        cmd.append("--quick")
    # calibrate stops starting measurements in time to fit and write what it has (a profile even when short of time)
    cmd += ["--time-limit", f"{max(limit_s - CALIBRATE_MARGIN_S, 0.5 * limit_s, 1.0):.0f}"]
    t0 = time.monotonic()
    log(f"calibrate: {' '.join(cmd[3:])} (limit {limit_s:.0f} s)")
    code, err = run_process(cmd, max(limit_s, 1.0))
    steps = [ln for ln in err.splitlines() if ln.startswith("calibrate: ")]  # one timed line per benchmark
    for ln in steps:
        log("  " + ln)
    ok = code == 0 and path.exists()
    msg = f"stopped at its time limit ({limit_s:.0f} s)" if code is None else (err.strip().splitlines() or ["?"])[-1]
    wall = time.monotonic() - t0
    earlier = [ctx["calibration"]] if ctx.get("calibration") else []  # the full grid's attempt, if this is the retry
    ctx["calibration"] = {"wall_s": wall, "command": " ".join(cmd[3:]), "ok": ok, "timed_out": code is None,
                          "benchmarks_done": steps, "earlier_attempts": earlier}
    if ok:
        ctx["profile"] = str(path)
        prof = json.loads(path.read_text())
        ctx["calibration"].update(efficiency=prof["efficiency"], efficiency_origin=prof["efficiency_origin"],
                                  profile_file=path.name, versions=prof.get("versions"))
        log(f"calibrate: done in {wall:.0f} s → {path.name}")
    else:
        ctx["notes"].append(f"calibrate failed: {msg}")
        log(f"calibrate failed: {msg}")
    return ok


def _effs(ctx: dict[str, Any]) -> dict[str, Any]:
    effs = {"defaults": default_efficiency(ctx["chip"])}
    if ctx.get("profile"):
        effs["calibrated"] = load_profile(ctx["profile"], ctx["chip"])
    return effs


def _run_cases(part: str, kind: str, groups: list[Any], ctx: dict[str, Any]) -> None:
    """groups: a worker payload each (one case, or a list of serving cases of one model)."""
    budget = ctx["budget"]
    for i, payload in enumerate(groups):
        left = budget.left_for(part)
        first = payload[0] if isinstance(payload, list) else payload
        if left < budget.min_case_s:
            rest = sum(len(g) if isinstance(g, list) else 1 for g in groups[i:])
            ctx["notes"].append(f"{part}: {rest} case(s) skipped for the time budget, from '{describe(first)}'")
            log(f"{part}: out of time, {rest} case(s) skipped")
            return
        more = f" (+{len(payload) - 1} more)" if isinstance(payload, list) and len(payload) > 1 else ""
        log(f"{part}: {describe(first)}{more} (limit {left:.0f} s)")
        data = run_worker(kind, payload, left, ctx["tmp"])
        if data.get("device"):
            ctx.setdefault("device", data["device"])
        done = {json.dumps(r["case"], sort_keys=True) for r in data["results"]}
        for r in data["results"]:
            keep_hlo(r, ctx)
            row = make_row(r["case"], r["measured"], ctx["chip"], _effs(ctx))
            ctx["rows"].append(row)
            log("  " + report.one_line(row))
        for case in payload if isinstance(payload, list) else [payload]:
            if json.dumps(case, sort_keys=True) not in done:
                reason = data.get("error") or data.get("note") or "not reached"
                ctx["rows"].append({"id": describe(case), "case": case, "measured": {"error": reason}})
                log(f"  {describe(case)}: {reason}")
        write_results(ctx)


def keep_hlo(result: dict[str, Any], ctx: dict[str, Any]) -> None:
    """Move a training case's compiled HLO (the worker's gzipped text) into one tar under the output folder
    (one file: the device tool returns few), named by the case; the row keeps the member's name."""
    src = result["measured"].pop("hlo_file", None)
    if not src or not Path(src).exists():
        return
    member = re.sub(r"[^A-Za-z0-9._-]+", "_", describe(result["case"]))[:150] + ".hlo.txt.gz"
    with tarfile.open(ctx["out"] / f"hlo_{ctx['chip_tag']}_{ctx['date']}.tar", "a") as tar:
        tar.add(src, arcname=member)
    result["measured"]["hlo_member"] = member
    Path(src).unlink()


def part_train(args, ctx: dict[str, Any]) -> None:
    groups = cs.smoke_cases()["train"] if args.cpu_smoke else cs.gpu_train_cases(ctx["chip"], "jax")
    if args.quick:
        groups = groups[:4]
    _run_cases("train", "train_jax", groups[args.train_from:], ctx)


def part_serve(args, ctx: dict[str, Any]) -> None:
    groups = cs.smoke_cases()["serve"] if args.cpu_smoke else cs.gpu_serve_cases(ctx["chip"])
    if args.quick:
        groups = [g[::2] for g in groups[:1]]
    _run_cases("serve", "serve", groups, ctx)


def part_torch(args, ctx: dict[str, Any]) -> None:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        ctx["notes"].append("torch: skipped, PyTorch is not installed")
        log("torch: skipped (PyTorch is not installed)")
        return
    groups = cs.smoke_cases()["torch"] if args.cpu_smoke else cs.gpu_train_cases(ctx["chip"], "torch")
    if args.cpu_smoke:
        ctx["notes"].append("torch: the PyTorch path needs CUDA; on the CPU it is not run")
        return
    _run_cases("torch", "train_torch", groups[:1] if args.quick else groups, ctx)


PART_FNS = {"calibrate": part_calibrate, "train": part_train, "serve": part_serve, "torch": part_torch}


# --- output ----------------------------------------------------------------------------------------

def gpu_name_and_driver() -> tuple[str | None, str | None]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None, None
    try:
        out = subprocess.run([exe, "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=False).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return None, None
    if not out:
        return None, None
    name, _, driver = out[0].partition(",")
    return name.strip(), driver.strip()


def write_results(ctx: dict[str, Any]) -> Path:
    path = ctx["out"] / f"gpu_{ctx['chip_tag']}_{ctx['date']}{ctx.get('suffix', '')}.json"
    data = {"schema": SCHEMA, "mode": ctx["mode"], "date": ctx["date"], "chip": ctx["chip"].name,
            "gpu": ctx["gpu"], "driver": ctx["driver"], "host": platform.node(), "device": ctx.get("device"),
            "budget_s": ctx["budget"].total_s, "wall_s": ctx["budget"].elapsed(),
            "calibration": ctx.get("calibration"),
            "profile_file": Path(ctx["profile"]).name if ctx.get("profile") else None,
            "compared": COMPARED, "notes": ctx["notes"], "rows": ctx["rows"]}
    path.write_text(json.dumps(data, indent=1, default=float) + "\n")
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="calibrate --quick and a few cases of each part")
    ap.add_argument("--full-calibrate", action="store_true",
                    help="calibrate's full grid (falls back to the quick grid if it overruns its share)")
    ap.add_argument("--cpu-smoke", action="store_true", help="toy sizes on the CPU: proves the code paths")
    ap.add_argument("--out", help="output folder (default: $OUT, else ./out/gpu)")
    ap.add_argument("--budget-s", type=float, help="global time budget (default 450 s; --cpu-smoke 60 s)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    ap.add_argument("--hardware", help="chip to predict for (default: the GPU nvidia-smi names; h100-sxm on the CPU)")
    ap.add_argument("--profile", help="use this calibrated profile instead of running calibrate")
    ap.add_argument("--train-from", type=int, default=0, metavar="K",
                    help="start the JAX training grid at its K-th case (0-based; a later call runs what an earlier one "
                         "had no time for)")
    args = ap.parse_args(argv)
    bad = [p for p in args.parts.split(",") if p not in PARTS]
    if bad:
        ap.error(f"unknown part '{bad[0]}' (known: {', '.join(PARTS)})")
    return args


def resolve_chip(args, gpu: str | None) -> Chip:
    name = args.hardware or (chip_for_device_kind(gpu) if gpu else None) or "h100-sxm"
    return load_chip(name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpu, driver = gpu_name_and_driver()
    if not args.cpu_smoke and gpu is None:
        print("error: no NVIDIA GPU found (nvidia-smi); use --cpu-smoke on the CPU", file=sys.stderr)
        return 2
    out = Path(args.out or os.environ.get("OUT") or ROOT / "out" / "gpu")
    out.mkdir(parents=True, exist_ok=True)
    chip = resolve_chip(args, gpu)
    parts = args.parts.split(",")
    budget = Budget(args.budget_s or (60.0 if args.cpu_smoke else 450.0), 3.0 if args.cpu_smoke else 20.0, parts)
    ctx: dict[str, Any] = {"out": out, "chip": chip, "chip_tag": "cpu" if args.cpu_smoke else chip.name.split("-")[0],
                           "date": dt.datetime.now(dt.UTC).date().isoformat(), "mode": "cpu-smoke" if args.cpu_smoke
                           else "gpu", "gpu": gpu, "driver": driver, "budget": budget, "notes": [], "rows": []}
    if args.profile:
        ctx["profile"] = args.profile
    if set(parts) != set(PARTS):  # a partial run (e.g. the parts a first call had no time for) gets its own file
        ctx["suffix"] = "_" + "-".join(p for p in PARTS if p in parts)
    log(f"suite on {gpu or 'CPU (smoke)'} as {chip.name}; budget {budget.total_s:.0f} s; out {out}")
    with tempfile.TemporaryDirectory() as tmp:
        ctx["tmp"] = Path(tmp)
        for part in PARTS:
            if part in parts:
                try:
                    PART_FNS[part](args, ctx)
                except Exception as exc:  # noqa: BLE001 - keep what the other parts measure
                    ctx["notes"].append(f"{part}: failed in the suite itself: {type(exc).__name__}: {exc}")
                    log(f"{part}: FAILED {type(exc).__name__}: {exc}")
                write_results(ctx)
    path = write_results(ctx)
    print(report.markdown(json.loads(path.read_text())))
    log(f"wrote {path} in {budget.elapsed():.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
