"""meshplan's GEMM time against a measured table: OpenXLA's sm_90 (H100) bf16 matmul timings.

    python benchmarks/gemm_check.py [--json]

The table (data/xla_matmul_sm90_bf16.csv, 375 shapes: b in {1,2,4}, m, n, k in {256 .. 4096}) is XLA's own
measurement of each dot on an H100, stored as FLOP/s. Two of meshplan's GEMM terms are compared with it, unchanged:

  training ledger  flops / (peak * Efficiency.matmul(m, n, k))            (train/costmodel.py's matmul rate:
                   the large-GEMM fraction times the thin-dimension penalty of the smallest dimension)
  serving step     max(bytes / (HBM * hbm_fraction), flops / (peak * _matmul_fraction(rows=m, narrower weight dim)))
                   + kernel_overhead_s                                   (infer/step.py, one GEMM of a step)

It also fits the table's own two-parameter description, time = latency + flops / (peak * fraction), by least squares
on all rows, to say in two numbers what the measured GEMMs do. Nothing here is fed back into meshplan: it reports.
Error = predicted / measured - 1 (positive: meshplan predicts a slower GEMM than measured).
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import sys
from pathlib import Path

import numpy as np

from meshplan.cost.efficiency import default_efficiency
from meshplan.infer.step import _matmul_fraction
from meshplan.specs.hardware import Chip, load_chip

TABLE = Path(__file__).parent / "data" / "xla_matmul_sm90_bf16.csv"
CHIP = "h100-sxm"  # the table's sm_90 part (data/xla_matmul_sm90_bf16.csv header: read as the SXM part)
FLOP_BINS = ((0.0, 1e9), (1e9, 1e10), (1e10, 1e11), (1e11, float("inf")))


def load_table(path: Path = TABLE) -> list[tuple[int, int, int, int, float]]:
    """(b, m, n, k, measured seconds) per row; the '#' lines are the source note."""
    with path.open() as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    out = []
    for r in rows:
        b, m, n, k = (int(r[x]) for x in ("b", "m", "n", "k"))
        out.append((b, m, n, k, gemm_flops(b, m, n, k) / int(r["bf16_flops_per_s"])))
    return out


def gemm_flops(b: int, m: int, n: int, k: int) -> float:
    """2 * b * m * n * k: one multiply and one add per MAC of b [m,k] x [k,n] products."""
    return 2.0 * b * m * n * k


def serving_gemm_s(chip: Chip, eff, b: int, m: int, n: int, k: int, dtype: str = "bf16",
                   operand_bytes: float = 2.0) -> float:
    """The serving step's time for one GEMM (infer/step.py's terms): max(flops / (peak x _matmul_fraction(rows = m,
    narrower weight dim)), bytes / (HBM x hbm_fraction)) + kernel_overhead_s, at the compute dtype's peak; the input and
    weight take `operand_bytes` per element, the output 2 (bf16)."""
    t_mm = gemm_flops(b, m, n, k) / (chip.peak(dtype) * _matmul_fraction(eff, dtype, m, min(n, k)))
    t_mem = b * ((m * k + k * n) * operand_bytes + m * n * 2.0) / (chip.hbm_bandwidth_bytes_per_s * eff.hbm_fraction)
    return max(t_mm, t_mem) + eff.kernel_overhead_s


def predictions(rows: list[tuple[int, int, int, int, float]], chip: Chip) -> dict[str, np.ndarray]:
    eff = default_efficiency(chip)
    peak = chip.peak("bf16")
    train = [gemm_flops(b, m, n, k) / (peak * float(eff.matmul(m, n, k))) for b, m, n, k, _ in rows]
    serve = [serving_gemm_s(chip, eff, b, m, n, k) for b, m, n, k, _ in rows]
    return {"training": np.array(train), "serving": np.array(serve)}


def fit_latency_fraction(rows: list[tuple[int, int, int, int, float]], peak: float) -> tuple[float, float]:
    """Least squares of measured time = latency + flops / (peak * fraction) over the rows: (latency_s, fraction)."""
    flops = np.array([gemm_flops(*r[:4]) for r in rows])
    t = np.array([r[4] for r in rows])
    A = np.stack([np.ones_like(flops), flops / peak], axis=1)
    (lat, inv_frac), *_ = np.linalg.lstsq(A, t, rcond=None)
    return float(lat), float(1.0 / inv_frac)


def report(rows: list[tuple[int, int, int, int, float]]) -> dict:
    chip = load_chip(CHIP)
    peak = chip.peak("bf16")
    meas = np.array([r[4] for r in rows])
    flops = np.array([gemm_flops(*r[:4]) for r in rows])
    out: dict = {"rows": len(rows), "chip": chip.name, "peak_bf16_flops_per_s": peak, "models": {}}
    for name, pred in predictions(rows, chip).items():
        err = pred / meas - 1.0
        bins = []
        for lo, hi in FLOP_BINS:
            sel = (flops >= lo) & (flops < hi)
            bins.append({"flops_from": lo, "flops_to": hi, "n": int(sel.sum()),
                         "signed_median": float(np.median(err[sel])), "median_abs": float(np.median(abs(err[sel])))})
        out["models"][name] = {"signed_median": float(np.median(err)), "median_abs": float(np.median(abs(err))),
                               "p90_abs": float(np.percentile(abs(err), 90)), "by_flops": bins}
    lat, frac = fit_latency_fraction(rows, peak)
    fit = lat + flops / (peak * frac)
    out["table_fit"] = {"latency_s": lat, "fraction_of_peak": frac,
                        "median_abs": float(np.median(abs(fit / meas - 1.0)))}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = report(load_table())
    if args.json:
        json.dump(res, sys.stdout, indent=2)
        print()
        return 0
    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, Python {platform.python_version()}")
    print(f"{res['rows']} measured sm_90 bf16 GEMMs (OpenXLA matmul_interpolator_data.h); error = predicted/measured - 1")
    for name, s in res["models"].items():
        print(f"\n{name}: signed median {100 * s['signed_median']:+.1f}%, median |error| {100 * s['median_abs']:.1f}%, "
              f"p90 |error| {100 * s['p90_abs']:.1f}%")
        print("  | GEMM FLOP | n | signed median | median abs |")
        print("  |---|---|---|---|")
        for bn in s["by_flops"]:
            print(f"  | {bn['flops_from']:.0e} - {bn['flops_to']:.0e} | {bn['n']} | {100 * bn['signed_median']:+.1f}% | "
                  f"{100 * bn['median_abs']:.1f}% |")
    f = res["table_fit"]
    print(f"\nthe table's own fit, time = latency + flops / (peak x fraction): latency {f['latency_s'] * 1e6:.2f} us, "
          f"fraction {f['fraction_of_peak']:.3f} of {res['peak_bf16_flops_per_s'] / 1e12:.0f} TFLOP/s ({res['chip']}); "
          f"median |error| of that fit {100 * f['median_abs']:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
