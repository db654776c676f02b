"""Expert-shaped GEMMs on one GPU, bf16 against fp8 (issue #14, fine-grained MoE): the rate a routed expert's
GEMMs reach at a given tokens-per-expert, launched one cuBLAS GEMM per expert (Transformer Engine GroupedLinear's
way) or as one grouped GEMM (torch._grouped_mm / torch._scaled_grouped_mm, torchtitan's way), and what FP8 costs
beside them (tensorwise and rowwise scales, with and without quantizing the input).

    python benchmarks/gpu/experts.py [--out DIR] [--budget-s S]
    python benchmarks/gpu/experts.py --report FILE [--hardware h200]   # markdown table, beside meshplan's GEMM time

Shapes (d_model, expert d_ff) from the models' published configs: Qwen3-30B-A3B (2048, 768), GPT-OSS-120B
(2880, 2880), DeepSeek-V3 (7168, 2048). Per expert two GEMMs of the forward: gate+up [m, D]·[D, 2F] and down
[m, F]·[F, D]. Timed with CUDA events over 10 repetitions after 3 warm-ups; weights stay resident in L2 where
they fit (no flush), as they do between micro-batches. Writes experts_<gpu>_<date>.json under --out, else $OUT.
Needs PyTorch with CUDA; every variant that the installed PyTorch lacks is recorded as an error, not fatal.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

FP8_MAX = 448.0  # largest finite e4m3fn value (OCP FP8 spec)
# (model, D, F, local experts, tokens per local expert)
GRID = [("qwen3-30b-a3b", 2048, 768, 8, m) for m in (128, 512, 2048, 8192)] + \
       [("qwen3-30b-a3b", 2048, 768, 128, m) for m in (128, 1024)] + \
       [("gpt-oss-120b", 2880, 2880, 16, m) for m in (512, 2048)] + \
       [("deepseek-v3", 7168, 2048, 8, m) for m in (512, 2048, 8192)]
DENSE = [(8192, 8192, 8192), (16384, 14336, 4096), (16384, 4096, 14336), (4096, 4096, 4096)]


def timed(fn: Callable[[], Any], reps: int = 10, warm: int = 3) -> float:
    import torch

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def quant_tensorwise(x: Any) -> tuple[Any, Any]:
    """Current (per-tensor) scaling in eager PyTorch: amax, scale, scaled cast (what TE fuses into 1-3 kernels)."""
    import torch

    amax = x.abs().amax().float().clamp(min=1e-12)
    return (x.float() * (FP8_MAX / amax)).to(torch.float8_e4m3fn), (amax / FP8_MAX).reshape(())


def quant_rowwise(x: Any) -> tuple[Any, Any]:
    import torch

    amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    return (x.float() * (FP8_MAX / amax)).to(torch.float8_e4m3fn), amax / FP8_MAX


def gemm_variants(m: int, n: int, k: int, experts: int) -> dict[str, Callable[[], Any]]:
    """One forward linear of `experts` local experts, m rows each: x [E·m, k], w [E, n, k]."""
    import torch

    dev = "cuda"
    x = torch.randn(experts * m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
    xs = list(x.split(m))
    xq_t = [quant_tensorwise(a) for a in xs]
    wq_t = [quant_tensorwise(w[e]) for e in range(experts)]
    xq_r = [quant_rowwise(a) for a in xs]
    wq_r = [quant_rowwise(w[e]) for e in range(experts)]  # [n, k] rows: one scale per output column
    offs = torch.arange(m, experts * m + 1, m, device=dev, dtype=torch.int32)
    v: dict[str, Callable[[], Any]] = {}
    v["bf16_loop"] = lambda: [torch.mm(xs[e], w[e].t()) for e in range(experts)]
    v["bf16_grouped"] = lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    def fp8_t() -> list:
        return [torch._scaled_mm(xq_t[e][0], wq_t[e][0].t(), scale_a=xq_t[e][1], scale_b=wq_t[e][1],
                                 out_dtype=torch.bfloat16) for e in range(experts)]

    def fp8_t_quant() -> list:
        out = []
        for e in range(experts):
            a, sa = quant_tensorwise(xs[e])
            out.append(torch._scaled_mm(a, wq_t[e][0].t(), scale_a=sa, scale_b=wq_t[e][1], out_dtype=torch.bfloat16))
        return out

    def fp8_r() -> list:
        return [torch._scaled_mm(xq_r[e][0], wq_r[e][0].t(), scale_a=xq_r[e][1], scale_b=wq_r[e][1].t(),
                                 out_dtype=torch.bfloat16) for e in range(experts)]

    v["fp8_tensorwise_loop"] = fp8_t
    v["fp8_tensorwise_loop_with_quantize"] = fp8_t_quant
    v["fp8_rowwise_loop"] = fp8_r
    aq = torch.cat([q for q, _ in xq_r])
    sa = torch.cat([s for _, s in xq_r]).reshape(-1)
    wq = torch.stack([q for q, _ in wq_r])  # [E, n, k]
    sb = torch.stack([s.reshape(-1) for _, s in wq_r])  # [E, n]
    v["fp8_rowwise_grouped"] = lambda: torch._scaled_grouped_mm(aq, wq.transpose(-2, -1), sa, sb, offs=offs,
                                                                out_dtype=torch.bfloat16)
    v["quantize_only_tensorwise"] = lambda: [quant_tensorwise(a) for a in xs]
    return v


def report(path: Path, hardware: str) -> str:
    """Markdown: microseconds per variant, and meshplan's time for the same GEMMs (Efficiency.matmul at the GEMM's
    shape, one launch per expert: the planner's `_grouped_gemm_s` without the load ratio) with the defaults."""
    from meshplan.cost.efficiency import default_efficiency
    from meshplan.specs.hardware import load_chip

    data = json.loads(path.read_text())
    chip = load_chip(hardware)
    eff = default_efficiency(chip)
    variants: list[str] = []
    table: dict[tuple, dict[str, Any]] = {}
    for r in data["rows"]:
        key = (r["model"], r["gemm"], r["experts"], r["m"], r["n"], r["k"])
        table.setdefault(key, {})[r["variant"]] = r.get("time_s")
        if r["variant"] not in variants:
            variants.append(r["variant"])
    lines = [f"Expert GEMMs on {data['gpu']} (torch {data['torch']}, CUDA {data['cuda']}), microseconds for all "
             f"experts; meshplan: the defaults of {chip.name}.", "",
             "| model | GEMM | experts | m | n | k | meshplan | " + " | ".join(variants) + " |",
             "|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(variants)]
    for (model, gemm, e, m, n, k), v in table.items():
        pred = e * (2.0 * m * n * k / (chip.peak("bf16") * float(eff.matmul(m, n, k))) + eff.kernel_overhead_s)
        cells = " | ".join("err" if v.get(x) is None else f"{v[x] * 1e6:.0f}" for x in variants)
        lines.append(f"| {model} | {gemm} | {e} | {m} | {n} | {k} | {pred * 1e6:.0f} | {cells} |")
    return "\n".join(lines)


def measure(rows: list[dict[str, Any]], label: dict[str, Any], m: int, n: int, k: int, experts: int) -> None:
    flops = 2.0 * m * n * k * experts
    for name, fn in gemm_variants(m, n, k, experts).items():
        row = {**label, "m": m, "n": n, "k": k, "experts": experts, "variant": name, "flops": flops}
        try:
            t = timed(fn)
            row.update(time_s=t, tflops_per_s=flops / t / 1e12 if not name.startswith("quantize") else None)
        except Exception as exc:  # noqa: BLE001 - a variant the installed PyTorch lacks is a row, not a failure
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        rows.append(row)
        t_txt = f"{row['time_s'] * 1e6:9.1f} us  {row['tflops_per_s'] or 0:6.1f} TFLOP/s" if "time_s" in row \
            else row["error"]
        print(f"  {label.get('model', 'dense'):14s} {label['gemm']:8s} E={experts:3d} m={m:5d} n={n:5d} k={k:5d} "
              f"{name:34s} {t_txt}", flush=True)
    import torch

    torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="output folder (default $OUT, else ./out/gpu)")
    ap.add_argument("--budget-s", type=float, default=60.0, help="stop starting new shapes after this")
    ap.add_argument("--report", metavar="FILE", help="print the markdown table of a results file and stop")
    ap.add_argument("--hardware", default="h200", help="chip whose default efficiencies --report compares with")
    args = ap.parse_args()
    if args.report:
        print(report(Path(args.report), args.hardware))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA device for PyTorch")
        return 2
    t0 = time.monotonic()
    out = Path(args.out or os.environ.get("OUT") or "out/gpu")
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    shapes = [({"model": "dense", "gemm": "dense"}, M, N, K, 1) for M, N, K in DENSE]
    for model, D, F, E, m in GRID:
        shapes += [({"model": model, "gemm": "gate_up"}, m, 2 * F, D, E), ({"model": model, "gemm": "down"}, m, D, F, E)]
    for i, (label, m, n, k, e) in enumerate(shapes):
        if time.monotonic() - t0 > args.budget_s:
            notes.append(f"{len(shapes) - i} shape(s) skipped for the budget")
            break
        measure(rows, label, m, n, k, e)
    path = out / f"experts_{gpu.split()[-1].lower()}_{dt.datetime.now(dt.UTC).date().isoformat()}.json"
    path.write_text(json.dumps({"schema": "meshplan-gpu-experts/1", "gpu": gpu, "torch": torch.__version__,
                                "cuda": torch.version.cuda, "wall_s": time.monotonic() - t0, "notes": notes,
                                "rows": rows}, indent=1) + "\n")
    print(f"wrote {path} in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
