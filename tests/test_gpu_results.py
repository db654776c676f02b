"""The committed GPU measurements (benchmarks/results/gpu_<chip>_*.json, written by benchmarks/gpu/run.py on a
GPU) stay matched by the current model: every case is re-predicted now, with the default efficiencies and with
the profile calibrated in the same run, re-fitted from its stored records by the current fit
(benchmarks/gpu/report.py `repredict`), and the errors must stay inside issue #15's bounds. The measurements are
fixed; the model and the fit must keep matching them.

Where the committed rows do not reach a bound yet, the pair (file, bound) is listed in KNOWN_GAPS with what was
measured and why, and the test is a strict xfail: it fails as soon as the model meets the bound, so that the entry
is taken out."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import report  # noqa: E402  (the suite's modules, not part of the package)

FILES = sorted(p for p in RESULTS.glob("gpu_*.json") if json.loads(p.read_text()).get("mode") == "gpu")
NO_RESULTS = ("no GPU results committed yet (benchmarks/results/gpu_*.json): issue #15 needs a session lent a GPU "
              "to run benchmarks/gpu/run.py and commit its output")

# (file, kind, quantity, efficiencies, statistic) → what the committed rows reach and why (benchmarks/gpu/README.md)
KNOWN_GAPS = {
    ("gpu_h200_2026-12-04.json", "decode", "step_time_s", "calibrated", "median"):
        "the first call's decode loop kept the cache [B, S, K, H] and XLA transposed it every step (fixed in "
        "serve_jax.py; the second call's file holds the fixed loop's rows)",
    ("gpu_h200_2026-12-04_serve.json", "decode", "step_time_s", "calibrated", "median"):
        "heads-major cache: batch 1 steps take 3.2-3.9 ms against a 0.65 ms weight read; not yet explained "
        "(no device time left to profile)",
    ("gpu_h200_2026-12-04_s14.json", "train", "step_time_s", "calibrated", "worst"):
        "1B with full recompute: measured 295.7 ms, 22 ms over no recompute. Session 15's compiled HLO showed XLA "
        "drops the down-projection from the recomputed forward (remat_dce) and the measured gemm-last step showed "
        "a recomputed pointwise op costs nothing under XLA: +18.5% → +11.5% with this run's own profile (+8.5% "
        "with session 15's). The rest (~25 ms for ~27 TFLOP of recomputed GEMMs and attention) is not explained",
    ("gpu_h200_2026-12-04_s14.json", "decode", "step_time_s", "calibrated", "median"):
        "session 15 took the serving engines' 0.5 ms host step (decode_step_overhead_s) out of the suite's decode "
        "prediction: its loop runs 16 steps in one XLA program. That left the calibrated per-kernel cost exposed: "
        "the tiny-kernel slope (0.93 us) against the ~4 us the 1B rows need (the defaults' 4 us: batch 1 × 1k "
        "−1.0%, batch 256 × 4k +2.0%); the copy chain meant to measure it has not yet run past L2 on a GPU",
    ("gpu_h200_2026-12-04_s15.json", "decode", "step_time_s", "calibrated", "median"):
        "the split decode attention (first timed here) slowed the steps that attend 512 or more (sequence, KV "
        "head) rows: 64 × 8k 6.12 → 7.81 ms, 256 × 4k 10.8 → 16.6 ms against session 14's unsplit loop; "
        "serve_jax now splits only below twice the SMs (split_rows_limit), not yet timed; and the calibrated "
        "per-kernel cost (the tiny-kernel slope, 2.0 us; the chain's intercept ran from L2) is below the ~4 us "
        "the 1B rows need once the engine's host step is out of the prediction (as for session 14's file)",
}


def test_known_gaps_name_committed_files() -> None:
    names = {p.name for p in FILES}
    assert {k[0] for k in KNOWN_GAPS} <= names


@pytest.mark.parametrize("path", FILES or [None], ids=[p.name for p in FILES] or ["no-results"])
@pytest.mark.parametrize("bound", report.BOUNDS, ids=[f"{b[0]}-{b[1]}-{b[2]}-{b[3]}" for b in report.BOUNDS])
def test_committed_gpu_cases_stay_within_the_issue_bounds(path: Path | None, bound: tuple, request) -> None:
    if path is None:
        pytest.skip(NO_RESULTS)
    rows = report.repredict(json.loads(path.read_text()), path.parent)["rows"]
    rows = [r for r in rows if "error" not in r["measured"]]
    s = next(x for x in report.summary(rows) if (x["kind"], x["quantity"], x["efficiencies"], x["statistic"])
             == bound[:4])
    if s["value"] is None:
        pytest.skip(f"{path.name} has no {bound[0]} rows with {bound[1]} ({bound[2]} efficiencies)")
    gap = KNOWN_GAPS.get((path.name, *bound[:4]))
    if gap:
        request.applymarker(pytest.mark.xfail(strict=True, reason=gap))
    assert s["met"], (f"{path.name}: {bound[0]} {bound[1]} ({bound[2]}) {bound[3]} |error| {s['value']:.1%} > "
                      f"{bound[4]:.0%}")


def test_the_refit_drops_the_dispatch_bound_gemms_of_the_h200_run() -> None:
    """The H200 run's one-kernel program took 46.2 us; the GEMMs that took less than twice that per program
    (512^3-2048^3 and the 64-256-row thin ones, read off the stored records here) leave the fit, and what remains
    (4096^3, 8192^3 and 512-2048 rows against 8192^2) reaches 66-75% of the bf16 peak, so the refit's peak fraction
    lies in that range, where the run's own fit (every point) put it at 0.69 with a 481-wide half dimension."""
    from meshplan.measure.fit import fit_efficiency
    from meshplan.specs.hardware import load_chip

    path = RESULTS / "profile_h200_2026-12-04.json"
    if not path.exists():
        pytest.skip("no H200 profile committed")
    prof = json.loads(path.read_text())
    recs = prof["benchmarks"]
    one = next(r["time_s"] for r in recs if r["name"] == "program of 1 tiny kernel")
    assert one == pytest.approx(46.2e-6, rel=0.01)
    slow = {r["name"] for r in recs if r["benchmark"] == "matmul" and r["time_s"] < 2 * one}
    assert slow == {"512x512x512", "1024x1024x1024", "2048x2048x2048", "64x8192x8192", "128x8192x8192",
                    "256x8192x8192", "fp8 2048x2048x2048"}
    kept = [r["fraction"] for r in recs if r["benchmark"] == "matmul" and r["name"] not in slow
            and r["dtype"] != "float8_e4m3fn"]
    fitted, curves = fit_efficiency(recs, load_chip("h200"))
    assert set(curves["dispatch_bound"]["matmul"]) == slow
    assert min(kept) <= fitted["matmul_peak_fraction"] <= max(kept) + 0.02
    assert prof["efficiency"]["matmul_half_dim"] > 400  # the run's own fit, dragged by the dispatch-bound points
    assert fitted["matmul_half_dim"] < 100


def _hlo_rows() -> list[tuple[Path, dict, str]]:
    """(tar, row, member) for every committed training row whose compiled HLO is archived beside its results."""
    out = []
    for path in FILES:
        data = json.loads(path.read_text())
        tar = path.parent / path.name.replace("gpu_", "hlo_", 1).replace(".json", ".tar")
        for row in data["rows"]:
            member = row["measured"].get("hlo_member")
            if member and tar.exists():
                out.append((tar, row, member))
    return out


def _hlo_text(tar_path: Path, member: str) -> str:
    import gzip
    import tarfile

    with tarfile.open(tar_path) as tar:
        return gzip.decompress(tar.extractfile(member).read()).decode()


HLO_ROWS = _hlo_rows()


@pytest.mark.parametrize("tar_path,row,member", HLO_ROWS or [(None, None, None)],
                         ids=[m[:60] for _, _, m in HLO_ROWS] or ["no-hlo"])
def test_ledger_matmul_flops_equal_the_gpu_programs_gemms(tar_path, row, member) -> None:
    """The GEMM FLOPs of each measured step as the GPU compiler emitted it (cuBLAS calls and Triton GEMM fusions,
    times their loops' trips: hlo.dot_flops of the archived HLO) equal the ledger's matmul FLOPs for the case,
    recompute included: one ledger, checked against what ran on the chip."""
    if tar_path is None:
        pytest.skip("no compiled HLO archived with the GPU results (benchmarks/results/hlo_*.tar)")
    from predict import predict_train

    from meshplan.cost.efficiency import default_efficiency
    from meshplan.measure.hlo import dot_flops
    from meshplan.specs.hardware import load_chip

    chip = load_chip(json.loads((tar_path.parent / tar_path.name.replace("hlo_", "gpu_", 1)
                                 .replace(".tar", ".json")).read_text())["chip"])
    hlo = dot_flops(_hlo_text(tar_path, member))
    ledger = predict_train(row["case"], chip, default_efficiency(chip))["matmul_flops"]
    assert hlo == pytest.approx(ledger, rel=1e-3)


def test_full_recompute_reruns_the_layer_but_its_down_projection_on_the_h200() -> None:
    """By hand, Llama 3.2 1B (D 2048, 32 query and 8 KV heads of 64, F 8192, 16 layers) at 4 × 4096 tokens: the
    compiled full-recompute step runs the QKV (2048 → 3072), out-projection (2048 → 2048) and gate/up (2048 → 2·8192)
    GEMMs once more per layer, and not the down-projection (8192 → 2048): XLA drops what the backward never reads."""
    rows = {r["case"]["recompute"]: (t, m) for t, r, m in HLO_ROWS
            if r["case"]["model"] == "llama3.2-1b" and r["case"]["framework"] == "jax" and not r["case"]["overrides"]}
    if not {"none", "full"} <= set(rows):
        pytest.skip("no archived 1B none/full HLO")
    from meshplan.measure.hlo import dot_flops

    none, full = (dot_flops(_hlo_text(*rows[k])) for k in ("none", "full"))
    tokens, D, layers = 4 * 4096, 2048, 16
    rerun = 2 * tokens * D * (3072 + 2048 + 2 * 8192) * layers
    assert full - none == pytest.approx(rerun, rel=1e-9)
