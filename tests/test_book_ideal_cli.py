"""The book's worked problems whose answer is ideal (peak FLOPs, peak bandwidth), answered through the CLI's
`--ideal` (the `book_ideal` key of --json), the way a reader would check the book with meshplan. The same
problems also pass through the Python API in test_book_network.py / test_book_single_chip.py /
test_book_inference.py; here only the CLI path is new. Presets carry the problems' inputs (v5e W = 8.2e11,
ICI 4.5e10 one-way; v4 ICI 4.5e10 one-way; H100 NVLink 450e9, NIC 50e9, bf16 9.89e14, HBM 3.35e12), which
each case asserts through `hardware --json` before using them.
"""

from __future__ import annotations

import json

import pytest
from conftest import answer, book_problems, run_cli

PROBLEMS = book_problems()


def _cli(capsys, *args: str) -> dict:
    code, out, err = run_cli(list(args), capsys)
    assert code == 0, err
    return json.loads(out)


def _coll(capsys, kind: str, hw: str, chips: int, mesh: str, axes: str, nbytes: float, *extra: str) -> dict:
    return _cli(capsys, "collective", kind, "--hardware", hw, "--chips", str(chips), "--mesh", mesh, "--axes", axes,
                "--bytes", repr(float(nbytes)), *extra, "--ideal", "--json")["book_ideal"]


def _check(pid: str, name: str, got: float, factor: float = 1.0) -> None:
    if pid not in PROBLEMS:
        pytest.skip("scaling_book_problems.yaml is not beside the project")
    p = PROBLEMS[pid]
    a = answer(p, name)
    want, tol = (a["exact"], 0.01) if "exact" in a else (a["value"], p.get("rel_tolerance", 0.01))
    assert got == pytest.approx(want * factor, rel=tol), (pid, name, got, want, factor)


@pytest.fixture(scope="module")
def presets():
    from meshplan.specs.hardware import load_chip

    v5e, v4, h100 = load_chip("tpu-v5e"), load_chip("tpu-v4"), load_chip("h100-sxm")
    assert v5e.hbm_bandwidth_bytes_per_s == 8.2e11 and v5e.peak("int8") == 3.94e14
    assert v5e.links.ici_bandwidth_per_link_bytes_per_s == 4.5e10 == v4.links.ici_bandwidth_per_link_bytes_per_s
    assert h100.links.nvlink_bandwidth_bytes_per_s == 450e9 and h100.links.scale_out_bandwidth_bytes_per_s == 50e9
    assert h100.peak("bf16") == 9.89e14 and h100.hbm_bandwidth_bytes_per_s == 3.35e12


def test_ch1_int8_critical_batch(capsys, presets):
    # C_int8/W = 3.94e14/8.2e11 = 480.49 OP/B; B_crit = 480.49/2 = 240.24
    d = _cli(capsys, "roofline", "--hardware", "tpu-v5e", "--op", "matmul:240,8192,8192@int8", "--dtype", "int8",
             "--ideal", "--json")
    _check("ch1-q1-int8-matmul", "hw_int8_intensity", d["critical_intensity"])
    _check("ch1-q1-int8-matmul", "B_crit", d["critical_batch"]["int8"])


def test_ch1_h100_critical_batch(capsys, presets):
    # 9.89e14 / 3.35e12 = 295.22 (bf16 weights and FLOPs: (C/W) x 2/2)
    d = _cli(capsys, "roofline", "--hardware", "h100-sxm", "--op", "matmul:1,8192,8192", "--ideal", "--json")
    _check("ch1-q5-h100-critical-batch", "B_crit", d["critical_batch"]["bf16"])


def test_ch3_popquiz2_no_wraparound(capsys, presets):
    # V = 2EF = 33,554,432 B over Y=4 of a 4x8 v5e slice (no wraparound): V x 3/(4 x 4.5e10) = 559 us
    b = _coll(capsys, "allgather", "tpu-v5e", 32, "X=8,Y=4", "Y", 2 * 2048 * 8192)
    _check("ch3-popquiz2-allgather-v5e", "t_no_wrap", b["time_s"])


def test_ch3_q2_v4p(capsys, presets):
    # 4x4x4 v4 (wraps), W_bidir = 9e10: AG_X of 2BD/Y = 2,097,152 B -> V/W = 23.3 us; AG_XY of 2BD = 8,388,608 B
    # over two axes -> V/(2W) = 46.6 us; AR_Z of 2BD/(XY) = 524,288 B -> 2V/W = 11.65 us
    B, D = 1024, 4096
    mesh = "X=4,Y=4,Z=4"
    _check("ch3-q2-allgather-v4p", "t_allgather_X", _coll(capsys, "allgather", "tpu-v4", 64, mesh, "X", 2 * B * D / 4)["time_s"])
    _check("ch3-q2-allgather-v4p", "t_allgather_XY",
           _coll(capsys, "allgather", "tpu-v4", 64, mesh, "X,Y", 2 * B * D)["time_s"])
    _check("ch3-q2-allgather-v4p", "t_allreduce_Z",
           _coll(capsys, "allreduce", "tpu-v4", 64, mesh, "Z", 2 * B * D / 16)["time_s"])


def test_ch3_q4_matmul_strategies(capsys, presets):
    # v5p alpha = C/W_bidir = 4.59e14/1.8e11 = 2550; at B = 10000 strategy 1 (AllGather) is compute-bound,
    # linear in D; strategy 2 (AllReduce Z[B,F]) is comm-bound, independent of D: they cross at D* = 2 alpha = 5100
    d = _cli(capsys, "matmul", "--hardware", "tpu-v5p", "--chips", "64", "--mesh", "X=4,R=16", "--lhs", "B,D",
             "--rhs", "D:X,F", "--sizes", "B=10000,D=4000,F=8192", "--ideal", "--json")["book_ideal"]
    t = {a["strategy"]: a["time_overlapped_s"] for a in d["alternatives"]}
    assert d["strategy"].startswith("AllGather")
    _check("ch3-q4-matmul-strategies", "D_threshold",
           4000 * t["multiply local slices, then reduce the partial output"] / t[d["strategy"]])


def test_ch3_q10_alltoall_factor(capsys, presets):
    # bidirectional wrapped ring: AllGather V/W_bidir, AllToAll V/(4 W_bidir) -> 4
    ag = _coll(capsys, "allgather", "tpu-v4", 64, "a=16,x=4", "x", 1e9)["time_s"]
    a2a = _coll(capsys, "alltoall", "tpu-v4", 64, "a=16,x=4", "x", 1e9)["time_s"]
    _check("ch3-q10-alltoall-factor", "bidirectional_ratio_AG_over_A2A", ag / a2a)


def test_ch12_popquiz1(capsys, presets):
    # V = 2BF = 33,554,432 B on 8 H100s: V x 7/(8 x 450e9) = 65.2 us
    b = _coll(capsys, "allgather", "h100-sxm", 8, "d=8", "d", 2 * 1024 * 16384)
    _check("ch12-popquiz1-allgather", "t_precise", b["time_s"])


def test_ch12_sharp(capsys, presets):
    # ring 2V x 7/(8W) vs SHARP V/W: 1.75 = the book's 2 (2B/W vs B/W) x the ring's 7/8, which the book drops
    ring = _coll(capsys, "allreduce", "h100-sxm", 8, "d=8", "d", 1e10, "--no-sharp")["time_s"]
    sharp = _coll(capsys, "allreduce", "h100-sxm", 8, "d=8", "d", 1e10, "--sharp")["time_s"]
    assert sharp == pytest.approx(1e10 / 450e9)
    _check("ch12-sharp", "ideal_speedup", ring / sharp, factor=7 / 8)


def test_ch12_fat_tree_levels(capsys, presets):
    # 1024 H100s: node 8 x 450e9/7 = 514e9; leaf 32 x 400e9/31 = 413e9; spine 4 x 12.8e12/3 = 17.1e12 (V/T per level)
    V = 1e9
    lv = _coll(capsys, "allgather", "h100-sxm", 1024, "data=128,tensor=8", "data,tensor", V)["levels"]
    bw = {k: V / t for k, t in lv.items()}
    _check("ch12-fat-tree-bandwidth", "node", bw["nvlink"])
    _check("ch12-fat-tree-bandwidth", "leaf", bw["leaf"])
    _check("ch12-fat-tree-bandwidth", "spine", bw["spine"])
    _check("ch12-fat-tree-bandwidth", "effective", min(bw.values()))


def test_ch12_two_node_allgather(capsys, presets):
    # 2 nodes: node level 8 x 450e9/7 = 514e9, cross-node 2 x 400e9/1 = 800e9 -> the node level binds
    V = 1e9
    lv = _coll(capsys, "allgather", "h100-sxm", 16, "data=2,tensor=8", "data,tensor", V)["levels"]
    _check("ch12-quiz4-q5-two-node-allgather", "node_level_bw", V / lv["nvlink"])
    _check("ch12-quiz4-q5-two-node-allgather", "cross_node_bw", V / lv["leaf"])


def test_ch12_cross_node_alltoall(capsys, presets):
    # 1 node: T = V 7/(450e9 x 64); the book's B/(8 W) drops 7/8 -> V/T x 7/8 = 3.6e12.
    # 2 nodes: T = V (2-1)/(4 x 400e9); the book's B/(2 x 400e9) drops 1/2 -> V/T x 1/2 = 8e11; ratio 4.5
    V = 1e9
    one = V / _coll(capsys, "alltoall", "h100-sxm", 8, "d=8", "d", V)["time_s"] * 7 / 8
    two = V / _coll(capsys, "alltoall", "h100-sxm", 16, "d=16", "d", V)["time_s"] / 2
    _check("ch12-cross-node-alltoall", "one_node_bw_equiv", one)
    _check("ch12-cross-node-alltoall", "two_node_bw_equiv", two)
    _check("ch12-cross-node-alltoall", "degradation", one / two)


def test_ch12_popquiz3_y8(capsys, presets):
    # AllGather_X(bf16[D_X, F_Y]) in one SU, Y = 8: V = 2DF/8 over X = 32 nodes: V x 31/(32 x 400e9) = 1.30 ms
    D, F = 8192, 32768
    b = _coll(capsys, "allgather", "h100-sxm", 256, "X=32,Y=8", "X", 2 * D * F / 8)
    _check("ch12-popquiz3-sharded-allgather", "t_Y_le_8", b["time_s"])


def test_ch8_int4_params_only_step(capsys, presets):
    # LLaMA-3-70B int4 on a v5e 2x2: weights 70.55e9 x 0.5 = 35.27e9 B / (4 x 8.2e11) = 10.75 ms
    # (the book's 70e9 -> 35e9/3.28e12 = 10.67 ms; 0.8% apart, the model's exact parameter count)
    d = _cli(capsys, "serve", "--model", "llama3-70b", "--hardware", "tpu-v5e", "--chips", "4", "--input-len", "1024",
             "--output-len", "512", "--quant", "int4", "--kv-quant", "int8", "--tp", "4", "--batch", "1", "--ideal",
             "--json")
    _check("ch8-full-hbm-latency", "int4_params_only_step", d["book_ideal"]["min_decode_step_s"])
    assert d["tpot_s"] > d["book_ideal"]["tpot_s"]
