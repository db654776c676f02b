"""meshplan's kernel-level terms against NVIDIA's measured kernel tables (aiconfigurator's database).

    python benchmarks/kernel_check.py [--json]

Tables from ai-dynamo/aiconfigurator@095f58a51 (data/aic_*.csv, each with its source and method in its header), each
compared with the meshplan term that times the same operation, unchanged:

  nccl-tests on 2/4/8 H100 SXM (all_gather, reduce_scatter, all_reduce; 64 KiB - 512 MiB)
      cost.collectives.group_collective on an h100-sxm node: the collectives model training and serving share
  vLLM 0.14's custom all-reduce in a CUDA graph (TP 2/4/8, up to 8 MiB)
      infer.step._allreduce_s for a vLLM layout: the serving step's TP all-reduce
  vLLM 0.14's bf16 GEMMs at decode batches (m <= 256, weights >= 64 MiB)
      the serving step's GEMM term (gemm_check.predictions "serving": max of the weight read and the matmul, plus
      one kernel overhead)
  TensorRT-LLM 1.2's dense GEMM op (PyTorch flow, bf16 / per-tensor fp8 / block fp8) on H100 and H200, m 1-4096
      the serving step's GEMM term in that format (max of the weight read and the matmul, plus one kernel overhead),
      and the table's own description at decode rows (m <= 64): time = fixed + weight bytes / (fraction x HBM peak)
  vLLM 0.14's fused_moe and TensorRT-LLM 1.2's CUTLASS MoE layers (bf16 / fp8 / fp8_block, 11 expert shapes)
      the rate the serving step streams touched experts at (efficiency.hbm_fraction of the HBM peak)
  TensorRT-LLM 1.2's MoE layers on H100 and H200 and vLLM 0.14 / 0.24 FusedMoE layers on H100, H200 and A100, at
  1,024-16,384 tokens (bf16 / fp8 / fp8_block / mxfp4, the expert shapes of the presets)
      the serving step's MoE terms for one layer: infer.step.routed_expert_gemm_s, the moe_permute traffic and the
      routing kernels' overheads, at the generic rate and on the engine's measured curve; and the curves themselves
      (engine_kernel_fits: how serving.yaml engine_grouped_matmul_peak_fraction is read from these tables)

Nothing here is fed back into meshplan: it reports. Error = predicted / measured - 1 (positive: meshplan slower).
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import statistics
import sys
from pathlib import Path

import numpy as np
from gemm_check import predictions, serving_gemm_s

from meshplan.cost.collectives import group_collective
from meshplan.cost.topology import make_cluster
from meshplan.infer.config import ServeConfig
from meshplan.infer.memory import moe_layer_share
from meshplan.infer.step import _allreduce_s, moe_permute_bytes, routed_expert_gemm_s, rows_per_touched_expert
from meshplan.math.transformer import expert_params, touched_experts
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

DATA = Path(__file__).parent / "data"
CHIP = "h100-sxm"
OPS = {"all_gather": "allgather", "reduce_scatter": "reducescatter", "all_reduce": "allreduce"}
MIB = 2**20


def _rows(name: str) -> list[dict]:
    with (DATA / name).open() as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def _bin(nbytes: float, edges: tuple[float, ...]) -> str:
    lo = max((e for e in edges if e <= nbytes), default=edges[0])
    hi = min((e for e in edges if e > nbytes), default=None)
    def fmt(b: float) -> str:
        return f"{b / MIB:g} MiB" if b >= MIB else f"{b / 1024:g} KiB"

    return f"{fmt(lo)} - {fmt(hi) if hi else '...'}"


def _stats(errs: list[float]) -> dict:
    return {"n": len(errs), "signed_median": statistics.median(errs), "median_abs": statistics.median(abs(e) for e in errs)}


def nccl(chip) -> dict:
    """group_collective vs nccl-tests, by op, GPUs and message size."""
    out: dict[str, dict] = {}
    edges = (64 * 1024, MIB, 16 * MIB, 128 * MIB)
    groups: dict[tuple, list[float]] = {}
    for r in _rows("aic_h100_nccl_tests.csv"):
        g, b = int(r["gpus"]), float(r["bytes"])
        pred = group_collective(OPS[r["op"]], b, make_cluster(chip, g), g).time_s
        groups.setdefault((r["op"], g, _bin(b, edges)), []).append(pred / (float(r["time_us"]) * 1e-6) - 1.0)
    for (op, g, b), errs in groups.items():  # inserted in the file's order: op, GPUs, size
        out[f"{op} x{g} {b}"] = _stats(errs)
    return out


def custom_allreduce(chip) -> dict:
    """The serving step's TP all-reduce (vLLM layout) vs vLLM's custom all-reduce in a CUDA graph."""
    out: dict[str, dict] = {}
    edges = (256.0, 64 * 1024, MIB)
    groups: dict[tuple, list[float]] = {}
    cfg = ServeConfig(engine="vllm")
    for r in _rows("aic_h100_vllm_custom_allreduce.csv"):
        g, b = int(r["gpus"]), float(r["bytes"])
        pred = _allreduce_s(chip, cfg, b, g)
        groups.setdefault((g, _bin(b, edges)), []).append(pred / (float(r["time_us"]) * 1e-6) - 1.0)
    for (g, b), errs in groups.items():  # the file's order: GPUs, size
        out[f"tp{g} {b}"] = _stats(errs)
    return out


def decode_gemm(chip) -> dict:
    """The serving step's GEMM term vs vLLM's bf16 GEMMs at decode batches, by m."""
    rows = [(1, int(r["m"]), int(r["n"]), int(r["k"]), float(r["time_us"]) * 1e-6)
            for r in _rows("aic_h100_vllm_decode_gemm_bf16.csv")]
    pred = predictions(rows, chip)["serving"]
    groups: dict[str, list[float]] = {}
    for (_, m, _, _, t), p in zip(rows, pred, strict=True):
        label = "m = 1" if m == 1 else "m 2-32" if m <= 32 else "m 48-128" if m <= 128 else "m 160-256"
        groups.setdefault(label, []).append(float(p) / t - 1.0)
    order = ("m = 1", "m 2-32", "m 48-128", "m 160-256")
    return {k: _stats(groups[k]) for k in order if k in groups}


MOE_BYTES = {"bfloat16": 2.0, "fp8": 1.0, "fp8_block": 1.0, "w4a16_mxfp4": 4.25 / 8}
# a table's format name -> (the layout's weight_dtype, config.expert_gemm_format's name for the kernel's format)
MOE_FORMATS = {"bfloat16": ("bf16", "bf16"), "fp8": ("fp8", "fp8"), "fp8_block": ("fp8", "fp8_block"),
               "w4a16_mxfp4": ("mxfp4", "mxfp4")}
MOE_BINS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)  # upper edges of the rows-per-touched-expert bins


def _moe_fixed_s(chip, eff, tokens: float, d_model: int, k: int) -> float:
    """The serving step's terms of one MoE layer besides its expert GEMMs: the permute traffic (step.py's moe_permute
    term, bf16 activations) and the kernel overheads of the routing kernels and of the gate/up, activation and down
    kernels."""
    from meshplan.infer.config import serving_constant

    permute = moe_permute_bytes(tokens, d_model, k, 2.0) / (chip.hbm_bandwidth_bytes_per_s * eff.hbm_fraction)
    return permute + (serving_constant("moe_routing_kernels_per_layer", chip) + 3) * eff.kernel_overhead_s


def moe_layer_rows(chip) -> list[dict]:
    """Each measured MoE layer with its rows per touched expert, its touched expert bytes on one GPU and the expert
    streaming rate the measurement implies once meshplan's own fixed terms of that layer are taken out (the per-kernel
    overhead of the router, top-k, permute and finalize kernels and of the gate/up, activation and down kernels, and
    the permute traffic: step.py's kernel and moe_permute terms), as a fraction of the HBM peak."""
    from meshplan.cost.efficiency import default_efficiency

    eff = default_efficiency(chip)
    W = chip.hbm_bandwidth_bytes_per_s
    out = []
    for r in _rows("aic_h100_moe_layers.csv"):
        T, k, E = int(r["tokens"]), int(r["topk"]), int(r["experts"])
        h, f = int(r["hidden"]), int(r["inter"])
        # the collector's balanced routing (collector/helper.py balanced_logits): token i picks experts i + j x ceil(E/k)
        # (mod E), so the layer touches min(E, tokens x k) distinct experts, each at tokens x k / touched rows
        touched = min(E, T * k)
        nbytes = touched * 3 * h * f * MOE_BYTES[r["dtype"]] / (int(r["moe_tp"]) * int(r["moe_ep"]))
        t = float(r["time_us"]) * 1e-6 - _moe_fixed_s(chip, eff, T, h, k)
        out.append({"fw": r["fw"], "rows": T * k / touched, "bytes": nbytes, "fraction": nbytes / (t * W) if t > 0
                    else float("inf")})
    return out


def moe_layers(chip) -> dict:
    """The measured MoE layers' expert streaming fraction (moe_layer_rows), by engine and rows per touched expert,
    beside the fraction meshplan's serving step streams touched experts at (efficiency.hbm_fraction)."""
    from meshplan.cost.efficiency import default_efficiency

    hbm = default_efficiency(chip).hbm_fraction
    rows, out, lo = moe_layer_rows(chip), {}, 0.0
    for hi in MOE_BINS:
        for fw in ("vllm", "trtllm", "both"):
            sel = [r["fraction"] for r in rows if lo < r["rows"] <= hi and fw in ("both", r["fw"])]
            out[f"{fw} {lo:g}-{hi:g} rows"] = {"n": len(sel), "measured_fraction": statistics.median(sel),
                                               "model_fraction": hbm}
        lo = hi
    return out


def moe_prefill_predicted_s(r: dict, chip, engine: str = "default") -> float:
    """The serving step's MoE terms for one measured layer (aic_trtllm_moe_prefill.csv, aic_vllm_moe_prefill.csv,
    aic_a100_trtllm_moe.csv):
    the routed-expert GEMMs (step.routed_expert_gemm_s, the preset's expert shape at the row's moe_tp) or, where
    longer, the read of the touched experts' weights at the step's HBM rate (stage_parts' max of the weight read and
    the GEMMs), plus the rest of the layer's terms (_moe_fixed_s, as moe_layer_rows takes them out). The row names the
    preset whose expert shape it measures."""
    from meshplan.cost.efficiency import default_efficiency

    m = load_model(r["model"])
    if (m.d_model, m.d_ff, m.experts_per_token, m.n_experts) != tuple(int(r[k]) for k in ("hidden", "inter", "topk",
                                                                                           "experts")):
        raise ValueError(f"{r['model']}: the row's expert shape is not the preset's")
    eff = default_efficiency(chip)
    weight_dtype, fmt = MOE_FORMATS[r["dtype"]]
    cfg = ServeConfig(tp=int(r["moe_tp"]), weight_dtype=weight_dtype, engine=engine)
    T = float(r["tokens"])
    read = touched_experts(m, T) * expert_params(m) / cfg.tp * MOE_BYTES[r["dtype"]] \
        / (chip.hbm_bandwidth_bytes_per_s * eff.hbm_fraction)
    # routed_expert_gemm_s times the step's mean layer, whose routed experts carry moe_layer_share of a MoE layer's
    # (DeepSeek-V3: 58 MoE layers among 61); a measured row is one MoE layer, whole, in the row's own format
    gemm = routed_expert_gemm_s(m, chip, cfg, eff, T, fmt=fmt) / moe_layer_share(m)
    return max(gemm, read) + _moe_fixed_s(chip, eff, T, m.d_model, m.experts_per_token)


# A measured layer slower by more than this than another of the same preset, format and routing that does at least
# its work per GPU (as many tokens or more, at the same or a smaller moe_tp) is not the kernel's steady behaviour: a
# timed CUDA kernel repeats within a few percent run to run, and neither more tokens nor a wider shard per GPU can take
# less time for the same grouped GEMMs, permute and routing.
DOMINATED_TOLERANCE = 0.10


def dominated_rows(rows: list[dict]) -> list[dict]:
    """The rows of a MoE layer table (model, dtype, distribution, tokens, moe_tp, time_us) that another row of the
    same model, dtype and routing beats by more than DOMINATED_TOLERANCE while doing at least their work per GPU:
    tokens >= theirs and moe_tp <= theirs (each GPU runs every expert at 1/moe_tp of its intermediate columns)."""
    def key(r: dict) -> tuple:
        return r.get("chip"), r["model"], r["dtype"], r["distribution"]

    def work(r: dict) -> tuple[int, int, float]:
        return int(r["tokens"]), int(r["moe_tp"]), float(r["time_us"])

    # compared only within a chip, preset, format and routing: each row's work read once, not once per pair
    groups: dict[tuple, list[tuple[int, int, float, dict]]] = {}
    for r in rows:
        groups.setdefault(key(r), []).append((*work(r), r))
    out = []
    for r in rows:
        tokens, tp, t = work(r)
        if any(q is not r and tq >= tokens and tpq <= tp and time_q * (1 + DOMINATED_TOLERANCE) < t
               for tq, tpq, time_q, q in groups[key(r)]):
            out.append(r)
    return out


def moe_prefill_rows() -> list[dict]:
    """The H100 layers of TensorRT-LLM 1.2's table (aic_trtllm_moe_prefill.csv) that session 28 compared with the
    generic rate: bf16 and per-tensor fp8, moe_tp 1-8, the expert shapes of mixtral-8x7b, mixtral-8x22b,
    qwen3-30b-a3b, qwen3-235b-a22b and deepseek-v3."""
    return [r for r in _rows("aic_trtllm_moe_prefill.csv") if r["chip"] == CHIP and r["dtype"] in ("bfloat16", "fp8")
            and int(r["moe_tp"]) <= 8]


def moe_prefill(chip) -> dict:
    """Error of the step's MoE terms at the generic rate (no engine curve) against TensorRT-LLM 1.2's measured layers
    at prefill token counts (moe_prefill_rows), by preset, format and routing; the rows `dominated_rows` screens out
    are counted apart ("screened out"), not compared."""
    rows = moe_prefill_rows()
    screened = dominated_rows(rows)
    screened_ids = {id(r) for r in screened}
    groups: dict[str, list[float]] = {}
    for r in rows:
        if id(r) in screened_ids:
            continue
        label = f"{r['model']} {r['dtype']} {r['distribution']}"
        groups.setdefault(label, []).append(moe_prefill_predicted_s(r, chip) / (float(r["time_us"]) * 1e-6) - 1.0)
    out = {k: _stats(v) for k, v in sorted(groups.items())}
    counts: dict[str, int] = {}
    for r in screened:
        label = f"{r['model']} moe_tp {r['moe_tp']}"
        counts[label] = counts.get(label, 0) + 1
    out["screened out"] = {"n": len(screened), "rows": dict(sorted(counts.items()))}
    return out


A100_ROW_BINS = ((0.0, 64.0), (64.0, 512.0), (512.0, 2048.0), (2048.0, float("inf")))


def _with_expert_rows(name: str) -> list[dict]:
    """A MoE layer table's rows, each with the rows its touched experts run (step.rows_per_touched_expert)."""
    out, models = [], {}
    for r in _rows(name):
        m = models.setdefault(r["model"], load_model(r["model"]))
        out.append({**r, "rows": rows_per_touched_expert(m, float(r["tokens"]))})
    return out


def a100_moe_rows() -> list[dict]:
    """aic_a100_trtllm_moe.csv's layers with their rows per touched expert."""
    return _with_expert_rows("aic_a100_trtllm_moe.csv")


def a100_moe(chip) -> dict:
    """The step's MoE terms on A100 against TensorRT-LLM 1.0's measured layers (every token count, power-law
    routing), by rows per touched expert (below ~64 rows the layer is bound by its weight read)."""
    groups: dict[str, list[float]] = {}
    for r in a100_moe_rows():
        lo, hi = next(b for b in A100_ROW_BINS if b[0] <= r["rows"] < b[1])
        label = f"{lo:g}-{hi:g} rows" if hi < float("inf") else f"{lo:g}+ rows"
        groups.setdefault(label, []).append(moe_prefill_predicted_s(r, chip) / (float(r["time_us"]) * 1e-6) - 1.0)
    return {k: _stats(v) for k, v in groups.items()}


# The engines' MoE tables: each table's release -> the engine preset that stands for it (serving.yaml
# engine_grouped_matmul_peak_fraction and engine_releases), by the CSV's release column; the routing the curves are read
# under (aiconfigurator's skewed default, as real routers are), and the grids of rows_half and half_dim
ENGINE_TABLES = {"vllm": ("aic_vllm_moe_prefill.csv", {"0.14.0": "vllm@0.14", "0.24.0": "vllm"}),
                 "trtllm": ("aic_trtllm_moe_prefill.csv", {"1.2.0rc5": "trtllm"})}
KERNEL_CURVE_ROUTING = "power_law_1.01"
ROWS_HALF_GRID = np.arange(0, 513)
HALF_DIM_GRID = np.arange(0, 4097, 16)


def vllm_moe_rows() -> list[dict]:
    """aic_vllm_moe_prefill.csv's layers with their rows per touched expert."""
    return _with_expert_rows(ENGINE_TABLES["vllm"][0])


def trtllm_moe_rows() -> list[dict]:
    """aic_trtllm_moe_prefill.csv's layers (TensorRT-LLM 1.2's PyTorch-flow MoE on H100 and H200) with their rows per
    touched expert."""
    return _with_expert_rows(ENGINE_TABLES["trtllm"][0])


def engine_moe_rows(engine: str) -> list[dict]:
    """An engine's MoE table (ENGINE_TABLES) with each row's engine preset under `preset`, less the rows
    `dominated_rows` screens out of each release and chip."""
    name, releases = ENGINE_TABLES[engine]
    rows = _with_expert_rows(name)
    out = []
    for release in releases:
        for chip in sorted({r["chip"] for r in rows}):
            group = [r for r in rows if r[engine] == release and r["chip"] == chip]
            screened = {id(r) for r in dominated_rows(group)}
            out += [{**r, "preset": releases[release]} for r in group if id(r) not in screened]
    return out


def format_fraction_implied(r: dict, chip, half_dim: float | None = None) -> float:
    """The fraction of its format's peak one measured layer implies: its expert FLOPs over its time less the step's own
    fixed MoE terms (_moe_fixed_s), over the format's peak (the FP8 peak for fp8 and fp8_block, the bf16 peak for bf16
    and for MXFP4 experts, which Hopper dequantizes to bf16 math) times the thin-dimension penalty d / (d + half_dim)
    of the expert's narrower weight dimension d (default half_dim: efficiency.yaml matmul_half_dim; 0: no penalty, the
    raw fraction the engine curves are fitted to). How efficiency.yaml grouped_matmul_peak_fraction a100-80gb is read
    from the A100 table (bf16, its layers of >= 2048 rows per expert)."""
    from meshplan.cost.efficiency import default_efficiency

    m, eff = load_model(r["model"]), default_efficiency(chip)
    T, tp = float(r["tokens"]), int(r["moe_tp"])
    flops = 2 * T * m.experts_per_token * expert_params(m) / tp
    seconds = float(r["time_us"]) * 1e-6 - _moe_fixed_s(chip, eff, T, m.d_model, m.experts_per_token)
    dim = expert_dim(r)
    peak = chip.peak("fp8" if MOE_FORMATS[r["dtype"]][1] in ("fp8", "fp8_block") else "bf16")
    h = eff.matmul_half_dim if half_dim is None else half_dim
    return flops / seconds / (peak * dim / (dim + h))


def expert_dim(r: dict) -> float:
    """The narrower weight dimension of a measured layer's expert problem on one GPU: min(D, F / moe_tp)."""
    m = load_model(r["model"])
    return min(m.d_model, m.d_ff / int(r["moe_tp"]))


def fit_kernel_curve(points: list[tuple[float, float, float]]) -> tuple[float, int, int, float]:
    """(fraction, rows_half, half_dim, median |relative error|) of the curve
    fraction x rows / (rows + rows_half) x dim / (dim + half_dim) through `points` (rows per touched expert, the
    expert's narrower weight dimension, raw implied fraction of the format's peak): rows_half and half_dim the grid
    points (ROWS_HALF_GRID, HALF_DIM_GRID) with the least squared log error, fraction the geometric mean of
    implied x (rows + rows_half) / rows x (dim + half_dim) / dim at them (the least-squares scale in log space)."""
    rows, dims, frac = (np.asarray(c, dtype=float) for c in zip(*points, strict=True))
    by_rows = np.log((rows[:, None] + ROWS_HALF_GRID[None, :]) / rows[:, None])  # points x rows_half
    best = None
    for h in HALF_DIM_GRID:
        logs = (np.log(frac) + np.log((dims + h) / dims))[:, None] + by_rows
        sse = ((logs - logs.mean(axis=0)) ** 2).sum(axis=0)
        i = int(np.argmin(sse))
        if best is None or sse[i] < best[0] - 1e-12:
            best = (float(sse[i]), int(ROWS_HALF_GRID[i]), int(h), float(np.exp(logs[:, i].mean())))
    _, r0, h0, c = best
    model = c * rows / (rows + r0) * dims / (dims + h0)
    return c, r0, h0, float(np.median(np.abs(model / frac - 1.0)))


def engine_kernel_fits(engine: str | None = None) -> dict[tuple[str, str, str], dict]:
    """(engine preset, chip, format) -> the kernel curve (fit_kernel_curve) through the engine table's layers at
    KERNEL_CURVE_ROUTING (the screened rows left out): how serving.yaml engine_grouped_matmul_peak_fraction (fraction,
    rows_half, half_dim) is read from the tables. `engine`: one of ENGINE_TABLES, default every one."""
    groups: dict[tuple[str, str, str], list[tuple[float, float, float]]] = {}
    chips: dict[str, object] = {}
    for eng in ([engine] if engine else ENGINE_TABLES):
        for r in engine_moe_rows(eng):
            if r["distribution"] != KERNEL_CURVE_ROUTING:
                continue
            chip = chips.setdefault(r["chip"], load_chip(r["chip"]))
            key = (r["preset"], r["chip"], MOE_FORMATS[r["dtype"]][1])
            groups.setdefault(key, []).append((r["rows"], expert_dim(r), format_fraction_implied(r, chip, half_dim=0)))
    out = {}
    for k, pts in sorted(groups.items()):
        c, r0, h0, err = fit_kernel_curve(pts)
        out[k] = {"n": len(pts), "fraction": c, "rows_half": r0, "half_dim": h0, "median_abs_error": err}
    return out


def engine_moe(engine: str) -> dict:
    """The step's MoE terms for an engine table's measured layers (each timed as its release's preset and in its own
    format) against the table, by release, chip, format and rows per touched expert; 'default' beside each: the same
    layers timed without the engine's measured curve (the generic rate under the chip's grouped ceiling, as training's
    and the engines without a curve)."""
    groups: dict[str, dict[str, list[float]]] = {}
    chips: dict[str, object] = {}
    for r in engine_moe_rows(engine):
        if r["distribution"] != KERNEL_CURVE_ROUTING:
            continue
        chip = chips.setdefault(r["chip"], load_chip(r["chip"]))
        t = float(r["time_us"]) * 1e-6
        band = "under 64 rows" if r["rows"] < 64 else "64-512 rows" if r["rows"] < 512 else "512+ rows"
        label = f"{engine} {r[engine]} {r['chip']} {MOE_FORMATS[r['dtype']][1]} {band}"
        g = groups.setdefault(label, {"engine": [], "default": []})
        g["engine"].append(moe_prefill_predicted_s(r, chip, r["preset"]) / t - 1.0)
        g["default"].append(moe_prefill_predicted_s(r, chip) / t - 1.0)
    return {k: {**_stats(v["engine"]), "default_signed_median": statistics.median(v["default"])}
            for k, v in sorted(groups.items())}


# TensorRT-LLM's dense GEMM formats in data/aic_trtllm_dense_gemm.csv -> (meshplan's compute dtype, bytes per weight
# and per input element); outputs are bf16 (2 bytes)
DENSE_GEMM_FORMATS = {"bfloat16": ("bf16", 2.0), "fp8": ("fp8", 1.0), "fp8_block": ("fp8", 1.0)}
DENSE_GEMM_M_BINS = ((1, 64, "m 1-64"), (65, 256, "m 128-256"), (257, 1024, "m 512-1024"), (1025, 1 << 30, "m 4096"))
STREAM_FIT_MIN_BYTES = 64 * MIB  # past the 50 MB L2: the weight read is an HBM stream


def trtllm_dense_gemm_rows() -> list[dict]:
    return [{"chip": r["chip"], "dtype": r["dtype"], "m": int(r["m"]), "n": int(r["n"]), "k": int(r["k"]),
             "time_s": float(r["time_us"]) * 1e-6} for r in _rows("aic_trtllm_dense_gemm.csv")]


def dense_gemm_predicted_s(r: dict, chip, eff=None) -> float:
    """The serving step's term for one GEMM in the row's format (gemm_check.serving_gemm_s at the format's compute
    dtype and bytes); `eff` defaults to the chip's."""
    from meshplan.cost.efficiency import default_efficiency

    cdt, b = DENSE_GEMM_FORMATS[r["dtype"]]
    return serving_gemm_s(chip, eff or default_efficiency(chip), 1, r["m"], r["n"], r["k"], cdt, b)


def dense_gemm_stream_fits(rows: list[dict] | None = None) -> dict[tuple[str, str], dict]:
    """The table's own description of its decode rows (m <= 64, weights >= 64 MiB), by chip and format: least squares of
    time = fixed + weight bytes / rate, the rate as a fraction of the chip's HBM peak."""
    rows = trtllm_dense_gemm_rows() if rows is None else rows
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        wbytes = r["n"] * r["k"] * DENSE_GEMM_FORMATS[r["dtype"]][1]
        if r["m"] <= 64 and wbytes >= STREAM_FIT_MIN_BYTES:
            groups.setdefault((r["chip"], r["dtype"]), []).append({**r, "weight_bytes": wbytes})
    out = {}
    for (chip_name, dtype), g in sorted(groups.items()):
        x = np.array([r["weight_bytes"] for r in g])
        y = np.array([r["time_s"] for r in g])
        (slope, fixed), *_ = np.linalg.lstsq(np.stack([x, np.ones_like(x)], axis=1), y, rcond=None)
        out[(chip_name, dtype)] = {"n": len(g), "fixed_us": float(fixed) * 1e6,
                                   "stream_fraction": float(1.0 / slope / load_chip(chip_name).hbm_bandwidth_bytes_per_s)}
    return out


def trtllm_dense_gemm() -> dict:
    """meshplan's serving GEMM term vs TensorRT-LLM 1.2's dense GEMMs, by chip, format and row bin."""
    from meshplan.cost.efficiency import default_efficiency

    chips = {name: load_chip(name) for name in ("h100-sxm", "h200")}
    effs = {name: default_efficiency(chip) for name, chip in chips.items()}
    groups: dict[str, list[float]] = {}
    for r in trtllm_dense_gemm_rows():
        label = next(lab for lo, hi, lab in DENSE_GEMM_M_BINS if lo <= r["m"] <= hi)
        err = dense_gemm_predicted_s(r, chips[r["chip"]], effs[r["chip"]]) / r["time_s"] - 1.0
        groups.setdefault(f"{r['chip']} {r['dtype']} {label}", []).append(err)
    order = [f"{c} {d} {lab}" for c in chips for d in DENSE_GEMM_FORMATS for _, _, lab in DENSE_GEMM_M_BINS]
    return {k: _stats(groups[k]) for k in order if k in groups}


def report() -> dict:
    chip = load_chip(CHIP)
    return {"chip": chip.name, "nccl_tests": nccl(chip), "vllm_custom_allreduce": custom_allreduce(chip),
            "decode_gemm_bf16": decode_gemm(chip), "trtllm_dense_gemm": trtllm_dense_gemm(),
            "trtllm_dense_gemm_stream": {" ".join(k): v for k, v in dense_gemm_stream_fits().items()},
            "moe_layers": moe_layers(chip), "moe_prefill": moe_prefill(chip),
            "a100_moe": a100_moe(load_chip("a100-80gb")),
            **{f"{e}_moe": engine_moe(e) for e in ENGINE_TABLES},
            "engine_kernel_fits": {" ".join(k): v for k, v in engine_kernel_fits().items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = report()
    if args.json:
        json.dump(res, sys.stdout, indent=2)
        print()
        return 0
    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, Python {platform.python_version()}")
    print(f"meshplan's terms on {res['chip']} vs aiconfigurator's measured H100 tables; "
          "error = predicted / measured - 1 (positive: meshplan slower)")
    for title, key in (("nccl-tests (collectives model)", "nccl_tests"),
                       ("vLLM custom all-reduce, CUDA graph (serving step's TP all-reduce)", "vllm_custom_allreduce"),
                       ("vLLM bf16 GEMM at decode batches (serving step's GEMM term)", "decode_gemm_bf16"),
                       ("TensorRT-LLM 1.2 dense GEMMs, PyTorch flow, H100 and H200 (serving step's GEMM term in the "
                        "format)", "trtllm_dense_gemm"),
                       ("TensorRT-LLM 1.2 CUTLASS MoE layers, 1,024-16,384 tokens, moe_tp 1-8 (serving step's MoE "
                        "terms)", "moe_prefill"),
                       ("TensorRT-LLM 1.0 MoE layers on A100-SXM4-80GB, 1-65,536 tokens, moe_tp 1-8, power-law routing "
                        "(serving step's MoE terms, a100-80gb)", "a100_moe")):
        print(f"\n### {title}\n| group | n | signed median | median abs |\n|---|---|---|---|")
        for g, s in res[key].items():
            if "signed_median" in s:
                print(f"| {g} | {s['n']} | {100 * s['signed_median']:+.1f}% | {100 * s['median_abs']:.1f}% |")
        if "screened out" in res[key]:
            sc = res[key]["screened out"]
            print(f"\n{sc['n']} measured layers screened out (slower by more than {DOMINATED_TOLERANCE:.0%} than a layer of "
                  "the same preset, format and routing doing at least their work per GPU): "
                  + ", ".join(f"{k} ({n})" for k, n in sc["rows"].items()))
    print("\n### TensorRT-LLM 1.2 dense GEMMs at decode rows (m <= 64, weights >= 64 MiB): the table's own fit, time = "
          "fixed + weight bytes / (fraction x HBM peak); meshplan: hbm_fraction and one kernel_overhead_s\n"
          "| chip format | n | stream fraction | fixed us |\n|---|---|---|---|")
    for g, s in res["trtllm_dense_gemm_stream"].items():
        print(f"| {g} | {s['n']} | {s['stream_fraction']:.3f} | {s['fixed_us']:.1f} |")
    for engine, title in (("vllm", "vLLM FusedMoE"), ("trtllm", "TensorRT-LLM 1.2 PyTorch-flow MoE")):
        print(f"\n### {title} layers, 1,024-16,384 tokens, power-law routing, each in its own format (serving step's "
              "MoE terms as the release's preset; 'without' = the generic rate instead of the engine's measured curve)")
        print("| group | n | signed median | median abs | without: signed median |\n|---|---|---|---|---|")
        for g, s in res[f"{engine}_moe"].items():
            print(f"| {g} | {s['n']} | {100 * s['signed_median']:+.1f}% | {100 * s['median_abs']:.1f}% | "
                  f"{100 * s['default_signed_median']:+.1f}% |")
    print(f"\n### Engine MoE kernel curves by release, chip and format: fraction x rows / (rows + rows_half) x dim / "
          f"(dim + half_dim) of the format's peak, fitted over every layer at {KERNEL_CURVE_ROUTING} (serving.yaml "
          "engine_grouped_matmul_peak_fraction)\n| preset chip format | n | fraction | rows_half | half_dim | "
          "median abs error |\n|---|---|---|---|---|---|")
    for g, s in res["engine_kernel_fits"].items():
        print(f"| {g} | {s['n']} | {s['fraction']:.3f} | {s['rows_half']} | {s['half_dim']} | "
              f"{100 * s['median_abs_error']:.1f}% |")
    print("\n### MoE layers, vLLM fused_moe and TensorRT-LLM CUTLASS (expert weights streamed, fraction of HBM peak)")
    print("| engine, rows per touched expert | n | measured median | meshplan |\n|---|---|---|---|")
    for g, s in res["moe_layers"].items():
        print(f"| {g} | {s['n']} | {s['measured_fraction']:.2f} | {s['model_fraction']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
