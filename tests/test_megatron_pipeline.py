"""Megatron-Core / Megatron-Bridge behaviour of the dense GPU rows (issue #14), against hand sums on a plain network:
interleaved pipeline sends overlapped with the next model chunk (Options.pp_overlap), the embedding and the loss
counted as layers in the pipeline split (Options.pp_head_in_split), Megatron-FSDP without FSDP2's copies
(Options.fsdp_copies), and the presets and harness that switch them on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from meshplan.cost.efficiency import default_efficiency
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.evaluate import evaluate
from meshplan.train.frameworks import framework_options
from meshplan.train.space import Problem

SEQ = 8192
# Llama 3.1 405B: D = 16384, 126 layers; TP 8 with sequence parallelism sends 1/8 of a micro-batch's hidden states
D_405B, TP, PP, VPP, GBS = 16384, 8, 8, 8, 64
P2P_BYTES = 2 * SEQ * D_405B / TP  # bf16: 33,554,432 B per send


def _model(model: str, chip: str, cfg: ParallelConfig, gbs: int, bw: float | None = None, **opts):
    prob = Problem(load_model(model), load_chip(chip), cfg.chips, SEQ, gbs)
    cm = CostModel(prob, default_efficiency(prob.chip), Options(**opts))
    if bw is not None:  # a plain zero-latency network, so the sums are by hand
        cm.comm.time = lambda kind, nbytes, size, stride: (nbytes / bw) * (size > 1)
    return cm, LayoutArrays.from_configs([cfg])


def _terms(cm: CostModel, L: LayoutArrays):
    g = cm.geometry(L)
    ct = cm.compute_terms(L, g)
    return g, ct, cm.comm_terms(L, g, ct)


CFG_405B = ParallelConfig(tp=TP, pp=PP, vpp=VPP, microbatch=1, recompute="none", sequence_parallel=True)


# Megatron-Core's first rank runs (pp - 1)·2 + (vpp - 1)·pp = 14 + 56 = 70 warm-up forward chunks and as many
# cool-down backward ones, whose sends block; the other 2·vpp·n_micro - 140 = 2 × 8 × 64 - 140 = 884 overlap
WARMUP_SENDS, STEADY_SENDS = 2 * ((PP - 1) * 2 + (VPP - 1) * PP), 2 * VPP * GBS - 2 * ((PP - 1) * 2 + (VPP - 1) * PP)


@pytest.mark.parametrize("bw", [1.0e11, 1.0e9])
def test_interleaved_sends_hide_behind_the_next_chunk(bw: float) -> None:
    """Each steady-state send (33.5 MB) hides behind one model chunk's forward (126 layers over 8 × 8 chunks: 2
    layers); only the excess shows; the 140 warm-up and cool-down sends block. 100 GB/s: 0.34 ms a send, far below
    two 405B layers; 1 GB/s: 33.6 ms a send, the excess over the chunk shows too."""
    blocking, L = _model("llama3-405b", "h100-sxm", CFG_405B, GBS, bw)
    overlapped, _ = _model("llama3-405b", "h100-sxm", CFG_405B, GBS, bw, pp_overlap=True)
    _, _, off = _terms(blocking, L)
    _, ct, on = _terms(overlapped, L)
    send_s = P2P_BYTES / bw
    assert float(off["pp_mb"][0]) == pytest.approx(2 * VPP * send_s, rel=1e-12)
    assert float(on["pp_link_mb"][0]) == pytest.approx(2 * VPP * send_s, rel=1e-12)
    chunk_fwd = 2 * float(ct["layer_fwd"][0])  # ceil(126 / 64) = 2 layers a chunk
    step_sends = WARMUP_SENDS * send_s + STEADY_SENDS * max(send_s - chunk_fwd, 0.0)
    assert float(on["pp_mb"][0]) * GBS == pytest.approx(step_sends, rel=1e-9)
    if bw == 1.0e11:
        assert float(on["pp_mb"][0]) * GBS == pytest.approx(140 * P2P_BYTES / bw, rel=1e-9)


def test_without_interleaving_the_sends_block() -> None:
    """Megatron overlaps pipeline sends only in the interleaved schedule (arguments.py turns overlap_p2p_comm off
    without virtual stages): vpp = 1 exposes every send, pp_overlap or not."""
    cfg = ParallelConfig(tp=TP, pp=PP, microbatch=1, recompute="full", sequence_parallel=True)
    cm, L = _model("llama3-405b", "h100-sxm", cfg, GBS, 1.0e11, pp_overlap=True)
    _, _, cc = _terms(cm, L)
    assert float(cc["pp_mb"][0]) == pytest.approx(2 * P2P_BYTES / 1.0e11, rel=1e-12)


def test_overlapped_sends_shorten_the_step() -> None:
    """With 64 micro-batches the exposed pipeline time drops from 64 × 16 blocking sends (0.344 s) to the 140 of
    the warm-up and cool-down (47 ms); the bubble, (pp - 1)/vpp micro-batch slots, shrinks with the micro-batch's
    exposed sends; the hidden sends slow the compute they run beside (NCCL's SMs, efficiency.nccl_sm_slowdown)."""
    blocking, L = _model("llama3-405b", "h100-sxm", CFG_405B, GBS, 1.0e11)
    overlapped, _ = _model("llama3-405b", "h100-sxm", CFG_405B, GBS, 1.0e11, pp_overlap=True)
    off, on = evaluate(blocking, L), evaluate(overlapped, L)
    send_s = P2P_BYTES / 1.0e11
    assert float(off.time["exposed_comm/pp"][0]) == pytest.approx(GBS * 2 * VPP * send_s, rel=1e-12)
    assert float(on.time["exposed_comm/pp"][0]) == pytest.approx(WARMUP_SENDS * send_s, rel=1e-9)
    saved_per_mb = (GBS * 2 * VPP - WARMUP_SENDS) * send_s / GBS
    assert float(off.time["bubble"][0] - on.time["bubble"][0]) == pytest.approx((PP - 1) / VPP * saved_per_mb,
                                                                                 rel=1e-9)
    slowdown = float(on.time["compute"][0] - off.time["compute"][0])
    assert 0.0 < slowdown < 0.25 * STEADY_SENDS * send_s


def test_the_loss_takes_a_layers_place_in_the_split() -> None:
    """Llama 3.1 405B on PP 16 × VP 4 (the Megatron-Bridge GB200 recipe): 126 layers + embedding + loss = 128 slots,
    2 per chunk, 8 per stage; the last stage runs 7 layers beside the loss. The loss (2·t·D·V/tp = 2 × 8192 × 16384
    × 128256 / 4 = 8.6e12 FLOPs) is lighter than a layer (2·t·(attention 5.70e8 + MLP 2.62e9 weights)/tp = 1.31e13
    FLOPs of GEMMs alone), so a middle stage's 8 layers set the pace and the loss costs nothing; split without the
    head, the last stage holds ceil(126 / 64) × 4 = 8 layers and the loss on top."""
    cfg = ParallelConfig(dp=4, tp=4, pp=16, vpp=4, microbatch=1, recompute="none", sequence_parallel=True)
    plain, L = _model("llama3-405b", "gb200-nvl72", cfg, 1536)
    head, _ = _model("llama3-405b", "gb200-nvl72", cfg, 1536, pp_head_in_split=True)
    g0, ct0, _ = _terms(plain, L)
    g1, ct1, _ = _terms(head, L)
    assert float(g0["layers_stage"][0]) == float(g1["layers_stage"][0]) == 8.0
    layer_f = float(ct1["layer_fwd"][0])
    layer_b = float(ct1["layer_bwd"][0] + ct1["layer_recompute"][0])
    assert float(ct1["fwd"][0]) == pytest.approx(8 * layer_f, rel=1e-12)
    assert float(ct1["bwd"][0]) == pytest.approx(8 * layer_b, rel=1e-12)
    loss_f = float(ct0["fwd"][0]) - 8 * layer_f
    assert 0.3 * layer_f < loss_f < layer_f  # the loss is there without the head in the split, and lighter
    assert float(ct0["bwd"][0]) == pytest.approx(8 * layer_b + 2 * loss_f, rel=1e-12)


def test_two_stages_both_carry_a_head() -> None:
    """With PP 2 there is no middle stage: Llama 3 8B's 32 layers + 2 slots give 17 a stage, the first runs the
    embedding + 16 layers, the last 16 layers + the loss, which is what the plain split gives (16 layers + loss)."""
    cfg = ParallelConfig(pp=2, microbatch=1, recompute="none")
    plain, L = _model("llama3-8b", "h100-sxm", cfg, 16)
    head, _ = _model("llama3-8b", "h100-sxm", cfg, 16, pp_head_in_split=True)
    g0, ct0, _ = _terms(plain, L)
    g1, ct1, _ = _terms(head, L)
    assert (float(g0["layers_stage"][0]), float(g1["layers_stage"][0])) == (16.0, 17.0)
    assert float(ct1["fwd"][0]) == pytest.approx(float(ct0["fwd"][0]), rel=1e-12)
    assert float(ct1["bwd"][0]) == pytest.approx(float(ct0["bwd"][0]), rel=1e-12)


def test_megatron_fsdp_has_no_copies() -> None:
    """Llama 3 8B (8,030,261,248 parameters: embedding and output 2 × 128256 × 4096, 32 layers of 218,112,000, the
    final norm 4096) on FSDP 8: FSDP2 copies every gathered layer out of the all-gather buffer twice a micro-batch
    (forward and backward gathers, read + write bf16: 4 B) and the gradients into the reduce-scatter input once
    (read bf16 2 + write fp32 4 B): 14 B per parameter per micro-batch, 8 micro-batches (64 / 8). Megatron-FSDP's
    parameters are views of its buffers: none of it."""
    params = 2 * 128256 * 4096 + 32 * 218_112_000 + 4096
    cfg = ParallelConfig(fsdp=8, microbatch=1, recompute="none")
    torch_fsdp, L = _model("llama3-8b", "h100-sxm", cfg, 64)
    megatron_fsdp, _ = _model("llama3-8b", "h100-sxm", cfg, 64, fsdp_copies=False)
    a, b = evaluate(torch_fsdp, L), evaluate(megatron_fsdp, L)
    assert a.ledger.plan(0)["hbm_bytes"] - b.ledger.plan(0)["hbm_bytes"] == pytest.approx(8 * 14 * params, rel=1e-9)


def test_presets_and_releases() -> None:
    base = Options()
    nemo, old, megatron = (framework_options(n, base, {}) for n in ("nemo", "nemo@24.07", "megatron"))
    assert (nemo.pp_overlap, nemo.fsdp_copies, nemo.grad_reduce_bytes) == (True, False, 2.0)
    assert (old.pp_overlap, old.grad_reduce_bytes, old.fp8_recipe) == (False, 4.0, "delayed")
    assert (megatron.pp_overlap, megatron.fsdp_copies, megatron.grad_reduce_bytes) == (True, False, 4.0)
    titan = framework_options("torchtitan", base, {})
    assert (titan.pp_overlap, titan.fsdp_copies, titan.pp_head_in_split) == (False, True, False)


def test_harness_reads_the_recipes_behaviour() -> None:
    """Every Megatron-Bridge row runs the current NeMo preset; the 405B rows carry the recipe's pipeline split in
    their notes; torchtitan rows keep FSDP2's copies and blocking sends."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import _measurements as H
    from _split import load_new_training

    seen = 0
    for e in load_new_training():
        opts = H.options_of(e)
        key = e["source"]["key"]
        if key.startswith("megatron-bridge-perf"):
            assert (opts.pp_overlap, opts.fsdp_copies, opts.grad_reduce_bytes) == (True, False, 2.0), e["id"]
            assert opts.pp_head_in_split == ("405b" in key), e["id"]
            seen += "405b" in key
        elif key.startswith("torchtitan"):
            assert (opts.pp_overlap, opts.fsdp_copies, opts.pp_head_in_split) == (False, True, False), e["id"]
    assert seen == 28  # 17 GB200/B200/H100 rows, 11 GB300 (session 33)


def test_flags_win_over_the_preset(capsys) -> None:
    """`--framework nemo` overlaps the interleaved sends; `--no-pp-overlap` exposes them again, and the exposed
    pipeline time is then the blocking sends of every micro-batch (the JSON's time_s), larger than with the preset."""
    import json

    from conftest import run_cli

    args = ["train", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "16", "--seq-len", "8192",
            "--global-batch", "32", "--dp", "2", "--tp", "2", "--pp", "4", "--vpp", "2", "--cp", "1", "--fsdp", "1",
            "--microbatch", "1", "--recompute", "full", "--zero", "1", "--framework", "nemo", "--json"]
    plans = {}
    for extra in ([], ["--no-pp-overlap"], ["--pp-head-in-split"]):
        code, out, err = run_cli(args + extra, capsys)
        assert code == 0, err
        plans[" ".join(extra)] = json.loads(out)["plans"][0]
    assert plans["--no-pp-overlap"]["step_time_s"] > plans[""]["step_time_s"]
    # Llama 3 8B: 32 layers + 2 slots over 4 × 2 chunks is not whole (Megatron would refuse): ceil(34 / 8) = 5 layers
    # a chunk, 10 a stage instead of 8, so the head in the split costs more here than the loss alone
    assert plans["--pp-head-in-split"]["step_time_s"] > plans[""]["step_time_s"]


@pytest.mark.parametrize("framework", ["megatron", "nemo"])
def test_head_in_split_exported_and_read_back(capsys, tmp_path, framework: str) -> None:
    """`--pp-head-in-split` writes Megatron's account-for-embedding/loss switches (Megatron-LM arguments.py;
    NeMo's model.config keys) and `--from` reads them back into the same option."""
    from conftest import run_cli

    args = ["train", "--model", "llama3-405b", "--hardware", "h100-sxm", "--chips", "256", "--seq-len", "8192",
            "--global-batch", "512", "--dp", "2", "--tp", "8", "--pp", "16", "--vpp", "4", "--cp", "1", "--fsdp", "1",
            "--microbatch", "1", "--recompute", "full", "--zero", "1", "--dtype", "fp8", "--framework", framework,
            "--pp-head-in-split", "--export", framework, "--out", str(tmp_path)]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    written = "\n".join(f.read_text() for f in tmp_path.iterdir())
    key = "--account-for-loss-in-pipeline-split" if framework == "megatron" else "account_for_loss_in_pipeline_split"
    assert key in written
    from meshplan.export import megatron, nemo

    job = (megatron if framework == "megatron" else nemo).load(
        next(f for f in tmp_path.iterdir() if f.suffix in (".sh", ".yaml", ".yml", "")).read_text(), 256)
    assert job.pins.pp == 16
    assert job.options["pp_head_in_split"] is True
