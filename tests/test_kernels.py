"""measure/kernels.py: the kinds of work of a compiled GPU module's instructions (read off the H200 run's archived
HLO), the breakdown of per-instruction device times, and the profiler path on the CPU (no device plane: empty)."""

from __future__ import annotations

import gzip
import tarfile
from pathlib import Path

import pytest

from meshplan.measure.hlo import parse_module
from meshplan.measure.kernels import KINDS, breakdown, op_kind

ROOT = Path(__file__).resolve().parents[1]
TAR = ROOT / "benchmarks" / "results" / "hlo_h200_2026-12-04_s15.tar"
NONE_1B = "jax_train_llama3.2-1b_seq_4096_batch_4_recompute_none_attention_cudnn_bf16.hlo.txt.gz"


@pytest.fixture(scope="module")
def gpu_hlo() -> str:
    if not TAR.exists():
        pytest.skip("no archived H200 HLO")
    with tarfile.open(TAR) as tar:
        return gzip.decompress(tar.extractfile(NONE_1B).read()).decode()


def test_kinds_of_the_h200_programs_instructions(gpu_hlo: str) -> None:
    """Every cuBLAS call is a GEMM, every cuDNN fused-attention call attention; the Triton GEMM fusions are GEMMs
    and the other fusions pointwise; loops and tuples are containers (None). Counts read from the module text:
    13 cuBLASLt matmuls and 2 nested Triton GEMM fusions, 3 cuDNN fmha calls (2 forward: the forward loop's and
    the backward's rerun of the core under none's saved residuals, 1 backward)."""
    instrs = parse_module(gpu_hlo)
    kinds: dict[str | None, int] = {}
    for ins in instrs.values():
        k = op_kind(ins)
        kinds[k] = kinds.get(k, 0) + 1
    cublas = sum(1 for i in instrs.values() if i.op == "custom-call" and "__cublas$lt$matmul" in i.rest)
    triton_gemm = sum(1 for i in instrs.values() if i.op == "fusion" and "__triton_nested_gemm_fusion" in i.rest)
    fmha = sum(1 for i in instrs.values() if i.op == "custom-call" and "__cudnn$fmha" in i.rest)
    assert (cublas, triton_gemm, fmha) == (13, 2, 3)
    launches = [i for i in instrs.values() if op_kind(i) == "gemm" and i.op in ("custom-call", "fusion")]
    assert len(launches) == cublas + triton_gemm  # the other "gemm"s are the dots inside those fusions
    assert kinds["attention"] == fmha
    assert kinds["pointwise"] > 50 and None in kinds  # the loop's fusions; while/tuple/parameter are containers
    whiles = [i for i in instrs.values() if i.op == "while"]
    assert whiles and all(op_kind(i) is None for i in whiles)


def test_breakdown_sums_by_kind_and_skips_containers(gpu_hlo: str) -> None:
    instrs = parse_module(gpu_hlo)
    gemm = next(n for n, i in instrs.items() if op_kind(i) == "gemm")
    attn = next(n for n, i in instrs.items() if op_kind(i) == "attention")
    loop = next(n for n, i in instrs.items() if i.op == "while")
    out = breakdown({gemm: 2e-3, attn: 1e-3, loop: 5e-3, "a-runtime-kernel": 0.25e-3}, gpu_hlo, top=2)
    assert out["kernel_time_s"] == {**dict.fromkeys(KINDS, 0.0), "gemm": 2e-3, "attention": 1e-3, "other": 0.25e-3}
    assert out["kernel_total_s"] == pytest.approx(3.25e-3)
    assert [r["op"] for r in out["top_ops"]] == [gemm, attn]


@pytest.mark.jax
def test_profile_step_on_the_cpu_is_empty() -> None:
    """The CPU's profile has no device plane: the step runs under the profiler and the breakdown is {}."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from meshplan.measure.kernels import profile_step

    f = jax.jit(lambda a: jnp.tanh(a @ a))
    a = jnp.ones((64, 64))
    text = f.lower(a).compile().as_text()
    assert profile_step(lambda: jax.block_until_ready(f(a)), text) == {}


def test_report_prints_the_profiled_steps_kinds() -> None:
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    import report

    times = {**dict.fromkeys(KINDS, 0.0), "gemm": 0.2, "attention": 0.03, "pointwise": 0.04}
    row = {"id": "jax train x", "case": {"kind": "train"},
           "measured": {"step_time_s": 0.28, "kernels": {"kernel_time_s": times, "kernel_total_s": 0.27}}}
    lines = report.kernel_lines([row, {"id": "y", "case": {"kind": "train"}, "measured": {"step_time_s": 1.0}}])
    assert lines[1].startswith("| case (one profiled step) | gemm | attention |")
    assert lines[3] == "| jax train x | 200.00 ms | 30.00 ms | 0.00 ms | 0.00 ms | 40.00 ms | 0.00 ms | 270.00 ms | 280.00 ms |"
    assert len(lines) == 4  # the row without a profile is left out


@pytest.mark.jax
def test_measure_kernels_on_the_cpu_says_there_are_none() -> None:
    """`meshplan measure --kernels` runs the extra profiled step and says the CPU's profile has no device kernels."""
    pytest.importorskip("jax")
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", "import sys; from meshplan.cli import main; main(sys.argv[1:])",
                        "measure", "--model", "llama3.2-1b", "--layers", "1",
                        "--seq-len", "32", "--steps", "1", "--kernels", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-500:]
    assert json.loads(r.stdout)["measured"]["kernels"] == {"note": "the profile has no device kernels (the CPU)"}
