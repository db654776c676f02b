"""From benchmark records to efficiency fields and a meshplan-profile/1 object (numpy only, no JAX).

Fits (relative to the chip's catalog peaks, book ch.1): matmul_peak_fraction and matmul_half_dim by least
squares of fraction = p·d/(d + d_half) over d = min(m, n, k) (the planner's `Efficiency.matmul`);
fp8_peak_fraction at the largest fp8 shape; hbm_fraction from the largest copy; attention_fwd/bwd_fraction at
the two longest lengths (causal FLOPs, the backward counted as attention_bwd_flops_ratio × forward, as the
planner counts it), and attention_sdpa_fwd/bwd_fraction the same way from PyTorch SDPA; kernel_overhead_s from the
intercept of a dependent kernel chain's time against its bytes, the GEMV chain's before the copy chain's (the slope
of the tiny-kernel chain where neither gives a positive intercept at a rate HBM can serve). Fields not measured keep their
defaults and are marked "default" in `efficiency_origin`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from meshplan.cost.efficiency import PROFILE_SCHEMA, default_efficiency, profile_rules
from meshplan.errors import MeshplanError
from meshplan.specs.hardware import Chip

Record = dict[str, Any]


def fit_half_dim(d: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least squares of y = p·d/(d + h) over (p, h): p is closed-form for each h on a log grid, refined
    once around the best h. Returns (p, h, rms error)."""
    def best(hs: np.ndarray) -> tuple[float, float, float]:
        x = d[None, :] / (d[None, :] + hs[:, None])
        p = (x * y).sum(1) / (x * x).sum(1)
        sse = ((p[:, None] * x - y) ** 2).sum(1)
        i = int(np.argmin(sse))
        return float(p[i]), float(hs[i]), float(np.sqrt(sse[i] / len(d)))

    _, h, _ = best(np.logspace(0, 4.7, 189))
    return best(np.linspace(h / 1.06, h * 1.06, 101))


# A timed program whose time is under this many times the run's own one-kernel program time (the `overhead`
# benchmark) is bound by the host's dispatch, not the device: batches dispatch distinct inputs back to back
# (timing.py), so such a point measures dispatch. Seen on an H200 with JAX 0.11.2: ~46 us per program, and the
# 512-2048 square GEMMs "ran" at 0.6-37% of peak (benchmarks/results/profile_h200_2026-12-04.json). 2 is a
# margin, not a fit: at half the program time the device is busy at most half the batch.
DISPATCH_BOUND_FACTOR = 2.0


def program_overhead_s(records: list[Record]) -> float | None:
    """The run's one-kernel program time (benchmark `overhead`), None where it was not measured."""
    one = [r["time_s"] for r in records if r.get("benchmark") == "overhead" and r.get("name", "").startswith(
        "program of 1 ")]
    return one[0] if one else None


def program_floor(records: list[Record]) -> Callable[[int], float] | None:
    """Seconds a program of n ops costs with no work to speak of: the one-kernel program time, and where the run
    also timed a program of many tiny GEMMs on their own operands (calibrate's `overhead`, as many as the GEMM
    benchmark puts in one program), linear in n between the two. On the H200 (session 14) a 16-GEMM program with
    32 operands took ~200 us against a one-kernel program's 40 us, so 512^3 and 1024^3 GEMMs 16 to a program
    (222 and 181 us) passed a floor of the one-kernel time alone while running at 2% and 19% of peak
    (benchmarks/results/profile_h200_2026-12-04_s14.json). None where neither was measured."""
    t1 = program_overhead_s(records)
    if t1 is None:
        return None
    many = [r for r in records if r.get("benchmark") == "overhead" and r.get("ops_per_program", 1) > 1]
    if not many:
        return lambda n: t1
    # the fastest of its timed batches (an overhead only ever adds time: STREAM's best-of-trials logic, as hbm_fraction)
    best = min(many[0]["time_s"], (many[0].get("timing") or {}).get("min_s", many[0]["time_s"]))
    n_many, t_many = many[0]["ops_per_program"], max(best, t1)
    return lambda n: t1 + (t_many - t1) * (min(n, n_many) - 1) / (n_many - 1)


def device_bound(records: list[Record], floor: Callable[[int], float] | None) -> list[Record]:
    """The records whose program time (time per op × ops per program) is at least DISPATCH_BOUND_FACTOR × the
    program's dispatch floor (`program_floor`: seconds for a program of n ops); all of them where no floor was
    measured."""
    if floor is None:
        return records
    return [r for r in records
            if r["time_s"] * r.get("ops_per_program", 1) >= DISPATCH_BOUND_FACTOR * floor(r.get("ops_per_program", 1))]


def _median(xs: list[float]) -> float:
    return float(np.median(xs))


def fit_matmul(recs: list[Record]) -> dict[str, Any]:
    pts = [(min(r["m"], r["n"], r["k"]), r["fraction"]) for r in recs if r.get("dtype") != "float8_e4m3fn"]
    if len(pts) < 2:
        return {}
    d, y = (np.array(v, dtype=float) for v in zip(*pts, strict=True))
    if len(set(d.tolist())) < 2:
        return {"matmul_peak_fraction": float(y.max())}
    p, h, rms = fit_half_dim(d, y)
    return {"matmul_peak_fraction": p, "matmul_half_dim": h,
            "_curve": {"model": "fraction = p * d / (d + d_half), d = min(m, n, k)", "peak_fraction": p,
                       "half_dim": h, "rms_error": rms, "points": [[float(a), float(b)] for a, b in pts]}}


def fit_efficiency(records: list[Record], chip: Chip) -> tuple[dict[str, float], dict[str, Any]]:
    """Efficiency fields measured from the records, and the fitted curves behind them."""
    by: dict[str, list[Record]] = {}
    for r in records:
        if "skipped" not in r:
            by.setdefault(r["benchmark"], []).append(r)
    out: dict[str, float] = {}
    curves: dict[str, Any] = {}
    floor = program_floor(records)
    for k in ("matmul", "hbm"):
        kept = device_bound(by.get(k, []), floor)
        names = [r["name"] for r in by.get(k, []) if r not in kept]
        if names:
            by[k] = kept
            curves.setdefault("dispatch_bound", {})[k] = names  # reported, left out of the fit
    mm = fit_matmul(by.get("matmul", []))
    if "_curve" in mm:
        curves["matmul"] = mm.pop("_curve")
    out.update(mm)
    fp8 = [r for r in by.get("matmul", []) if r.get("dtype") == "float8_e4m3fn"]
    if fp8:
        out["fp8_peak_fraction"] = max(fp8, key=lambda r: r["m"])["fraction"]
    if by.get("hbm"):
        # the best rate over the device-bound copy sizes: time is only ever added to a copy (an allocation, a
        # dispatch, another process), so the fastest reading is the least biased one (STREAM, McCalpin 1995, reports
        # the best of its trials for the same reason); was the largest copy's, 0.51 on the H200 where its 256 MiB
        # copy ran at 0.64 and its norm kernels at 0.56-0.65 (benchmarks/results/profile_h200_2026-12-04.json)
        out["hbm_fraction"] = max(r["fraction"] for r in by["hbm"])
    out.update(_fit_attention(by.get("attention", []), chip, curves, "attention"))
    for direction in ("fwd", "bwd"):
        # the measured rate is the device's own at the calibration's lengths: it holds flat, without the defaults'
        # tile factor (efficiency.attention_tile_factor, anchored at 8K causal) on top of it
        if f"attention_{direction}_fraction" in out:
            out[f"attention_tile_{direction}"] = 0.0
    out.update(_fit_attention(by.get("sdpa", []), chip, curves, "attention_sdpa"))
    if by.get("norm"):
        curves["norm"] = {r["name"]: r["fraction"] for r in by["norm"]}  # reported beside hbm_fraction
    ovh = [r for r in by.get("overhead", []) if "per_kernel_s" in r]
    if ovh:
        out["kernel_overhead_s"] = ovh[0]["per_kernel_s"]
    # the intercept of a memory-bound kernel chain, not the tiny-kernel slope: the cost model adds kernel_overhead_s
    # to each kernel's roofline time (cost/roofline.py), so it is the fixed cost of a kernel that moves data, which
    # back-to-back 32x32 matmuls undercount (0.93 and 2.0 us on the H200, where the 1B decode rows need ~4 us:
    # results/gpu_h200_2026-12-04_s14.json, _s15.json). The GEMV chain (decode's own kernels) first, then the copies
    for key, name in (("gemv_chain", "kernel_overhead_gemv"), ("chain", "kernel_overhead")):
        chain = fit_kernel_chain([r for r in by.get("overhead", []) if key in r])
        if not chain:
            continue
        curves[name] = chain
        rate = chain["rate_bytes_per_s"]
        if rate is not None and rate > chip.hbm_bandwidth_bytes_per_s:
            # faster than HBM: the chain's buffers stayed in the on-chip cache (the H200's quick grid of session 15,
            # copies of 256 KiB-16 MiB against a 50 MB L2, fitted 8.7 TB/s and a 2.68 us intercept that made the
            # calibrated decode step at batch 1 x 1k 22% slow: results/gpu_h200_2026-12-04_s15.json); such an
            # intercept is not a memory-bound kernel's fixed cost, so it is reported and not used
            chain["not_used"] = "rate above the chip's HBM bandwidth: cache-resident buffers"
        elif chain["t0_s"] <= 0:
            chain["not_used"] = "intercept not positive"
        else:
            out["kernel_overhead_s"] = chain["t0_s"]
            chain["used"] = "kernel_overhead_s"
            break
    return out, curves


def fit_kernel_chain(recs: list[Record]) -> dict[str, Any]:
    """Least squares of seconds per kernel against bytes moved, t = t0 + bytes / rate (Hockney 1994), over a
    dependent kernel chain's sizes (calibrate._copy_chain, calibrate._gemv_chain); {} with fewer than three sizes."""
    if len({r["bytes"] for r in recs}) < 3:
        return {}
    x = np.array([r["bytes"] for r in recs], dtype=float)
    y = np.array([r["time_s"] for r in recs], dtype=float)
    slope, t0 = np.polyfit(x, y, 1)
    return {"model": "t = t0 + bytes / rate (Hockney 1994)", "t0_s": float(t0),
            "rate_bytes_per_s": float(1.0 / slope) if slope > 0 else None,
            "points": [[float(a), float(b)] for a, b in zip(x, y, strict=True)]}


def _fit_attention(recs: list[Record], chip: Chip, curves: dict[str, Any], prefix: str) -> dict[str, float]:
    """Fractions at the two longest lengths (flash attention's efficiency plateaus with length), read from the
    base head shape only (the head-shape sweep is reported, not fitted); fields `{prefix}_fwd/bwd_fraction`."""
    curves_key = prefix
    sweep = [r for r in recs if r.get("sweep")]
    recs = [r for r in recs if not r.get("sweep")]
    if not recs:
        return {}
    ratio = default_efficiency(chip).attention_bwd_flops_ratio
    peak = chip.peak("bf16")
    longest = sorted({r["seq"] for r in recs})[-2:]
    fwd_of = {r["seq"]: r for r in recs if r["name"].startswith("fwd T")}
    resolved: list[Record] = []
    unresolved: list[str] = []
    for r in recs:
        if "bwd_time_s" in r:
            if backward_resolved(fwd_of.get(r["seq"]), r):
                resolved.append(r)
            else:
                unresolved.append(r["name"])
    fwd = [r["fraction"] for r in fwd_of.values() if r["seq"] in longest]
    bwd = [r["work"] * ratio / (r["bwd_time_s"] * peak) for r in resolved if r["seq"] in longest]
    curves[curves_key] = {"impl": recs[0]["impl"], "lengths": longest, "bwd_flops_ratio": ratio,
                          "fwd": {str(r["seq"]): r["fraction"] for r in fwd_of.values()},
                          "bwd": {str(r["seq"]): r["work"] * ratio / (r["bwd_time_s"] * peak) for r in resolved},
                          "head_shapes": {r["name"]: r["fraction"] for r in sweep if r["name"].startswith("fwd T")}}
    if unresolved:
        curves[curves_key]["bwd_unresolved"] = unresolved  # reported, left out of the fit
    out = {f"{prefix}_fwd_fraction": _median(fwd)} if fwd else {}
    if bwd:
        out[f"{prefix}_bwd_fraction"] = _median(bwd)
    return out


def backward_resolved(fwd: Record | None, fwd_bwd: Record) -> bool:
    """Whether a backward's time, read as the fwd+bwd median less the forward median, is a measurement: only where
    the fastest fwd+bwd batch was slower than the slowest forward batch (the two timings' ranges are disjoint).
    Otherwise the difference is timing noise: a loaded 2-core CI runner (session 23) gave a difference of ~1e-9 s
    and an attention_bwd_fraction of 10.6 of an H100's peak, which no profile may hold. Records without timings
    (hand-written) are taken as they are; the profile's range check still applies to what they give."""
    if fwd is None or "timing" not in fwd or "timing" not in fwd_bwd:
        return True
    return bool(fwd_bwd["timing"]["min_s"] > fwd["timing"]["max_s"])


def build_profile(chip: Chip, records: list[Record], meta: dict[str, Any]) -> dict[str, Any]:
    """The meshplan-profile/1 JSON object: every efficiency field (measured or default, marked which)."""
    measured, curves = fit_efficiency(records, chip)
    # a fit outside the range a profile may hold (validate.PROFILE_FRACTION, PROFILE_RULES) is a bad measurement, not
    # a property of the chip: keep the default and report it, so calibrate never writes a profile `--profile` refuses
    rules = profile_rules()
    for field, value in list(measured.items()):
        try:
            if field in rules:
                rules[field].check(value, field)
        except MeshplanError as e:
            curves.setdefault("out_of_range", {})[field] = {"value": value, "why": str(e)}
            del measured[field]
    base = default_efficiency(chip).as_dict()
    base.pop("origin", None)
    eff = {k: float(measured.get(k, v)) for k, v in base.items()}
    origin = {k: ("measured" if k in measured else "default") for k in base}
    cpu = meta.get("platform") == "cpu"
    profile: dict[str, Any] = {"schema": PROFILE_SCHEMA, "chip": chip.name,
                               "device_kind": "cpu" if cpu else meta.get("device_kind")}
    if cpu:
        profile["cpu_only"] = True
        profile["warning"] = (f"measured on the CPU and labelled {chip.name} by --hardware: these numbers say "
                              f"nothing about a {chip.name}")
    profile.update({"efficiency": eff, "efficiency_origin": origin, "fitted_curves": curves, **meta,
                    "benchmarks": records})
    return profile
