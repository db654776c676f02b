"""Distributed saved activations (Options.distribute_saved_activations): under full recompute without sequence
parallelism each TP rank keeps 1/tp of every checkpointed layer input and the layer's backward all-gathers it over TP
before the recomputed forward (Megatron-LM --distribute-saved-activations, megatron/core/tensor_parallel/random.py
CheckpointFunction; DeepSpeed activation checkpointing `partition_activations`, checkpointing.py get_full_inputs;
metaseq --distribute-checkpointed-activations). Numbers derived by hand below."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_cli

from meshplan.cost.efficiency import default_efficiency
from meshplan.export.common import PlanToExport
from meshplan.export.megatron import export, load
from meshplan.math.transformer import activation_bytes_per_layer
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import ModelConfig, load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.evaluate import evaluate
from meshplan.train.frameworks import framework_options
from meshplan.train.planner import plan
from meshplan.train.space import Pins, Problem

# OPT-175B's shapes (Zhang et al. 2022, Table 1): 96 layers, d_model 12288, 96 heads of 128, ReLU MLP 4 x 12288
OPT = ModelConfig(name="opt-175b-like", n_layers=96, d_model=12288, n_heads=96, n_kv_heads=96, head_dim=128,
                  d_ff=49152, vocab_size=50272, mlp_act="relu", tied_embeddings=True)
TINY = ModelConfig(name="tiny", n_layers=2, d_model=256, n_heads=8, n_kv_heads=4, head_dim=32, d_ff=512,
                   vocab_size=512)


def test_full_recompute_keeps_one_tp_share_of_the_layer_input() -> None:
    """2048 tokens x micro-batch 8 x d_model 12288 x 2 B = 402,653,184 B per layer kept whole; split over TP 8:
    402,653,184 / 8 = 50,331,648 B. With SP the saved input is already 1/8 (the flag changes nothing), and other
    policies keep what they kept (the flag is for full recompute: Megatron-LM arguments.py)."""
    whole = activation_bytes_per_layer(OPT, 2048, 8, "full", tp=8)["total"]
    split = activation_bytes_per_layer(OPT, 2048, 8, "full", tp=8, distribute_saved=True)["total"]
    assert whole == 2048 * 8 * 12288 * 2 == 402_653_184
    assert split == 402_653_184 / 8 == 50_331_648
    sp = activation_bytes_per_layer(OPT, 2048, 8, "full", tp=8, sequence_parallel=True)["total"]
    assert activation_bytes_per_layer(OPT, 2048, 8, "full", tp=8, sequence_parallel=True,
                                      distribute_saved=True)["total"] == sp == 50_331_648
    for policy in ("none", "selective", "gemm-last"):
        assert (activation_bytes_per_layer(OPT, 2048, 8, policy, tp=8, distribute_saved=True)
                == activation_bytes_per_layer(OPT, 2048, 8, policy, tp=8))


def _cm(model: ModelConfig, chip: str, cfg: ParallelConfig, seq: int, batch: int, framework: str | None,
        **opts) -> tuple[CostModel, LayoutArrays]:
    gpu = load_chip(chip)
    prob = Problem(model, gpu, cfg.chips, seq, batch)
    o = framework_options(framework, Options(**opts), {})
    return CostModel(prob, default_efficiency(gpu), o), LayoutArrays.from_configs([cfg])


def test_opt_175b_saved_inputs_shrink_by_seven_eighths() -> None:
    """OPT-175B's layout (TP 8 over 124 data-parallel ranks, 8 sequences of 2048 a rank, full recompute, no SP): the 96
    saved layer inputs drop from 96 x 402,653,184 B to 96 x 50,331,648 B, 96 x 352,321,536 = 33,822,867,456 B less
    (the one-layer backward working set, all of a layer's activations rebuilt, is the same)."""
    cfg = ParallelConfig(dp=124, tp=8, microbatch=8, recompute="full", zero=2, sequence_parallel=False)
    mem = {}
    for dist in (False, True):
        cm, L = _cm(OPT, "a100-80gb", cfg, 2048, 992, None, distribute_saved_activations=dist)
        mem[dist] = float(cm.memory_terms(L, cm.geometry(L))["activations"][0])
    assert mem[False] - mem[True] == pytest.approx(96 * 402_653_184 * 7 / 8) == 33_822_867_456


def _ledger(cfg: ParallelConfig, dist: bool) -> dict:
    cm, L = _cm(TINY, "a100-80gb", cfg, 128, 16, "megatron", distribute_saved_activations=dist)
    return evaluate(cm, L).ledger.plan(0)["collective_bytes"]


def test_one_all_gather_of_the_layer_input_per_layer_backward() -> None:
    """TP 8, micro-batch 16 of 128 tokens (t = 2048, one micro-batch), 2 layers, no SP: each layer's backward gathers
    its [t, D] input, v = 2 B x 2048 x 256 = 1,048,576 B: 2 layers x 1 micro-batch x v = 2 v of all-gathers (no other
    all-gather without SP); the all-reduces stay 14 v + 24,576 B (test_ledger: a rerun forward's 2 v a layer). Under
    SP (already split, 18 v of gathers) or without full recompute nothing changes."""
    v = 2 * 2048 * 256
    full = ParallelConfig(tp=8, microbatch=16, recompute="full", sequence_parallel=False)
    c = _ledger(full, True)
    assert c["all_gather/tensor"] == 2 * v == 2_097_152
    assert c["all_reduce/tensor"] == _ledger(full, False)["all_reduce/tensor"] == 14 * v + 24576
    assert "all_gather/tensor" not in _ledger(full, False)
    sp = ParallelConfig(tp=8, microbatch=16, recompute="full")
    assert _ledger(sp, True) == _ledger(sp, False)
    sel = ParallelConfig(tp=8, microbatch=16, recompute="selective", sequence_parallel=False)
    assert _ledger(sel, True) == _ledger(sel, False)


def test_the_gather_is_exposed_once_per_layer_per_micro_batch() -> None:
    """The gather blocks the recomputed forward (gather_split_1d_tensor / get_full_inputs run before it, no GEMM to hide
    behind): the TP seconds per micro-batch grow by layers x the all-gather of [t, D] over TP, here 2 x
    comm.time(allgather, 1,048,576 B, 8)."""
    cfg = ParallelConfig(tp=8, microbatch=16, recompute="full", sequence_parallel=False)
    tp_mb = {}
    for dist in (False, True):
        cm, L = _cm(TINY, "a100-80gb", cfg, 128, 16, "megatron", distribute_saved_activations=dist)
        g = cm.geometry(L)
        tp_mb[dist] = float(cm.comm_terms(L, g, cm.compute_terms(L, g))["tp_mb"][0])
    ag = float(np.asarray(cm.comm.time("allgather", 2 * 2048 * 256, 8, 1)).ravel()[0])
    assert ag > 0
    assert tp_mb[True] - tp_mb[False] == pytest.approx(2 * ag)


def _export(cfg: ParallelConfig, opts: Options) -> str:
    gpu = load_chip("h100-sxm")
    prob = Problem(load_model("llama3-8b"), gpu, 64, 2048, 64)
    pins = Pins(dp=cfg.dp, tp=cfg.tp, pp=1, cp=1, ep=1, fsdp=1, vpp=1, microbatch=1, recompute="full", zero=0,
                offload=0.0, sequence_parallel=cfg.sequence_parallel)
    pr = plan(prob, pins, default_efficiency(gpu), opts, top=1).plans[0]
    return export(PlanToExport(prob, cfg, opts, pr, "meshplan train (test)", "llama3-8b"))


def test_megatron_export_writes_and_reads_the_flag() -> None:
    """--distribute-saved-activations goes with full recompute, TP > 1 and no --sequence-parallel (Megatron-Core's
    TransformerConfig refuses it with SP); the loader reads it back into the option."""
    on = Options(distribute_saved_activations=True)
    cfg = ParallelConfig(dp=8, tp=8, microbatch=1, recompute="full", sequence_parallel=False)
    text = _export(cfg, on)
    assert "--distribute-saved-activations" in text
    assert load(text).options["distribute_saved_activations"] is True
    with_sp = ParallelConfig(dp=8, tp=8, microbatch=1, recompute="full", sequence_parallel=True)
    assert "--distribute-saved-activations" not in _export(with_sp, on)
    assert "--distribute-saved-activations" not in _export(cfg, Options())
    assert load(_export(cfg, Options())).options["distribute_saved_activations"] is False


def test_cli_refuses_the_flag_where_it_cannot_apply(capsys) -> None:
    """Megatron-LM's own checks: no sequence parallelism (Megatron-Core's TransformerConfig), full recompute
    granularity (arguments.py)."""
    base = ["train", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len", "2048",
            "--global-batch", "8", "--distribute-saved-activations"]
    code, out, err = run_cli(base, capsys)
    assert code != 0 and "--no-sp" in out + err
    code, out, err = run_cli(base + ["--no-sp", "--recompute", "selective"], capsys)
    assert code != 0 and "full recompute" in out + err
    code, out, err = run_cli(base + ["--no-sp", "--tp", "8", "--recompute", "full", "--json"], capsys)
    assert code == 0, out + err
