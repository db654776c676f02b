"""Serving scheduler physics of issue #14: step token budget per engine, the wait for the next iteration, chunked
prefill under a small budget, MoE grouped-GEMM rows per expert, closed-loop and burst arrivals. Hand-derived."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from conftest import run_cli

from meshplan.cost.efficiency import default_efficiency
from meshplan.infer.config import ServeConfig, Workload, engine_token_budget, step_token_budget
from meshplan.infer.memory import activation_bytes_per_chip
from meshplan.infer.metrics import evaluate, scheduler_wait_s, ttft_continuous
from meshplan.infer.simulate import SimSpec, _Replica, make_requests, simulate
from meshplan.infer.step import stage_parts, step_cost, tokens_per_expert
from meshplan.math.transformer import param_counts
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

M8, H100, A100 = load_model("llama3.1-8b"), load_chip("h100-sxm"), load_chip("a100-80gb")
EFF = default_efficiency(H100)


def test_engine_budgets_follow_the_engines_defaults():
    # vLLM get_batch_defaults (OPENAI_API_SERVER): 8192 on >= 70 GiB GPUs except A100, else 2048
    assert engine_token_budget("vllm", H100) == 8192
    assert engine_token_budget("vllm", load_chip("h200")) == 8192
    assert engine_token_budget("vllm", A100) == 2048
    assert engine_token_budget("vllm", load_chip("a100-40gb")) == 2048
    # SGLang chunked_prefill_size 8192 on 35-160 GB GPUs; TensorRT-LLM max_num_tokens 8192
    assert engine_token_budget("sglang", H100) == 8192
    assert engine_token_budget("trtllm", A100) == 8192
    # vLLM's TPU branch of get_batch_defaults (OPENAI_API_SERVER): V6E 1024, V5E 512, V5P 256
    assert engine_token_budget("vllm", load_chip("tpu-v6e")) == 1024
    assert engine_token_budget("vllm", load_chip("tpu-v5e")) == 512
    assert engine_token_budget("vllm", load_chip("tpu-v5p")) == 256
    # no SGLang entry for TPUs: the serving.yaml default (8192)
    assert engine_token_budget("sglang", load_chip("tpu-v6e")) == 8192
    assert step_token_budget(H100, ServeConfig(max_num_batched_tokens=512)) == 512
    assert step_token_budget(H100, ServeConfig()) == 8192


def test_scheduler_wait_is_half_a_busy_step():
    # Orca iteration-level scheduling: mean residual of a 20 ms step under random arrival = 10 ms
    assert scheduler_wait_s(0.020, others=3) == pytest.approx(0.010)
    assert scheduler_wait_s(0.020, others=0) == 0.0  # idle engine: starts at once


def test_ttft_chunks_a_prompt_by_the_step_budget():
    w = Workload(1000, 200)
    cfg = ServeConfig(max_num_batched_tokens=512)
    # batch 1: no other sequence -> no wait; chunks of 512: a 512-token step, then the 488 left (their mean position
    # 1000 - 244 = 756)
    one = step_cost(M8, H100, cfg, EFF, 0, w.mean_decode_context, 512, 500.0, 1).time_s
    rest = step_cost(M8, H100, cfg, EFF, 0, w.mean_decode_context, 488, 756.0, 1).time_s
    assert ttft_continuous(M8, H100, cfg, EFF, w, 1) == pytest.approx(one + rest)
    # batch 65: 64 decodes take 64 tokens of the budget -> chunks of 448: two mixed steps of 448 and one of the 104
    # left (mean position 948), after waiting half of the running 30 ms step (15 ms)
    mixed = step_cost(M8, H100, cfg, EFF, 64, w.mean_decode_context, 448, 500.0, 65).time_s
    last = step_cost(M8, H100, cfg, EFF, 64, w.mean_decode_context, 104, 948.0, 65).time_s
    assert ttft_continuous(M8, H100, cfg, EFF, w, 65, busy_step_s=0.030) == pytest.approx(0.015 + 2 * mixed + last)
    # the default budget (8192) takes the prompt in one step
    big = step_cost(M8, H100, ServeConfig(), EFF, 0, w.mean_decode_context, 1000, 500.0, 1).time_s
    assert ttft_continuous(M8, H100, ServeConfig(), EFF, w, 1) == pytest.approx(big)


def test_continuous_ttft_includes_the_wait_for_the_running_step():
    w, b = Workload(1000, 200), 32
    p = evaluate(M8, H100, 1, ServeConfig(), EFF, w, b)
    # steady state: 32 x 1000 / 200 = 160 prompt tokens per step on average, but a step carries a whole 1000-token
    # prompt (the 8192 budget holds it) or none: 16% of the steps carry one (metrics.mean_step_s)
    long = step_cost(M8, H100, ServeConfig(), EFF, 32, 1100.0, 1000, 500.0, 32, prefill_seqs=1.0).time_s
    short = step_cost(M8, H100, ServeConfig(), EFF, 32, 1100.0).time_s
    step = 0.16 * long + 0.84 * short
    assert 32 / p.throughput_tokens_per_s == pytest.approx(step)
    # a random arrival waits the mean residual of the running step, E[S^2] / (2 E[S]) (length-biased), and behind
    # the prompts of the other 31 sequences, each replaced every 200 steps (31 / (200 x step) per second)
    residual = (0.16 * long**2 + 0.84 * short**2) / (2 * step)
    assert residual > step / 2
    queue = ttft_continuous(M8, H100, ServeConfig(), EFF, w, b, 0.0, 31 / (200 * step))
    assert p.ttft_s == pytest.approx(residual + queue)
    assert queue > ttft_continuous(M8, H100, ServeConfig(), EFF, w, b)


def test_activation_workspace_scales_with_the_budget():
    cfg = ServeConfig()
    logits = 8 * M8.vocab_size * 4.0  # batch 8, fp32 logits, tp 1
    full = activation_bytes_per_chip(M8, H100, cfg, 8) - logits
    small = activation_bytes_per_chip(M8, H100, replace(cfg, max_num_batched_tokens=512), 8) - logits
    assert small == pytest.approx(full * 512 / 8192)  # workspace = budget tokens x width


def test_moe_expert_gemms_run_at_tokens_per_expert_rows():
    mix = load_model("mixtral-8x7b")
    assert tokens_per_expert(mix, 1024) == pytest.approx(256.0)  # 1024 tokens x k=2 / E=8
    assert tokens_per_expert(M8, 1024) == 1024  # dense: every token in one GEMM
    # prefill-only step of T = 4096 tokens at context 1: compute-bound, attention negligible
    T, cfg = 4096.0, ServeConfig()
    parts = stage_parts(mix, H100, cfg, EFF, 0.0, 0.0, T, 1.0)
    pc = param_counts(mix)
    expert = 3 * mix.d_model * mix.d_ff  # one gated expert: 3 x 4096 x 14336 = 176,160,768
    routed = mix.experts_per_token * expert  # k = 2 experts per token
    dense = pc.per_layer_attention + pc.per_layer_norms + pc.per_layer_router  # per layer, tp = 1
    peak = H100.peak("bf16") * EFF.matmul_peak_fraction
    h, d_half = EFF.matmul_rows_half, EFF.matmul_half_dim  # 128 rows, 256 wide
    # each GEMM at the penalty of its most constraining dimension: the dense GEMMs' narrower weight side is
    # d_model = 4096 (fused QKV 4096 -> 4096 + 2 x 8 x 128 = 6144, O 4096 -> 4096), 4096/(4096+256) = 0.941 below
    # their rows' 4096/(4096+128) = 0.970; the experts' rows 1024/(1024+128) = 0.889 below their 4096/(4096+256)
    f_dense, f_exp = 4096 / (4096 + d_half), (T / 4) / (T / 4 + h)
    f_logits = 1 / (1 + h)  # the output projection runs for the one sampled row of the prompt chunk
    L = mix.n_layers
    want = (2 * T * L * dense / (peak * f_dense) + 2 * 1 * mix.d_model * mix.vocab_size / (peak * f_logits)
            + 2 * T * L * routed / (peak * f_exp))
    assert parts["compute"] == pytest.approx(want, rel=1e-9)
    # expand + finalize: 2 x T x D x (k + 1) bf16 elements per layer = 2 * 4096 * 4096 * 3 * 2 B = 201,326,592 B,
    # x 32 layers = 6,442,450,944 B at H100's 3.35 TB/s x hbm_fraction
    assert parts["moe_permute"] == pytest.approx(6_442_450_944 / (3.35e12 * EFF.hbm_fraction), rel=1e-9)
    # 10 dense kernels + 4 routing kernels per layer (router GEMM, top-k, expand, finalize), 32 layers
    assert parts["kernel_overhead"] == pytest.approx(32 * 14 * EFF.kernel_overhead_s)
    assert stage_parts(M8, H100, cfg, EFF, 0.0, 0.0, T, 1.0)["moe_permute"] == 0.0  # dense model


def test_closed_loop_with_one_client_serves_requests_one_after_another():
    w, cfg = Workload(200, 20), ServeConfig()
    spec = SimSpec(rate=math.inf, n_requests=4, concurrency=1)
    reqs = make_requests(spec, w)
    _Replica(M8, H100, cfg, EFF, 64, concurrency=1).run(reqs)
    for prev, nxt in zip(reqs, reqs[1:], strict=False):
        assert nxt.arrival == pytest.approx(prev.finish)  # sent when the previous one finishes
    ttfts = [r.first_token - r.arrival for r in reqs]
    assert max(ttfts) == pytest.approx(min(ttfts))  # each finds an idle engine


def test_burst_with_batch_one_queues_every_request_behind_the_previous():
    w, cfg, n = Workload(200, 20), ServeConfig(), 5
    sim = simulate(M8, H100, 1, cfg, EFF, w, 1, SimSpec(rate=math.inf, n_requests=n))
    alone = simulate(M8, H100, 1, cfg, EFF, w, 1, SimSpec(rate=math.inf, n_requests=1))
    ttft0, e2e = alone["ttft_s"]["mean"], alone["ttft_s"]["mean"] + 19 * alone["tpot_s"]["mean"]
    # request j (0-based) starts after j whole requests: TTFT_j = j * e2e + ttft0; mean over 5 = 2 * e2e + ttft0
    assert sim["ttft_s"]["mean"] == pytest.approx(2 * e2e + ttft0)


def test_cli_engine_and_budget_flags(capsys):
    base = ["serve", "--model", "llama3.1-8b", "--hardware", "a100-80gb", "--chips", "1", "--input-len", "1000",
            "--output-len", "200", "--tp", "1", "--batch", "8", "--json"]
    code, out, err = run_cli(base + ["--engine", "vllm"], capsys)
    assert code == 0, err
    d = json.loads(out)
    assert d["engine"] == "vllm" and d["step_token_budget"] == 2048 and d["config"]["max_num_batched_tokens"] == 2048
    code, out, _ = run_cli(base + ["--engine", "vllm", "--max-num-batched-tokens", "512", "--simulate", "--rate",
                                   "inf", "--requests", "12", "--concurrency", "4"], capsys)
    d = json.loads(out)
    assert code == 0 and d["step_token_budget"] == 512 and d["simulation"]["concurrency"] == 4


@pytest.mark.parametrize("extra, needle", [
    (["--engine", "foo"], "--engine"),
    (["--max-num-batched-tokens", "0"], "max-num-batched-tokens"),
    (["--simulate", "--rate", "2", "--concurrency", "0"], "concurrency"),
])
def test_cli_scheduler_bad_input(capsys, extra, needle):
    base = ["serve", "--model", "llama3.1-8b", "--hardware", "h100-sxm", "--chips", "1", "--input-len", "100",
            "--output-len", "10", "--tp", "1"]
    code, _, err = run_cli(base + extra, capsys)
    assert code == 2 and err.startswith("error:") and needle in err


def test_ttft_is_smooth_across_a_chunk_boundary_and_keeps_littles_law():
    # QA session 22: a prompt a few tokens past one chunk (8192 against 8192 - 63 decodes) was charged two full chunk
    # steps, and its queue behind the others' prompts doubled, past saturation: TTFT 0.45 s at 8100 tokens, 23.5 s at
    # 8192. The last chunk now holds only the rest, and a prompt's queue work is its share of full steps
    cfg, h200 = ServeConfig(engine="vllm", max_num_batched_tokens=8192), load_chip("h200")
    eff = default_efficiency(h200)
    points = [evaluate(M8, h200, 1, cfg, eff, Workload(i, 256), 64, closed_loop=True) for i in (8100, 8192, 9000)]
    ttfts = [p.ttft_s for p in points]
    assert ttfts[0] < ttfts[1] < ttfts[2] < 1.5 * ttfts[0]
    # a closed loop of 64 clients: output tokens/s x end-to-end latency = 64 x 256 tokens in flight (Little's law)
    for p in points:
        assert p.throughput_tokens_per_s * p.e2e_latency_s == pytest.approx(64 * 256, rel=0.05)


def test_pipeline_prompt_queue_has_one_server_per_micro_batch():
    # pp 2: each micro-batch carries its own waiting prompt, so the queue drains two prompts per pass; with one
    # server the load was 1.49 (past saturation) and TTFT 30 s where Little's law and the simulator give 8.6-8.9 s
    h200 = load_chip("h200")
    cfg = ServeConfig(tp=1, pp=2, engine="vllm", max_num_batched_tokens=8192)
    p = evaluate(M8, h200, 2, cfg, default_efficiency(h200), Workload(4096, 128), 400)
    assert p.running_batch == 248
    assert p.throughput_tokens_per_s * p.e2e_latency_s == pytest.approx(400 * 128, rel=0.05)
