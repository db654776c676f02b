"""Search speed of the training planner: llama3-405b on 16,384 h100-sxm, seq 8192, global batch 2048 sequences,
every degree free (what `meshplan train --model llama3-405b --hardware h100-sxm --chips 16384 --seq-len 8192
--global-batch 2048` does, without the CLI and printing).

asv-style: the setup (model, chip, efficiency table, imports) is not timed; one warm-up run fills the
process-wide caches (collective placements, default torus shapes), then the median of 5 timed runs of
`planner.plan` is reported, with the cold first run for reference.

    python benchmarks/search_speed.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np

from meshplan.cost.efficiency import default_efficiency
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.planner import plan
from meshplan.train.space import Pins, Problem

MODEL, HARDWARE, CHIPS, SEQ_LEN, GLOBAL_BATCH = "llama3-405b", "h100-sxm", 16_384, 8192, 2048


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    cpu = _cpu_model()
    return (f"{platform.platform()} | {cpu} | {os.cpu_count()} CPUs | Python {platform.python_version()} "
            f"({platform.python_implementation()}) | numpy {np.__version__}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="timed runs (median reported)")
    args = ap.parse_args(argv)

    # --- setup (untimed)
    chip = load_chip(HARDWARE)
    problem = Problem(load_model(MODEL), chip, CHIPS, SEQ_LEN, GLOBAL_BATCH)
    eff = default_efficiency(chip)
    pins = Pins()

    # --- warm-up (timed separately, not in the median)
    t0 = time.perf_counter()
    first = plan(problem, pins, eff, top=1)
    cold = time.perf_counter() - t0

    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        res = plan(problem, pins, eff, top=1)
        times.append(time.perf_counter() - t0)
        assert res.searched == first.searched
    med = statistics.median(times)
    best = res.plans[0]

    print(f"machine: {machine()}")
    print(f"problem: {MODEL} on {CHIPS} x {HARDWARE}, seq {SEQ_LEN}, global batch {GLOBAL_BATCH}, every degree free")
    rejected = sum(v for k, v in res.infeasible.items() if k != "does not fit in HBM")
    print(f"layouts evaluated: {res.evaluated} of {res.searched} searched ({res.feasible} fit in HBM; the rest "
          f"offload variants that cannot enter the top plan; {rejected} more candidates rejected by divisibility "
          "rules before evaluation)")
    print(f"seconds (median of {args.repeat}): {med:.4f}  [min {min(times):.4f}, max {max(times):.4f}; "
          f"cold first run {cold:.4f}]")
    print(f"layouts/s: {res.evaluated / med:,.0f}")
    print(f"best: {best['config']} step {best['step_time_s']:.3f} s, MFU {best['mfu']:.1%}, "
          f"bottleneck {best['bottleneck']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
