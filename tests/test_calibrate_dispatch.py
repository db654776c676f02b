"""calibrate's timing of short kernels (found on the first GPU run, an H200): one program per GEMM is timed at the
host's dispatch rate, so GEMMs and copies run as several independent copies per program, and the fit leaves out
any point whose program time is under twice the run's own one-kernel program time."""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshplan.measure.fit import DISPATCH_BOUND_FACTOR, device_bound, fit_efficiency
from meshplan.specs.hardware import load_chip


def _mm(name: str, d: int, time_s: float, ops: int = 1) -> dict:
    peak = load_chip("h100-sxm").peak("bf16")
    return {"benchmark": "matmul", "name": name, "time_s": time_s, "m": d, "n": d, "k": d, "dtype": "bfloat16",
            "fraction": 2.0 * d**3 / time_s / peak, "ops_per_program": ops}


def test_points_under_twice_the_program_time_leave_the_fit() -> None:
    overhead = {"benchmark": "overhead", "name": "program of 1 tiny kernel", "time_s": 50e-6}
    # 512^3 alone in a program: 40 us < 2 x 50 us, dispatch-bound; the same GEMM 16 to a program: 640 us, kept
    alone, batched, big = _mm("a", 512, 40e-6), _mm("b", 512, 40e-6, ops=16), _mm("c", 4096, 200e-6)
    assert DISPATCH_BOUND_FACTOR == 2.0
    assert device_bound([alone, batched, big], lambda n: 50e-6) == [batched, big]
    assert device_bound([alone], None) == [alone]  # no overhead measured: nothing is left out
    _, curves = fit_efficiency([overhead, alone, batched, big], load_chip("h100-sxm"))
    assert curves["dispatch_bound"] == {"matmul": ["a"]}
    assert [p[0] for p in curves["matmul"]["points"]] == [512.0, 4096.0]


@pytest.mark.jax
def test_many_runs_independent_copies_in_one_program() -> None:
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from meshplan.measure.calibrate import _many

    rng = np.random.default_rng(0)
    args = [jnp.asarray(rng.standard_normal((4, 4), dtype=np.float32)) for _ in range(6)]
    outs = _many(jnp.dot, 2, 3)(*args)
    assert len(outs) == 3
    for i, o in enumerate(outs):
        np.testing.assert_allclose(np.asarray(o), np.asarray(args[2 * i] @ args[2 * i + 1]), rtol=1e-5)


def test_show_names_the_points_left_out_of_the_fit(tmp_path, capsys) -> None:
    """`calibrate --show` on the H200 profile fitted again by the current fit says which GEMMs were left out."""
    import json
    from pathlib import Path

    from conftest import run_cli

    from meshplan.measure.fit import build_profile

    src = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "profile_h200_2026-12-04.json"
    prof = json.loads(src.read_text())
    new = build_profile(load_chip("h200"), prof["benchmarks"], {"platform": prof["platform"],
                                                                 "device_kind": prof["device_kind"]})
    path = tmp_path / "refit.json"
    path.write_text(json.dumps(new))
    code, out, _ = run_cli(["calibrate", "--show", str(path)], capsys)
    assert code == 0
    line = " ".join(out.split())  # the console wraps long lines
    assert "left out of the matmul fit, bound by the host's dispatch rather than the device: 512x512x512, " \
           "1024x1024x1024, 2048x2048x2048, 64x8192x8192" in line


def test_sdpa_backend_is_named_from_its_kernel() -> None:
    """The H200 run timed SDPA's default backend at 0.53/0.51 of peak (fwd/bwd, 8k) without knowing which backend
    ran; calibrate now names it from the forward kernel (names as printed in pytorch/pytorch#142132 and
    meta-pytorch/tritonbench#41)."""
    from meshplan.measure.torch_timing import backend_of_kernel

    assert backend_of_kernel("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0") == "cudnn"
    assert backend_of_kernel("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>") \
        == "flash (FlashAttention-2)"
    assert backend_of_kernel("fmha_cutlassF_bf16_aligned_64x64_rf_sm80") == "efficient (memory-efficient, CUTLASS)"
    assert backend_of_kernel(None) == "not identified"
    assert backend_of_kernel("some_other_kernel").startswith("kernel some_other_kernel")


def test_the_floor_of_a_many_gemm_program_is_its_own_tiny_program() -> None:
    """The H200 run of session 14 (profile_h200_2026-12-04_s14.json): one-kernel program 40.0 us, 512^3 and
    1024^3 GEMMs 16 to a program at 13.9 and 11.3 us each (222 and 181 us a program: above twice the one-kernel
    time, so the one-kernel floor keeps them, at 2% and 19% of peak). With a 16-tiny-GEMM program measured (here
    200 us, about what those programs show), the floor for n GEMMs is 40 + 160·(n − 1)/15 us: 512^3 and 1024^3 fall
    under twice 200 us and leave the fit; 2048^3 (26.9 us, 430 us a program) and the 15-to-a-program thin 64-row
    GEMM (46.4 us, 696 us against twice 189.3 us) stay."""
    from meshplan.measure.fit import program_floor

    one = {"benchmark": "overhead", "name": "program of 1 tiny kernel", "time_s": 40.0e-6}
    many = {"benchmark": "overhead", "name": "program of 16 tiny matmuls", "time_s": 200e-6, "ops_per_program": 16}
    a, b, c = _mm("512", 512, 13.9e-6, 16), _mm("1024", 1024, 11.3e-6, 16), _mm("2048", 2048, 26.9e-6, 16)
    thin = {**_mm("64x8192x8192", 64, 46.4e-6, 15), "n": 8192, "k": 8192}
    floor = program_floor([one, many])
    assert floor(1) == pytest.approx(40e-6) and floor(16) == pytest.approx(200e-6)
    # the floor is the fastest timed batch where the record has one (overheads only add time)
    noisy = {**many, "time_s": 2.3e-3, "timing": {"median_s": 2.3e-3, "min_s": 200e-6}}
    assert program_floor([one, noisy])(16) == pytest.approx(200e-6)
    assert floor(15) == pytest.approx(40e-6 + 160e-6 * 14 / 15)
    assert device_bound([a, b, c, thin], floor) == [c, thin]
    assert device_bound([a, b, c, thin], program_floor([one])) == [a, b, c, thin]  # the one-kernel floor alone
    _, curves = fit_efficiency([one, many, a, b, c, thin], load_chip("h100-sxm"))
    assert curves["dispatch_bound"] == {"matmul": ["512", "1024"]}


def _chain(nbytes: float, time_s: float) -> dict:
    return {"benchmark": "overhead", "name": f"copy chain {nbytes:.0f}", "time_s": time_s, "bytes": nbytes,
            "chain": 32}


def test_kernel_overhead_is_the_copy_chains_intercept() -> None:
    """Copies of 0.5, 2, 8 and 32 MB taking 3 us plus their bytes at 3 TB/s (Hockney's t0 + n/r): the fit gives back
    t0 = 3 us and 3 TB/s, and kernel_overhead_s is t0, not the 1 us slope of the tiny-kernel chain. A chain faster
    than the chip's HBM (the H100's 3.35 TB/s) ran from cache: its intercept is reported, not used."""
    from meshplan.measure.fit import fit_kernel_chain

    pts = [_chain(b, 3e-6 + b / 3e12) for b in (0.5e6, 2e6, 8e6, 32e6)]
    fit = fit_kernel_chain(pts)
    assert fit["t0_s"] == pytest.approx(3e-6, rel=1e-6) and fit["rate_bytes_per_s"] == pytest.approx(3e12, rel=1e-6)
    slope = {"benchmark": "overhead", "name": "program of 65 tiny kernels", "time_s": 100e-6, "per_kernel_s": 1e-6}
    eff, curves = fit_efficiency([slope, *pts], load_chip("h100-sxm"))
    assert eff["kernel_overhead_s"] == pytest.approx(3e-6, rel=1e-6)
    assert curves["kernel_overhead"]["points"][0] == [0.5e6, pytest.approx(3e-6 + 0.5e6 / 3e12)]
    cached = [_chain(b, 3e-6 + b / 8.7e12) for b in (0.5e6, 2e6, 8e6, 32e6)]  # L2-resident: faster than HBM
    eff, curves = fit_efficiency([slope, *cached], load_chip("h100-sxm"))
    assert eff["kernel_overhead_s"] == pytest.approx(1e-6) and "not_used" in curves["kernel_overhead"]
    # an intercept that is not positive (noise on a host where launches cost nothing) leaves the slope's value
    flat = [_chain(b, b / 4e12 - 1e-7) for b in (0.5e6, 2e6, 8e6)]
    assert fit_efficiency([slope, *flat], load_chip("h100-sxm"))[0]["kernel_overhead_s"] == pytest.approx(1e-6)
    # fewer than three sizes: no fit
    assert fit_kernel_chain(pts[:2]) == {}
    assert fit_efficiency([slope, *pts[:2]], load_chip("h100-sxm"))[0]["kernel_overhead_s"] == pytest.approx(1e-6)


def _gemv(nbytes: float, time_s: float) -> dict:
    return {"benchmark": "overhead", "name": f"gemv chain {nbytes:.0f}", "time_s": time_s, "bytes": nbytes,
            "gemv_chain": 32}


def test_the_gemv_chains_intercept_comes_before_the_copy_chains() -> None:
    """GEMVs over 8, 32 and 128 MiB weights at 4 us + bytes at 3 TB/s, copies at 3 us + bytes at 3 TB/s: the GEMV
    chain's 4 us is kernel_overhead_s (decode's own kernels). A GEMV chain faster than HBM (cached weights) is not
    used, and the copy chain's 3 us is."""
    h100 = load_chip("h100-sxm")
    gemv = [_gemv(b, 4e-6 + b / 3e12) for b in (8 * 2**20, 32 * 2**20, 128 * 2**20)]
    copies = [_chain(b, 3e-6 + b / 3e12) for b in (64e6, 128e6, 256e6)]
    eff, curves = fit_efficiency([*copies, *gemv], h100)
    assert eff["kernel_overhead_s"] == pytest.approx(4e-6, rel=1e-6)
    assert curves["kernel_overhead_gemv"]["used"] == "kernel_overhead_s" and "kernel_overhead" not in curves
    cached = [_gemv(b, 4e-6 + b / 9e12) for b in (8 * 2**20, 32 * 2**20, 128 * 2**20)]
    eff, curves = fit_efficiency([*copies, *cached], h100)
    assert eff["kernel_overhead_s"] == pytest.approx(3e-6, rel=1e-6)
    assert "not_used" in curves["kernel_overhead_gemv"] and curves["kernel_overhead"]["used"] == "kernel_overhead_s"


def _attn(name: str, T: int, median_s: float, lo_s: float, hi_s: float, **extra) -> dict:
    peak = load_chip("h100-sxm").peak("bf16")
    flops = 4.0 * T * (T / 2.0) * 8 * 128  # causal QKᵀ and AV, batch 1, 8 heads of 128
    return {"benchmark": "attention", "name": name, "seq": T, "impl": "jax", "work": flops, "time_s": median_s,
            "fraction": flops / median_s / peak, "timing": {"median_s": median_s, "min_s": lo_s, "max_s": hi_s},
            **extra}


def test_a_backward_lost_in_the_forwards_noise_is_left_out() -> None:
    """CI run of session 23: fwd+bwd's median came out at the forward's, the backward read as 1e-9 s and the profile
    held attention_bwd_fraction 10.6, which `--profile` refuses. A backward counts only where the fastest fwd+bwd
    batch is slower than the slowest forward batch."""
    chip = load_chip("h100-sxm")
    ratio, peak = 2.5, chip.peak("bf16")  # efficiency.yaml attention_bwd_flops_ratio
    recs = [_attn("fwd T=1024", 1024, 1.0e-3, 0.9e-3, 1.4e-3),
            _attn("fwd+bwd T=1024", 1024, 1.3e-3, 1.2e-3, 1.5e-3, bwd_time_s=0.3e-3),  # ranges overlap: noise
            _attn("fwd T=2048", 2048, 4.0e-3, 3.9e-3, 4.1e-3),
            _attn("fwd+bwd T=2048", 2048, 12.0e-3, 11.8e-3, 12.3e-3, bwd_time_s=8.0e-3)]
    measured, curves = fit_efficiency(recs, chip)
    assert curves["attention"]["bwd_unresolved"] == ["fwd+bwd T=1024"]
    # the backward fraction is T=2048's alone: its FLOPs × 2.5 over 8 ms at the H100's peak
    assert measured["attention_bwd_fraction"] == pytest.approx(recs[3]["work"] * ratio / (8.0e-3 * peak))
    # no long length resolved: no field at all, the default stays
    measured, curves = fit_efficiency(recs[:2], chip)
    assert "attention_bwd_fraction" not in measured and "attention_fwd_fraction" in measured


def test_a_fit_above_the_datasheet_peak_keeps_the_default_and_says_so(tmp_path, capsys) -> None:
    from meshplan.cost.efficiency import default_efficiency, profile_efficiency
    from meshplan.measure.fit import build_profile

    chip = load_chip("h100-sxm")
    # a forward at 2x the H100's peak: impossible, so a bad timing
    fast = _attn("fwd T=2048", 2048, 1e-6, 1e-6, 1e-6)
    assert fast["fraction"] > 1.05
    prof = build_profile(chip, [fast], {"platform": "gpu", "device_kind": "NVIDIA H100"})
    assert prof["efficiency_origin"]["attention_fwd_fraction"] == "default"
    assert prof["efficiency"]["attention_fwd_fraction"] == default_efficiency(chip).attention_fwd_fraction
    assert prof["fitted_curves"]["out_of_range"]["attention_fwd_fraction"]["value"] == pytest.approx(fast["fraction"])
    profile_efficiency(prof, chip, "p.json", "profile p.json")  # what calibrate writes, --profile reads
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    from conftest import run_cli

    code, out, _ = run_cli(["calibrate", "--show", str(path)], capsys)
    line = " ".join(out.split())
    assert code == 0 and f"attention_fwd_fraction kept its default: the fit gave {fast['fraction']:.4g}" in line
