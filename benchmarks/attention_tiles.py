"""Fused attention's tile overhead and 8K-causal rate, read from NVIDIA's cuDNN training-attention tables.

`data/cudnn_sdpa_training.csv` (NVIDIA/cudnn-frontend's benchmark/sdpa_benchmark_training results: cuDNN fused
attention, Llama 3.1 heads, bf16, causal and unmasked, 2K-32K tokens, forward and backward on GB200, GB300, H200).
A tiled kernel's time is c·V + a·Q (efficiency.attention_tile_factor): V the (query tile, key tile) pairs it
visits, B = 128-token tiles, n = S/B (causal n(n+1)/2 per batch-head, unmasked n²), Q = n query tiles per
batch-head. Least squares on the relative error over the 2,048-16,384-token rows (32K: the training range ends at
16K, and GB200's 32K causal forward runs 13% under its 16K rate) gives k = a/c, the fixed work per query tile in
tile visits, which efficiency.yaml attention_tile_fwd/_bwd carry; the fraction of peak at the anchor (causal, 8,192
tokens) is the table's own row, which attention_fwd/bwd_fraction carry. Then meshplan's time for every row (the
chip's fraction and tile factor) beside the measured time.

Then the same kernel on other heads (`data/cudnn_sdpa_heads.csv`: DeepSeek-V3 / Kimi K2.6 MLA 192/128, Qwen3.5 256,
LTX-2 and Wan 2.2 128 unmasked, gpt-oss 64 with a 128-token window on GB200/GB300 and 1,024 on H200), none of them
fitted: meshplan's time with the forward's fixed work per query tile a fixed time (the head-width rule of
efficiency.attention_tile_factor) beside the time with that work scaled by the head width (session 34's rule).

Then the serving engines' own prompt-attention ops: TensorRT-LLM 1.3's, vLLM 0.24's (FlashAttention-3) and SGLang
0.5.14's (FlashAttention-3) context attention on H100 and H200 (`data/aic_context_attention.csv`, NVIDIA's
aiconfigurator tables: 2,533 shapes per engine and chip, batch 1-256, prompts of 1-16,384 tokens, 4-64 query heads)
fitted as time = t0 + c·V + a·Q (t0 the op's fixed cost per call), which serving.yaml engine_context_attention carries
as (fixed_s, fraction at the 8K causal anchor, tile_k).

    python benchmarks/attention_tiles.py
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import numpy as np

from meshplan.cost.efficiency import (
    ATTENTION_TILE,
    anchor_tile_factor,
    attention_head_dim_rate,
    attention_tile_factor,
    default_efficiency,
)
from meshplan.specs.hardware import load_chip
from meshplan.train.costmodel import ATTENTION_KERNEL_FRACTIONS

DATA = Path(__file__).parent / "data" / "cudnn_sdpa_training.csv"
HEADS_DATA = Path(__file__).parent / "data" / "cudnn_sdpa_heads.csv"
ENGINE_DATA = Path(__file__).parent / "data" / "aic_context_attention.csv"
# cuDNN 9.10.2 on B200 (NVIDIA/cudnn-frontend@f937055): the `cudnn-9.10` kernel's constants (efficiency.yaml
# attention_cudnn910_*), fitted on its 8K-32K causal rows (the shorter ones are timed through PyTorch's SDPA call, whose
# fixed cost swamps the kernel's)
RELEASE_DATA = Path(__file__).parent / "data" / "cudnn_sdpa_b200_9_10.csv"
RELEASE_FIT = (8192, 32768)
ENGINES = ("trtllm", "vllm", "sglang")
CHIPS = {"gb200": "gb200-nvl72", "gb300": "gb300-nvl72", "h200": "h200"}
FIT_MAX_SEQ = 16384
BWD_FLOPS_RATIO = 2.5  # the tables count the backward as 2.5 forwards (their tflops column), as meshplan does


def load_rows(path: Path = DATA) -> list[dict]:
    with path.open() as fh:
        lines = [ln for ln in fh if not ln.startswith("#")]
    rows = []
    for r in csv.DictReader(lines):
        rows.append(dict(system=r["system"], causal=r["mask"] == "top_left", batch=int(r["batch"]),
                         seq=int(r["seq_len"]), heads=int(r["q_heads"]), head_dim=int(r["head_dim"]),
                         direction=r["pass"], time_s=float(r["time_ms"]) * 1e-3))
    return rows


def counted_flops(r: dict) -> float:
    """The FLOPs the tables (and meshplan) count: 4·b·h·S·keys·d, keys = S/2 causal, S unmasked, the window where
    there is one; x2.5 backward."""
    keys = r.get("window") or (r["seq"] / 2 if r["causal"] else r["seq"])
    f = 4.0 * r["batch"] * r["heads"] * r["seq"] * keys * r["head_dim"]
    return f * (BWD_FLOPS_RATIO if r["direction"] == "bwd" else 1.0)


def tiles(r: dict) -> tuple[float, float]:
    """(V, Q): (query tile, key tile) pairs visited and query tiles, over every batch-head."""
    n, bh = r["seq"] / ATTENTION_TILE, r["batch"] * r["heads"]
    return bh * (n * (n + 1) / 2 if r["causal"] else n * n), bh * n


def fit_tiles(rows: list[dict], system: str, direction: str, max_seq: int = FIT_MAX_SEQ,
              chip: str | None = None) -> dict:
    """k = a/c of time = c·V + a·Q over the system's rows up to `max_seq` (least squares of the relative error),
    and the measured fraction of peak (of `chip`, default CHIPS[system]) of the causal 8,192-token row."""
    sel = [r for r in rows if r["system"] == system and r["direction"] == direction and r["seq"] <= max_seq]
    a_mat = np.array([[*tiles(r)] for r in sel]) / np.array([[r["time_s"]] for r in sel])
    (c, a), *_ = np.linalg.lstsq(a_mat, np.ones(len(sel)), rcond=None)
    peak = load_chip(chip or CHIPS[system]).peak("bf16")
    anchor = next(r for r in sel if r["causal"] and r["seq"] == 8192)
    return dict(k=a / c, anchor_fraction=counted_flops(anchor) / anchor["time_s"] / peak, n=len(sel),
                worst=max(abs((c * tiles(r)[0] + a * tiles(r)[1]) / r["time_s"] - 1) for r in sel))


def load_release_rows(path: Path = RELEASE_DATA) -> list[dict]:
    """The cuDNN 9.10.2 B200 table as load_rows' rows (system 'b200', causal, both passes)."""
    with path.open() as fh:
        table = list(csv.DictReader(line for line in fh if not line.startswith("#")))
    return [dict(system="b200", causal=True, batch=int(r["batch_size"]), seq=int(r["q_seqlen"]),
                 heads=int(r["num_q_heads"]), head_dim=int(r["head_dim"]), direction=d,
                 time_s=float(r[col]) * 1e-3)
            for r in table for d, col in (("fwd", "forward_time"), ("bwd", "backward_time"))]


def fit_release(rows: list[dict], direction: str) -> dict:
    """fit_tiles over the release table's batch-1 rows in RELEASE_FIT (k and the 8K causal fraction of B200's peak)."""
    lo, hi = RELEASE_FIT
    sel = [r for r in rows if lo <= r["seq"] <= hi and r["batch"] == 1]
    return fit_tiles(sel, "b200", direction, max_seq=hi, chip="b200")


def release_predicted_s(r: dict) -> float:
    """meshplan's time for a release-table row under the `cudnn-9.10` kernel."""
    chip = load_chip("b200")
    eff = default_efficiency(chip)
    fwd_field, bwd_field = ATTENTION_KERNEL_FRACTIONS["cudnn-9.10"]
    frac = getattr(eff, fwd_field if r["direction"] == "fwd" else bwd_field)
    factor = attention_tile_factor(eff, r["direction"], r["seq"] / 2, 0.5, kernel="cudnn-9.10")
    return counted_flops(r) / (chip.peak("bf16") * frac) * factor


def load_engine_rows(path: Path = ENGINE_DATA) -> list[dict]:
    with path.open() as fh:
        return [dict(engine=r["engine"], chip=r["chip"], batch=int(r["batch"]), seq=int(r["isl"]), heads=int(r["heads"]),
                     time_s=float(r["latency_ms"]) * 1e-3)
                for r in csv.DictReader(line for line in fh if not line.startswith("#"))]


def fit_engine_context(rows: list[dict], engine: str, chip_name: str, head_dim: int = 128) -> dict:
    """time = t0 + c·V + a·Q over the engine's causal prompt-attention rows on the chip (least squares of the relative error):
    fixed_s = t0, tile_k = a/c, and the fraction of the bf16 peak at the 8K causal anchor, r / anchor_tile_factor(k)
    with r = 4·head_dim·B² / (c·peak) the rate per visited tile; with its median and 90th-percentile |error|."""
    sel = [r for r in rows if r["engine"] == engine and r["chip"] == chip_name]
    terms = []
    for r in sel:
        n, bh = r["seq"] / ATTENTION_TILE, r["batch"] * r["heads"]
        terms.append((1.0, bh * n * (n + 1) / 2, bh * n))
    a_mat = np.array(terms) / np.array([[r["time_s"]] for r in sel])
    (t0, c, a), *_ = np.linalg.lstsq(a_mat, np.ones(len(sel)), rcond=None)
    k = a / c
    rate = 4.0 * head_dim * ATTENTION_TILE**2 / (c * load_chip(chip_name).peak("bf16"))
    errs = np.abs(np.array([(t0 + c * v + a * q) / r["time_s"] - 1 for (_, v, q), r in zip(terms, sel, strict=True)]))
    return dict(fixed_s=t0, tile_k=k, fraction=rate / anchor_tile_factor(k), n=len(sel),
                median=float(np.median(errs)), p90=float(np.percentile(errs, 90)))


def predicted_s(r: dict, width_rule: bool = True) -> float:
    """meshplan's time for the row: counted FLOPs at the chip's attention fraction, times its tile factor (for a
    head-width row, `width_rule` False scales the forward's fixed work per query tile with the width, as before)."""
    chip = load_chip(CHIPS[r["system"]])
    eff = default_efficiency(chip)
    frac = eff.attention_fwd_fraction if r["direction"] == "fwd" else eff.attention_bwd_fraction
    width = r.get("width", 2.0 * r["head_dim"])
    if r.get("window"):
        keys, diag = r["window"], 1.0
    else:
        keys, diag = (r["seq"] / 2, 0.5) if r["causal"] else (r["seq"], 0.0)
    factor = attention_tile_factor(eff, r["direction"], keys, diag, width=width if width_rule else 256.0)
    # the training ledger's rate at a head narrower than 128 (efficiency.yaml attention_head_dim_rate): the backward's,
    # and the forward's only under session 34's rule (a chip with a forward tile constant takes the width there now)
    rate = attention_head_dim_rate(chip, width / 2, "fused", r["direction"])
    if width_rule and r["direction"] == "fwd":
        rate = 1.0
    return counted_flops(r) / (chip.peak("bf16") * frac * rate) * factor


def mla_backward_rate(rows: list[dict], system: str | None = None) -> float:
    """cuDNN's backward rate at MLA's head (192 + 128) relative to head dim 128: the median over the 2K-16K rows of
    meshplan's time at rate 1 over the measured time (efficiency.yaml attention_head_dim_rate gb200-nvl72 fused_bwd
    160), on one system or on all Blackwell rows."""
    sel = [r for r in rows if r["width"] == 320 and r["direction"] == "bwd" and r["seq"] <= FIT_MAX_SEQ
           and r["system"] != "h200" and (system is None or r["system"] == system)]
    return float(np.median([predicted_s(r) * attention_head_dim_rate(load_chip(CHIPS[r["system"]]), 160, "fused", "bwd")
                            / r["time_s"] for r in sel]))


def load_head_rows(path: Path = HEADS_DATA) -> list[dict]:
    """The other heads' rows; `head_dim` the mean of d_qk and d_v (the FLOPs are 2·b·h·S·keys·(d_qk + d_v))."""
    with path.open() as fh:
        rows = []
        for r in csv.DictReader(line for line in fh if not line.startswith("#")):
            dq, dv = int(r["head_dim_qk"]), int(r["head_dim_v"])
            rows.append(dict(system=r["system"], model=r["model"], causal=r["mask"] == "top_left",
                             window=int(r["window"]), batch=int(r["batch"]), seq=int(r["seq_len"]),
                             heads=int(r["q_heads"]), head_dim=(dq + dv) / 2, width=float(dq + dv),
                             direction=r["pass"], time_s=float(r["time_ms"]) * 1e-3))
    return rows


def main() -> int:
    rows = load_rows()
    print("| system | pass | rows fitted | k (tile visits per query tile) | worst fit error | 8K causal fraction of peak |")
    print("|---|---|---|---|---|---|")
    for system in CHIPS:
        for direction in ("fwd", "bwd"):
            f = fit_tiles(rows, system, direction)
            print(f"| {system} | {direction} | {f['n']} | {f['k']:.2f} | {f['worst']:.1%} | {f['anchor_fraction']:.3f} |")
    print("\n| system | mask | tokens | pass | measured ms | meshplan ms | error |")
    print("|---|---|---|---|---|---|---|")
    errs = []
    for r in rows:
        p = predicted_s(r)
        errs.append(p / r["time_s"] - 1)
        print(f"| {r['system']} | {'causal' if r['causal'] else 'full'} | {r['seq']} | {r['direction']} | "
              f"{r['time_s'] * 1e3:.3f} | {p * 1e3:.3f} | {errs[-1]:+.1%} |")
    a = np.abs(errs)
    print(f"\nall {len(errs)} rows: median |error| {np.median(a):.1%}, worst {a.max():.1%}, signed median "
          f"{np.median(errs):+.1%}")
    heads = [r for r in load_head_rows() if r["seq"] <= FIT_MAX_SEQ]
    print("\nOther heads (not fitted), 2K-16K tokens: meshplan's signed error by model, median [range]")
    print("| system | model | d_qk + d_v | window | pass | rows | fixed time per query tile (now) | "
          "scaled with the width (s34) |\n|---|---|---|---|---|---|---|---|")
    for system in CHIPS:
        for model in sorted({r["model"] for r in heads if r["system"] == system}):
            for direction in ("fwd", "bwd"):
                sel = [r for r in heads if r["system"] == system and r["model"] == model and r["direction"] == direction]
                if not sel:
                    continue
                cols = []
                for rule in (True, False):
                    e = [predicted_s(r, rule) / r["time_s"] - 1 for r in sel]
                    cols.append(f"{np.median(e):+.1%} [{min(e):+.0%}, {max(e):+.0%}]")
                print(f"| {system} | {model} | {sel[0]['width']:.0f} | {sel[0]['window'] or '-'} | {direction} | "
                      f"{len(sel)} | {cols[0]} | {cols[1]} |")
    print(f"cuDNN backward at MLA's head (192 + 128) over head dim 128's rate: GB200 {mla_backward_rate(heads, 'gb200'):.3f}, "
          f"GB300 {mla_backward_rate(heads, 'gb300'):.3f}, both {mla_backward_rate(heads):.3f} "
          "(efficiency.yaml attention_head_dim_rate: fused_bwd 160 on Blackwell)")
    for direction in ("fwd", "bwd"):
        for rule, name in ((True, "now"), (False, "s34"))[: 2 if direction == "fwd" else 1]:
            e = np.array([predicted_s(r, rule) / r["time_s"] - 1 for r in heads if r["direction"] == direction])
            print(f"{direction} {name}: {len(e)} rows, median |error| {np.median(np.abs(e)):.1%}, signed "
                  f"{np.median(e):+.1%}")
    release = load_release_rows()
    print("\ncuDNN 9.10.2 on B200 (the `cudnn-9.10` kernel; fitted on the 8K-32K rows, the others not):")
    for direction in ("fwd", "bwd"):
        f = fit_release(release, direction)
        print(f"  {direction}: k {f['k']:.2f}, 8K causal fraction {f['anchor_fraction']:.3f}, worst fit error {f['worst']:.1%}")
    print("| batch | tokens | pass | measured ms | meshplan ms (cudnn-9.10) | error |\n|---|---|---|---|---|---|")
    for r in release:
        if r["seq"] >= 8192:
            p = release_predicted_s(r)
            print(f"| {r['batch']} | {r['seq']} | {r['direction']} | {r['time_s'] * 1e3:.3f} | {p * 1e3:.3f} | "
                  f"{p / r['time_s'] - 1:+.1%} |")
    engine = load_engine_rows()
    print("\n| engine prompt attention | chip | rows | fixed_s | tile_k | fraction at 8K causal | median |error| | "
          "p90 |error| |\n|---|---|---|---|---|---|---|---|")
    for name in ENGINES:
        for chip in ("h100-sxm", "h200"):
            f = fit_engine_context(engine, name, chip)
            print(f"| {name} | {chip} | {f['n']} | {f['fixed_s'] * 1e6:.1f} us | {f['tile_k']:.2f} | {f['fraction']:.3f} | "
                  f"{f['median']:.1%} | {f['p90']:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
