"""The in-situ cost of a blocking collective in an inference step, from a published with/without-communication pair.

    python benchmarks/collective_sync.py [--json]

Ladder-Residual's gpt-fast runs (data/ladder_gptfast_70b_tp.csv; Zhang, Mishra et al., ICML 2025) time the same
Llama-3-70B shape at TP 2/4/8 twice: as it is (160 all-reduces per token) and with every all-reduce removed (its
"upper bound"). Their difference is what the all-reduces cost inside the decode loop, measured:

  in-situ per decode all-reduce = (t_standard - t_upper - prefill all-reduces) / (511 decode steps x 160)

t = batch x 512 / tokens/s, the whole generate call (a 1024-token prefill and 511 decode steps). The prefill's 160
all-reduces of batch x 1024 x 8192 x 2 bytes are taken at the nccl-tests time of that size on H100
(data/aic_h100_nccl_tests.csv, log-log interpolation). The same all-reduce timed alone in a CUDA graph
(data/aic_h100_vllm_custom_allreduce.csv: vLLM 0.14's one-shot kernel, batch x 8192 x 2 bytes) is its kernel time;
the rest is what the collective costs inside the step beyond its own kernel: every rank waits for the slowest to
arrive (the layer before it runs on each GPU with its own jitter) and the step cannot overlap anything across the
barrier. Batches 1 and 4 set serving.yaml collective_sync_s (their prefill is 1-4% of the communication time);
batches 16 and 64 are shown, not used: there a 16k-64k-token prefill's all-reduces and gpt-fast's unfused decode
attention weigh on the pair.

Nothing here is fed back into meshplan at run time: the script derives the constant and --check compares it with
serving.yaml (tests/test_collective_sync.py runs the check).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
from pathlib import Path

DATA = Path(__file__).parent / "data"
LAYERS, D_MODEL, ACT_BYTES = 80, 8192, 2  # Llama-3-70B shape, fp16 (gpt_desync_TP.py "llama-3-70b")
PROMPT, NEW = 1024, 512  # scripts/throughput-70B.sh
USED_BATCHES = (1, 4)


def _rows(name: str) -> list[dict]:
    with (DATA / name).open() as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def _loglog(points: list[tuple[float, float]], x: float) -> float:
    """Log-log interpolation in sorted (x, y) points; clamped to the end segments' extension."""
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x <= x1:
            f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))


def meshplan_in_situ_s(tp: int, nbytes: float) -> float:
    """meshplan's serving step for the same all-reduce: its kernel (infer.step._allreduce_s, an engine with the
    custom all-reduce) plus the in-situ wait (config.collective_sync_s)."""
    from meshplan.infer.config import ServeConfig, collective_sync_s
    from meshplan.infer.step import _allreduce_s
    from meshplan.specs.hardware import load_chip

    chip = load_chip("h100-sxm")
    return _allreduce_s(chip, ServeConfig(tp=tp, engine="vllm"), nbytes, tp) + collective_sync_s(chip, tp)


def derive() -> dict:
    ar = _rows("aic_h100_vllm_custom_allreduce.csv")
    nccl = [r for r in _rows("aic_h100_nccl_tests.csv") if r["op"] == "all_reduce"]
    out = []
    for r in _rows("ladder_gptfast_70b_tp.csv"):
        tp, b = int(r["tp"]), int(r["batch"])
        t_std = b * NEW / float(r["standard_tokens_per_s"])
        t_ub = b * NEW / float(r["upper_bound_tokens_per_s"])
        pre_bytes = b * PROMPT * D_MODEL * ACT_BYTES
        pre_s = 2 * LAYERS * _loglog([(float(x["bytes"]), float(x["time_us"])) for x in nccl if int(x["gpus"]) == tp],
                                     pre_bytes) * 1e-6
        insitu_s = (t_std - t_ub - pre_s) / ((NEW - 1) * 2 * LAYERS)
        dec_bytes = b * D_MODEL * ACT_BYTES
        kernel_s = _loglog([(float(x["bytes"]), float(x["time_us"])) for x in ar if int(x["gpus"]) == tp],
                           dec_bytes) * 1e-6
        out.append({"tp": tp, "batch": b, "message_bytes": dec_bytes, "in_situ_s": insitu_s, "kernel_s": kernel_s,
                    "excess_s": insitu_s - kernel_s, "prefill_share": pre_s / (t_std - t_ub),
                    "used": b in USED_BATCHES, "meshplan_s": meshplan_in_situ_s(tp, dec_bytes)})
    by_tp = {tp: statistics.mean(x["excess_s"] for x in out if x["tp"] == tp and x["used"])
             for tp in sorted({x["tp"] for x in out})}
    return {"rows": out, "collective_sync_s": by_tp}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--check", action="store_true", help="exit 1 unless serving.yaml collective_sync_s (gpu) holds "
                                                          "these values to 0.1 us")
    args = ap.parse_args(argv)
    res = derive()
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print("| TP | batch | message | in situ per all-reduce | kernel alone (CUDA graph) | excess | prefill share | used "
              "| meshplan in situ | error |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for x in res["rows"]:
            print(f"| {x['tp']} | {x['batch']} | {x['message_bytes'] / 1024:.0f} KiB | {x['in_situ_s'] * 1e6:.1f} us | "
                  f"{x['kernel_s'] * 1e6:.1f} us | {x['excess_s'] * 1e6:+.1f} us | {x['prefill_share']:.1%} | "
                  f"{'yes' if x['used'] else 'no'} | {x['meshplan_s'] * 1e6:.1f} us | "
                  f"{x['meshplan_s'] / x['in_situ_s'] - 1:+.0%} |")
        print("\ncollective_sync_s (mean excess of batches 1 and 4): "
              + ", ".join(f"TP {tp}: {v * 1e6:.1f} us" for tp, v in res["collective_sync_s"].items()))
    if args.check:
        from meshplan.infer.config import collective_sync_table
        from meshplan.specs.hardware import load_chip

        table = collective_sync_table(load_chip("h100-sxm"))
        bad = [tp for tp, v in res["collective_sync_s"].items() if abs(table.get(tp, math.inf) - v) > 0.1e-6]
        if bad:
            print(f"serving.yaml collective_sync_s differs from the derivation at TP {bad}: {table}")
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
