"""The TP sweeps of aiconfigurator's silicon sample: meshplan's TPOT error by model, engine, GPU and TP degree.

    python benchmarks/aic_tp_sweep.py [--tuning-only]

A term that grows with the TP degree (the serving step's collectives) shows as an error that drifts with TP inside
one campaign, where the model, engine, GPU and lengths stay fixed. Dense campaigns only (Llama 3.1 8B / 70B, Qwen3
32B): MoE campaigns change their expert layout along with TP. Rows as serving_accuracy.py predicts them
(aic_silicon.load, serving_accuracy.predict); error = predicted / measured TPOT - 1 (positive: meshplan slower).
Session 36 read these sweeps to judge an in-situ collective wait (benchmarks/README.md); it reports, nothing is fed
back.
"""

from __future__ import annotations

import argparse
import collections
import statistics

import aic_silicon
import serving_accuracy

DENSE = ("llama3.1-8b", "llama3.1-70b", "qwen3-32b")


def sweep(tuning_only: bool = False) -> dict[tuple, list[float]]:
    rules = serving_accuracy._assumptions()
    out: dict[tuple, list[float]] = collections.defaultdict(list)
    for e in aic_silicon.load():
        if e["model"] not in DENSE or (tuning_only and e["split"] != "tuning"):
            continue
        p = serving_accuracy.predict(e, rules)
        key = (e["split"], e["model"], e["engine"].split("@")[0], e["hardware"], int(e["tp"]))
        out[key].append(p["tpot_s"] / e["measured"]["tpot_s"] - 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tuning-only", action="store_true", help="the tuning half's campaigns only")
    args = ap.parse_args(argv)
    res = sweep(args.tuning_only)
    campaigns = sorted({k[:4] for k in res})
    print("| half | model | engine | GPU | TP 1 | TP 2 | TP 4 | TP 8 |")
    print("|---|---|---|---|---|---|---|---|")
    for c in campaigns:
        cells = []
        for tp in (1, 2, 4, 8):
            v = res.get((*c, tp))
            cells.append(f"{statistics.median(v):+.1%} ({len(v)})" if v else "-")
        print(f"| {' | '.join(c)} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
