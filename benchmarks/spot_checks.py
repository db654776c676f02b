"""Spot checks outside shared/reference: published runs from other teams and chips (data/spot_checks.yaml).

Each run is planned at its published layout (every published degree pinned) and compared with the published step
time, or, where only MFU is published, with meshplan's own MFU at that layout.

    python benchmarks/spot_checks.py
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

import yaml

from meshplan.cost.efficiency import default_efficiency
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.costmodel import Options
from meshplan.train.frameworks import framework_options
from meshplan.train.planner import plan
from meshplan.train.space import Pins, Problem

DATA = Path(__file__).parent / "data"


def evaluate_run(r: dict) -> dict:
    """Predicted step time and MFU at the published layout, and the relative error of the step time (an MFU
    comparison converts to one: predicted step / published step = published MFU / predicted MFU)."""
    model = r["model"]
    model_ref = str(DATA / model) if model.endswith(".json") else model
    shape = tuple(r["slice"]) if r.get("slice") else None
    prob = Problem(load_model(model_ref), load_chip(r["hardware"]), r["chips"], r["seq"], r["gbs"], shape)
    opts = framework_options(r.get("framework"), Options(compute_dtype=r.get("dtype", "bf16")), {})
    best = plan(prob, Pins(**r["pins"]), default_efficiency(prob.chip), opts, top=1).plans[0]
    if "step_s" in r:
        err = best["step_time_s"] / r["step_s"] - 1
        published = f"{r['step_s']:.2f} s"
    else:
        err = r["mfu"] / best["mfu"] - 1
        published = f"MFU {r['mfu']:.1%}"
    return {"id": r["id"], "pred_step_s": best["step_time_s"], "pred_mfu": best["mfu"], "published": published,
            "rel_err": err, "bottleneck": best["bottleneck"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DATA / "spot_checks.yaml"))
    args = ap.parse_args(argv)
    runs = yaml.safe_load(Path(args.data).read_text())["runs"]
    print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print(f"{'id':32s} {'published':>11s} {'pred step s':>11s} {'pred MFU':>9s} {'step err':>9s}  bottleneck")
    rows = [evaluate_run(r) for r in runs]
    for row in rows:
        print(f"{row['id']:32s} {row['published']:>11s} {row['pred_step_s']:11.2f} {row['pred_mfu']:9.1%} "
              f"{row['rel_err']:+9.1%}  {row['bottleneck']}")
    errs = [abs(row["rel_err"]) for row in rows]
    print(f"\n{len(rows)} runs: median |err| {statistics.median(errs):.1%}, worst {max(errs):.1%}, "
          f"{sum(e <= 0.25 for e in errs)}/{len(errs)} within 25%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
