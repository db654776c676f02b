"""Session 23 QA sweep of the book tools (`roofline`, `collective`, `matmul`): every expected value below is derived by
hand from the book's formulas and the chip datasheets, not read from meshplan."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.cost import roofline as rf
from meshplan.math.transformer import kv_cached_tokens, mean_attended_keys, newest_query_keys, touched_experts
from meshplan.specs.model import load_model

V5E_INT8_PEAK = 3.94e14  # TPU v5e int8 OP/s (Google Cloud TPU v5e docs; book ch.1 Q1)


def _json(capsys, args: list[str]) -> dict:
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    return json.loads(out)


def test_roofline_op_takes_the_commands_dtype(capsys):
    # book ch.1 Q1 (int8 matmul on v5e): B=256, D=F=8192, one byte per element: BD + DF + BF bytes, 2BDF OPs at
    # the int8 peak. --dtype int8 used to reach only the header, the row was timed as bf16
    B, D, F = 256, 8192, 8192
    d = _json(capsys, ["roofline", "-h", "tpu-v5e", "--op", f"matmul:{B},{D},{F}", "--dtype", "int8", "--json"])
    op = d["ops"][0]
    assert op["bytes"] == B * D + D * F + B * F == 71_303_168
    assert op["t_math_s"] == pytest.approx(2 * B * D * F / V5E_INT8_PEAK)
    assert op["name"] == f"matmul:{B},{D},{F}@int8"
    # the @dtype suffix wins over --dtype
    d = _json(capsys, ["roofline", "-h", "tpu-v5e", "--op", f"matmul:{B},{D},{F}@bf16", "--dtype", "int8", "--json"])
    assert d["ops"][0]["bytes"] == 2 * 71_303_168


@pytest.mark.parametrize("args", [
    ["roofline", "-h", "tpu-v5e", "--op", "matmul:256,8192,8192@fp8"],  # v5e has no fp8 unit: no silent bf16
    ["roofline", "-h", "tpu-v5e", "--op", "attention:1,8,8,64,7,128"],  # 64 query heads over 7 KV heads
    ["roofline", "-h", "tpu-v5e", "--op", "matmul:1,2,3", "--plot", "/tmp/meshplan-roofline.txt"],  # not an image
    ["matmul", "-h", "tpu-v5e", "-n", "16", "--mesh", "X=4,Y=4", "--lhs", "B,D", "--rhs", "D,F", "--sizes",
     "B=8192,D=8192,F=28672", "--dtype", "fp8"],
    ["matmul", "-h", "tpu-v5e", "-n", "16", "--mesh", "X=4,Y=4", "--lhs", "B,D", "--rhs", "D,F", "--sizes",
     "B=8192,D=8192,F=28672,B=4"],  # a size given twice
    ["matmul", "-h", "tpu-v5e", "-n", "16", "--mesh", "X=4,Y=4", "--lhs", "B,D", "--rhs", "D,F", "--sizes",
     "B=8192,D=8192,F=28672,Q=4"],  # a size for no dimension
    ["collective", "allreduce", "-h", "tpu-v5e", "-n", "256", "--mesh", "X=256", "--axes", "X", "--bytes", "1e9",
     "--sharp"],  # ICI reduces nothing in the network
    ["collective", "allreduce", "-h", "a100-80gb", "-n", "8", "--mesh", "X=8", "--axes", "X", "--bytes", "1e9",
     "--sharp"],  # NVLink SHARP is Hopper+
    ["collective", "allgather", "-h", "h100-sxm", "-n", "8", "--mesh", "X=8", "--axes", "X", "--bytes", "1e9",
     "--sharp"],  # SHARP is an allreduce choice
])
def test_contradictory_inputs_get_one_error_line(capsys, args):
    code, out, err = run_cli(args, capsys)
    assert code == 2 and err.startswith("error:") and err.count("\n") <= 1, err


def test_sharp_on_a_hopper_node_is_b_over_w(capsys):
    # book ch.12: SHARP all-reduce T = B / W_nvlink = 1e9 / 450e9 (ideal)
    d = _json(capsys, ["collective", "allreduce", "-h", "h100-sxm", "-n", "8", "--mesh", "X=8", "--axes", "X",
                       "--bytes", "1e9", "--sharp", "--ideal", "--json"])
    assert d["book_ideal"]["time_s"] == pytest.approx(1e9 / 450e9)


def test_multi_letter_axes_are_subscripted_apart(capsys):
    code, out, err = run_cli(["matmul", "-h", "h100-sxm", "-n", "16", "--mesh", "data=2,tensor=8", "--lhs",
                              "B:data+tensor,D", "--rhs", "D,F", "--sizes", "B=8192,D=8192,F=8192"], capsys)
    assert code == 0, err
    assert "[B_{data,tensor}, D]" in out and "datatensor" not in out


def test_moe_roofline_reads_only_the_experts_its_tokens_route_to():
    # Mixtral 8x7B, one token: k = 2 of 8 experts touched (E(1 - (1 - k/E)^1) = k). Up projection: the weights of
    # 2 experts, D x 2F bf16 each, plus E GEMMs of k/E rows reading D and writing 2F activations
    m = load_model("mixtral-8x7b")
    D, F, E, k = m.d_model, m.d_ff, m.n_experts, m.experts_per_token
    assert touched_experts(m, 1) == pytest.approx(k)
    up = next(o for o in rf.layer_ops(m, 1, 4096) if o.name == "mlp/up")
    assert up.bytes == pytest.approx(k * D * 2 * F * 2 + E * (k / E) * (D + 2 * F) * 2)
    assert up.flops == pytest.approx(2 * k * D * 2 * F)  # k experts' FLOPs for the token
    # at many tokens every expert is read once: E(1 - (1 - 1/4)^4096) = E
    many = next(o for o in rf.layer_ops(m, 4096, 4096) if o.name == "mlp/up")
    assert many.bytes == pytest.approx(E * D * 2 * F * 2 + 4096 * k * (D + 2 * F) * 2)


def test_newest_queries_attend_their_own_prefix():
    # the newest T of S causal queries attend S - T/2 keys on average (continuous positions): the T = S/2 chunk of
    # Llama 3 70B at S = 8192 costs 4 N H T (S - T/2) FLOPs, not 4 N H T S
    m = load_model("llama3-70b")
    S, T = 8192, 4096
    assert newest_query_keys(m, T, S) == pytest.approx(S - T / 2)
    assert newest_query_keys(m, 1, S) == pytest.approx(S - 0.5)  # a decode token sees the whole context
    assert newest_query_keys(m, S, S) == pytest.approx(S / 2)  # the whole sequence: the causal half
    core = next(o for o in rf.layer_ops(m, T, S) if o.name == "attn/core")
    assert core.flops == pytest.approx(4 * m.n_heads * m.head_dim * T * (S - T / 2))
    # the whole cache is read: K and V of S positions
    assert core.bytes == pytest.approx(2 * T * m.n_heads * m.head_dim * 2 + 2 * S * m.n_kv_heads * m.head_dim * 2)
    # a sliding window of w: the newest query of a long context attends w keys (gpt-oss alternates full and 128)
    g = load_model("gpt-oss-120b")
    full_and_window = [w or 100_000 for w in g.windows()]
    assert newest_query_keys(g, 1, 100_000) == pytest.approx(
        sum(min(w, 100_000 - 0.5) if w < 100_000 else 100_000 - 0.5 for w in full_and_window) / len(full_and_window),
        rel=1e-3)


def test_explain_names_the_axes_the_gradient_reduction_crosses(capsys):
    # dp 1, cp 4: the context ranks hold the same weights and reduce the gradients (Megatron-LM's data-parallel-with-
    # context group); the explanation named the data axis ('on no link') and advised growing a dp group of one
    d = _json(capsys, ["train", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "32", "--seq-len",
                       "4096", "--global-batch", "3", "--tp", "4", "--pp", "2", "--cp", "4", "--top", "1", "--json"])
    plan = d["plans"][0]
    assert plan["config"]["dp"] == 1 and plan["config"]["cp"] == 4
    assert plan["bottleneck"] == "comm/dp"
    text = plan["explanation"]
    assert "over the context ranks" in text and "no link" not in text and "per replica" not in text


def test_allreduce_across_many_nodes_takes_nccls_tree_latency(capsys):
    # NCCL's double binary tree: 2 x ((8 - 1) NVLink hops of 3 us + log2(2048) = 11 network hops of 5 us) = 152 us
    # (hop latencies from the h100-sxm spec), not the ring's 2 x 2047 x 5 us; bandwidth-bound at 1 GB
    d = _json(capsys, ["collective", "allreduce", "-h", "a100-80gb", "-n", "16384", "--mesh", "x=16384", "--axes",
                       "x", "--bytes", "1GB", "--json"])
    assert d["latency_time_s"] == pytest.approx(2 * (7 * 3e-6 + 11 * 5e-6))
    assert d["regime"] == "bandwidth" and "double binary tree (2048 nodes)" in d["algorithm"]
    # two nodes: the ring's latency is already the smaller, unchanged
    two = _json(capsys, ["collective", "allreduce", "-h", "a100-80gb", "-n", "16", "--mesh", "x=16", "--axes", "x",
                         "--bytes", "1GB", "--json"])
    assert "tree" not in two["algorithm"]


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["llama3-8b", "gpt-oss-120b", "gemma2-9b", "mixtral-8x7b"]),
       S=st.integers(1, 200_000), frac=st.floats(0.0, 1.0))
def test_newest_query_keys_bounds(name, S, frac):
    # the newest T queries attend at most the cached keys and at least the sequence's causal mean; all T = the mean
    m = load_model(name)
    T = max(1, int(S * frac))
    k = newest_query_keys(m, T, S)
    assert mean_attended_keys(m, S) - 1e-6 <= k <= kv_cached_tokens(m, S) + 1e-6
    if T == S:
        assert k == pytest.approx(mean_attended_keys(m, S))


def test_a_folder_is_named_as_a_folder(capsys, tmp_path):
    code, _, err = run_cli(["model", str(tmp_path)], capsys)
    assert code == 2 and f"folder '{tmp_path}' has no config.json" in err
    code, _, err = run_cli(["hardware", str(tmp_path)], capsys)
    assert code == 2 and "is a folder" in err and "unknown hardware" not in err
