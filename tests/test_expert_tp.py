"""Issue #14: expert tensor parallelism (Megatron-Core `--expert-tensor-parallel-size`; MoE Parallel Folding, Liu et al.
2025). ETP = TP splits every routed expert's F over the attention's TP ranks; ETP = 1 (every Megatron-Bridge MoE recipe,
the Megatron-MoE-ModelZoo) keeps whole experts on each rank and folds ETP × EP × expert-DP over the stage's TP × CP × DP
ranks. Expected values are worked by hand from the model and chip files.

Qwen3-235B-A22B (models/qwen3-235b-a22b.json): 94 layers, D 4096, 128 experts of F 1536 (SwiGLU: 3·D·F each), top-8,
no shared expert. One layer's experts: 3·4096·1536·128 = 2,415,919,104 parameters."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_cli

from meshplan.cost.collectives import ragged_destinations
from meshplan.cost.efficiency import default_efficiency
from meshplan.export import PRESET, export_train, train_module
from meshplan.export.common import PlanToExport
from meshplan.measure.verify import program_options
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options, expert_tp_degree
from meshplan.train.frameworks import framework_options, options_from_notes, preset
from meshplan.train.planner import plan
from meshplan.train.space import Pins, Problem

EXPERT_W = 3 * 4096 * 1536 * 128  # one layer's routed-expert parameters
SEQ, V = 4096, 2 * 4096 * 4096  # sequence; one micro-batch's bf16 activations [4096, 4096]: 33,554,432 B


def _cm(expert_tp: bool, chips: int = 512, dispatcher: str = "alltoall", **degrees):
    degrees = {"dp": 32, "tp": 2, "pp": 8, "ep": 32, "microbatch": 1, "zero": 1} | degrees
    prob = Problem(load_model("qwen3-235b-a22b"), load_chip("h100-sxm"), chips, SEQ, 1024)
    cm = CostModel(prob, default_efficiency(prob.chip), Options(expert_tp=expert_tp, moe_dispatcher=dispatcher))
    L = LayoutArrays.from_configs([ParallelConfig(**degrees)])
    return cm, L, cm.geometry(L)


def _f(x) -> float:
    return float(np.asarray(x).ravel()[0])


def test_expert_weights_per_rank_and_tokens() -> None:
    """TP 2 PP 8 DP 32 EP 32 (512 H100s). ETP = TP: each rank holds 1/(2·32) of a layer's experts, 37,748,736
    parameters (4 whole experts' halves); ETP 1: 1/32, 75,497,472 (4 whole experts). The rank routes its SP slice, 4096/2
    = 2048 tokens, either way; its experts compute the copies of 2048·2 = 4096 tokens after the dispatcher's TP gather
    (ETP = TP), or of its own 2048 (ETP 1). The dense rest (attention, router, norms) is the same."""
    tp_cm, _, g_tp = _cm(True)
    one_cm, _, g_one = _cm(False)
    assert _f(g_tp["etp"]) == 2 and _f(g_one["etp"]) == 1
    assert EXPERT_W / 64 == 37_748_736 and EXPERT_W / 32 == 75_497_472
    diff = _f(g_one["params_layer_local"]) - _f(g_tp["params_layer_local"])
    assert diff == pytest.approx(EXPERT_W / 32 - EXPERT_W / 64)
    assert _f(g_tp["t_route"]) == _f(g_one["t_route"]) == 2048
    assert _f(g_tp["t_expert"]) == 4096 and _f(g_one["t_expert"]) == 2048


def test_grouped_gemm_shape_whole_experts() -> None:
    """The grouped GEMM per local expert: ETP = TP, rows = 4096 tokens · 8 copies · 32 EP ranks / 128 experts = 8192 at
    width F/2 = 768; ETP 1, rows = 2048·8·32/128 = 4096 at the whole F 1536. The FLOPs per rank are the same:
    2·4096·(8·3·4096·1536)/2 = 618,475,290,624 (t_mb·k·3DF/tp either way)."""
    f_routed = 2 * SEQ * 8 * 3 * 4096 * 1536 / 2
    assert f_routed == 618_475_290_624
    for expert_tp, rows, width in ((True, 8192, 768), (False, 4096, 1536)):
        cm, _, g = _cm(expert_tp)
        seen = []
        cm._matmul_time = lambda flops, m_, n_, k_, grouped=False, seen=seen: \
            seen.append((flops, _f(m_), _f(n_), k_, grouped)) or 0.0
        cm._grouped_gemm_s(g, f_routed)
        assert seen == [(f_routed, rows, width, 4096, True)]  # timed as a grouped GEMM (Efficiency.grouped_matmul)


def test_tp_collectives_and_all_to_all_in_the_ledger() -> None:
    """Per step (32 micro-batches of 1 sequence: 1024 / DP 32; 12 layers a stage, ceil(94/8)), bf16, SP. ETP = TP: a
    layer gathers its attention input and the k = 8 routed copies (3 gathers a pass each: forward, output gradient,
    re-gather) and reduce-scatters 2·(1 + 8) times; ETP 1: the routed experts move nothing over TP, so 1 pair:
    all-gather 32·(12·3·(1 + 8) + 2)·V vs 32·(12·3 + 2)·V, reduce-scatter 32·(12·2·9 + 2)·V vs 32·(12·2 + 2)·V.
    The dispatch moves the rank's 2048 tokens · 8 copies · 4096 · 2 B = 134,217,728 B, 4 times a layer, either way:
    32·12·4·134,217,728 = 206,158,430,208 B, over `expert` (32 ranks tp·cp = 2 apart) or, folded, over 2 tensor
    ranks × 16 (32 consecutive ranks)."""
    from meshplan.train.evaluate import evaluate

    led = {}
    for expert_tp in (True, False):
        cm, L, _ = _cm(expert_tp)
        ev = evaluate(cm, L)
        led[expert_tp] = ev.ledger.plan(0)["collective_bytes"]
    assert led[True]["all_gather/tensor"] == pytest.approx(32 * (12 * 3 * 9 + 2) * V)
    assert led[False]["all_gather/tensor"] == pytest.approx(32 * (12 * 3 + 2) * V)
    assert led[True]["reduce_scatter/tensor"] == pytest.approx(32 * (12 * 2 * 9 + 2) * V)
    assert led[False]["reduce_scatter/tensor"] == pytest.approx(32 * (12 * 2 + 2) * V)
    assert 32 * 12 * 4 * 134_217_728 == 206_158_430_208
    assert led[True]["all_to_all/expert"] == pytest.approx(206_158_430_208)
    assert led[False]["all_to_all/expert+tensor"] == pytest.approx(206_158_430_208)
    assert "all_to_all/expert" not in led[False]


def test_ep_group_placement_on_8_gpu_nodes() -> None:
    """EP 32 with TP 2 on 8-GPU H100 nodes. ETP = TP: the EP ranks are tp·cp = 2 apart, 64 ranks = 8 nodes with 4 of
    the group each; ETP 1: 32 consecutive ranks = 4 whole nodes. DeepEP sends a token once per node it reaches: with
    8 copies over M nodes, M·(1 - ((M-1)/M)^8): 4·(1 - 0.75^8) = 3.5995 (ETP 1) against 8·(1 - 0.875^8) = 5.2511."""
    for expert_tp, stride, nodes, copies in ((True, 2, 8, 5.2511), (False, 1, 4, 3.5995)):
        cm, _, g = _cm(expert_tp, dispatcher="deepep")
        assert _f(cm._ep_stride(g)) == stride
        assert 32 * stride / 8 == nodes
        got = _f(cm._dispatch_copies(8, g["ep"], cm._ep_stride(g)))
        assert got == pytest.approx(nodes * (1 - ((nodes - 1) / nodes) ** 8))
        assert got == pytest.approx(copies, abs=1e-4)
        assert got == pytest.approx(ragged_destinations(8, nodes))


def test_expert_data_parallel_group_and_zero_shard() -> None:
    """TP 2 PP 4 DP 32 EP 8 (256 H100s, 24 layers a stage: ceil(94/4)). Expert DP: ETP = TP, dp·cp/ep = 32/8 = 4 ranks;
    ETP 1, tp·cp·dp/ep = 64/8 = 8 (the tensor ranks join it). ZeRO-1's optimizer shard of the experts is then the
    same, 24·EXPERT_W/(2·8)/4 = 24·EXPERT_W/(1·8)/8 = 24·37,748,736, while the bf16 working weights double under
    ETP 1: 24·(EXPERT_W/8 - EXPERT_W/16)·2 B = 7,247,757,312 B more. The expert gradients travel 16 ranks apart
    (tp·ep) in groups of 4 with ETP = TP, 8 apart (ep) in groups of 8 with ETP 1."""
    from meshplan.train.evaluate import evaluate

    out = {}
    for expert_tp in (True, False):
        cm, L, g = _cm(expert_tp, chips=256, dp=32, tp=2, pp=4, ep=8)
        out[expert_tp] = (cm, L, g)
    (cm_t, _, g_t), (cm_1, _, g_1) = out[True], out[False]
    assert _f(cm_t._expert_replicas(g_t)) == 4 and _f(cm_1._expert_replicas(g_1)) == 8
    e_t, e_1 = _f(cm_t._carved_experts(g_t)), _f(cm_1._carved_experts(g_1))
    assert e_t == pytest.approx(24 * EXPERT_W / 16) and e_1 == pytest.approx(24 * EXPERT_W / 8)
    assert e_t / 4 == pytest.approx(e_1 / 8) == pytest.approx(24 * 37_748_736)
    zl_t, zl_1 = _f(cm_t._zero_local(g_t, True)), _f(cm_1._zero_local(g_1, True))
    assert zl_1 - zl_t == pytest.approx(0.0, abs=1.0)  # the dense part is the same, the experts' shard too
    m_t, m_1 = (evaluate(cm, L).memory for cm, L, _ in out.values())
    assert _f(m_1["params"]) - _f(m_t["params"]) == pytest.approx(7_247_757_312)
    assert 24 * (EXPERT_W / 8 - EXPERT_W / 16) * 2 == 7_247_757_312
    # the expert group's collective: replicas/ep ranks at stride tp·ep (ETP = TP) or tp·cp·dp/ep at stride ep (ETP 1)
    calls = []
    for cm, _, g in out.values():
        cm.comm.time = lambda kind, nbytes, n, stride, calls=calls: calls.append((_f(n), _f(stride))) or 0.0
        cm._replica_collective("reducescatter", 2e9, 1e9, g, np.asarray(g["tp"]))
    assert calls == [(32, 2), (4, 16), (32, 2), (8, 8)]


def test_layout_beyond_the_data_ranks_means_whole_experts() -> None:
    """Qwen3-235B TP 2 PP 8 EP 32 DP 16 (the Megatron-MoE-ModelZoo's H100 row): the stage's 2·16 = 32 ranks do not
    divide by etp·ep = 64, so Megatron-Core builds it only with ETP 1, whatever the option; without SP the experts
    stay split over TP (ETP 1 needs SP)."""
    assert expert_tp_degree(True, 2, 1, 16, 32, True) == 1
    assert expert_tp_degree(True, 2, 1, 32, 32, True) == 2
    assert expert_tp_degree(False, 2, 1, 32, 32, True) == 1
    assert expert_tp_degree(False, 2, 1, 32, 32, False) == 2
    assert expert_tp_degree(False, 1, 1, 32, 8, False) == 1


def test_presets_and_notes_carry_the_expert_tp_size() -> None:
    assert preset("nemo")["expert_tp"] is False  # Megatron-Bridge MoE recipes: expert_tensor_parallel_size = 1
    assert preset("nemo@24.07")["expert_tp"] is True
    assert "expert_tp" not in preset("megatron")  # Megatron-LM's default ETP = TP (the Options default)
    assert program_options("nemo").expert_tp is True  # the compiled JAX program shards experts over `tensor`
    assert options_from_notes("flags: --expert-tensor-parallel-size 1, --overlap-grad-reduce")["expert_tp"] is False
    assert options_from_notes("tp 4 ep 8 etp 4")["expert_tp"] is True
    assert options_from_notes("tp 4 ep 8")["expert_tp"] is None


def _export(fw: str, expert_tp: bool) -> tuple[PlanToExport, str]:
    chip = load_chip("h100-sxm")
    problem = Problem(load_model("qwen3-235b-a22b"), chip, 512, SEQ, 1024)
    cfg = ParallelConfig(dp=32, tp=2, pp=8, ep=32, microbatch=1, zero=1)
    opts = framework_options(PRESET[fw], Options(), {"expert_tp": expert_tp})
    pins = Pins(dp=32, fsdp=1, tp=2, pp=8, vpp=1, cp=1, ep=32, microbatch=1, recompute="none", zero=1, offload=0.0,
                offload_optimizer=0, offload_params=0)
    pr = plan(problem, pins, default_efficiency(chip), opts, top=1).plans[0]
    pe = PlanToExport(problem, cfg, opts, pr, "meshplan train (test)", "qwen3-235b-a22b")
    return pe, export_train(fw, pe)[1]


@pytest.mark.parametrize("fw,flag", [("megatron", "--expert-tensor-parallel-size {}"),
                                     ("nemo", "expert_tensor_parallel_size: {}")])
def test_export_and_import_the_expert_tp_size(fw: str, flag: str) -> None:
    for expert_tp, size in ((True, 2), (False, 1)):
        pe, text = _export(fw, expert_tp)
        assert flag.format(size) in text
        job = train_module(fw).load(text, 512)
        assert job.options["expert_tp"] is expert_tp


def test_import_refuses_an_expert_tp_size_meshplan_does_not_model() -> None:
    _, text = _export("megatron", False)
    text = text.replace("--tensor-model-parallel-size 2", "--tensor-model-parallel-size 4").replace(
        "--expert-tensor-parallel-size 1", "--expert-tensor-parallel-size 2")
    with pytest.raises(Exception, match="neither 1 nor the tensor-parallel size 4"):
        train_module("megatron").load(text, 512)


BASE = ["train", "--model", "qwen3-235b-a22b", "--hardware", "h100-sxm", "--chips", "512", "--seq-len", "4096",
        "--global-batch", "1024"]


@pytest.mark.parametrize("extra,msg", [
    (["--etp", "2"], "--etp is 1 or the --tp degree"),
    (["--etp", "4", "--tp", "2"], "--etp is 1 or the --tp degree"),
    (["--etp", "1", "--tp", "2", "--no-sp"], "needs sequence parallelism"),
])
def test_cli_refuses_bad_etp(capsys, extra, msg) -> None:
    code, _, err = run_cli(BASE + extra, capsys)
    assert code == 2 and err.startswith("error:") and msg in err


def test_cli_refuses_etp_for_a_dense_model(capsys) -> None:
    code, _, err = run_cli(["train", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len",
                            "4096", "--global-batch", "8", "--etp", "1"], capsys)
    assert code == 2 and "needs a MoE model" in err


def test_optimizer_update_covers_the_expert_shard_the_memory_holds() -> None:
    """One ledger: the AdamW update reads and writes the ZeRO-1 shard whose state the memory ledger holds. TP 2 PP 8
    DP 32 EP 32, 12 layers on a stage (ceil(94/8)): under ETP = TP each rank holds 12·EXPERT_W/64 = 452,984,832 expert
    parameters and its expert-data-parallel group is 32·2/(2·32) = 1 rank, so it updates all of them; the dense rest is
    split over the 32 replicas. Under ETP 1 the rank holds 12·EXPERT_W/32 = 905,969,664, its expert-DP group folds the
    2 TP ranks (2·32/32 = 2), so it updates 452,984,832 of them too. fused AdamW: 30 B per updated parameter."""
    assert 12 * EXPERT_W // 64 == 452_984_832 and 12 * EXPERT_W // 32 == 905_969_664
    for expert_tp, held, group in ((True, 452_984_832, 1), (False, 905_969_664, 2)):
        cm, L, g = _cm(expert_tp)
        dense = _f(g["params_stage_local"]) - held
        expected_bytes = 30.0 * (dense / 32 + held / group)
        assert _f(cm.optimizer_terms(L, g)) == pytest.approx(expected_bytes / cm.hbm, rel=1e-9)
        assert 30.0 * held / group == 30.0 * 452_984_832  # the expert shard is the same either way


def test_assumes_line_names_the_plans_own_expert_tp(capsys):
    # session 21, QA finding: "experts split over TP (ETP = TP)" was printed for a plan whose EP (8) does not divide its
    # context x data ranks (4), which Megatron-Core runs with whole experts (ETP 1), as the plan's memory shows
    from conftest import run_cli

    base = ["train", "--model", "mixtral-8x7b", "--hardware", "h100-sxm", "--chips", "64", "--seq-len", "4096",
            "--global-batch", "256", "--tp", "8", "--pp", "2", "--ep", "8"]
    code, out, _ = run_cli(base, capsys)
    assert code == 0 and "whole experts per rank (ETP 1)" in " ".join(out.split())
    code, out, _ = run_cli([*base[:-6], "--tp", "2", "--pp", "1", "--ep", "2"], capsys)
    assert code == 0 and "experts split over TP (ETP = TP)" in " ".join(out.split())
