"""The step token budget bounds the sequences that decode at once (metrics.budget_batch_limit), and trtllm-bench's own
limits (infer/harness.py). Expected values are hand calculations from the budget's conservation of tokens and from
TensorRT-LLM's tuning.py formulas with the published model and device numbers."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.cost.efficiency import default_efficiency
from meshplan.infer.config import ServeConfig, Workload, replica_token_budget
from meshplan.infer.frontier import frontier
from meshplan.infer.harness import finetune_setting, trtllm_bench_settings
from meshplan.infer.metrics import budget_batch_limit, evaluate, slot_turnover_steps
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

H100, H200 = load_chip("h100-sxm"), load_chip("h200")
LLAMA8B = load_model("llama3.1-8b")


def test_chunked_engine_limit_is_budget_over_one_plus_prompt_per_turnover():
    # default engine: chunks prompts, 8192-token budget, no overlap scheduler; 5000/500 -> each slot turns over every
    # 500 steps with one 5000-token prompt: b + 10 b <= 8192 -> b = floor(8192 / 11) = 744
    assert budget_batch_limit(ServeConfig(), H100, Workload(5000, 500), 5000) == 744
    # a batch under the limit is left alone
    assert budget_batch_limit(ServeConfig(), H100, Workload(5000, 500), 700) == 700


def test_unchunked_engine_fits_one_whole_prompt_per_step():
    # TensorRT-LLM's C++ executor (no chunking, no overlap): a step holds floor((8192 - b) / 5000) = 1 prompt beside
    # b decodes, so 10 b <= 5000 -> 500; the PyTorch backend schedules one step ahead (turnover 501) -> 501
    w = Workload(5000, 500)
    assert budget_batch_limit(ServeConfig(engine="trtllm@0.17", max_num_batched_tokens=8192), H100, w, 5000) == 500
    assert budget_batch_limit(ServeConfig(engine="trtllm", max_num_batched_tokens=8192), H100, w, 5000) == 501


def test_batch_past_the_limit_waits_and_does_not_add_throughput():
    eff, w, cfg = default_efficiency(H100), Workload(1000, 10), ServeConfig()
    # 1000/10 at 8192 tokens: b + 100 b <= 8192 -> 81
    assert budget_batch_limit(cfg, H100, w, 200) == 81
    over, at = evaluate(LLAMA8B, H100, 1, cfg, eff, w, 200), evaluate(LLAMA8B, H100, 1, cfg, eff, w, 81)
    assert over.running_batch == 81 and over.as_dict()["running_batch"] == 81 and over.batch == 200
    assert over.throughput_tokens_per_s == pytest.approx(at.throughput_tokens_per_s)
    assert over.tpot_s == pytest.approx(at.tpot_s)
    # the other 119 wait for a slot: Little's law at the engine's request rate (output tokens/s / 10)
    assert over.queue_wait_s == pytest.approx((200 - 81) / (at.throughput_tokens_per_s / 10))
    assert over.ttft_s > at.ttft_s + over.queue_wait_s * 0.9


@settings(max_examples=40, deadline=None)
@given(i=st.integers(1, 30000), o=st.integers(1, 4000), budget=st.sampled_from([512, 2048, 8192, 32768]),
       engine=st.sampled_from(["default", "trtllm", "trtllm@0.17", "vllm"]))
def test_no_frontier_point_carries_more_tokens_per_step_than_the_budget(i, o, budget, engine):
    cfg = ServeConfig(max_num_batched_tokens=budget, engine=engine)
    w = Workload(i, o)
    for p in frontier(LLAMA8B, H200, 1, cfg, default_efficiency(H200), w):
        b = p.running_batch
        per_step = b + b * i / slot_turnover_steps(cfg, H200, w, b)
        # one prompt per step is always admitted (a prompt longer than the budget runs alone: prompt_chunk)
        assert per_step <= replica_token_budget(H200, cfg) or b == 1 or per_step <= b + i


def test_trtllm_bench_finetune_setting_grid():
    # tuning.py finetune_setting: 901 requests at 2048/128 -> batch 128 x ceil(901/128) = 1024, tokens
    # 901 x 17 = 15317 -> 1024 x ceil(15317/1024) = 15360; the floors 64 and 2048 for a small request count
    assert finetune_setting(901.0, 2048, 128, 1) == (1024, 15360)
    assert finetune_setting(20.0, 128, 2048, 1) == (64, 2048)
    # at most 4096 requests over the pp stages (4096 / 2 = 2048, tokens 2048 x 2 = 4096 -> 512 x 8), at most 32768
    # tokens (4096 x 11 = 45056 -> 32768)
    assert finetune_setting(9000.0, 1000, 1000, 2) == (2048, 4096)
    assert finetune_setting(9000.0, 5000, 500, 1) == (4096, 32768)


def test_trtllm_bench_settings_for_llama8b_fp8_on_h200():
    # by hand: 8,030,261,248 params x 1 B = 7.479 GiB; nvidia-smi 143771 MiB = 140.40 GiB; KV share 0.90 (the
    # PyTorch backend's kv_cache_free_gpu_mem_fraction default); fp8 KV 2 x 32 x 8 x 128 x 1 B = 64 KiB per token:
    # (140.40 - 7.479) x 0.90 / (64 KiB x 2176 tokens) = 901 requests -> (1024, 15360) as above
    cfg = ServeConfig(weight_dtype="fp8", kv_dtype="fp8", engine="trtllm")
    s = trtllm_bench_settings(LLAMA8B, H200, cfg, Workload(2048, 128))
    assert s.kv_cache_max_requests == pytest.approx(901, rel=0.005)
    assert (s.max_batch_size, s.max_num_tokens, s.chunked_prefill) == (1024, 15360, False)
    # 20000/2000: 89 requests -> batch 96, tokens 2048, raised to hold the prompt beside a full batch: 20000 + 96
    s = trtllm_bench_settings(LLAMA8B, H200, cfg, Workload(20000, 2000))
    assert (s.max_batch_size, s.max_num_tokens) == (96, 20096)
    # the TensorRT flow (v0.17): the estimate's KV share is tuning.py's default 0.95, prompts chunk, no prompt floor
    s17 = trtllm_bench_settings(LLAMA8B, H200, ServeConfig(weight_dtype="fp8", kv_dtype="fp8", engine="trtllm@0.17"),
                                Workload(20000, 2000))
    assert s17.kv_cache_max_requests == pytest.approx(89.1 * 0.95 / 0.90, rel=0.005)
    assert (s17.max_num_tokens, s17.chunked_prefill) == (2048, True)


def test_harness_limits_apply_per_attention_dp_rank():
    qwen = load_model("qwen3-30b-a3b")
    cfg = ServeConfig(tp=4, ep=4, attention_dp=True, weight_dtype="fp8", kv_dtype="fp8", engine="trtllm")
    s = trtllm_bench_settings(qwen, H200, cfg, Workload(1000, 1000))
    applied = s.apply(cfg, H200)
    # TensorRT-LLM runs one scheduler per attention-DP rank: the replica holds 4 x max_batch_size sequences
    assert applied.max_num_seqs == 4 * s.max_batch_size
    assert applied.max_num_batched_tokens == s.max_num_tokens and applied.chunked_prefill is False


def test_serve_harness_cli(capsys):
    base = ["serve", "--model", "llama3.1-8b", "--hardware", "h200", "--chips", "1", "--tp", "1", "--input-len",
            "2048", "--output-len", "128", "--quant", "fp8", "--kv-quant", "fp8"]
    code, out, _ = run_cli([*base, "--engine", "trtllm", "--harness", "trtllm-bench", "--json"], capsys)
    assert code == 0
    o = json.loads(out)
    assert o["harness"]["max_batch_size"] == 1024 and o["harness"]["max_num_tokens"] == 15360
    assert o["step_token_budget"] == 15360 and o["max_batch_per_replica"] <= 1024
    code, _, err = run_cli([*base, "--harness", "trtllm-bench"], capsys)
    assert code == 2 and err.startswith("error:") and "--engine trtllm" in err
    code, _, err = run_cli([*base, "--engine", "trtllm", "--harness", "trtllm-bench", "--max-num-seqs", "8"], capsys)
    assert code == 2 and err.startswith("error:")
    code, _, err = run_cli([*base, "--engine", "trtllm", "--harness", "nope"], capsys)
    assert code == 2 and "trtllm-bench" in err


def test_serve_max_num_seqs_caps_the_batch(capsys):
    code, out, _ = run_cli(["serve", "--model", "llama3.1-8b", "--hardware", "h100-sxm", "--chips", "1", "--tp", "1",
                            "--input-len", "512", "--output-len", "512", "--max-num-seqs", "48", "--json"], capsys)
    assert code == 0
    o = json.loads(out)
    assert o["max_batch_per_replica"] == 48 and o["batch"] <= 48
    code, _, err = run_cli(["serve", "--model", "llama3.1-8b", "--hardware", "h100-sxm", "--chips", "1",
                            "--input-len", "512", "--output-len", "512", "--max-num-seqs", "0"], capsys)
    assert code == 2 and err.startswith("error:")


def test_serve_text_names_the_sequences_waiting_for_the_budget(capsys):
    code, out, _ = run_cli(["serve", "--model", "llama3.1-8b", "--hardware", "h100-sxm", "--chips", "1", "--tp", "1",
                            "--input-len", "1000", "--output-len", "10", "--batch", "200"], capsys)
    assert code == 0
    assert "81 decode at once" in out.replace("\n", " ")


def test_frontier_holds_the_budget_limit_and_ranks_it_first():
    from meshplan.infer.frontier import best_point

    pts = frontier(LLAMA8B, H100, 1, ServeConfig(), default_efficiency(H100), Workload(1000, 10))
    assert 81 in [p.batch for p in pts]
    # every larger batch runs the same 81 sequences at the same throughput, with a longer TTFT: the smallest wins
    assert best_point(pts).batch == 81


def test_closed_form_limit_matches_the_step_level_simulator():
    # the simulator schedules every step within the budget on its own (decodes first, then prompt chunks); with 200
    # slots and clients to fill them it settles at the closed form's 81 running sequences' throughput and TPOT
    import math

    from meshplan.infer.simulate import SimSpec, simulate

    eff, w, cfg = default_efficiency(H100), Workload(1000, 10), ServeConfig()
    closed = evaluate(LLAMA8B, H100, 1, cfg, eff, w, 200)
    sim = simulate(LLAMA8B, H100, 1, cfg, eff, w, 200, SimSpec(math.inf, 1500, 0, concurrency=400))
    assert sim["throughput_tokens_per_s"] == pytest.approx(closed.throughput_tokens_per_s, rel=0.03)
    assert sim["tpot_s"]["p50"] == pytest.approx(closed.tpot_s, rel=0.03)


def test_serve_clients_line_counts_the_sequences_running_under_the_budget(capsys):
    # 400 clients, 248 decode at once under the 8192-token budget (4096-token prompts): 152 wait
    code, out, _ = run_cli(["serve", "--model", "llama3.1-8b", "--hardware", "h200", "--chips", "2", "--tp", "2",
                            "--input-len", "4096", "--output-len", "128", "--engine", "vllm", "--batch", "400",
                            "--concurrency", "400", "--json"], capsys)
    assert code == 0
    o = json.loads(out)
    assert o["running_batch"] == 248 and o["clients"]["running"] == 248 and o["clients"]["waiting"] == 152


def test_batch_past_the_engines_sequence_cap_names_the_cap(capsys):
    code, _, err = run_cli(["serve", "--model", "llama3.1-8b", "--hardware", "h200", "--chips", "1", "--input-len",
                            "1024", "--output-len", "1024", "--engine", "vllm", "--max-num-seqs", "64", "--batch",
                            "128"], capsys)
    assert code == 2 and err.startswith("error: batch 128 is more than vllm runs at once: 64")
    assert "--concurrency 128" in err and err.count("\n") == 1


def test_simulate_and_rate_refuse_what_they_would_ignore(capsys):
    base = ["serve", "--model", "llama3.1-8b", "--hardware", "h200", "--chips", "1", "--input-len", "1024",
            "--output-len", "128"]
    code, _, err = run_cli([*base, "--rate", "5"], capsys)
    assert code == 2 and "--simulate" in err
    code, _, err = run_cli([*base, "--batching", "static", "--simulate", "--concurrency", "8"], capsys)
    assert code == 2 and "--batching static" in err


def test_harness_that_refuses_every_layout_says_so(capsys):
    code, _, err = run_cli(["serve", "--model", "llama3.1-70b", "--hardware", "h100-sxm", "--chips", "2",
                            "--input-len", "90000", "--output-len", "1000", "--engine", "trtllm", "--harness",
                            "trtllm-bench"], capsys)
    assert code == 2 and err.startswith("error: trtllm-bench accepts no layout") and "pinned" not in err
