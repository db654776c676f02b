"""meshplan's memory-bound kernel time against NVIDIA's measured cuDNN normalisation kernels.

`data/cudnn_norms.csv` (NVIDIA/cudnn-frontend's benchmark/norms results: cuDNN RMSNorm and LayerNorm, bf16, on the
normalised shapes of Llama 3, Llama 4, Mixtral, Qwen3, DeepSeek-V3, GPT-3 and Nemotron-H, on GB200, GB300 and H200).
A norm is the simplest memory-bound kernel the training ledger times: forward reads x and writes y (2·N·C elements),
backward reads x and dy and writes dx (3·N·C), at 2 bytes each (the tables' own byte counts: their GB/s times their
time). meshplan times it as every pointwise kernel: bytes / (HBM bandwidth x hbm_fraction) + kernel_overhead_s
(efficiency.yaml; cost/roofline.py realistic_time_s). The measured time is the table's bytes over its GB/s (its ms
column has three decimals). Reported by bytes moved, since the fixed per-kernel cost rules the small shapes.

    python benchmarks/norm_check.py
"""

from __future__ import annotations

import csv
import statistics
import sys
from pathlib import Path

from meshplan.cost.efficiency import default_efficiency
from meshplan.cost.roofline import Op, realistic_time_s
from meshplan.specs.hardware import load_chip

DATA = Path(__file__).parent / "data" / "cudnn_norms.csv"
CHIPS = {"gb200": "gb200-nvl72", "gb300": "gb300-nvl72", "h200": "h200"}
PASSES = {"fwd": 2, "bwd": 3}  # tensors of N x C elements a pass reads or writes
BANDS = ((0.0, 16e6, "under 16 MB"), (16e6, 128e6, "16-128 MB"), (128e6, float("inf"), "128 MB and more"))


def load_rows(path: Path = DATA) -> list[dict]:
    with path.open() as fh:
        return list(csv.DictReader(line for line in fh if not line.startswith("#")))


def kernel(r: dict, direction: str) -> dict:
    """One measured pass: its bytes, measured seconds and meshplan's seconds on the row's chip."""
    chip = load_chip(CHIPS[r["system"]])
    nbytes = PASSES[direction] * int(r["N"]) * int(r["C"]) * 2.0
    measured = nbytes / (float(r[f"{direction}_gbps"]) * 1e9)
    op = Op(f"{r['shape']} {direction}", 4.0 * int(r["N"]) * int(r["C"]), nbytes, "elementwise")
    return {"bytes": nbytes, "measured_s": measured,
            "predicted_s": realistic_time_s(op, chip, default_efficiency(chip))}


def report(rows: list[dict]) -> dict[str, dict]:
    """Signed and absolute errors (predicted / measured - 1) by chip and band of bytes moved."""
    groups: dict[str, list[float]] = {}
    for r in rows:
        for direction in PASSES:
            k = kernel(r, direction)
            band = next(label for lo, hi, label in BANDS if lo <= k["bytes"] < hi)
            groups.setdefault(f"{r['system']} {band}", []).append(k["predicted_s"] / k["measured_s"] - 1)
    return {g: {"n": len(v), "signed_median": statistics.median(v), "median_abs": statistics.median(map(abs, v))}
            for g, v in sorted(groups.items())}


def main() -> int:
    print("| chip, bytes moved | n | signed median | median abs |\n|---|---|---|---|")
    for g, s in report(load_rows()).items():
        print(f"| {g} | {s['n']} | {s['signed_median']:+.1%} | {s['median_abs']:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
