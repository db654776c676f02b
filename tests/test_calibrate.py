"""`meshplan calibrate` and `meshplan measure` on the CPU (issue 7): the CPU path writes a profile that
`load_profile` accepts, `--show` reads it back, `measure` runs real steps beside a prediction, a profile for
another chip is refused, and two processes under jax.distributed finish a step and an all-reduce benchmark.

JAX runs only in subprocesses (never imported here), so other tests can still choose device counts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

needs_jax = pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs the jax extra")

TINY = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 256, "intermediate_size": 128, "max_position_embeddings": 64,
        "_name": "tiny"}


def _env(devices: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    # LLVM at -O0: compiles 3x faster on a small CI machine; these tests check plumbing, not CPU speed.
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    return env


def meshplan(*args: str, devices: int = 1, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the CLI in a fresh interpreter (its own JAX, its own device count)."""
    code = "import sys; from meshplan.cli import main; main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=_env(devices),
                          timeout=timeout, check=False)


@pytest.fixture(scope="module")
def cpu_profile(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cal") / "cpu.json"
    r = meshplan("calibrate", "--quick", "--hardware", "h100-sxm", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "say nothing about GPUs" in r.stderr.replace("\n", " ")
    return out


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("model") / "tiny.json"
    p.write_text(json.dumps(TINY))
    return p


@pytest.mark.jax
@needs_jax
def test_cpu_calibrate_writes_a_profile_load_profile_accepts(cpu_profile):
    from meshplan.cost.efficiency import load_profile
    from meshplan.specs.hardware import load_chip

    data = json.loads(cpu_profile.read_text())
    assert data["schema"] == "meshplan-profile/1" and data["chip"] == "h100-sxm"
    assert data["device_kind"] == "cpu" and data["cpu_only"] is True
    assert {"jax", "jaxlib"} <= set(data["versions"]) and data["measured_at"]
    measured = {k for k, v in data["efficiency_origin"].items() if v == "measured"}
    overhead = [(r["name"], r["time_s"]) for r in data["benchmarks"] if r["benchmark"] == "overhead"]
    assert {"attention_fwd_fraction", "kernel_overhead_s"} <= measured, overhead
    # the backward is measured unless its time was lost in the noise at both long lengths (a loaded CI runner,
    # session 23's CI run): then the profile names the records and keeps the default
    unresolved = data["fitted_curves"]["attention"].get("bwd_unresolved", [])
    lengths = data["fitted_curves"]["attention"]["lengths"]
    if all(f"fwd+bwd T={T}" in unresolved for T in lengths):
        assert "attention_bwd_fraction" not in measured
    else:
        assert "attention_bwd_fraction" in measured
    # matmul and hbm are measured unless their records ran at the dispatch floor: on a loaded 2-core CI runner every
    # quick-grid matmul can (CI run of session 21); then the profile must name each one as dropped and keep the default
    dropped = data["fitted_curves"].get("dispatch_bound") or {}
    for kind, fields, need in (("matmul", {"matmul_peak_fraction", "matmul_half_dim"}, 2), ("hbm", {"hbm_fraction"}, 1)):
        recs = [r for r in data["benchmarks"] if r["benchmark"] == kind and "skipped" not in r
                and r.get("dtype") != "float8_e4m3fn"]
        kept = {min(r.get("m", 0), r.get("n", 0), r.get("k", 0)) if kind == "matmul" else r["name"]
                for r in recs if r["name"] not in dropped.get(kind, [])}
        if len(kept) >= need:
            assert fields <= measured, (kind, dropped, overhead)
        else:
            assert not fields & measured and dropped.get(kind), (kind, dropped, overhead)
    kinds = {r["benchmark"] for r in data["benchmarks"] if "skipped" not in r}
    assert kinds >= {"matmul", "hbm", "attention", "host", "overhead", "layer"}
    eff = load_profile(cpu_profile, load_chip("h100-sxm"))
    assert eff.origin == "profile cpu.json"
    if "matmul_peak_fraction" in measured:
        assert 0 < eff.matmul_peak_fraction < 0.05  # a CPU against an H100's peak
    assert eff.matmul_peak_fraction == pytest.approx(data["efficiency"]["matmul_peak_fraction"])


@pytest.mark.jax
@needs_jax
def test_show_prints_achieved_vs_peak(cpu_profile, capsys):
    code, out, _ = run_cli(["calibrate", "--show", str(cpu_profile)], capsys)
    assert code == 0
    for word in ("matmul", "hbm", "attention", "of peak", "989 TFLOP/s", "cpu_only", "matmul_half_dim"):
        assert word in out


@pytest.mark.jax
@needs_jax
def test_profile_for_another_chip_is_refused(cpu_profile, capsys, monkeypatch):
    args = ["train", "--model", "llama3-8b", "--chips", "8", "--seq-len", "4096", "--global-batch", "32",
            "--profile", str(cpu_profile)]
    code, _, err = run_cli([*args, "--hardware", "a100-80gb"], capsys)
    assert code == 2 and err.startswith("error:") and "measured on 'h100-sxm'" in err
    # a CPU-measured profile is refused for planning (issue #18), unless explicitly allowed
    code, _, err = run_cli([*args, "--hardware", "h100-sxm", "--json"], capsys)
    assert code == 2 and "cpu_only" in err
    monkeypatch.setenv("MESHPLAN_ALLOW_CPU_PROFILE", "1")
    code, _, _ = run_cli([*args, "--hardware", "h100-sxm", "--json"], capsys)
    assert code == 0


@pytest.mark.jax
@needs_jax
def test_cpu_calibrate_needs_explicit_hardware(tmp_path):
    r = meshplan("calibrate", "--quick", "--bench", "overhead", "--out", str(tmp_path / "p.json"))
    assert r.returncode == 2 and "error:" in r.stderr and "--hardware" in r.stderr
    assert not (tmp_path / "p.json").exists()


def test_missing_jax_is_one_error_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "jax", None)  # `import jax` now raises ImportError
    code, _, err = run_cli(["calibrate", "--quick", "--hardware", "h100-sxm"], capsys)
    assert code == 2 and err.strip() == "error: meshplan calibrate needs the jax extra: pip install 'meshplan[jax]'"


@pytest.mark.jax
@needs_jax
def test_measure_runs_steps_beside_the_prediction(tiny_model, cpu_profile):
    r = meshplan("measure", "--model", str(tiny_model), "--layers", "1", "--seq-len", "32", "--global-batch", "2",
                 "--steps", "2", "--hardware", "h100-sxm", "--profile", str(cpu_profile), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    assert len(d["measured"]["step_times_s"]) == 2 and d["measured"]["step_time_s"] > 0
    assert d["measured"]["peak_memory_bytes"] > 0 and d["cpu_only"] is True
    assert set(d["predicted"]) == {"defaults", "profile"}
    assert d["predicted"]["defaults"]["step_time_s"] > 0 and d["predicted"]["profile"]["origin"] == "profile cpu.json"


def test_measure_rejects_an_unknown_attention_kernel(capsys):
    code, _, err = run_cli(["measure", "--model", "llama3.2-1b", "--attention", "flash9"], capsys)
    assert code == 2 and err.strip() == "error: --attention must be materialized, dpa or cudnn, got 'flash9'"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(args: list[str], timeout: float = 150) -> list[subprocess.CompletedProcess]:
    port = _free_port()
    code = "import sys; from meshplan.cli import main; main(sys.argv[1:])"
    procs = [subprocess.Popen([sys.executable, "-c", code, *args, "--coordinator", f"127.0.0.1:{port}",
                               "--num-processes", "2", "--process-id", str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env(1)) for i in range(2)]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


@pytest.mark.jax
@needs_jax
def test_two_processes_run_a_step_and_an_all_reduce(tmp_path, tiny_model):
    out = tmp_path / "mp.json"
    cal = _two_processes(["calibrate", "--quick", "--bench", "collectives", "--hardware", "h100-sxm",
                          "--out", str(out)])
    assert [r.returncode for r in cal] == [0, 0], cal[0].stderr[-2000:] + cal[1].stderr[-2000:]
    data = json.loads(out.read_text())
    ar = [r for r in data["benchmarks"] if r.get("collective") == "all-reduce"]
    assert ar and all(r["devices"] == 2 and r["processes"] == 2 and r["bus_bytes_per_s"] > 0 for r in ar)
    step = _two_processes(["measure", "--model", str(tiny_model), "--layers", "1", "--seq-len", "32",
                           "--global-batch", "2", "--steps", "1", "--hardware", "h100-sxm", "--json"])
    assert [r.returncode for r in step] == [0, 0], step[0].stderr[-2000:] + step[1].stderr[-2000:]
    d = json.loads(step[0].stdout)  # process 0 reports; the other stays quiet
    assert d["processes"] == 2 and d["layout"]["dp"] == 2 and d["measured"]["devices"] == 2
    assert step[1].stdout.strip() == ""


@pytest.mark.jax
@pytest.mark.gpu
@needs_jax
def test_gpu_quick_calibrate_detects_the_chip(tmp_path):
    """On a GPU/TPU host: calibrate --quick labels the profile with the detected catalog chip."""
    probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], capture_output=True,
                           text=True, check=False, timeout=120)
    if probe.stdout.strip() not in ("gpu", "tpu"):
        pytest.skip("no GPU or TPU visible to JAX")
    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, "-c", "import sys; from meshplan.cli import main; main(sys.argv[1:])",
                        "calibrate", "--quick", "--out", str(out)], capture_output=True, text=True, check=False,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    assert "cpu_only" not in data and 0.2 < data["efficiency"]["matmul_peak_fraction"] <= 1.0


# --- no JAX needed: the fit and the device-kind map (the GPU path's arithmetic, checked on synthetic data) ---

def _synthetic_h100_records() -> list[dict]:
    """What an H100 might measure: matmul fraction 0.78·d/(d+150), copies at 88% of HBM, FA at 55%/45%."""
    recs = []
    for m, n, k in [(d, d, d) for d in (512, 1024, 2048, 4096, 8192)] + [(d, 8192, 8192) for d in (64, 128, 256)]:
        recs.append({"benchmark": "matmul", "name": f"{m}x{n}x{k}", "m": m, "n": n, "k": k, "dtype": "bfloat16",
                     "fraction": 0.78 * min(m, n, k) / (min(m, n, k) + 150.0)})
    recs.append({"benchmark": "matmul", "name": "fp8", "m": 8192, "n": 8192, "k": 8192, "dtype": "float8_e4m3fn",
                 "fraction": 0.6})
    recs += [{"benchmark": "hbm", "name": f"copy {b}", "bytes": b, "fraction": f} for b, f in ((2**28, 0.8), (2**30, 0.88))]
    peak = 9.89e14
    for T in (4096, 8192):
        work = 4.0 * 16384 * (T / 2) * 16 * 128
        t_f = work / (0.55 * peak)
        recs.append({"benchmark": "attention", "name": f"fwd T={T}", "seq": T, "impl": "cudnn", "work": work,
                     "fraction": 0.55})
        recs.append({"benchmark": "attention", "name": f"fwd+bwd T={T}", "seq": T, "impl": "cudnn", "work": work,
                     "bwd_time_s": 2.5 * work / (0.45 * peak), "time_s": t_f + 2.5 * work / (0.45 * peak)})
    recs.append({"benchmark": "overhead", "name": "65", "per_kernel_s": 3e-6})
    recs.append({"benchmark": "layer", "name": "oom", "skipped": "RESOURCE_EXHAUSTED"})
    return recs


def test_fit_recovers_the_efficiency_curve_and_writes_a_loadable_profile(tmp_path):
    from meshplan.cost.efficiency import load_profile
    from meshplan.measure.fit import build_profile, fit_half_dim
    from meshplan.specs.hardware import load_chip

    d = np.array([64.0, 128, 256, 512, 1024, 4096, 8192])
    p, h, rms = fit_half_dim(d, 0.7 * d / (d + 200.0))
    assert p == pytest.approx(0.7, rel=2e-3) and h == pytest.approx(200.0, rel=1e-2) and rms < 1e-3
    chip = load_chip("h100-sxm")
    prof = build_profile(chip, _synthetic_h100_records(), {"platform": "gpu", "device_kind": "NVIDIA H100 80GB HBM3"})
    assert "cpu_only" not in prof and prof["efficiency_origin"]["step_overhead_s"] == "default"
    path = tmp_path / "h100.json"
    path.write_text(json.dumps(prof))
    eff = load_profile(path, chip)
    assert eff.matmul_peak_fraction == pytest.approx(0.78, rel=1e-2)
    assert eff.matmul_half_dim == pytest.approx(150.0, rel=2e-2)
    assert (eff.fp8_peak_fraction, eff.hbm_fraction, eff.kernel_overhead_s) == (0.6, 0.88, 3e-6)
    assert eff.attention_fwd_fraction == pytest.approx(0.55) and eff.attention_bwd_fraction == pytest.approx(0.45)


@pytest.mark.parametrize("kind,chip", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA H200", "h200"), ("NVIDIA B200", "b200"),
    ("TPU v4", "tpu-v4"), ("TPU v5 lite", "tpu-v5e"), ("TPU v5", "tpu-v5p"), ("TPU v5p", "tpu-v5p"),
    ("TPU v6 lite", "tpu-v6e"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA GH200 480GB", None), ("cpu", None)])
def test_device_kind_maps_to_the_catalog(kind, chip):
    from meshplan.measure.cluster import chip_for_device_kind
    from meshplan.specs.hardware import preset_chips

    assert chip_for_device_kind(kind) == chip
    assert chip is None or chip in preset_chips()


@pytest.mark.jax
@needs_jax
def test_time_limit_writes_a_profile_of_what_was_measured(tmp_path):
    """`--time-limit`: no measurement starts past the limit; the profile is still written, with the benchmarks that
    did not run listed as skipped and their fields left at the defaults (the H200 run of session 14 lost its whole
    profile when the GPU suite stopped calibrate at its share)."""
    out = tmp_path / "p.json"
    r = meshplan("calibrate", "--quick", "--hardware", "h100-sxm", "--bench", "matmul,hbm", "--time-limit", "0.001",
                 "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["benchmarks"] and all(rec.get("skipped") == "stopped at calibrate's time limit"
                                      for rec in data["benchmarks"])
    assert {rec["benchmark"] for rec in data["benchmarks"]} == {"matmul", "hbm"}
    assert data["efficiency_origin"]["matmul_peak_fraction"] == "default"
    assert data["efficiency_origin"]["hbm_fraction"] == "default"


@pytest.mark.jax
@needs_jax
def test_records_carry_their_setup_and_wall_time(cpu_profile):
    """Each timed record says how long its compile and trial took and its whole measurement (what a run that
    overruns its time needs to know: session 14's GEMM grid took 186 s of a 222 s calibrate)."""
    data = json.loads(cpu_profile.read_text())
    timed = [r for r in data["benchmarks"] if r["benchmark"] in ("matmul", "hbm") and "skipped" not in r]
    assert timed
    for r in timed:
        t = r["timing"]
        assert 0 < t["setup_s"] <= t["wall_s"]
        # the timed batches alone took at least repeats x inner calls of the program (ops_per_program GEMMs each)
        assert t["wall_s"] - t["setup_s"] >= 0.9 * t["repeats"] * t["inner"] * r["time_s"] * r["ops_per_program"]
    # the many-GEMM dispatch floor is a GPU measurement (no dispatch to hide on the CPU)
    assert not any(r["name"].startswith("program of 2 ") for r in data["benchmarks"])
    gemv = [r for r in data["benchmarks"] if "gemv_chain" in r]
    assert [r["bytes"] for r in gemv] == [4 * d * d for d in (128, 256, 512)]  # fp32 weights on the CPU grid
    chain = [r for r in data["benchmarks"] if "chain" in r]
    assert [r["bytes"] for r in chain] == [2 * 2**18, 2 * 2**20, 2 * 2**22]  # read + write of each buffer
    # each program runs its 32 dependent copies one after another: the largest copy takes longer than the smallest
    assert chain[-1]["time_s"] > chain[0]["time_s"]
    curves = data["fitted_curves"]
    assert len(curves["kernel_overhead_gemv"]["points"]) == 3
    used = [c for c in ("kernel_overhead_gemv", "kernel_overhead") if curves.get(c, {}).get("used")]
    if used:  # the first usable intercept (GEMV chain, then copies) is the profile's kernel_overhead_s
        assert data["efficiency"]["kernel_overhead_s"] == pytest.approx(curves[used[0]]["t0_s"])


def test_bad_time_limit_is_one_error_line(capsys):
    for bad in ("0", "-3"):
        code, _, err = run_cli(["calibrate", "--time-limit", bad], capsys)
        assert code == 2 and "error: --time-limit must be a positive number" in err, (bad, err)
    for bad in ("nan", "inf", "soon"):  # the CLI's own check of every float option
        code, _, err = run_cli(["calibrate", "--time-limit", bad], capsys)
        assert code == 2 and err.startswith("error: ") and "--time-limit" in err and len(err.splitlines()) == 1
