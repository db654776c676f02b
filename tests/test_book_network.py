"""The chapter 2, 3 and 12 network problems of scaling_book_problems.yaml, answered through meshplan's API.

Each entry of SOLVERS maps a problem id to a function of its `inputs` that returns {answer name: value}
computed with meshplan (topology, collectives, sharded matmuls). Where the book's worked answer drops an
(N-1)/N factor that meshplan keeps, the solver says so and converts explicitly (`BOOK_FACTOR`).
"""

from __future__ import annotations

import dataclasses

import pytest
from conftest import answer, book_problems

from meshplan.cost.collectives import collective, group_collective, level_bandwidths, point_to_point
from meshplan.cost.sharded_matmul import sharded_matmul
from meshplan.cost.topology import make_cluster, map_mesh
from meshplan.specs.hardware import load_chip

PROBLEMS = book_problems()


def _chip(name: str, peak: float | None = None, **links):
    chip = load_chip(name)
    if links:
        chip = chip.with_overrides(links=dataclasses.replace(chip.links, **links))
    if peak:
        chip = chip.with_overrides(peak_flops_per_s={**chip.peak_flops_per_s, "bf16": peak})
    return chip


# ---------------------------------------------------------------- chapter 2 / 3 (TPU)


def ch2_q5(i):
    # 4x4 v5e slice has no wraparound (only a 16-long axis wraps); (0,0)->(3,3): 6 hops, 2 ports.
    v5e = _chip("tpu-v5e", ici_bandwidth_per_link_bytes_per_s=i["link_bw_one_way"], fast_hop_latency_s=i["hop_latency_s"])
    c = point_to_point(make_cluster(v5e, 16, (4, 4)), i["bytes"], (0, 0), (3, 3))
    return {"t_bandwidth": c.bandwidth_time_s, "t_first_byte": c.latency_time_s, "t_total": c.time_s}


def ch3_popquiz2(i):
    # V = 2EF bytes; wrapped ring: V/W_bidir = 33554432/9e10; no wraparound on an axis of 4: V*3/(4*4.5e10)
    V = 2 * i["E"] * i["F"]
    v5e = _chip("tpu-v5e", ici_bandwidth_per_link_bytes_per_s=i["ici_one_way"])
    mesh = {"X": 8, "Y": i["Y"]}
    wrapped = map_mesh(make_cluster(v5e, 32, wraparound=True), mesh)
    plain = map_mesh(make_cluster(v5e, 32), mesh)  # 4x8 slice: no wraparound on v5e
    return {"t_ideal": collective("allgather", V, wrapped, ["Y"], ideal=True).time_s,
            "t_no_wrap": collective("allgather", V, plain, ["Y"], ideal=True).time_s}


def ch3_latency_threshold(i):
    # 16-long wrapped ring: latency 8 hops x 1us = 8us; bandwidth V/9e10 -> V* = 720 kB, per shard 45 kB
    v5e = _chip("tpu-v5e", ici_bandwidth_per_link_bytes_per_s=i["ici_one_way"], fast_hop_latency_s=i["hop_latency"])
    m = map_mesh(make_cluster(v5e, 256), {"x": 16, "y": 16})
    c = collective("allgather", 1e6, m, ["y"], ideal=True)
    v_star = 1e6 * c.latency_time_s / c.bandwidth_time_s  # bandwidth term is linear in V
    assert collective("allgather", 0.9 * v_star, m, ["y"], ideal=True).regime == "latency"
    assert collective("allgather", 1.1 * v_star, m, ["y"], ideal=True).regime == "bandwidth"
    return {"threshold_bytes": v_star / 16}


def ch7_latency_bound(i):
    # 8-way wrapped ring: 4 hops x 1us; V/(2*4.5e10) = 4us at V = 360 kB
    v5e = _chip("tpu-v5e", ici_bandwidth_per_link_bytes_per_s=i["ici_one_way"])
    m = map_mesh(make_cluster(v5e, 8, (8, 1), wraparound=True), {"tensor": i["shards"]})
    c = collective("allgather", 1e6, m, ["tensor"], ideal=True)
    acts = i["B"] * i["D"]  # int8 activations, 1 byte each
    assert collective("allgather", acts, m, ["tensor"], ideal=True).regime == "latency"  # book: latency-bound
    return {"buffer_threshold": 1e6 * c.latency_time_s / c.bandwidth_time_s, "activation_bytes": acts}


def ch3_q2(i):
    # AG_X([B_X, D_Y]): V = 2BD/Y over one wrapped axis -> V/W; AG_XY: V = 2BD over 2 axes -> V/(2W);
    # AR_Z([B_X, D_Y]{U_Z}): V = 2BD/(XY) -> 2V/W.  W = 9e10 bidirectional.
    v4 = _chip("tpu-v4", ici_bandwidth_per_link_bytes_per_s=i["ici_bidir"] / 2)
    m = map_mesh(make_cluster(v4, 64), {"X": i["X"], "Y": i["Y"], "Z": i["Z"]})
    assert m.cluster.slice_shape == (4, 4, 4) and all(m.cluster.wraparound)
    bd = 2 * i["B"] * i["D"]
    return {"t_allgather_X": collective("allgather", bd / i["Y"], m, ["X"], ideal=True).time_s,
            "t_allgather_XY": collective("allgather", bd, m, ["X", "Y"], ideal=True).time_s,
            "t_allreduce_Z": collective("allreduce", bd / (i["X"] * i["Y"]), m, ["Z"], ideal=True).time_s}


def ch3_q4(i):
    # v5p: C / W_bidir = 4.59e14 / 1.8e11 = 2550 = alpha. For B = 10000 > alpha, strategy 1 (AllGather
    # Y[D_X, F]) is compute-bound: T1 = 2BDF/C, linear in D; strategy 2 (partial matmul + AllReduce Z[B,F])
    # is comm-bound: T2 = 4BF/W, independent of D. They cross at D* = 4000 * T2 / T1(4000) = 2C/W.
    v5p = load_chip("tpu-v5p")
    assert v5p.peak() / (2 * v5p.links.ici_bandwidth_per_link_bytes_per_s) == pytest.approx(i["alpha"])
    m = map_mesh(make_cluster(v5p, 64), {"X": 4, "R": 16})
    r = sharded_matmul("B,D", "D:X,F", {"B": 10000, "D": 4000, "F": 8192}, m, ideal=True)
    t = dict(r.alternatives)
    assert r.strategy.startswith("AllGather")
    return {"D_threshold": 4000 * t["multiply local slices, then reduce the partial output"] / t[r.strategy]}


def ch3_q10(i):
    # Bidirectional wrapped ring: AllGather V/W_bidir, AllToAll V/(4 W_bidir) -> ratio 4.
    m = map_mesh(make_cluster(load_chip("tpu-v4"), 64), {"a": 16, "x": 4})
    ag = collective("allgather", 1e9, m, ["x"], ideal=True).time_s
    return {"bidirectional_ratio_AG_over_A2A": ag / collective("alltoall", 1e9, m, ["x"], ideal=True).time_s}


def ch3_popquiz_fp32(i):
    # A[I_XY, J] on {'X': 8, 'Y': 2}: local rows 1024/16 = 64; bytes 64 * 4096 * 4
    m = map_mesh(make_cluster(load_chip("h100-sxm"), 16), dict(i["mesh"]))
    r = sharded_matmul("I:X+Y,J", "J,K", {"I": i["shape"][0], "J": i["shape"][1], "K": 128}, m, dtype="fp32")
    rows, cols, _ = r.local_shape
    return {"local_rows": rows, "bytes_per_device": rows * cols * i["bytes_per_elem"]}


# ---------------------------------------------------------------- chapter 12 (GPU)


def _h100(n, **kw):
    return make_cluster(_chip("h100-sxm", **kw), n)


def ch12_quiz2(i):
    c = _h100(8, nvlink_bandwidth_bytes_per_s=i["gpu_egress"])
    # bisection of a non-blocking NVSwitch node: 4 GPUs x 450 GB/s in each of 2 directions
    return {"node_bw": c.domain_fast_bandwidth_bytes_per_s, "bisection_bw": c.domain_fast_bandwidth_bytes_per_s}


def ch12_popquiz1(i):
    # V = 2BF; precise ring: V (N-1)/(N W); the book's approximation is V/W (drops (N-1)/N)
    V = 2 * i["B"] * i["F"]
    c = group_collective("allgather", V, _h100(i["N"], nvlink_bandwidth_bytes_per_s=i["W"]), i["N"], ideal=True)
    return {"t_precise": c.time_s, "t_approx": c.time_s * i["N"] / (i["N"] - 1)}


def ch12_fat_tree(i):
    # 1024 GPUs = 128 nodes: node D=8 W=450e9 -> 514e9; leaf D=32 W=400e9 -> 413e9; spine D=4 W=12.8e12
    c = _h100(1024)
    bw = level_bandwidths(map_mesh(c, {"data": 128, "tensor": 8}).group(["data", "tensor"]))
    return {"node": bw["nvlink"], "leaf": bw["leaf"], "spine": bw["spine"], "effective": min(bw.values())}


def ch12_two_node_ag(i):
    # node: 8*450e9/7 = 514e9; cross-node (D=2): 2*400e9/1 = 800e9 -> the node level binds
    bw = level_bandwidths(map_mesh(_h100(16), {"data": 2, "tensor": 8}).group(["data", "tensor"]))
    return {"node_level_bw": bw["nvlink"], "cross_node_bw": bw["leaf"],
            "bottleneck": "node" if min(bw, key=bw.get) == "nvlink" else "cross"}


BOOK_FACTOR: dict[str, float] = {}
# Answers compared with the book's rounded `value` within the problem's rel_tolerance (not `exact` within 1%),
# because meshplan keeps a term the book's rule of thumb drops (see the solver's comment).
USE_VALUE = {("ch12-tp-limit", "Y_in_node"), ("ch12-tp-limit", "Y_cross_node")}


def ch12_popquiz3(i):
    # AllGather_X(bf16[D_X, F_Y]) in one SU (256 GPUs): V per X-group = 2DF/Y.
    # Y <= 8: X has one member per node on 32 nodes, k = 8/Y NICs per node-group: 2DF*31/(32*400e9).
    # Y = 16, 32: X = 16, 8 members, one per node: precise (X-1)/X * 2DF/(Y*50e9); the book drops (X-1)/X.
    D, F = i["D"], i["F"]
    out = {}
    for name, Y in (("t_Y_le_8", 8), ("t_Y16", 16), ("t_Y32", 32)):
        m = map_mesh(_h100(256), {"X": 256 // Y, "Y": Y})
        out[name] = collective("allgather", 2 * D * F / Y, m, ["X"], ideal=True).time_s
    BOOK_FACTOR.update({"t_Y16": 15 / 16, "t_Y32": 7 / 8})
    assert collective("allgather", 2 * D * F / 4, map_mesh(_h100(256), {"X": 64, "Y": 4}), ["X"],
                      ideal=True).time_s == pytest.approx(out["t_Y_le_8"])
    return out


def _dp_critical(chip, n, C):
    # DP per-GPU critical batch: T_math = 8BDF/(X C) vs T_comms = AllReduce(4DF bytes) -> B/X = C T_AR/(8DF)
    D = F = 8192
    t = group_collective("allreduce", 4 * D * F, make_cluster(chip, n), n, ideal=True, sharp=False)
    return C * t.time_s / (8 * D * F)


def ch12_dp(i):
    C = i["C"]
    h100 = _chip("h100-sxm", peak=C, nvlink_bandwidth_bytes_per_s=i["W_node"])
    h800 = _chip("h800", peak=C, nvlink_bandwidth_bytes_per_s=i["W_h800"])
    # the book drops (N-1)/N: in node 7/8; across >= 32 nodes the leaf level binds with 31/32
    BOOK_FACTOR.update({"in_node": 7 / 8, "h800": 7 / 8, "cross_node": 31 / 32, "llama3_16k_gpus": 31 / 32,
                        "deepseek_2048": 7 / 8})
    cross = _dp_critical(h100, 256, C)
    return {"in_node": _dp_critical(h100, 8, C), "cross_node": cross, "h800": _dp_critical(h800, 8, C),
            "llama3_16k_gpus": cross * 16000, "deepseek_2048": _dp_critical(h800, 8, C) * 2048}


def ch12_moe_dp(i):
    # MoE: T_math scales with k active experts, T_comms with all E -> (E/k) x the DP critical batch
    BOOK_FACTOR["per_gpu_batch"] = 31 / 32
    return {"per_gpu_batch": i["E"] / i["k"] * _dp_critical(_chip("h100-sxm", peak=990e12), 256, 990e12)}


def ch12_two_node_dp(i):
    # 2 nodes: the cross-node level of the AllReduce is 2 V (X-1)/(X W_node) -> alpha (X-1)/X = 1237.5.
    # (meshplan's full answer is larger: the NVLink level binds at 2 nodes, as in the book's Quiz 4 Q5.)
    D = F = 8192
    m = map_mesh(_h100(16), {"data": 2, "tensor": 8})
    t_leaf = dict(collective("allreduce", 4 * D * F, m, ["data", "tensor"], ideal=True, sharp=False).levels)["leaf"]
    return {"per_gpu_batch": 990e12 * t_leaf / (8 * D * F)}


def ch12_tp_limit(i):
    # Megatron TP: T_math = 4BDF/(Y C); T_comms = AG + RS of 2BD bytes over Y.
    # In node, precise: T_comms = 4BD (Y-1)/(Y W) -> Y_max - 1 = F W / C (book: Y < F W / C, ~8% apart).
    # Across many nodes the leaf level binds: T_comms = 4BD 31/(32 W_node) -> Y_max = F W_node 32/(31 C).
    B, D, F, C = 4096, 8192, i["F"], 990e12
    chip = _chip("h100-sxm", peak=C)

    def ratio(n):
        t = 2 * group_collective("allgather", 2 * B * D, make_cluster(chip, n), n, ideal=True).time_s
        return 4 * B * D * F / (n * C) / t

    return {"Y_in_node": 7 * ratio(8) + 1, "Y_cross_node": 256 * ratio(256)}


def ch12_gb200(i):
    gb = make_cluster(load_chip("gb200-nvl72"), 72).node_egress_bytes_per_s  # 72 NICs x 50 GB/s
    return {"node_egress": gb, "ratio_vs_h100": gb / _h100(8).node_egress_bytes_per_s}


def ch12_sharp(i):
    # ideal: ring 2V(N-1)/(N W) vs SHARP V/W (no (N-1)/N: each GPU sends V to the switch) -> 2 x 7/8 = 1.75;
    # the book's 2B/W vs B/W drops the ring's 7/8 (its note: "~75% predicted").
    # measured: ~30% gain -> bus bandwidth 2V(N-1)/N / T ~ 370 x 1.3 = 480 GB/s at 10 GB
    c, V = _h100(8, nvlink_bandwidth_bytes_per_s=i["W"]), 10e9
    plain, sharp = (group_collective("allreduce", V, c, 8, sharp=s) for s in (False, True))
    ideal = [group_collective("allreduce", V, c, 8, ideal=True, sharp=s).time_s for s in (False, True)]
    assert ideal[1] == pytest.approx(V / i["W"])  # SHARP: B/W exactly
    BOOK_FACTOR["ideal_speedup"] = 7 / 8
    return {"ideal_speedup": ideal[0] / ideal[1], "observed_gain": plain.time_s / sharp.time_s - 1,
            "observed_effective_bw": 2 * V * 7 / 8 / sharp.time_s}


def ch12_cross_node_a2a(i):
    # 1 node: T = V (N-1)/(W N^2); the book's V/(N W) drops (N-1)/N -> equivalent bw V/T * (N-1)/N = 3.6e12.
    # 2 nodes: T = V (M-1)/(M^2 W_node) = V/(4 * 400e9); the book's V/(M W_node) drops (M-1)/M -> 8e11.
    one = group_collective("alltoall", 1e9, _h100(8, nvlink_bandwidth_bytes_per_s=i["W_gpu"]), 8, ideal=True)
    two = group_collective("alltoall", 1e9, _h100(16), 16, ideal=True)
    a, b = 1e9 / one.time_s * 7 / 8, 1e9 / two.time_s * 1 / 2
    return {"one_node_bw_equiv": a, "two_node_bw_equiv": b, "degradation": a / b}


SOLVERS = {
    "ch2-q5-ici-transfer": ch2_q5,
    "ch3-popquiz2-allgather-v5e": ch3_popquiz2,
    "ch3-latency-threshold-v5e": ch3_latency_threshold,
    "ch7-latency-bound-collectives": ch7_latency_bound,
    "ch3-q2-allgather-v4p": ch3_q2,
    "ch3-q4-matmul-strategies": ch3_q4,
    "ch3-q10-alltoall-factor": ch3_q10,
    "ch3-popquiz-fp32-h100": ch3_popquiz_fp32,
    "ch12-quiz2-node-bandwidth": ch12_quiz2,
    "ch12-popquiz1-allgather": ch12_popquiz1,
    "ch12-fat-tree-bandwidth": ch12_fat_tree,
    "ch12-quiz4-q5-two-node-allgather": ch12_two_node_ag,
    "ch12-popquiz3-sharded-allgather": ch12_popquiz3,
    "ch12-dp-critical-batch": ch12_dp,
    "ch12-moe-dp": ch12_moe_dp,
    "ch12-two-node-dp": ch12_two_node_dp,
    "ch12-tp-limit": ch12_tp_limit,
    "ch12-gb200-node-egress": ch12_gb200,
    "ch12-sharp": ch12_sharp,
    "ch12-cross-node-alltoall": ch12_cross_node_a2a,
}

# Answers meshplan does not model (reason), checked to exist so the list stays honest.
NOT_EXPRESSIBLE = {
    ("ch2-q5-ici-transfer", "bytes"): "input restated",
    ("ch3-popquiz2-allgather-v5e", "array_bytes"): "input restated",
    ("ch3-popquiz2-allgather-v5e", "shard_bytes"): "input restated",
    ("ch3-popquiz2-allgather-v5e", "t_measured"): "a measurement (680 us); meshplan's 95% ICI efficiency gives 589 us",
    ("ch3-q10-alltoall-factor", "unidirectional_ratio_AG_over_A2A"): "meshplan has no unidirectional ring",
    ("ch3-popquiz-fp32-h100", "t_load"): "an HBM load (roofline), not a collective",
    ("ch12-quiz2-node-bandwidth", "switch_bw"): "NVSwitch port counts are not modelled",
}


def _cases():
    for pid, solver in SOLVERS.items():
        yield pytest.param(pid, solver, id=pid)


@pytest.mark.parametrize("pid, solver", list(_cases()))
def test_book_problem(pid, solver):
    if pid not in PROBLEMS:
        pytest.skip("scaling_book_problems.yaml is not beside the project (shared/reference)")
    p = PROBLEMS[pid]
    BOOK_FACTOR.clear()
    got = solver(p["inputs"])
    checked = 0
    for a in p["answers"]:
        if (pid, a["name"]) in NOT_EXPRESSIBLE:
            continue
        assert a["name"] in got, f"{pid}: no meshplan value for answer '{a['name']}'"
        exact = "exact" in a and (pid, a["name"]) not in USE_VALUE
        _compare(pid, a, got[a["name"]], p.get("rel_tolerance", 0.01), exact)
        checked += 1
    assert checked == len(got), f"{pid}: solver returned answers the YAML lacks"


def _compare(pid: str, a: dict, value, tol: float, exact: bool) -> None:
    if isinstance(a["value"], str):
        assert value == a["value"], f"{pid}/{a['name']}"
        return
    factor = BOOK_FACTOR.get(a["name"], 1.0)
    want, rtol = (a["exact"], min(tol, 0.01)) if exact else (a["value"], tol)
    assert value == pytest.approx(want * factor, rel=rtol), f"{pid}/{a['name']}: {value} vs {want} x {factor}"


def test_not_expressible_entries_exist():
    if not PROBLEMS:
        pytest.skip("scaling_book_problems.yaml is not beside the project")
    for pid, name in NOT_EXPRESSIBLE:
        answer(PROBLEMS[pid], name)
