"""Sharded matmuls (book ch.3 §4.2) and collective matmuls (book ch.10), against hand calculations.

TPU v5p: C = 4.59e14 FLOP/s, HBM 2.8e12 B/s, ICI 9e10 B/s one way per link (W_bidir = 1.8e11). On 64
chips (a 4x4x4 cube, wraparound on every axis) the mesh {'X': 4, 'R': 16} puts X on one full wrapped axis.
"""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from meshplan.cost.sharded_matmul import collective_matmul_time, parse_operand, sharded_matmul
from meshplan.cost.topology import make_cluster, map_mesh
from meshplan.errors import MeshplanError
from meshplan.specs.hardware import load_chip

C, W = 4.59e14, 1.8e11
MESH = map_mesh(make_cluster(load_chip("tpu-v5p"), 64), {"X": 4, "R": 16})


def test_parse_operand():
    assert parse_operand("B:data,D:tensor+fsdp,F") == (("B", ("data",)), ("D", ("tensor", "fsdp")), ("F", ()))


def test_case1_no_contracting_sharding_is_local():
    # A[I_X, J] . B[J, K_R] -> C[I_X, K_R]: local 2048 x 8192 x 512, compute-bound (T_mem 15.7 us < 37.4 us)
    r = sharded_matmul("I:X,J", "J,K:R", {"I": 8192, "J": 8192, "K": 8192}, MESH, ideal=True)
    assert r.case == 1 and r.steps == () and r.out == "[I_X, K_R]"
    assert r.local_shape == (2048, 8192, 512)
    assert r.compute_s == pytest.approx(2 * 2048 * 8192 * 512 / C)
    assert r.time_overlapped_s == r.time_sequential_s == r.compute_s


def test_case2_small_batch_prefers_partial_matmul_and_allreduce():
    # A[I, J] . B[J_X, K], I = 128: AllGather B costs 2JK/W = 746 us; the partial matmul then AllReduce of
    # C[I, K] costs 2 * 2IK / W = 23.3 us (book ch.3: better when the output is smaller than the input).
    r = sharded_matmul("I,J", "J:X,K", {"I": 128, "J": 8192, "K": 8192}, MESH, ideal=True)
    assert r.case == 2 and r.strategy.startswith("multiply local slices")
    assert [s.kind for s in r.steps] == ["allreduce"]
    assert r.comm_s == pytest.approx(2 * 2 * 128 * 8192 / W)
    alt = dict(r.alternatives)["AllGather the contracting dim, then local matmul"]
    assert alt == pytest.approx(2 * 8192 * 8192 / W)


@pytest.mark.parametrize("output, kind, comm, out", [
    ("replicated", "allreduce", 2 * 2 * 4096 * 4096 / W, "[I, K]"),
    ("sharded", "reducescatter", 2 * 4096 * 4096 / W, "[I_X, K]"),
])
def test_case3_both_sharded_reduce(output, kind, comm, out):
    # A[I, J_X] . B[J_X, K]: local 4096 x 2048 x 4096 (149.7 us compute), then AllReduce (2V/W) or
    # ReduceScatter (V/W) of V = 2 * 4096 * 4096 bytes.
    r = sharded_matmul("I,J:X", "J:X,K", {"I": 4096, "J": 8192, "K": 4096}, MESH, output=output, ideal=True)
    assert r.case == 3 and [s.kind for s in r.steps] == [kind] and r.out == out
    compute = 2 * 4096 * 2048 * 4096 / C
    assert r.compute_s == pytest.approx(compute)
    assert r.comm_s == pytest.approx(comm)
    assert r.time_overlapped_s == pytest.approx(max(compute, comm))
    assert r.time_sequential_s == pytest.approx(compute + comm)


def test_case4_gathers_the_smaller_operand_first():
    # A[I_X, J] . B[J, K_X] is invalid; A's shard (2*256*8192 = 4.2 MB) is smaller than B's (33.5 MB):
    # AllGather A over X: V = 16.8 MB -> 16.8e6 / 1.8e11 = 93.2 us.
    r = sharded_matmul("I:X,J", "J,K:X", {"I": 1024, "J": 8192, "K": 8192}, MESH, ideal=True)
    assert r.case == 4 and r.out == "[I, K_X]"
    assert r.steps[0].kind == "allgather" and r.steps[0].purpose.startswith("case 4")
    assert r.comm_s == pytest.approx(2 * 1024 * 8192 / W)


@pytest.mark.parametrize("lhs, rhs, err", [
    ("I:X,J", "K,L", "exactly one contracting"),
    ("I:X,J:X", "J,K", "mesh axis twice"),
    ("I:Q,J", "J,K", "not in the mesh"),
    ("I,J", "J,K,Z", "no size for dimension"),
])
def test_matmul_errors(lhs, rhs, err):
    with pytest.raises(MeshplanError, match=err):
        sharded_matmul(lhs, rhs, {"I": 1024, "J": 1024, "K": 1024, "L": 8}, MESH)


def test_collective_matmul_hides_comm_when_compute_is_long():
    # AllGather of V = 16.8 MB over a wrapped ring of 4, bidirectional: 2 steps (2 shards, then 1).
    # Permute step: V/4 / 9e10 + 1 us = 47.6 us. Compute 1 ms -> c = 250 us per shard: all hidden.
    V = 2 * 1024 * 8192
    t_step = V / 4 / 9e10 + 1e-6
    r = collective_matmul_time("allgather", V, 1e-3, MESH, ["X"], ideal=True)
    assert r.steps == 2 and r.step_comm_s == pytest.approx(t_step)
    assert r.time_s == pytest.approx(1e-3) and r.hidden and r.exposed_comm_s == pytest.approx(0.0)
    # Compute 40 us -> c = 10 us: T = 10 + max(20, 47.6) + max(10, 47.6) us; unfused = 40 + V/W us
    r = collective_matmul_time("allgather", V, 40e-6, MESH, ["X"], ideal=True)
    assert r.time_s == pytest.approx(10e-6 + 2 * t_step)
    assert r.exposed_comm_s == pytest.approx(2 * t_step - 30e-6) and not r.hidden
    assert r.unfused_time_s == pytest.approx(40e-6 + V / W)


def test_collective_matmul_on_gpu_is_unidirectional():
    # 8 H100s: 7 steps of V/8 over NVLink (450e9) + 3 us each; compute 1 ms hides them all
    m = map_mesh(make_cluster(load_chip("h100-sxm"), 8), {"tensor": 8})
    V = 64e6
    r = collective_matmul_time("allgather", V, 1e-3, m, ["tensor"], ideal=True)
    assert r.steps == 7 and r.step_comm_s == pytest.approx(V / 8 / 450e9 + 3e-6) and r.hidden


def test_cli_matmul_json(capsys):
    code, out, _ = run_cli(["matmul", "--hardware", "tpu-v5p", "--chips", "64", "--mesh", "X=4,R=16",
                            "--lhs", "I,J:X", "--rhs", "J:X,K", "--sizes", "I=4096,J=8192,K=4096",
                            "--ideal", "--json"], capsys)
    assert code == 0
    d = json.loads(out)
    assert d["case"] == 3 and d["collectives"][0]["kind"] == "allreduce"
    assert d["book_ideal"]["comm_s"] == pytest.approx(2 * 2 * 4096 * 4096 / W)
    assert d["comm_s"] > d["book_ideal"]["comm_s"]  # realistic ICI efficiency below 1
    assert "mapping" in d


def test_cli_matmul_text(capsys):
    code, out, _ = run_cli(["matmul", "-h", "h100-sxm", "--chips", "64", "--mesh", "data=8,tensor=8",
                            "--lhs", "B:data,D:tensor", "--rhs", "D:tensor,F", "--sizes", "B=8192,D=8192,F=28672"],
                           capsys)
    assert code == 0 and "strategy:" in out and "tensor=8 -> NVLink" in out


def test_cli_matmul_bad_sizes(capsys):
    code, _, err = run_cli(["matmul", "-h", "h100-sxm", "--chips", "8", "--mesh", "tensor=8", "--lhs", "B,D:tensor",
                            "--rhs", "D:tensor,F", "--sizes", "B=8,D=-1,F=8"], capsys)
    assert code == 2 and err.startswith("error:")


def test_realistic_local_gemm_is_the_roofline_commands_realistic_time():
    # session 21, QA finding: `matmul` printed the local GEMM at the peak (2 x 8192 x 8192 x 3584 / 989e12 = 486 us on
    # an H100) as its realistic time, while `roofline` timed the same GEMM at its kernel efficiency
    from meshplan.cost import roofline as rf
    from meshplan.cost.efficiency import default_efficiency

    chip = load_chip("h100-sxm")
    m = map_mesh(make_cluster(chip, 8), {"tensor": 8})
    sizes = {"B": 8192, "D": 8192, "F": 28672}
    ideal = sharded_matmul("B,D", "D,F:tensor", sizes, m, ideal=True)
    real = sharded_matmul("B,D", "D,F:tensor", sizes, m)
    assert ideal.compute_s == pytest.approx(2 * 8192 * 8192 * 3584 / 989e12)
    op = rf.matmul(8192, 8192, 3584)
    assert real.compute_s == pytest.approx(rf.realistic_time_s(op, chip, default_efficiency(chip)))
    assert real.compute_s > ideal.compute_s


def test_realistic_fp8_gemm_runs_at_the_planners_fp8_rate():
    """Session 28: `roofline`'s realistic time multiplied an FP8 GEMM's bf16 large-GEMM fraction (0.80) by the FP8 one
    (0.62), timing it at 0.50 of the FP8 peak where the planner and the serving step use 0.62 (efficiency.yaml
    fp8_peak_fraction). By hand on an H100: 2 x 8192 x 8192 x 3584 FLOPs at 1979 TFLOP/s x 0.62 x 3584/(3584 + 256),
    the kernel's launch on top; and the same rate as the training ledger's FP8 GEMM (CostModel.mm_peak)."""
    from meshplan.cost import roofline as rf
    from meshplan.cost.efficiency import default_efficiency
    from meshplan.specs.model import load_model
    from meshplan.train.costmodel import CostModel, Options, Problem

    chip = load_chip("h100-sxm")
    eff = default_efficiency(chip)
    op = rf.matmul(8192, 8192, 3584, lhs_dtype="fp8", rhs_dtype="fp8")
    flops = 2 * 8192 * 8192 * 3584
    hand = flops / (1979e12 * 0.62 * 3584 / (3584 + 256)) + eff.kernel_overhead_s
    assert eff.fp8_peak_fraction == 0.62 and eff.matmul_half_dim == 256.0
    assert rf.realistic_time_s(op, chip, eff) == pytest.approx(hand, rel=1e-9)
    cm = CostModel(Problem(load_model("llama3-8b"), chip, 8, 4096, 8), eff, Options(compute_dtype="fp8",
                                                                                   fp8_recipe="tensorwise"))
    ledger = cm._matmul_time(flops, 8192, 8192, 3584)
    assert rf.realistic_time_s(op, chip, eff) - eff.kernel_overhead_s == pytest.approx(ledger, rel=1e-9)
