"""Decode attention's KV read at the rate the engine's kernel reaches for its parallel work (issue #14, session 27):
serving.yaml engine_decode_attention_kv_rate, measured on vLLM 0.14.0's FlashAttention decode kernel
(benchmarks/data/aic_vllm_decode_attention.csv, aiconfigurator's H100 / H200 tables).

Checks: the yaml's points are the least-squares slopes of that table (re-derived here, so a point edited by hand or
chosen from a serving row fails); the step's KV term uses them exactly (hand calculation) for vLLM and only where the
rate is below the HBM stream; other engines, MLA, TPUs and wide batches keep the HBM stream."""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from meshplan.cost.efficiency import default_efficiency
from meshplan.infer.config import SERVING_FILE, ServeConfig, decode_attention_kv_rate, kv_heads_per_chip
from meshplan.infer.memory import kv_bytes_per_token_per_chip
from meshplan.infer.step import stage_parts
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

CSV = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "aic_vllm_decode_attention.csv"
HEAD_DIM, KV_BYTES = 128, 2  # the table's rows: head_dim 128, bf16 K and V
VLLM = "vllm@0.14"  # the release preset that carries the measured kernel


def _table_slopes() -> dict[str, list[tuple[int, float]]]:
    """Per chip and units (batch x kv_heads), the least-squares rate of time against KV bytes over 1024 <= ctx."""
    groups: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    with CSV.open() as f:
        for r in csv.DictReader(line for line in f if not line.startswith("#")):
            b, k, ctx = int(r["batch"]), int(r["kv_heads"]), int(r["ctx"])
            if ctx >= 1024:
                groups[(r["chip"], b * k)].append((b * k * ctx * HEAD_DIM * 2 * KV_BYTES, float(r["time_us"]) * 1e-6))
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for (chip, units), pts in sorted(groups.items()):
        if len(pts) < 3:
            continue
        x = np.array(pts)
        (_, slope), *_ = np.linalg.lstsq(np.vstack([np.ones(len(x)), x[:, 0]]).T, x[:, 1], rcond=None)
        out[chip].append((units, 1.0 / slope))
    return out


def test_points_are_the_tables_slopes():
    table = yaml.safe_load(SERVING_FILE.read_text())
    assert table["engine_decode_attention_kv_rate"] == {}  # no preset: the kernel measured is vLLM 0.14.0's
    entry = table["engine_releases"]["vllm@0.14"]["engine_decode_attention_kv_rate"]
    slopes = _table_slopes()
    assert set(entry) == set(slopes) == {"h100-sxm", "h200"}
    for chip, pts in slopes.items():
        got = entry[chip]["points"]
        assert [u for u, _ in got] == [u for u, _ in pts]
        for (_, want), (_, have) in zip(pts, got, strict=True):
            assert have == pytest.approx(want, rel=5e-3)  # the yaml keeps three significant figures


def test_rates_stay_below_hbm_peak_and_rise_with_units():
    for chip_name in ("h100-sxm", "h200"):
        chip = load_chip(chip_name)
        cfg = ServeConfig(engine=VLLM)
        rates = [decode_attention_kv_rate(cfg, chip, u) for u in (1, 4, 32, 64, 128, 512)]
        assert all(r < chip.hbm_bandwidth_bytes_per_s for r in rates)
        assert rates[0] < rates[2] < rates[3] < rates[4] <= rates[5]


def test_interpolation_is_linear_in_log2_units():
    chip, cfg = load_chip("h100-sxm"), ServeConfig(engine=VLLM)
    r16, r32 = decode_attention_kv_rate(cfg, chip, 16), decode_attention_kv_rate(cfg, chip, 32)
    mid = decode_attention_kv_rate(cfg, chip, 16 * math.sqrt(2))
    assert mid == pytest.approx((r16 + r32) / 2)
    assert decode_attention_kv_rate(cfg, chip, 0.25) == decode_attention_kv_rate(cfg, chip, 1)
    assert decode_attention_kv_rate(cfg, chip, 513) is None  # beyond the measurement: the HBM stream
    assert decode_attention_kv_rate(ServeConfig(engine="sglang"), chip, 4) is None
    assert decode_attention_kv_rate(cfg, load_chip("a100-80gb"), 4) is None


@pytest.mark.parametrize(("tp", "seqs", "ctx"), [(8, 4, 8192), (4, 8, 2048), (2, 4, 1024)])
def test_step_reads_the_decodes_kv_at_the_kernel_rate(tp, seqs, ctx):
    """Llama 3.1 70B on H100: 8 KV heads over tp chips; by hand, KV bytes / rate(seqs x 8/tp) for vLLM, KV bytes /
    (peak x hbm_fraction) for SGLang, the rest of the step unchanged."""
    m, chip, eff = load_model("llama3.1-70b"), load_chip("h100-sxm"), default_efficiency(load_chip("h100-sxm"))
    vllm = ServeConfig(tp=tp, engine=VLLM)
    cur = replace(vllm, engine="vllm")
    kv = kv_bytes_per_token_per_chip(m, vllm) * seqs * ctx
    rate = decode_attention_kv_rate(vllm, chip, seqs * 8 / tp)
    W = chip.hbm_bandwidth_bytes_per_s * eff.hbm_fraction
    assert rate < W
    a, b = stage_parts(m, chip, vllm, eff, seqs, ctx, 0, 0), stage_parts(m, chip, cur, eff, seqs, ctx, 0, 0)
    assert a["kv_cache"] == pytest.approx(kv / rate)
    assert b["kv_cache"] == pytest.approx(kv / W)
    assert a["weights"] == b["weights"] and a["kernel_overhead"] == b["kernel_overhead"]


def test_measured_kernel_time_is_met():
    """The step's KV term plus the table's own fixed part (the intercept of the same fit, which the step leaves to its
    kernel overheads) lands within 10% of each measured long-context row on H100 (units 1-64, ctx 4096-16384)."""
    m, chip = load_model("llama3.1-70b"), load_chip("h100-sxm")
    eff = default_efficiency(chip)
    rows = []
    with CSV.open() as f:
        for r in csv.DictReader(line for line in f if not line.startswith("#")):
            if r["chip"] == "h100-sxm" and 4096 <= int(r["ctx"]) and int(r["batch"]) * int(r["kv_heads"]) <= 64:
                rows.append(r)
    assert len(rows) > 20
    errs = []
    for r in rows:
        b, k, ctx = int(r["batch"]), int(r["kv_heads"]), int(r["ctx"])
        tp = m.n_kv_heads // k
        cfg = ServeConfig(tp=tp, engine=VLLM)
        t_kv = stage_parts(m, chip, cfg, eff, b, ctx, 0, 0)["kv_cache"] / m.n_layers
        assert kv_heads_per_chip(m, tp) == k
        errs.append((t_kv + 12e-6) / (float(r["time_us"]) * 1e-6) - 1.0)
    assert abs(float(np.median(errs))) < 0.10


def test_mla_tpu_and_other_engines_keep_the_hbm_stream():
    eff_gpu = default_efficiency(load_chip("h100-sxm"))
    ds = load_model("deepseek-v3")
    cfg = ServeConfig(tp=8, engine=VLLM, weight_dtype="fp8")
    chip = load_chip("h100-sxm")
    a = stage_parts(ds, chip, cfg, eff_gpu, 4, 4096, 0, 0)
    W = chip.hbm_bandwidth_bytes_per_s * eff_gpu.hbm_fraction
    assert a["kv_cache"] == pytest.approx(kv_bytes_per_token_per_chip(ds, cfg) * 4 * 4096 / W)
    tpu = load_chip("tpu-v6e")
    m = load_model("llama3.1-8b")
    assert decode_attention_kv_rate(ServeConfig(engine=VLLM), tpu, 4) is None
    for engine in ("default", "vllm", "trtllm", "lmdeploy", "sglang"):
        assert decode_attention_kv_rate(ServeConfig(engine=engine), chip, 4) is None
    # a wide batch (512 units and more) is past the measurement: unchanged
    wide = stage_parts(m, chip, ServeConfig(engine=VLLM), eff_gpu, 128, 2048, 0, 0)
    ref = stage_parts(m, chip, ServeConfig(engine="sglang"), eff_gpu, 128, 2048, 0, 0)
    assert wide["kv_cache"] == pytest.approx(ref["kv_cache"])
