"""What a TP all-reduce costs inside a decode loop against the same kernel timed alone: a published pair of runs
with and without the all-reduces, next to meshplan's all-reduce term.

    python benchmarks/collective_sync.py [--json]

Ladder-Residual's gpt-fast runs (data/ladder_gptfast_70b_tp.csv; Zhang, Mishra et al., ICML 2025) time the same
Llama-3-70B shape at TP 2/4/8 twice: as it is (160 all-reduces per token) and with every all-reduce removed (its
"upper bound"). Their difference is what the all-reduces cost inside gpt-fast's decode loop:

  in situ per decode all-reduce = (t_standard - t_upper - prefill all-reduces) / (511 decode steps x 160)

t = batch x 512 / tokens/s, the whole generate call (a 1024-token prefill and 511 decode steps). The prefill's 160
all-reduces of batch x 1024 x 8192 x 2 bytes are taken at the nccl-tests time of that size on H100
(data/aic_h100_nccl_tests.csv, log-log interpolation). The same all-reduce alone in a CUDA graph
(data/aic_h100_vllm_custom_allreduce.csv: vLLM 0.14's one-shot kernel, batch x 8192 x 2 bytes) is the kernel time;
meshplan's term is infer.step._allreduce_s for a vLLM layout (the serving step's TP all-reduce).

Session 36 finding (benchmarks/README.md): gpt-fast's all-reduce costs 2-4x the engine kernel alone inside its loop
(+8 to +19 us each at batches 1 and 4). Added to every serving collective, that excess made the TP sweeps of the
tuning half's modern engines (aiconfigurator's silicon sample: vLLM Llama-3.1-70B on H100/H200/B200, TensorRT-LLM 1.0
Llama-3.1-8B on H100) grow pessimistic with TP (+7% to +34% at TP 8) where they were flat with the kernel alone, so it
is not in the model: the excess belongs to gpt-fast's path (PyTorch functional collectives over IntraNodeComm), not
to every engine. Batches 16 and 64 are shown, not summarised: there a 16k-64k-token prefill's all-reduces and
gpt-fast's unfused decode attention weigh on the pair.

Nothing here is fed back into meshplan: it reports. tests/test_collective_sync.py checks one row by hand.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

from kernel_check import _rows  # the data/ CSV reader (comment lines skipped) kernel_check reads the same tables with

from meshplan.infer.config import ServeConfig
from meshplan.infer.step import _allreduce_s
from meshplan.specs.hardware import load_chip

LAYERS, D_MODEL, ACT_BYTES = 80, 8192, 2  # Llama-3-70B shape, fp16 (gpt_desync_TP.py "llama-3-70b")
PROMPT, NEW = 1024, 512  # scripts/throughput-70B.sh
SUMMARY_BATCHES = (1, 4)


def _loglog(points: list[tuple[float, float]], x: float) -> float:
    """Log-log interpolation in (x, y) points; beyond the ends, the end segment extended."""
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    pairs = list(zip(pts, pts[1:], strict=False))
    (x0, y0), (x1, y1) = next(((a, b) for a, b in pairs if x <= b[0]), pairs[-1])
    f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))


def derive() -> dict:
    ar = _rows("aic_h100_vllm_custom_allreduce.csv")
    nccl = [r for r in _rows("aic_h100_nccl_tests.csv") if r["op"] == "all_reduce"]
    chip = load_chip("h100-sxm")
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
                    "meshplan_s": _allreduce_s(chip, ServeConfig(tp=tp, engine="vllm"), dec_bytes, tp)})
    summary = {tp: statistics.mean(x["excess_s"] for x in out if x["tp"] == tp and x["batch"] in SUMMARY_BATCHES)
               for tp in sorted({x["tp"] for x in out})}
    return {"rows": out, "mean_excess_s_batches_1_4": summary}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = derive()
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print("| TP | batch | message | in situ per all-reduce (gpt-fast) | kernel alone (CUDA graph) | excess | "
          "prefill share | meshplan's term | meshplan vs in situ |")
    print("|---|---|---|---|---|---|---|---|---|")
    for x in res["rows"]:
        print(f"| {x['tp']} | {x['batch']} | {x['message_bytes'] / 1024:.0f} KiB | {x['in_situ_s'] * 1e6:.1f} us | "
              f"{x['kernel_s'] * 1e6:.1f} us | {x['excess_s'] * 1e6:+.1f} us | {x['prefill_share']:.1%} | "
              f"{x['meshplan_s'] * 1e6:.1f} us | {x['meshplan_s'] / x['in_situ_s'] - 1:+.0%} |")
    print("\nmean excess over the kernel alone, batches 1 and 4: "
          + ", ".join(f"TP {tp}: {v * 1e6:+.1f} us" for tp, v in res["mean_excess_s_batches_1_4"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
