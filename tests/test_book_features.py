"""Issue 19: the book's questions meshplan answers now (ch.3, ch.7, ch.8, ch.12), each against numbers worked out
by hand from the book's formulas (arithmetic in the comments), through the Python API and the CLI."""

from __future__ import annotations

import json
import math

import pytest
from conftest import run_cli

from meshplan.cost import roofline as rf
from meshplan.cost.collectives import group_collective, ragged_alltoall, ragged_destinations
from meshplan.cost.sharded_matmul import bytes_all_chips, replication_factor, sharded_matmul
from meshplan.cost.topology import make_cluster, map_mesh
from meshplan.infer import bounds as bd
from meshplan.specs.hardware import ON_CHIP_KEYS, load_chip
from meshplan.specs.pod import superpod

# ---------------------------------------------------------------- the one critical batch


def test_one_critical_batch_per_precision_v5e():
    # v5e C_bf16 = 1.97e14, C_int8 = 3.94e14, W = 8.2e11 (book ch.7 §8.1):
    # bf16: 1.97e14/8.2e11 * 2/2 = 240.24; int8 weights + bf16 FLOPs: 240.24 * 1/2 = 120.12;
    # int8 weights + int8 FLOPs: 3.94e14/8.2e11 * 1/2 = 240.24 (the book's 240, not 480)
    got = rf.chip_critical_batches(load_chip("tpu-v5e"))
    assert got["bf16"] == pytest.approx(240.24, rel=1e-4)
    assert got["int8_weights_bf16_flops"] == pytest.approx(120.12, rel=1e-4)
    assert got["int8"] == pytest.approx(240.24, rel=1e-4)
    assert not hasattr(bd, "critical_batch")  # the 480-giving duplicate is gone


# ---------------------------------------------------------------- ch.3: replication, totals


def test_replication_factor_book_ch3_q1():
    # A[I_X, J] on Mesh({X: 4, Y: 8, Z: 2}): replicated over Y and Z -> 8 * 2 = 16 copies (book ch.3 Q1)
    m = map_mesh(make_cluster(load_chip("tpu-v5p"), 64), {"X": 4, "Y": 8, "Z": 2})
    assert replication_factor("I:X,J", m) == 16
    assert replication_factor("I:X+Y,J:Z", m) == 1
    assert replication_factor("I,J", m) == 64


def test_bytes_all_chips_book_ch3_pop_quiz():
    # int8[128, 2048] as A[I_XY, J] on {X: 2, Y: 8, Z: 2}: one copy per Z plane -> 128 * 2048 * 2 = 524,288 B
    m = map_mesh(make_cluster(load_chip("tpu-v5e"), 32), {"X": 2, "Y": 8, "Z": 2})
    assert bytes_all_chips("I:X+Y,J", {"I": 128, "J": 2048}, m, "int8") == 524288


def test_sharded_matmul_comm_totals():
    # X[B, D] . Y[D_X, F] on v5p {X: 4, R: 16}: AllGather Y over X, V = D F 2 = 4000 * 8192 * 2 = 65.536e6 B;
    # each chip sends V (X-1)/X = 49.152e6 B; all 64 chips: 64 * 49.152e6 = 3.145728e9 B
    m = map_mesh(make_cluster(load_chip("tpu-v5p"), 64), {"X": 4, "R": 16})
    r = sharded_matmul("B,D", "D:X,F", {"B": 10000, "D": 4000, "F": 8192}, m, ideal=True)
    assert r.comm_bytes_per_chip == pytest.approx(49.152e6)
    assert r.comm_bytes_all_chips == pytest.approx(3.145728e9)
    assert dict(r.replication) == {"[B, D]": 64, "[D_X, F]": 16, "[B, F]": 64}


# ---------------------------------------------------------------- ch.7 / ch.8: serving


@pytest.mark.parametrize("chips, param_bytes, kv_per_token", [
    (16, 140e9, 324e3),  # bf16: (16*16e9 - 140e9) / (8192*324e3) = 116e9 / 2.654e9 = 43.70 -> 43
    (8, 70e9, 162e3),  # int8: (128e9 - 70e9) / (8192*162e3) = 58e9 / 1.327e9 = 43.70 -> 43
    (4, 35e9, 81e3),  # int4: (64e9 - 35e9) / (8192*81e3) = 29e9 / 6.635e8 = 43.70 -> 43
])
def test_ideal_max_decode_batch_book_ch8(chips, param_bytes, kv_per_token):
    assert bd.ideal_max_decode_batch(chips * 16e9, param_bytes, kv_per_token * 8192) == 43


def test_ideal_max_decode_batch_zero_when_weights_do_not_fit():
    assert bd.ideal_max_decode_batch(2 * 16e9, 70e9, 1e9) == 0


def test_queries_per_s_per_chip_book_ch8():
    # 43 / (0.019 * 512 * 16) = 43 / 155.648 = 0.2763 (book: 0.27 for bf16 on 4x4)
    assert bd.queries_per_s_per_chip(43, 0.019, 512, 16) == pytest.approx(0.27626, rel=1e-4)


def test_max_batch_for_step_target():
    # LLaMA-3-70B int8 on v5e 4x2, KV 8192 x 162e3 = 1.327104e9 per sequence, target 17 ms:
    # N W = 6.56e12; memory: (0.017 * 6.56e12 - 70e9) / 1.327104e9 = 4.152e10 / 1.327104e9 = 31.29;
    # FLOPs: 0.017 / (1.327104e9/6.56e12 + 2*70e9/(8*1.97e14)) = 0.017 / (2.0230e-4 + 8.883e-5) = 58.4 -> 31
    kv = 8192 * 162e3
    b = bd.max_batch_for_step(0.017, 70e9, kv, 8, 8.2e11, 1.97e14, 70e9)
    assert b == 31
    assert bd.ideal_decode_step(70e9, kv, 31, 8, 8.2e11, 1.97e14, 70e9) <= 0.017
    assert bd.ideal_decode_step(70e9, kv, 32, 8, 8.2e11, 1.97e14, 70e9) > 0.017
    assert bd.max_batch_for_step(0.005, 70e9, kv, 8, 8.2e11, 1.97e14, 70e9) == -1  # 70e9/6.56e12 = 10.7 ms


def test_ideal_serving_point_smallest_topology():
    # int4 weights 70e9 * 0.5 = 35e9 -> 35e9/16e9 = 2.19 -> 4 chips (power of two); batch 43 (see above);
    # step = (43 * 6.635e8 + 35e9)/(4 * 8.2e11) = (2.853e10 + 3.5e10)/3.28e12 = 19.37 ms (FLOPs 2*43*70e9/(4*1.97e14)
    # = 7.6 ms < 10.7 ms weights); QPS/chip = 43 / (0.01937 * 512 * 4) = 1.084
    p = bd.ideal_serving_point(70e9, "int4", 81e3, 8192, 512, 16e9, 8.2e11, 1.97e14)
    assert (p.chips, p.max_batch, p.batch) == (4, 43, 43)
    assert p.step_s == pytest.approx((43 * 8192 * 81e3 + 35e9) / 3.28e12)
    assert p.queries_per_s_per_chip == pytest.approx(43 / (p.step_s * 512 * 4))
    assert p.step_s == pytest.approx(0.01937, rel=1e-3)


def test_weight_stationary_2d_book_ch7_q7():
    # F = 4D: X = sqrt(D N/(2F)) = sqrt(N/8); T_2D = sqrt(128) B D/(sqrt(N) W); T_1D = 4BD/(3W); crossover
    # 128 (3/4)^2 = 72. B=64, D=8192, W=9e10: N=256: T_2D = 11.3137*524288/(16*9e10) = 4.119e-6 s,
    # T_1D = 2097152/2.7e11 = 7.767e-6 s -> 2D; N=64: T_2D = 11.3137*524288/(8*9e10) = 8.238e-6 s -> 1D.
    w = bd.weight_stationary_2d(64, 8192, 32768, 256, 9e10, 1.97e14)
    assert w.x == pytest.approx(math.sqrt(32)) and w.yz == pytest.approx(256 / math.sqrt(32))
    assert w.t_comms_2d_s == pytest.approx(4.119e-6, rel=1e-3)
    assert w.t_comms_1d_s == pytest.approx(7.767e-6, rel=1e-3)
    assert w.crossover_chips == pytest.approx(72) and w.better == "2d"
    small = bd.weight_stationary_2d(64, 8192, 32768, 64, 9e10, 1.97e14)
    assert small.t_comms_2d_s == pytest.approx(8.238e-6, rel=1e-3) and small.better == "1d"


def test_weight_stationary_1d_side_counts_the_chips_own_torus_axes():
    # v5e is a 2D torus: the 1D comparison shards over 2 axes, T_1D = 4BD/(2W), and 2D wins past
    # 32 (F/D) (2/4)^2 = 32 x 3.5 x 0.25 = 28 chips for Llama 3.1 70B (F = 28672 = 3.5 D); v5p keeps the book's 3 axes
    from meshplan.infer.config import ServeConfig, Workload
    from meshplan.infer.ideal import ideal_serving
    from meshplan.specs.model import load_model

    m = load_model("llama3.1-70b")
    for name, axes, crossover in (("tpu-v5e", 2, 28.0), ("tpu-v5p", 3, 63.0)):
        chip = load_chip(name)
        ws = ideal_serving(m, chip, ServeConfig(tp=16), Workload(1000, 100), 64, None)["weight_stationary_2d"]
        W = 2 * chip.links.ici_bandwidth_per_link_bytes_per_s
        assert ws["t_comms_1d_s"] == pytest.approx(4 * 64 * 8192 / (axes * W))
        assert ws["crossover_chips"] == pytest.approx(crossover)


# ---------------------------------------------------------------- ch.12: chips, SuperPod, SHARP, ragged all-to-all


def test_on_chip_memories_have_sources():
    # book ch.12 table: H100 SMEM 256 kB/SM, L2 50 MB, 132 SMs; B200 L2 126 MB; book ch.2: v5e VMEM 128 MiB
    h100, b200, v5e = load_chip("h100-sxm"), load_chip("b200"), load_chip("tpu-v5e")
    assert h100.on_chip_memory["smem_bytes_per_sm"] == 256 * 1024 and h100.on_chip_memory["l2_bytes"] == 50e6
    assert h100.on_chip_memory["sm_count"] == 132 and b200.on_chip_memory["l2_bytes"] == 126e6
    assert v5e.on_chip_memory["vmem_bytes"] == 128 * 2**20
    for chip in (h100, b200, v5e):
        for k in chip.on_chip_memory:
            assert k in ON_CHIP_KEYS and chip.sources[f"on_chip_memory.{k}"]


def test_superpod_h100_book_ch12_table():
    # node 8 x 450e9 = 3.6e12; leaf (SU) 8 switches x 64 ports x 50e9 / 2 = 12.8e12 = 256 x 50e9;
    # spine 16 x 64 x 50e9 = 51.2e12 = 1024 x 50e9; switches 128 x 4 + 4 x 8 + 16 = 560
    sp = superpod(load_chip("h100-sxm"))
    assert (sp.gpus, sp.nodes, sp.su_count, sp.total_switches) == (1024, 128, 4, 560)
    lv = {x.name: x for x in sp.levels}
    assert lv["node"].unit_bandwidth_bytes_per_s == 3.6e12 and lv["node"].per_gpu_bytes_per_s == 450e9
    assert lv["leaf"].unit_bandwidth_bytes_per_s == 12.8e12 and lv["leaf"].per_gpu_bytes_per_s == 50e9
    assert lv["spine"].unit_bandwidth_bytes_per_s == 51.2e12 and lv["spine"].per_gpu_bytes_per_s == 50e9
    assert sp.node_egress_bytes_per_s == 400e9


def test_superpod_b200():
    # B200 node 8 x 900e9 = 7.2e12 on 2 NVSwitches; switches 128 x 2 + 32 + 16 = 304; node egress 8 x 50e9
    sp = superpod(load_chip("b200"))
    assert sp.levels[0].unit_bandwidth_bytes_per_s == 7.2e12 and sp.total_switches == 304
    assert sp.node_egress_bytes_per_s == 400e9


def test_sharp_allreduce_is_b_over_w():
    # book ch.12: SHARP AllReduce T = B/W with no (N-1)/N; 1e9/450e9 = 2.222 ms on one H100 node
    c = make_cluster(load_chip("h100-sxm"), 8)
    assert group_collective("allreduce", 1e9, c, 8, ideal=True, sharp=True).time_s == pytest.approx(1e9 / 450e9)


def test_ragged_alltoall():
    # expected distinct destinations n(1 - ((n-1)/n)^k): k=1 -> 1; k=2, n=8 -> 8(1 - 49/64) = 1.875;
    # k=8, n=8 -> 8(1 - 0.343608) = 5.2511. Dense AllToAll on 8 H100s V (N-1)/(W N^2) = 1e9*7/(450e9*64)
    # = 2.4306e-4 s; top-2 ragged: x 1.875 = 4.5573e-4 s
    assert ragged_destinations(1, 8) == pytest.approx(1.0)
    assert ragged_destinations(2, 8) == pytest.approx(1.875)
    assert ragged_destinations(8, 8) == pytest.approx(5.2511, rel=1e-4)
    m = map_mesh(make_cluster(load_chip("h100-sxm"), 8), {"ep": 8})
    assert ragged_alltoall(1e9, m, ["ep"], 2, ideal=True).time_s == pytest.approx(4.5573e-4, rel=1e-4)


# ---------------------------------------------------------------- CLI


def test_cli_hardware_json_has_superpod_and_on_chip(capsys):
    code, out, _ = run_cli(["hardware", "h100-sxm", "--json"], capsys)
    d = json.loads(out)
    assert code == 0 and d["on_chip_memory"]["l2_bytes"] == 50e6
    assert d["superpod_structure"]["total_switches"] == 560


def test_cli_hardware_text_shows_fabric(capsys):
    code, out, _ = run_cli(["hardware", "b200"], capsys)
    assert code == 0 and "SuperPod" in out and "tmem_bytes_per_sm" in out


def test_cli_roofline_ideal_json(capsys):
    # matmul 4096 x 8192 x 8192 bf16 on v5e: ideal T = 2*4096*8192*8192/1.97e14 = 2.790 ms (compute-bound);
    # the realistic time is at least that
    code, out, _ = run_cli(["roofline", "--hardware", "tpu-v5e", "--op", "matmul:4096,8192,8192", "--ideal",
                            "--json"], capsys)
    d = json.loads(out)
    b = d["book_ideal"]["ops"][0]
    assert code == 0 and b["time_s"] == pytest.approx(2 * 4096 * 8192 * 8192 / 1.97e14)
    assert b["realistic_s"] > b["time_s"] and d["ops"][0]["realistic_s"] == b["realistic_s"]
    assert d["critical_batch"]["int8"] == pytest.approx(3.94e14 / 8.2e11 / 2)


def test_cli_collective_bytes_all_chips(capsys):
    # AllGather of 1e9 B over tensor=8 on 64 H100s (8 groups at once): each chip sends 1e9 x 7/8 = 8.75e8 B;
    # all 64 chips: 5.6e10 B
    code, out, _ = run_cli(["collective", "allgather", "-h", "h100-sxm", "--chips", "64", "--mesh", "data=8,tensor=8",
                            "--axes", "tensor", "--bytes", "1e9", "--json"], capsys)
    d = json.loads(out)
    assert code == 0 and d["bytes_per_chip"] == pytest.approx(8.75e8) and d["bytes_all_chips"] == pytest.approx(5.6e10)


def test_cli_collective_topk_needs_alltoall(capsys):
    code, _, err = run_cli(["collective", "allgather", "-h", "h100-sxm", "--chips", "8", "--mesh", "d=8", "--axes",
                            "d", "--bytes", "1e9", "--topk", "2"], capsys)
    assert code == 2 and err.startswith("error:")


def test_cli_serve_ideal_json(capsys):
    # LLaMA-3-8B bf16 on one H100 at batch 1, 1024 in / 512 out: KV/token 2*32*8*128*2 = 131072 B; mean context
    # 1024 + 256 = 1280 -> 1.6777e8 B; weights 8029995008 * 2 = 1.605999e10 B; memory-bound step
    # (1.6777e8 + 1.605999e10)/3.35e12 = 4.8441 ms. Free-HBM batch: (80e9 - 1.605999e10)/(1536 * 131072)
    # = 6.394e10/2.01327e8 = 317.6 -> 317. QPS/chip = 1/(4.8441e-3 * 512) = 0.40319
    code, out, _ = run_cli(["serve", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "1",
                            "--input-len", "1024", "--output-len", "512", "--batch", "1", "--tp", "1", "--ideal",
                            "--json"], capsys)
    assert code == 0
    d = json.loads(out)
    b = d["book_ideal"]
    assert b["tpot_s"] == pytest.approx(4.8441e-3, rel=1e-4)
    assert b["max_batch_per_replica"] == 317
    assert b["queries_per_s_per_chip"] == pytest.approx(0.40319, rel=1e-4)
    assert d["tpot_s"] > b["tpot_s"]  # realistic above ideal
    # QPS vs batch: batch 8 -> (8 * 1.6777e8 + 1.605999e10)/3.35e12 = 1.740216e10/3.35e12 = 5.1947 ms (still
    # memory-bound: FLOPs 2 * 8 * ~7.5e9/9.89e14 = 0.12 ms < 4.79 ms weights); QPS/chip 8/(5.1947e-3 * 512) = 3.0079
    row = {r["batch"]: r for r in b["by_batch"]}
    assert row[1]["step_s"] == pytest.approx(b["tpot_s"])
    assert row[8]["step_s"] == pytest.approx(5.1947e-3, rel=1e-4)
    assert row[8]["queries_per_s_per_chip"] == pytest.approx(3.0079, rel=1e-4)
    dtypes = {(r["weight_dtype"], r["topology"]): r["chips"] for r in b["smallest_topologies"]}
    # weights 16.06 GB bf16 / 80 GB -> 1 chip; doubled 2
    assert dtypes[("bf16", "smallest")] == 1 and dtypes[("bf16", "doubled")] == 2


def test_cli_train_ideal_json(capsys):
    # the ideal step is model FLOPs/(N C_bf16), so realistic/ideal must equal 1/MFU, which the planner computes
    # on its own (MFU = model FLOPs / (step x N x C), DESIGN.md)
    code, out, _ = run_cli(["train", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len",
                            "4096", "--global-batch", "32", "--top", "1", "--ideal", "--json"], capsys)
    assert code == 0
    p = json.loads(out)["plans"][0]
    assert p["book_ideal"]["realistic_over_ideal"] == pytest.approx(1 / p["mfu"], rel=1e-9)
    assert p["book_ideal"]["step_time_s"] == pytest.approx(p["model_flops_per_step"] / (8 * 9.89e14))


def test_hardware_yaml_bad_on_chip_key(tmp_path, capsys):
    from meshplan.specs.hardware import HARDWARE_DIR

    p = tmp_path / "chip.yaml"
    p.write_text((HARDWARE_DIR / "h100-sxm.yaml").read_text().replace("  sm_count:", "  smx_count:"))
    code, _, err = run_cli(["hardware", str(p)], capsys)
    assert code == 2 and err.startswith("error:") and "on_chip_memory.smx_count" in err
    p.write_text((HARDWARE_DIR / "h100-sxm.yaml").read_text().replace("spine_switches: {value: 16", "spine_switches: {value: -16"))
    code, _, err = run_cli(["hardware", str(p)], capsys)
    assert code == 2 and "superpod.spine_switches" in err
