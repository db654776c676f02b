"""`meshplan serve` and meshplan.infer: hand-derived values, monotonicity, CLI contract, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from meshplan.cost.efficiency import default_efficiency
from meshplan.infer.config import ServeConfig, Workload, serving_constant
from meshplan.infer.disagg import disaggregate
from meshplan.infer.frontier import frontier
from meshplan.infer.memory import max_batch_per_replica, memory_per_chip, weight_bytes_per_chip
from meshplan.infer.metrics import evaluate
from meshplan.infer.simulate import SimSpec, simulate
from meshplan.infer.step import decode_step
from meshplan.math.transformer import param_counts
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

M70, H100 = load_model("llama3-70b"), load_chip("h100-sxm")
EFF = default_efficiency(H100)
W = Workload(1000, 500)


def test_decode_step_batch1_llama3_70b_tp8_by_hand():
    """Batch 1, 8 x H100 TP=8 bf16: weights/(8 W_hbm eff) + per-layer kernels + 2 all-reduces per layer."""
    m, tp, ctx = M70, 8, 1000
    pc = param_counts(m)
    D, H, L = m.d_model, m.head_dim, m.n_layers
    # per chip: Q/O and MLP split 8 ways, K/V: one of the 8 KV heads per chip, norms replicated, output proj / 8
    layer = 2 * D * m.q_dim / tp + 2 * D * H * 1 + pc.per_layer_mlp / tp + pc.per_layer_norms
    weights = (L * layer + D * m.vocab_size / tp) * 2.0
    bw = 3.35e12 * EFF.hbm_fraction  # datasheet HBM bandwidth x measured fraction
    kv = 2 * L * 1 * H * 2.0 * ctx  # one KV head per chip, bf16
    act = D * 2.0  # one token's activation
    # the engine's one-shot kernel whenever the message is eligible (not NCCL's ring): 4.55 us (h100-sxm
    # custom_allreduce_latency_s) + 16,384 B x 7 peers at 450 GB/s x 0.648 (custom_allreduce_nvlink_fraction) = 4.94 us;
    # the two-shot (9.1 us + ...) is slower here
    ar = serving_constant("custom_allreduce_latency_s", H100) + act * (tp - 1) / (4.5e11 * 0.648)
    assert ar == pytest.approx(4.943e-6, rel=1e-3)
    # pointwise kernels of the one token: norms + residuals 10·D (replicated over TP), RoPE on q and k
    # 2·(64 + 8)·128/8, SwiGLU 3·F/8, bf16, every layer: (81920 + 2304 + 10752) · 2 B · 80 = 15.2 MB
    pointwise = L * (10 * D + 2 * (64 + 8) * 128 / tp + 3 * m.d_ff / tp) * 2.0
    expected = (weights / bw + kv / bw + pointwise / bw + 2 * L * ar
                + L * serving_constant("decode_kernels_per_layer", H100) * EFF.kernel_overhead_s
                + serving_constant("decode_step_overhead_s", H100))
    got = decode_step(m, H100, ServeConfig(tp=8), EFF, 1, ctx)
    assert got.time_s == pytest.approx(expected, rel=1e-9)
    assert got.bound == "weights"
    # far from the bandwidth roofline: overheads add >20% over weights/(8 W_hbm)
    assert got.time_s > 1.2 * weights / 3.35e12


def test_weight_and_kv_memory_by_dtype():
    bf16 = weight_bytes_per_chip(M70, ServeConfig(tp=8))
    assert weight_bytes_per_chip(M70, ServeConfig(tp=8, weight_dtype="fp8")) == pytest.approx(bf16 / 2)
    assert weight_bytes_per_chip(M70, ServeConfig(tp=8, weight_dtype="int4")) == pytest.approx(bf16 / 4)
    kv16 = memory_per_chip(M70, H100, ServeConfig(tp=8), EFF, 10, 1000).kv_cache
    kv8 = memory_per_chip(M70, H100, ServeConfig(tp=8, kv_dtype="int8"), EFF, 10, 1000).kv_cache
    assert kv16 == pytest.approx(2 * kv8)
    assert kv16 == pytest.approx(10 * 1000 * 2 * 80 * 1 * 128 * 2)


def test_max_batch_is_the_edge_of_memory():
    cfg = ServeConfig(tp=4, weight_dtype="fp8")
    mb = max_batch_per_replica(M70, H100, cfg, EFF, W)
    assert mb > 0
    assert memory_per_chip(M70, H100, cfg, EFF, mb, W.max_context).fits
    assert not memory_per_chip(M70, H100, cfg, EFF, mb + 1, W.max_context).fits


def test_weights_that_do_not_fit_give_zero_batch():
    assert max_batch_per_replica(M70, H100, ServeConfig(tp=1), EFF, W) == 0


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 300), d=st.integers(1, 300), mode=st.sampled_from(["continuous", "static"]),
       tp=st.sampled_from([2, 4, 8]), pp=st.sampled_from([1, 2]))
def test_tpot_non_decreasing_in_batch(b, d, mode, tp, pp):
    cfg = ServeConfig(tp=tp, pp=pp, weight_dtype="fp8")
    a = evaluate(M70, H100, 8 * pp, cfg, EFF, W, b, mode)
    c = evaluate(M70, H100, 8 * pp, cfg, EFF, W, b + d, mode)
    assert c.tpot_s >= a.tpot_s * (1 - 1e-12)


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 200), d=st.integers(1, 200), tp=st.sampled_from([2, 4, 8]))
def test_throughput_non_decreasing_until_memory(b, d, tp):
    cfg = ServeConfig(tp=tp, weight_dtype="fp8", kv_dtype="fp8")
    mb = max_batch_per_replica(M70, H100, cfg, EFF, W)
    lo, hi = min(b, mb), min(b + d, mb)

    def one_shot(batch: int) -> bool:  # the engine's one-shot all-reduce holds the step's [tokens, D] bf16
        tokens = batch * (1 + W.input_len / W.output_len)
        return tokens * M70.d_model * 2 <= serving_constant("custom_allreduce_max_bytes", H100)

    # past the one-shot kernel's size limit the engine falls back to NCCL, a real (vLLM) step down
    assume(one_shot(lo) == one_shot(hi))
    assert evaluate(M70, H100, 8, cfg, EFF, W, hi).throughput_tokens_per_s >= \
        evaluate(M70, H100, 8, cfg, EFF, W, lo).throughput_tokens_per_s * (1 - 1e-12)


@settings(max_examples=20, deadline=None)
@given(tp=st.sampled_from([2, 4, 8]), k=st.integers(1, 4), extra=st.integers(1, 4))
def test_more_chips_never_fewer_max_batch(tp, k, extra):
    def deployment_max(chips: int, cfg: ServeConfig) -> int:
        return max_batch_per_replica(M70, H100, cfg, EFF, W) * (chips // cfg.chips_per_replica)

    cfg = ServeConfig(tp=tp, weight_dtype="fp8")
    assert deployment_max(tp * (k + extra), cfg) >= deployment_max(tp * k, cfg)
    # the same replica spread over more chips (larger TP) holds at least as many sequences
    wide = ServeConfig(tp=8, weight_dtype="fp8")
    assert deployment_max(8, wide) >= deployment_max(tp, cfg)


def test_static_batch_prefill_scales_with_prompts():
    cfg = ServeConfig(tp=8)
    p1 = evaluate(M70, H100, 8, cfg, EFF, W, 1, "static")
    p8 = evaluate(M70, H100, 8, cfg, EFF, W, 8, "static")
    assert p8.ttft_s > 4 * p1.ttft_s  # prefill is compute-bound: ~linear in prompt tokens (book ch.7)


def test_cost_per_million_output_tokens_matches_price():
    p = evaluate(M70, H100, 8, ServeConfig(tp=8), EFF, Workload(1, 500), 16)
    usd_per_s = 8 * H100.price_per_chip_hour / 3600
    cost = p.cost_per_million_tokens()
    assert cost["output"] <= usd_per_s / p.throughput_tokens_per_s * 1e6 * (1 + 1e-9)
    assert cost["output"] == pytest.approx(usd_per_s / p.throughput_tokens_per_s * 1e6, rel=0.05)


def test_frontier_and_moe_expert_parallel():
    mix = load_model("mixtral-8x7b")
    pts = frontier(mix, H100, 8, ServeConfig(tp=8, ep=8), EFF, W)
    assert pts and pts[0].batch == 1
    tput = [p.throughput_tokens_per_s for p in pts]
    assert tput == sorted(tput)
    # at batch 1 only k of E experts are read: faster than a dense read of all experts
    one = decode_step(mix, H100, ServeConfig(tp=8, ep=8), EFF, 1, 1000)
    assert one.parts["weights"] < weight_bytes_per_chip(mix, ServeConfig(tp=8)) / (3.35e12 * EFF.hbm_fraction)


def test_simulation_is_seeded_and_ordered():
    cfg = ServeConfig(tp=8, weight_dtype="fp8")
    spec = SimSpec(rate=4.0, n_requests=40, seed=7, input_dist="exponential", output_dist="uniform")
    a = simulate(M70, H100, 8, cfg, EFF, Workload(500, 100), 32, spec)
    b = simulate(M70, H100, 8, cfg, EFF, Workload(500, 100), 32, spec)
    assert a == b
    for k in ("ttft_s", "tpot_s"):
        assert 0 < a[k]["p50"] <= a[k]["p90"] <= a[k]["p99"]


def test_disaggregation_ratio_follows_the_book():
    cfg = ServeConfig(tp=8, weight_dtype="fp8")
    plan = disaggregate(M70, H100, 64, cfg, cfg, EFF, Workload(4000, 200), 64)
    assert plan.ratio == pytest.approx(plan.prefill_s * 64 / (plan.tpot_s * 200))
    assert plan.prefill_instances + plan.decode_instances <= 8
    assert plan.kv_transfer_s > 0 and plan.ttft_s > plan.prefill_s


# ---------------------------------------------------------------- CLI

BASE = ["serve", "--model", "llama3-70b", "--hardware", "h100-sxm", "--chips", "8", "--input-len", "1000",
        "--output-len", "500"]


def test_cli_json_contract(capsys):
    code, out, err = run_cli(BASE + ["--tp", "8", "--quant", "fp8", "--json"], capsys)
    assert code == 0, err
    d = json.loads(out)
    for k in ("ttft_s", "tpot_s", "throughput_tokens_per_s", "max_batch", "memory_bytes_per_chip",
              "cost_per_million_tokens", "batch", "config", "e2e_latency_s", "frontier"):
        assert k in d
    assert {"weights", "kv_cache", "activations", "total"} <= set(d["memory_bytes_per_chip"])
    assert {"input", "output"} <= set(d["cost_per_million_tokens"])
    # --batch omitted: the highest-throughput batch on the frontier
    assert d["throughput_tokens_per_s"] == pytest.approx(max(p["throughput_tokens_per_s"] for p in d["frontier"]))


def test_cli_targets_search_simulate_disaggregate_plot(capsys, tmp_path):
    png = tmp_path / "f.png"
    code, out, err = run_cli(BASE + ["--quant", "fp8", "--search", "--tpot-target", "0.03", "--simulate",
                                     "--rate", "2", "--requests", "30", "--disaggregate", "--plot", str(png),
                                     "--json"], capsys)
    assert code == 0, err
    d = json.loads(out)
    assert d["tpot_s"] <= 0.03
    assert png.stat().st_size > 1000
    assert {"p50", "p90", "p99"} <= set(d["simulation"]["ttft_s"])
    assert d["disaggregated"]["prefill_instances"] >= 1


def test_cli_table(capsys):
    code, out, _ = run_cli(BASE + ["--tp", "8", "--batch", "4"], capsys)
    assert code == 0 and "TPOT" in out


@pytest.mark.parametrize("args, needle", [
    (["--output-len", "0"], "--output-len"),
    (["--tp", "8", "--batch", "100000"], "needs"),
    (["--tp", "8", "--tpot-target", "0.0001"], "best reachable"),
    (["--tp", "3"], "tp=3"),
    (["--quant", "fp4"], "--quant"),
    (["--simulate"], "--rate"),
])
def test_cli_bad_input(capsys, args, needle):
    code, out, err = run_cli(BASE + args + ["--json"], capsys)
    assert code == 2
    assert err.startswith("error:") and needle in err
    assert "Traceback" not in err


def test_serving_accuracy_script_on_two_entries(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "serving_accuracy.py"
    spec = importlib.util.spec_from_file_location("serving_accuracy", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    entry = {"id": "a", "source": "s", "model": "llama3-70b", "hardware": "h100-sxm", "chips": 2, "tp": 2, "pp": 1,
             "weight_dtype": "fp8", "kv_dtype": None, "input_len": 500, "output_len": 2000, "batch": 1,
             "regime": "fixed_batch", "measured": {"output_tokens_per_s": 52.85, "tpot_s": 0.01891, "ttft_s": None}}
    other = {**entry, "id": "b", "batch": None, "regime": "offline_max_throughput",
             "measured": {"output_tokens_per_s": 4205, "tpot_s": None, "ttft_s": None}}
    f = tmp_path / "m.yaml"
    f.write_text(json.dumps({"measurements": [entry, other]}))
    res = mod.run(f)
    assert res["summary"]["output_tokens_per_s"]["n"] == 2
    assert res["rows"][0]["predicted"]["kv_dtype"] == "fp8"
    assert abs(res["rows"][0]["error"]["tpot_s"]) < 0.3


def test_disaggregated_text_shows_the_plan_it_sizes(capsys):
    # session 21, QA finding: the text output printed only '1:1 (ratio 2.01)' under the colocated table; the pools, their
    # TTFT/TPOT/throughput and which pool sets the rate were in --json alone
    import json

    from conftest import run_cli

    args = ["serve", "--model", "llama3-70b", "--hardware", "h100-sxm", "--chips", "8", "--input-len", "2000",
            "--output-len", "500", "--disaggregate"]
    code, out, _ = run_cli([*args, "--json"], capsys)
    assert code == 0
    d = json.loads(out)["disaggregated"]
    code, text, _ = run_cli(args, capsys)
    text = " ".join(text.split())
    assert code == 0
    assert f"{d['prefill_instances']}:{d['decode_instances']}" in text
    assert f"{d['throughput_tokens_per_s']:,.0f}" in text and f"batch {d['decode_batch']}" in text
    bound = "prefill-bound" if d["prefill_instances"] / d["decode_instances"] < d["prefill_per_decode_ratio"] \
        else "decode-bound"
    assert bound in text


def test_a_prompt_longer_than_the_step_budget_holds_its_slot_for_its_chunks(capsys):
    # session 21, QA finding: 100,000-token prompts, 100 output tokens, 4 sequences on one H100: throughput was B / step
    # (every slot emitting a token every step) although each request spends its prompt's extra chunk steps without one.
    # Hand count: 4 slots, 3 decodes beside a chunk -> 8,192 - 3 = 8,189 prompt tokens per step -> ceil(100,000 / 8,189)
    # = 13 chunk steps, the last one yielding the first token, then 99 decode steps: 112 steps per request
    import json

    from conftest import run_cli

    code, out, _ = run_cli(["serve", "--model", "llama3.1-8b", "--hardware", "h100-sxm", "--chips", "1", "--input-len",
                            "100000", "--output-len", "100", "--batch", "4", "--json"], capsys)
    assert code == 0
    d = json.loads(out)
    step = d["decode_step"]["time_s"]  # the mean step the batch runs (its chunk steps and pure decodes)
    assert d["throughput_tokens_per_s"] == pytest.approx(4 * 100 / (112 * step))


def test_a_request_past_the_models_context_window_is_one_error(capsys, tmp_path):
    """Session 24 (a QA finding left in session 23): Llama 2's 4,096-token window took 8,000 + 512-token requests and
    GPT-3's learned positions 2,048 + 2,000. vLLM refuses a max_model_len above the config's max_position_embeddings;
    so does meshplan, for the mean request and for a length trace's longest one."""
    from conftest import run_cli

    code, _, err = run_cli(["serve", "--model", "llama2-7b", "--hardware", "h100-sxm", "--chips", "1",
                            "--input-len", "8000", "--output-len", "512"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "8512 tokens (input 8000 + output 512)" in err and "context window of 4096 tokens" in err
    code, _, err = run_cli(["serve", "--model", "gpt3-175b", "--hardware", "h100-sxm", "--chips", "8",
                            "--input-len", "2000", "--output-len", "49"], capsys)
    assert code == 2 and "context window of 2048 tokens" in err
    # exactly the window: served
    code, _, _ = run_cli(["serve", "--model", "gpt3-175b", "--hardware", "h100-sxm", "--chips", "8",
                          "--input-len", "2000", "--output-len", "48"], capsys)
    assert code == 0
    # a trace whose mean fits and whose longest request does not
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"input_lens": [100, 4000], "output_lens": [100, 200]}))
    code, _, err = run_cli(["serve", "--model", "llama2-7b", "--hardware", "h100-sxm", "--chips", "1", "--simulate",
                            "--rate", "1", "--requests", "4", "--length-trace", str(trace)], capsys)
    assert code == 2 and "longest request (4200 tokens" in err
    # a server command line whose own maximum context passes the window: the engine refuses the command itself
    cmd = tmp_path / "v.sh"
    cmd.write_text("vllm serve meta-llama/Llama-2-7b-hf --max-model-len 8192\n")
    code, _, err = run_cli(["serve", "--from", str(cmd), "--model", "llama2-7b", "--hardware", "h100-sxm",
                            "--input-len", "100", "--output-len", "100"], capsys)
    assert code == 2 and "maximum context (8192 tokens)" in err and "--max-model-len" in err
    # a config that names no window has none to enforce (max_seq_len is then a default, not the model's)
    cfg = json.loads((Path(__file__).resolve().parents[1] / "src/meshplan/specs/data/models/llama2-7b.json").read_text())
    del cfg["max_position_embeddings"]
    (tmp_path / "m.json").write_text(json.dumps(cfg))
    code, _, _ = run_cli(["serve", "--model", str(tmp_path / "m.json"), "--hardware", "h100-sxm", "--chips", "1",
                          "--input-len", "8000", "--output-len", "512"], capsys)
    assert code == 0
    # a config that declares its window under GPT-2's key is refused naming that key (session 25)
    cfg["n_positions"] = 4096
    (tmp_path / "g.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(["serve", "--model", str(tmp_path / "g.json"), "--hardware", "h100-sxm", "--chips", "1",
                            "--input-len", "8000", "--output-len", "512"], capsys)
    assert code == 2 and "(n_positions in its config.json)" in err
    assert "max_position_embeddings" not in err


def test_a_fixed_length_closed_loop_says_its_clients_run_in_step(capsys):
    """Session 24: 16 closed-loop clients of fixed 1000/200-token requests start together, finish together and send
    together, so the simulation's TTFT (prompts arriving in waves, ~0.28 s) is far from the closed form's (clients at
    spread-out ages, ~0.04 s). The output says why; with outputs of varied length the waves spread and the two agree.
    Session 26: --requests now reaches the closed form too, whose mean counts the benchmark's first round (all 16 at
    t = 0) beside the steady state: the mean of the simulation's TTFTs is what it predicts."""
    from conftest import run_cli

    args = ["serve", "--model", "llama3.1-8b", "--hardware", "h100-sxm", "--chips", "1", "--tp", "1", "--input-len",
            "1000", "--output-len", "200", "--concurrency", "16", "--engine", "vllm", "--simulate", "--requests", "400",
            "--json"]
    code, out, _ = run_cli(args, capsys)
    d = json.loads(out)
    assert code == 0 and d["simulation"]["ttft_s"]["p50"] > 2 * d["ttft_s"] and "stay in step" in d["simulation"]["note"]
    code, out, _ = run_cli([*args, "--output-dist", "exponential"], capsys)
    d = json.loads(out)
    assert code == 0 and "note" not in d["simulation"]
    assert d["simulation"]["ttft_s"]["mean"] == pytest.approx(d["ttft_s"], rel=0.1)
