"""Tables from a GPU suite results file: `python benchmarks/gpu/report.py FILE` prints the markdown for
benchmarks/README.md (the rows, then the summary against issue #15's bounds)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

# issue #15, "Must show": (row kind, compared quantity, efficiencies, statistic, bound on |error|)
BOUNDS = [("train", "step_time_s", "calibrated", "median", 0.05),
          ("train", "step_time_s", "calibrated", "worst", 0.10),
          ("train", "step_time_s", "defaults", "median", 0.15),
          ("train", "allocator_peak_bytes", "defaults", "worst", 0.10),  # the allocator's peak (predict.COMPARED)
          ("prefill", "step_time_s", "calibrated", "median", 0.08),
          ("decode", "step_time_s", "calibrated", "median", 0.08)]
MFU_BOUND = 0.45  # the JAX reference model on the best 1B-8B single-GPU case


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:+.1%}"


def _time(s: float | None) -> str:
    if s is None:
        return "—"
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.3f} s"


def one_line(row: dict[str, Any]) -> str:
    m = row["measured"]
    if "error" in m:
        return f"{row['id']}: {m['error']}"
    parts = [f"{row['id']}: {_time(m['step_time_s'])}"]
    if "mfu" in m:
        parts.append(f"MFU {m['mfu']:.1%}")
    for key in ("defaults", "calibrated"):
        e = row.get(f"errors_{key}", {})
        if e:
            parts.append(f"{key} " + ", ".join(f"{k.replace('_s', '').replace('_bytes', '')} {_pct(v)}"
                                              for k, v in e.items()))
    return "; ".join(parts)


def abs_errors(rows: list[dict[str, Any]], kind: str, quantity: str, key: str) -> list[float]:
    return [abs(r[f"errors_{key}"][quantity]) for r in rows
            if r["case"]["kind"] == kind and quantity in r.get(f"errors_{key}", {})]


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each bound of the issue with the statistic the rows reach (None where no row has the quantity)."""
    out = []
    for kind, q, key, stat, bound in BOUNDS:
        errs = abs_errors(rows, kind, q, key)
        value = (statistics.median(errs) if stat == "median" else max(errs)) if errs else None
        out.append({"kind": kind, "quantity": q, "efficiencies": key, "statistic": stat, "bound": bound,
                    "value": value, "rows": len(errs), "met": None if value is None else value <= bound})
    return out


def best_jax_mfu(rows: list[dict[str, Any]]) -> float | None:
    mfus = [r["measured"]["mfu"] for r in rows if r["case"]["kind"] == "train"
            and r["case"]["framework"] == "jax" and "mfu" in r["measured"]]
    return max(mfus) if mfus else None


def markdown(data: dict[str, Any]) -> str:
    rows = data["rows"]
    lines = [f"GPU suite, {data['mode']}, {data['date']}: {data.get('gpu') or 'CPU'} (driver {data.get('driver')}), "
             f"predicted as {data['chip']}; wall {data['wall_s']:.0f} s of a {data['budget_s']:.0f} s budget.", ""]
    cal = data.get("calibration") or {}
    if cal:
        lines += [f"Calibration (`{cal.get('command')}`): {cal.get('wall_s', 0):.0f} s, "
                  f"{'ok' if cal.get('ok') else 'failed'}; profile `{data.get('profile_file')}`.", ""]
    lines += ["| case | measured | MFU | mem measured | pred. defaults | err | pred. calibrated | err | mem err |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        m = r["measured"]
        if "error" in m:
            lines.append(f"| {r['id']} | {m['error'][:80]} | | | | | | | |")
            continue
        pd, pc = r.get("predicted_defaults", {}), r.get("predicted_calibrated", {})
        ed, ec = r.get("errors_defaults", {}), r.get("errors_calibrated", {})
        # train: the allocator's peak, the compared memory (predict.COMPARED); NVML's figure stays in the JSON
        mem_key = "allocator_peak_bytes" if r["case"]["kind"] == "train" else "kv_cache_bytes"
        mem = m.get(mem_key)
        mfu = f"{m['mfu']:.1%}" if "mfu" in m else ""
        mem_s = f"{mem / 2**30:.2f} GiB" if mem else ""
        lines.append(f"| {r['id']} | {_time(m['step_time_s'])} | {mfu} | {mem_s} | {_time(pd.get('step_time_s'))} | "
                     f"{_pct(ed.get('step_time_s'))} | {_time(pc.get('step_time_s'))} | {_pct(ec.get('step_time_s'))} | "
                     f"{_pct(ed.get(mem_key))} |")
    lines += ["", "| bound (issue #15) | rows | reached | bound | met |", "|---|---:|---:|---:|---|"]
    for s in summary(rows):
        met = "—" if s["met"] is None else ("yes" if s["met"] else "**no**")
        val = "—" if s["value"] is None else f"{s['value']:.1%}"
        lines.append(f"| {s['kind']} {s['quantity']} ({s['efficiencies']}), {s['statistic']} |abs error| | "
                     f"{s['rows']} | {val} | {s['bound']:.0%} | {met} |")
    mfu = best_jax_mfu(rows)
    lines.append(f"| JAX reference model, best MFU (≥ {MFU_BOUND:.0%}) | | "
                 f"{'—' if mfu is None else f'{mfu:.1%}'} | | "
                 f"{'—' if mfu is None else ('yes' if mfu >= MFU_BOUND else '**no**')} |")
    lines += kernel_lines(rows)
    if data.get("notes"):
        lines += ["", "Notes: " + "; ".join(data["notes"])]
    return "\n".join(lines)


def kernel_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The profiled step of each training row that has one (measure/kernels.py): device time by kind of work, its
    sum, and the row's measured step time."""
    prof = [r for r in rows if (r["measured"].get("kernels") or {}).get("kernel_time_s")]
    if not prof:
        return []
    from meshplan.measure.kernels import KINDS

    out = ["", "| case (one profiled step) | " + " | ".join(KINDS) + " | kernels in all | step measured |",
           "|---|" + "---:|" * (len(KINDS) + 2)]
    for r in prof:
        k = r["measured"]["kernels"]
        out.append(f"| {r['id']} | " + " | ".join(_time(k["kernel_time_s"][x]) for x in KINDS)
                   + f" | {_time(k['kernel_total_s'])} | {_time(r['measured']['step_time_s'])} |")
    return out


def refit_profile(path: Path, chip: Any) -> Any:
    """The efficiency of a committed profile, fitted again from its stored records by the current fit
    (`meshplan.measure.fit`): the measurements stay as they were, the way they are read follows the code."""
    from meshplan.cost.efficiency import profile_efficiency
    from meshplan.measure.fit import build_profile

    prof = json.loads(path.read_text())
    refit = build_profile(chip, prof["benchmarks"], {"platform": prof.get("platform")})
    return profile_efficiency(refit, chip, str(path), f"refit of {path.name}")


def repredict(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The results with every row predicted again by the current model: with the default efficiencies, and with
    the file's profile (`profile_file`, beside it) re-fitted from its records."""
    from predict import errors, predict_case

    from meshplan.cost.efficiency import default_efficiency
    from meshplan.specs.hardware import load_chip

    chip = load_chip(data["chip"])
    effs = {"defaults": default_efficiency(chip)}
    if data.get("profile_file"):
        effs["calibrated"] = refit_profile(folder / data["profile_file"], chip)
    rows = []
    for r in data["rows"]:
        row = {k: v for k, v in r.items() if not k.startswith(("predicted_", "errors_"))}
        if "error" not in r["measured"]:
            for key, eff in effs.items():
                row[f"predicted_{key}"] = pred = predict_case(r["case"], chip, eff)
                row[f"errors_{key}"] = errors(r["case"]["kind"], r["measured"], pred)
        rows.append(row)
    return {**data, "rows": rows}


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--repredict"]
    if len(args) != 1:
        print("usage: report.py RESULTS.json [--repredict]  (--repredict: the current model and fit)",
              file=sys.stderr)
        sys.exit(2)
    path = Path(args[0])
    data = json.loads(path.read_text())
    print(markdown(repredict(data, path.parent) if "--repredict" in sys.argv else data))
