"""Attention data parallelism + expert parallelism (ServeConfig.attention_dp), values by hand from the shapes of
Qwen3-235B-A22B (94 layers, D 4096, 64 query heads, 4 KV heads of 128, 128 experts of F 1536, top-8, vocab 151,936)
in FP8 on 8 x H200. Sources: TensorRT-LLM _torch/models/modeling_qwen3_moe.py (no attention all-reduce, embedding
unsplit under enable_attention_dp), fused_moe/communication/allgather_reducescatter.py (dispatch = all-gather of the
post-quant hidden states, ids and scales; combine = reduce-scatter), SGLang server_args.py (dp_size divides tp_size,
chunked_prefill_size // dp_size)."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from meshplan.cost.collectives import group_collective
from meshplan.cost.efficiency import default_efficiency
from meshplan.cost.topology import make_cluster
from meshplan.errors import InfeasibleError
from meshplan.export.serving import ServePlan, export_engine, load_engine
from meshplan.infer.config import ServeConfig, Workload, check_layout, prefill_room, replica_token_budget
from meshplan.infer.frontier import layouts
from meshplan.infer.memory import (
    attention_params_per_chip,
    kv_bytes_per_token_per_chip,
    max_batch_per_replica,
    memory_per_chip,
    weight_bytes_per_chip,
)
from meshplan.infer.step import _layer_comm_s, attention_dp_moe_bytes, stage_parts, tokens_per_expert
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

L, D, K, H, E, F, TOPK, V = 94, 4096, 4, 128, 128, 1536, 8, 151936


@pytest.fixture(scope="module")
def setup():
    m, chip = load_model("qwen3-235b-a22b"), load_chip("h200")
    tp8 = ServeConfig(tp=8, weight_dtype="fp8", kv_dtype="fp8", engine="trtllm", max_num_batched_tokens=8192)
    adp = ServeConfig(tp=8, ep=8, attention_dp=True, weight_dtype="fp8", kv_dtype="fp8", engine="trtllm",
                      max_num_batched_tokens=8192)
    return m, chip, default_efficiency(chip), tp8, adp


def test_attention_weights_whole_per_gpu(setup):
    m, chip, _, tp8, adp = setup
    # Q and O: 2 x 4096 x (64 x 128); K and V: 2 x 4096 x (4 x 128); Qwen3's q_norm and k_norm (128 each); no biases
    whole = 2 * D * 64 * H + 2 * D * K * H + 2 * H
    assert attention_params_per_chip(m, 1) == whole == 71_303_424
    # TP8: Q/O split 8 ways, one KV head per GPU (8 > 4 heads: each head on 2 GPUs), the QK norms split with them
    assert attention_params_per_chip(m, 8) == 2 * D * 64 * H / 8 + 2 * D * H * 1 + 2 * H / 8
    # attention DP, FP8: per GPU 94 layers x (attention + 2 norms x 4096 + router 4096 x 128 whole + 128/8 experts of
    # 3 x 4096 x 1536) + embedding and LM head whole (2 x 151,936 x 4096) + the final norm, 1 byte each
    layer = whole + 2 * D + D * E + E * 3 * D * F / 8
    assert weight_bytes_per_chip(m, adp) == pytest.approx(L * layer + 2 * V * D + D)
    assert weight_bytes_per_chip(m, adp) / 1e9 == pytest.approx(36.38, abs=0.01)


def test_kv_per_token_per_gpu_no_head_duplication(setup):
    m, _, _, tp8, adp = setup
    # TP8 with 4 KV heads: each GPU holds one head (each head stored twice over the 8 GPUs)
    assert kv_bytes_per_token_per_chip(m, tp8) == 2 * L * 1 * H * 1 == 24_064
    # attention DP: a token lives on its request's GPU with all 4 heads once
    assert kv_bytes_per_token_per_chip(m, adp) == 2 * L * K * H * 1 == 96_256
    # bytes one token costs the replica: 8 x 24,064 = 192,512 under TP8, 96,256 under attention DP (half)
    assert 8 * kv_bytes_per_token_per_chip(m, tp8) == 2 * kv_bytes_per_token_per_chip(m, adp)


def test_max_batch_per_rank_times_ranks(setup):
    m, chip, eff, tp8, adp = setup
    w = Workload(128, 2048)
    b = max_batch_per_replica(m, chip, adp, eff, w)
    assert b % 8 == 0  # ranks x the rank's own batch
    per_rank = b // 8
    held = w.max_context  # TensorRT-LLM reserves input + output (guaranteed no evict)
    mem = memory_per_chip(m, chip, adp, eff, b, held)
    assert mem.kv_cache == pytest.approx(per_rank * held * 96_256)
    assert mem.fits and not memory_per_chip(m, chip, adp, eff, b + 8, held).fits
    # more sequences than TP8 (no duplicated heads), less than 2x (the replicated attention weights cost ~7 GB)
    tp_b = max_batch_per_replica(m, chip, tp8, eff, w)
    assert 1.5 * tp_b < b < 2 * tp_b


def test_moe_dispatch_bytes_and_rows_per_expert(setup):
    m, chip, _, _, adp = setup
    tokens = 3792
    dispatch, combine = attention_dp_moe_bytes(m, chip, adp, tokens)
    # all-gather: each token's FP8 hidden state (4096 B) + 8 int32 ids + 8 fp32 scales; reduce-scatter: bf16 outputs
    assert dispatch == tokens * (D * 1 + 2 * TOPK * 4) == 15_774_720
    assert combine == tokens * D * 2
    # every rank's tokens reach the experts: rows of each expert's GEMM = tokens x k / E
    assert tokens_per_expert(m, tokens) == tokens * TOPK / E == 237
    # no attention all-reduce: the layer's collectives are exactly the all-gather and the reduce-scatter over 8 GPUs
    cl = make_cluster(chip, 8)
    want = group_collective("allgather", dispatch, cl, 8).time_s + group_collective("reducescatter", combine, cl, 8).time_s
    assert _layer_comm_s(m, chip, adp, tokens) == pytest.approx(want)


def test_step_rank_share(setup):
    m, chip, eff, tp8, adp = setup
    # 800 decodes: each rank attends its own 100; the KV read is 100 x ctx x 96,256 B vs TP8's 800 x ctx x 24,064 B
    a = stage_parts(m, chip, adp, eff, 800, 2000, 0, 0)
    t = stage_parts(m, chip, tp8, eff, 800, 2000, 0, 0)
    kv_a = a["kv_cache"] or a["attention"]
    kv_t = t["kv_cache"] or t["attention"]
    assert kv_a == pytest.approx(kv_t * (100 * 96_256) / (800 * 24_064), rel=1e-9)
    # a prompt chunk runs whole on one rank: its room is one rank's budget less that rank's decodes
    assert replica_token_budget(chip, adp) == 8 * 8192
    assert prefill_room(adp, chip, 800) == 8192 - 100


def test_sglang_budget_is_per_replica(setup):
    m, chip, _, _, adp = setup
    from dataclasses import replace

    sg = replace(adp, engine="sglang")  # SGLang divides chunked_prefill_size by dp_size
    assert replica_token_budget(chip, sg) == 8192
    assert prefill_room(sg, chip, 0) == 8192 // 8


def test_dense_model_refused(setup, capsys):
    _, chip, _, _, _ = setup
    with pytest.raises(InfeasibleError, match="mixture-of-experts"):
        check_layout(load_model("llama3-70b"), chip, 8, ServeConfig(tp=8, attention_dp=True))
    code, _, err = run_cli(["serve", "--model", "llama3-70b", "--hardware", "h200", "--chips", "8",
                            "--input-len", "100", "--output-len", "100", "--attention-dp"], capsys)
    assert code == 2 and err.strip().startswith("error:") and len(err.strip().splitlines()) == 1


def test_search_tries_attention_dp_for_moe_only(setup):
    m, chip, _, _, _ = setup
    base = ServeConfig(weight_dtype="fp8", kv_dtype="fp8")
    assert any(c.attention_dp for c in layouts(m, chip, 8, base))
    assert not any(c.attention_dp for c in layouts(load_model("llama3-70b"), chip, 8, base))
    assert not any(c.attention_dp for c in layouts(m, chip, 8, base, attention_dp=False))


def test_cli_pin_json_key_and_round_trip(capsys, tmp_path):
    args = ["serve", "--model", "qwen3-235b-a22b", "--hardware", "h200", "--chips", "8", "--input-len", "1000",
            "--output-len", "1000", "--tp", "8", "--ep", "8", "--attention-dp", "--json"]
    code, out, _ = run_cli(args, capsys)
    assert code == 0
    o = json.loads(out)
    assert o["config"]["attention_dp"] is True and o["config"]["tp"] == 8 and o["config"]["ep"] == 8
    assert o["replica_step_token_budget"] == 8 * o["step_token_budget"]
    assert o["max_batch_per_replica"] % 8 == 0
    # --tp alone: no attention DP (pinned layout)
    code, out, _ = run_cli(args[:-4] + ["--json"], capsys)
    assert json.loads(out)["config"]["attention_dp"] is False
    plan = ServePlan(o, "Qwen/Qwen3-235B-A22B", "meshplan serve ...", "continuous", o["step_token_budget"])
    v = load_engine(export_engine("vllm", plan)["vllm.sh"])
    assert (v.tp, v.ep, v.replicas, v.attention_dp) == (8, 8, 1, True)
    assert v.batch == 8 * -(-o["batch"] // 8)
    s = load_engine(export_engine("sglang", plan)["sglang.sh"])
    assert (s.tp, s.ep, s.replicas, s.attention_dp, s.batch) == (8, 8, 1, True, o["batch"])
    t = export_engine("trtllm", plan)
    assert "enable_attention_dp: true" in t["trtllm_extra.yml"]
    assert f"--max_batch_size {-(-o['batch'] // 8)}" in t["trtllm.sh"].replace(" \\\n    ", " ")
    # the vLLM file read back plans the same layout
    f = tmp_path / "vllm.sh"
    f.write_text(export_engine("vllm", plan)["vllm.sh"])
    code, out, _ = run_cli(["serve", "--from", str(f), "--hardware", "h200", "--input-len", "1000",
                            "--output-len", "1000", "--json"], capsys)
    assert code == 0 and json.loads(out)["yours"]["config"]["attention_dp"] is True


def test_attention_dp_at_tp_1_is_refused_on_one_line(capsys):
    """Attention DP runs over a replica's tp ranks: pinned at tp=1 it would only rename plain replicas, so the pinned
    layout gets one `error:` line (exit 2); unpinned, the search skips that candidate and plans the rest."""
    common = ["serve", "--model", "qwen3-30b-a3b", "--hardware", "h100-sxm", "--chips", "8", "--input-len", "1000",
              "--output-len", "200", "--attention-dp"]
    code, out, err = run_cli([*common, "--tp", "1"], capsys)
    assert code == 2 and err.strip().startswith("error:") and "tp=1" in err and len(err.strip().splitlines()) == 1
    code, out, err = run_cli([*common, "--json"], capsys)
    assert code == 0, err
    cfg = json.loads(out)["config"]
    assert cfg["attention_dp"] is True and cfg["tp"] > 1
