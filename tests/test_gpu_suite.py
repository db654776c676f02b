"""The GPU suite (benchmarks/gpu) proven on the CPU before a GPU session spends device time on it: the whole
suite at toy sizes (`--cpu-smoke`), and the pieces whose correctness the timings rest on (the flash-attention
core, mixed precision, the KV-cache decode loop, the layer cut), each against an independent computation."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "gpu"
sys.path.insert(0, str(SUITE))
needs_jax = pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs the jax extra")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_smoke")
    # a generous budget: on a loaded CI machine the parts must not be cut (the toy cases take ~20 s of CPU)
    r = subprocess.run([sys.executable, str(SUITE / "run.py"), "--cpu-smoke", "--out", str(out), "--budget-s", "300"],
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-2000:]
    (results,) = out.glob("gpu_cpu_*.json")
    return {"out": out, "path": results, "data": json.loads(results.read_text()), "stdout": r.stdout}


@pytest.mark.jax
@needs_jax
def test_cpu_smoke_runs_every_part_and_predicts_each_row(smoke) -> None:
    data = smoke["data"]
    assert data["schema"] == "meshplan-gpu-results/1" and data["mode"] == "cpu-smoke"
    assert data["calibration"]["ok"] and (smoke["out"] / data["profile_file"]).exists()
    kinds = {r["case"]["kind"] for r in data["rows"]}
    assert kinds == {"train", "prefill", "decode", "mixed"}
    for r in data["rows"]:
        assert "error" not in r["measured"], r
        assert r["measured"]["step_time_s"] > 0
        for key in ("defaults", "calibrated"):
            pred = r[f"predicted_{key}"]
            # the recorded error is predicted / measured − 1, recomputed here from the row's own numbers
            assert r[f"errors_{key}"]["step_time_s"] == pytest.approx(
                pred["step_time_s"] / r["measured"]["step_time_s"] - 1)
    decode = next(r for r in data["rows"] if r["case"]["kind"] == "decode")
    c = decode["case"]
    # the tiny model's cache: 2 (K and V) × 2 layers × batch 2 × (32 + 3 + 2) positions × 2 KV heads × 16 × 2 B
    assert decode["measured"]["kv_cache_bytes"] == 2 * 2 * 2 * (32 + 3 + 2) * 2 * 16 * 2
    assert decode["errors_defaults"]["kv_cache_bytes"] == pytest.approx(0.0)  # the planner's formula is exact here
    assert c["batch"] == 2 and "| bound (issue #15)" in smoke["stdout"]
    train = next(r for r in data["rows"] if r["case"]["kind"] == "train")
    assert train["case"]["compute_dtype"] == "bf16"  # fp32 master weights, bf16 compute: the GPU path
    # untrained loss: the final RMSNorm gives unit-RMS x, tied embedding rows are N(0, 1/V) (fan-in V = 256), so
    # each logit is N(0, D/V = 64/256 = 0.25) and E[loss] ≈ ln V + σ²/2 = 5.545 + 0.125 = 5.67
    assert train["measured"]["losses"][0] == pytest.approx(5.67, abs=0.1)


@pytest.mark.jax
@needs_jax
def test_results_test_repredicts_a_results_file(smoke) -> None:
    """tests/test_gpu_results.py's re-prediction (report.repredict), run on the smoke file: the same model, and the
    profile re-fitted from its own records, give the same errors as the run recorded."""
    import report

    rows = [r for r in report.repredict(smoke["data"], smoke["path"].parent)["rows"] if "error" not in r["measured"]]
    recorded = [r for r in smoke["data"]["rows"] if "error" not in r["measured"]]
    assert len(rows) == len(recorded) == 4
    for new, old in zip(rows, recorded, strict=True):
        for key in ("errors_defaults", "errors_calibrated"):
            assert new[key] == pytest.approx(old[key])


@pytest.mark.jax
@needs_jax
def test_report_prints_the_markdown_table(smoke) -> None:
    r = subprocess.run([sys.executable, str(SUITE / "report.py"), str(smoke["path"])], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "| case | measured |" in r.stdout and "prefill tiny (smoke) 32 tokens" in r.stdout


@pytest.mark.jax
@needs_jax
def test_dot_product_attention_core_equals_the_materialised_one() -> None:
    """GQA grouping and the causal mask of the flash path agree with the reference model's own einsums."""
    import jax
    import jax.numpy as jnp

    from meshplan.measure import jaxmodel as jm

    kq, kk, kv = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(kq, (2, 24, 8, 16), jnp.float32)  # N = 8 query heads
    k, v = (jax.random.normal(x, (2, 24, 2, 16), jnp.float32) for x in (kk, kv))  # K = 2 KV heads
    pos = jnp.arange(24)
    ref = jm.ATTENTION_CORES["materialized"](q, k, v, pos, pos)
    got = jm.ATTENTION_CORES["dpa"](q, k, v, pos, pos)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-5)


TINY = {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "d_ff": 128, "vocab_size": 256}


@pytest.mark.jax
@needs_jax
def test_decode_steps_reproduce_the_prefill() -> None:
    """The KV-cache loop: decoding 13 tokens one by one from an empty cache ends with the logits that a prefill of
    the same 13 tokens gives at its last position (fp32 on the CPU), and leaves the cache the prefill fills."""
    import jax.numpy as jnp
    import serve_jax as sj

    from meshplan.specs.model import load_model

    m = load_model("llama3.2-1b").with_overrides(**TINY)
    params = sj.init_weights(m, jnp.float32)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 13), dtype=np.int32))
    want, want_cache = sj.make_prefill(m, "materialized", 16)(params, toks)
    decode = sj.make_decode(m)
    cache = [(jnp.zeros_like(k), jnp.zeros_like(v)) for k, v in want_cache]
    for i in range(13):
        got, cache = decode(params, cache, toks[:, i], jnp.int32(i))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(cache[1][0]), np.asarray(want_cache[1][0]), rtol=1e-4, atol=1e-4)


@pytest.mark.jax
@needs_jax
def test_decode_steps_in_one_program_equal_single_steps() -> None:
    """make_decode_steps (n greedy steps in one scan) leaves the cache and the last token that n single-step calls
    give when each step's argmax feeds the next (fp32 on the CPU)."""
    import jax.numpy as jnp
    import serve_jax as sj

    from meshplan.specs.model import load_model

    m = load_model("llama3.2-1b").with_overrides(**TINY)
    params = sj.init_weights(m, jnp.float32)
    tok = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2,), dtype=np.int32))
    one, cache = sj.make_decode(m), sj.random_cache(m, 2, 16, jnp.float32, seed=2)
    want_tok, want_cache = tok, [(k.copy(), v.copy()) for k, v in cache]
    for i in range(5):
        logits, want_cache = one(params, want_cache, want_tok, jnp.int32(7 + i))
        want_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    got_tok, got_cache = sj.make_decode_steps(m, 5)(params, cache, tok, jnp.int32(7))
    np.testing.assert_array_equal(np.asarray(got_tok), np.asarray(want_tok))
    for (gk, gv), (wk, wv) in zip(got_cache, want_cache, strict=True):
        np.testing.assert_allclose(np.asarray(gk), np.asarray(wk), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(gv), np.asarray(wv), rtol=1e-5, atol=1e-5)


def test_a_model_that_does_not_fit_is_cut_and_named() -> None:
    import cases as cs
    from predict import case_model, predict_train

    from meshplan.cost.efficiency import default_efficiency
    from meshplan.errors import InfeasibleError
    from meshplan.specs.hardware import load_chip

    chip = load_chip("h100-sxm")
    big = cs.cut_to_fit(cs.train_case("8b", 4096, 2, "full", "jax", "cudnn", 5), chip)
    m = case_model(big)
    # Llama 3 8B keeps 18 bytes of state per parameter (2 bf16 + 4 fp32 grad + 12 Adam): 8.0e9 × 18 = 144 GB > 80 GB
    assert m.n_layers < 32 and f"cut to {m.n_layers} of 32 layers" in m.name
    budget = cs.FIT_FRACTION * chip.usable_hbm_bytes
    eff = default_efficiency(chip)
    assert predict_train(big, chip, eff)["memory_bytes"] <= budget
    one_more = {**big, "overrides": {**big["overrides"], "n_layers": m.n_layers + 1}}
    try:
        assert predict_train(one_more, chip, eff)["memory_bytes"] > budget
    except InfeasibleError:
        pass  # the planner itself finds it does not fit
    small = cs.train_case("1b", 4096, 4, "none", "jax", "cudnn", 5)
    assert cs.cut_to_fit(small, chip) == small


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch is not installed (not a dependency)")
def test_torch_reference_model_matches_meshplans_parameter_count_and_trains() -> None:
    """The PyTorch model of the suite's torch part (run here on the CPU, uncompiled): meshplan's parameter count,
    and the untrained loss ln V + σ²/2 with each logit N(0, D·(1/D) = 1) (unit-RMS x, embedding std 1/√D):
    ln 256 + 0.5 = 6.05, under each recompute policy."""
    import torch
    import torch_model as tmod
    from predict import case_model

    from meshplan.math.transformer import param_counts

    m = case_model({"model": "llama3.2-1b", "overrides": TINY})
    torch.manual_seed(0)
    toks = torch.randint(0, 256, (2, 65))
    for recompute in ("none", "selective", "full"):
        model = tmod.Decoder(m, recompute)
        assert sum(p.numel() for p in model.parameters()) == param_counts(m).total
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        loss = float(tmod.train_step(model, opt, toks[:, :-1], toks[:, 1:]))
        assert loss == pytest.approx(6.05, abs=0.15)


@pytest.mark.gpu
@needs_jax
def test_cudnn_flash_attention_on_the_gpu_matches_the_materialised_core() -> None:
    """GPU only: cuDNN's kernel in bf16 against the einsum core in fp32 (relative error of bf16 operands)."""
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no NVIDIA GPU (nvidia-smi not found)")
    import jax
    import jax.numpy as jnp

    if jax.default_backend() != "gpu":
        pytest.skip("JAX sees no GPU")
    from meshplan.measure import jaxmodel as jm

    kq, kk, kv = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(kq, (2, 1024, 32, 128), jnp.float32)
    k, v = (jax.random.normal(x, (2, 1024, 8, 128), jnp.float32) for x in (kk, kv))
    pos = jnp.arange(1024)
    ref = np.asarray(jm.ATTENTION_CORES["materialized"](q, k, v, pos, pos))
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    got = np.asarray(jm.ATTENTION_CORES["cudnn"](*bf, pos, pos).astype(jnp.float32))
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


def test_summary_reads_median_and_worst_against_the_issue_bounds() -> None:
    import report

    def row(kind: str, err: float) -> dict:
        return {"case": {"kind": kind, "framework": "jax"}, "measured": {"step_time_s": 1.0},
                "errors_calibrated": {"step_time_s": err}, "errors_defaults": {"step_time_s": 2 * err}}

    rows = [row("train", 0.02), row("train", -0.04), row("train", 0.12), row("decode", -0.07)]
    got = {(s["kind"], s["efficiencies"], s["statistic"]): s for s in report.summary(rows)}
    # train calibrated |errors| 0.02, 0.04, 0.12: median 0.04 <= 5%, worst 0.12 > 10%
    assert got[("train", "calibrated", "median")]["value"] == pytest.approx(0.04)
    assert got[("train", "calibrated", "median")]["met"] is True
    assert got[("train", "calibrated", "worst")]["value"] == pytest.approx(0.12)
    assert got[("train", "calibrated", "worst")]["met"] is False
    assert got[("train", "defaults", "median")]["value"] == pytest.approx(0.08)  # twice the calibrated errors
    assert got[("decode", "calibrated", "median")]["met"] is True  # 7% <= 8%
    assert got[("prefill", "calibrated", "median")]["value"] is None  # no prefill rows


def test_fit_reads_sdpa_into_its_own_fields_and_leaves_the_head_shape_sweep_out() -> None:
    """Synthetic records: cuDNN attention at 0.60 forward / 0.50 backward, SDPA at 0.30 / 0.25, and a head-shape
    sweep record at 0.10 that must not pull the attention fit down."""
    from meshplan.measure.fit import build_profile
    from meshplan.specs.hardware import load_chip

    chip = load_chip("h100-sxm")
    peak = chip.peak("bf16")
    ratio = 2.5  # efficiency.yaml attention_bwd_flops_ratio (FlashAttention-2 §3.1.2)

    def pair(bench: str, T: int, fwd: float, bwd: float, **tags) -> list[dict]:
        work = 4.0 * 16384 * (T / 2) * 16 * 128
        t_f, t_b = work / (fwd * peak), ratio * work / (bwd * peak)
        return [{"benchmark": bench, "name": f"fwd T={T}", "seq": T, "impl": bench, "work": work, "fraction": fwd,
                 **tags},
                {"benchmark": bench, "name": f"fwd+bwd T={T}", "seq": T, "impl": bench, "work": work,
                 "bwd_time_s": t_b, "time_s": t_f + t_b, **tags}]

    recs = [r for T in (8192, 16384) for r in pair("attention", T, 0.60, 0.50) + pair("sdpa", T, 0.30, 0.25)]
    recs += pair("attention", 16384, 0.10, 0.10, sweep="head_shape")
    eff = build_profile(chip, recs, {"platform": "gpu", "device_kind": "NVIDIA H100 80GB HBM3"})["efficiency"]
    assert eff["attention_fwd_fraction"] == pytest.approx(0.60)
    assert eff["attention_bwd_fraction"] == pytest.approx(0.50)
    assert eff["attention_sdpa_fwd_fraction"] == pytest.approx(0.30)
    assert eff["attention_sdpa_bwd_fraction"] == pytest.approx(0.25)


def test_experts_report_sets_meshplans_gemm_time_beside_the_measured_one() -> None:
    """experts.py --report runs without PyTorch; its meshplan column for the 8192^3 dense GEMM on the H200 is
    2·8192³ / (989e12 × 0.75 × 8192/(8192 + 256)) + 4 us = 1533 us (efficiency.yaml's GPU defaults: peak fraction
    0.75, half dimension 256, 4 us per launch), beside the 1394 us measured there with bf16 cuBLAS."""
    path = ROOT / "benchmarks" / "results" / "experts_h200_2026-12-04.json"
    r = subprocess.run([sys.executable, str(SUITE / "experts.py"), "--report", str(path)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("| dense | dense | 1 | 8192 | 8192 | 8192 |"))
    assert line.split("|")[7].strip() == "1533" and line.split("|")[8].strip() == "1394"
    assert len([x for x in r.stdout.splitlines() if x.startswith("| ")]) == 1 + 4 + 2 * 11  # header, 4 dense, 11 expert shapes × 2 GEMMs


def test_split_count_divides_the_cache_near_the_target() -> None:
    import serve_jax as sj

    assert sj.split_count(32768) == 32  # 1024 per split
    assert sj.split_count(32768 + 18) == 26  # 32786 = 2·13²·97: splits of 1261
    assert sj.split_count(1024 + 18) == 1  # 1042 = 2·521: no split of 256..: one
    assert sj.split_count(4096 + 18) == 11  # 4114 = 2·11²·17: splits of 374
    for cap in (16, 1042, 4114, 8210, 32786):
        c = sj.split_count(cap)
        assert cap % c == 0 and (c == 1 or cap // c >= sj.SPLIT_TARGET // 4)


def test_split_count_leaves_enough_rows_unsplit() -> None:
    """No split once the step attends max_rows (sequence, KV head) rows or more; below that the length rule."""
    import serve_jax as sj

    limit = 2 * 132  # the H200's SMs × SPLIT_ROWS_PER_SM
    assert sj.split_count(32768 + 18, rows=32 * 8, max_rows=limit) == 26  # batch 32, 8 KV heads: 256 rows, split
    assert sj.split_count(4096 + 18, rows=256 * 8, max_rows=limit) == 1  # batch 256: 2048 rows, one
    assert sj.split_count(8192 + 18, rows=64 * 8, max_rows=limit) == 1  # batch 64: 512 rows, one
    assert sj.split_count(8192 + 18, rows=64 * 8) == 10  # no limit given: the length rule alone (8210 = 2·5·821)


@pytest.mark.jax
@needs_jax
def test_split_decode_attention_equals_one_softmax() -> None:
    """The split attention (split_count > 1) gives what one softmax over the whole cache gives (fp32 on the CPU)."""
    import jax
    import jax.numpy as jnp
    import serve_jax as sj

    from meshplan.specs.model import load_model

    m = load_model("llama3.2-1b").with_overrides(**TINY)
    params = sj.init_weights(m, jnp.float32)
    cache = sj.random_cache(m, 2, 1024, jnp.float32, seed=3)  # 1024 positions: 4 splits of 256 at target 256
    tok = jnp.asarray([3, 5], dtype=jnp.int32)
    old = sj.SPLIT_TARGET
    try:
        sj.SPLIT_TARGET = 256
        assert sj.split_count(1024, sj.SPLIT_TARGET) == 4
        split, _ = jax.jit(sj._decode_fn(m))(params, [(k.copy(), v.copy()) for k, v in cache], tok, jnp.int32(700))
        sj.SPLIT_TARGET = 10**9  # one split
        whole, _ = jax.jit(sj._decode_fn(m))(params, [(k.copy(), v.copy()) for k, v in cache], tok, jnp.int32(700))
    finally:
        sj.SPLIT_TARGET = old
    np.testing.assert_allclose(np.asarray(split), np.asarray(whole), rtol=1e-4, atol=1e-4)


def test_the_suites_decode_and_prefill_carry_no_engine_host_step() -> None:
    """The reference loop runs its decode steps inside one XLA program and each prefill as one program: the suite
    predicts them without the serving engines' per-step host overhead (serving.yaml decode_step_overhead_s), which
    an engine-loop prediction of the same step carries on top of the same device work."""
    from predict import case_model, decode_context, predict_decode, predict_prefill, reference_config

    from meshplan.cost.efficiency import default_efficiency
    from meshplan.infer.config import ServeConfig, serving_constant
    from meshplan.infer.step import decode_step, prefill_step
    from meshplan.specs.hardware import load_chip

    chip = load_chip("h200")
    eff = default_efficiency(chip)
    d = {"model": "llama3.2-1b", "overrides": {}, "kind": "decode", "batch": 16, "context": 4096, "steps": 16}
    m = case_model(d)
    host = serving_constant("decode_step_overhead_s", chip)
    # the reference loop's cache is dense (predict.reference_config): read over its whole capacity
    engine = decode_step(m, chip, reference_config(d), eff, 16, decode_context(d)).time_s
    assert predict_decode(d, chip, eff)["step_time_s"] == pytest.approx(engine - host, rel=1e-12)
    p = {"model": "llama3.2-1b", "overrides": {}, "kind": "prefill", "batch": 1, "prompt_len": 2048}
    engine = prefill_step(m, chip, ServeConfig(), eff, 1, 2048).time_s
    assert predict_prefill(p, chip, eff)["step_time_s"] == pytest.approx(engine - host, rel=1e-12)


@pytest.mark.jax
@needs_jax
def test_mixed_step_is_a_decode_step_and_a_prefill_in_one() -> None:
    """serve_jax's mixed step (session 16) runs B decode tokens and a prompt chunk through the same GEMMs: its decode
    logits equal a pure decode step's on the same cache, and the chunk's last logits equal a prefill of that prompt
    (fp32, the tiny model)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import serve_jax as sj
    from cases import _base
    from predict import case_model

    preset, over = _base("tiny")
    m = case_model({"model": preset, "overrides": over})
    params = sj.init_weights(m, jnp.float32)
    B, C, P = 2, 32, 16
    cache = sj.random_cache(m, B, C + 5, jnp.float32, seed=1)
    tok, prompt = jnp.array([3, 7], jnp.int32), (jnp.arange(P, dtype=jnp.int32)[None] * 5) % m.vocab_size
    logits_dec, _ = jax.jit(sj._decode_fn(m))(params, cache, tok, jnp.int32(C))
    logits_mix, _ = jax.jit(sj._mixed_fn(m, "dpa"))(params, cache, tok, jnp.int32(C), prompt)
    logits_pre, _ = sj.make_prefill(m, "dpa", P)(params, prompt)
    assert logits_mix.shape == (B + 1, m.vocab_size)
    np.testing.assert_allclose(np.asarray(logits_mix[:B]), np.asarray(logits_dec), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(logits_mix[B]), np.asarray(logits_pre[0]), rtol=0, atol=1e-5)


def test_mixed_prediction_is_the_serving_step_of_both() -> None:
    """predict.predict_mixed is step.step_cost with the decodes and the chunk together: slower than the decode step
    alone and than the chunk's prefill alone, faster than the two one after the other (the weights are read once)."""
    from predict import predict_decode, predict_mixed, predict_prefill

    from meshplan.cost.efficiency import default_efficiency
    from meshplan.specs.hardware import load_chip

    chip = load_chip("h200")
    eff = default_efficiency(chip)
    base = {"model": "llama3-8b", "overrides": {}, "dtype": "bf16"}
    mixed = predict_mixed({**base, "kind": "mixed", "batch": 64, "context": 1024, "prompt_len": 512,
                           "attention": "cudnn", "steps": 16}, chip, eff)["step_time_s"]
    decode = predict_decode({**base, "kind": "decode", "batch": 64, "context": 1024, "steps": 16}, chip, eff)
    prefill = predict_prefill({**base, "kind": "prefill", "prompt_len": 512, "batch": 1}, chip, eff)["step_time_s"]
    assert max(decode["step_time_s"], prefill) < mixed < decode["step_time_s"] + prefill
