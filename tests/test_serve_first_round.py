"""A closed-loop benchmark's first round (session 26): the clients of a benchmark of N requests start together, so
the first `clients` prompts queue behind each other for the step token budget; after that round the clients' phases
spread. metrics.first_round_ttft_s prices the round in closed form, benchmark_mean_ttft_s weighs it into the mean, and
evaluate(..., clients, requests) / `serve --concurrency C --requests N` report it. The expectations here come from a
hand count of the round's steps and from the simulator, which runs the round step by step with its own scheduler."""

import json
import math

import pytest
from conftest import run_cli

from meshplan.cost.efficiency import default_efficiency
from meshplan.errors import MeshplanError
from meshplan.infer.config import ServeConfig, Workload, frontend_first_token_s
from meshplan.infer.metrics import benchmark_mean_ttft_s, evaluate, first_round_ttft_s
from meshplan.infer.simulate import SimSpec, simulate
from meshplan.infer.step import step_cost
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model


def _setup(model: str, hardware: str):
    chip = load_chip(hardware)
    return load_model(model), chip, default_efficiency(chip)


def test_a_round_that_fits_one_step_is_that_step():
    # 4 prompts of 1024 tokens and a budget of 8192: vLLM schedules all four in the first step, which carries no
    # decodes yet (nothing is prefilled before it), and every prompt gets its first token at that step's end
    m, chip, eff = _setup("llama3.1-70b", "h200")
    cfg = ServeConfig(tp=8, weight_dtype="fp8", engine="vllm", max_num_batched_tokens=8192)
    want = step_cost(m, chip, cfg, eff, 0, 1024, 4 * 1024, 512, 4, 4).time_s
    assert first_round_ttft_s(m, chip, cfg, eff, Workload(1024, 256), 4) == pytest.approx(want, rel=1e-12)


def test_whole_prompts_one_a_step_take_turns():
    # prompts as long as the budget and an engine that takes whole prompts: prompt i ends with step i, so the mean is
    # (n + 1) / 2 steps of one prompt (TensorRT-LLM without chunked context; no decodes ride a prompt-first engine)
    m, chip, eff = _setup("llama3.1-8b", "h100-sxm")
    cfg = ServeConfig(tp=1, engine="sglang", max_num_batched_tokens=4096)
    one = step_cost(m, chip, cfg, eff, 0, 4096, 4096, 2048, 1, 1).time_s
    got = first_round_ttft_s(m, chip, cfg, eff, Workload(4096, 128), 6)
    assert got == pytest.approx(3.5 * one, rel=1e-12)


CASES = [  # (model, hardware, layout) on one replica; pipelines are left out: the simulator pipelines a step only when it
    # happens to carry two prompts' chunks, the closed form whenever prompts wait (first_round_ttft_s)
    ("llama3.1-70b", "h200", ServeConfig(tp=8, weight_dtype="fp8", engine="vllm", max_num_batched_tokens=8192)),
    ("llama3.1-8b", "h100-sxm", ServeConfig(tp=1, engine="trtllm", max_num_batched_tokens=8192)),
    ("llama3.1-8b", "h100-sxm", ServeConfig(tp=1, engine="sglang")),
    ("llama3.1-8b", "h100-sxm", ServeConfig(tp=1, engine="lmdeploy")),
    ("qwen3-235b-a22b", "h200", ServeConfig(tp=8, ep=8, attention_dp=True, weight_dtype="fp8", engine="sglang")),
    ("deepseek-v3", "h200", ServeConfig(tp=8, ep=8, attention_dp=True, engine="trtllm")),
]


@pytest.mark.parametrize("model,hardware,cfg", CASES, ids=lambda c: getattr(c, "engine", c))
@pytest.mark.parametrize("lengths", [(1024, 256), (8192, 1024), (300, 64)])
@pytest.mark.parametrize("n", [4, 16, 64])
def test_the_closed_form_round_agrees_with_the_simulated_one(model, hardware, cfg, lengths, n):
    m, chip, eff = _setup(model, hardware)
    w = Workload(*lengths)
    sim = simulate(m, chip, cfg.chips_per_replica, cfg, eff, w, n, SimSpec(rate=math.inf, n_requests=n, concurrency=n))
    simulated = sim["ttft_s"]["mean"] - frontend_first_token_s(cfg, chip)
    assert first_round_ttft_s(m, chip, cfg, eff, w, n) == pytest.approx(simulated, rel=0.15)


def test_the_benchmark_mean_weighs_the_round_by_its_share():
    assert benchmark_mean_ttft_s(0.1, 1.1, 10, 100) == pytest.approx(0.2)  # 10 of 100 requests at 1.1 s, 90 at 0.1 s
    assert benchmark_mean_ttft_s(0.1, 1.1, 10, 10) == pytest.approx(1.1)  # one round only
    assert benchmark_mean_ttft_s(0.1, 1.1, 10, 5) == pytest.approx(1.1)  # never fewer requests than the round


def test_evaluate_counts_the_round_and_tends_to_the_steady_state():
    m, chip, eff = _setup("llama3.1-70b", "h200")
    cfg = ServeConfig(tp=8, weight_dtype="fp8", engine="vllm", max_num_batched_tokens=8192)
    w = Workload(1024, 1024)
    steady = evaluate(m, chip, 8, cfg, eff, w, 1024, clients=64).ttft_s
    one_round = evaluate(m, chip, 8, cfg, eff, w, 1024, clients=64, requests=64).ttft_s
    assert one_round == pytest.approx(first_round_ttft_s(m, chip, cfg, eff, w, 64), rel=1e-12)  # no frontend here
    means = [evaluate(m, chip, 8, cfg, eff, w, 1024, clients=64, requests=64 * r).ttft_s for r in (2, 10, 100, 10_000)]
    assert one_round > means[0] > means[1] > means[2] > means[3] > steady
    assert means[1] == pytest.approx(steady + (one_round - steady) / 10, rel=1e-9)
    assert means[3] == pytest.approx(steady, rel=0.01)  # 1 request in 10,000 from the round
    # the round does not touch the decode: TPOT and throughput are the steady state's
    p = evaluate(m, chip, 8, cfg, eff, w, 1024, clients=64, requests=640)
    q = evaluate(m, chip, 8, cfg, eff, w, 1024, clients=64)
    assert (p.tpot_s, p.throughput_tokens_per_s) == (q.tpot_s, q.throughput_tokens_per_s)


def test_two_replicas_each_take_half_the_round():
    m, chip, eff = _setup("llama3.1-8b", "h100-sxm")
    cfg = ServeConfig(tp=1, engine="vllm")
    w = Workload(2000, 200)
    two = evaluate(m, chip, 2, cfg, eff, w, 256, clients=32, requests=32).ttft_s
    assert two == pytest.approx(first_round_ttft_s(m, chip, cfg, eff, w, 16), rel=1e-12)


def test_requests_need_a_closed_loop():
    m, chip, eff = _setup("llama3.1-8b", "h100-sxm")
    with pytest.raises(MeshplanError, match="closed loop"):
        evaluate(m, chip, 1, ServeConfig(tp=1), eff, Workload(100, 10), 8, requests=100)


SERVE = ["serve", "--model", "llama3.1-8b", "--hardware", "h100-sxm", "--chips", "1", "--tp", "1", "--input-len",
         "1000", "--output-len", "200", "--engine", "vllm"]


def test_cli_requests_with_concurrency(capsys):
    code, out, _ = run_cli([*SERVE, "--concurrency", "16", "--json"], capsys)
    steady = json.loads(out)
    code2, out, _ = run_cli([*SERVE, "--concurrency", "16", "--requests", "160", "--json"], capsys)
    bench = json.loads(out)
    assert code == code2 == 0 and bench["clients"]["requests"] == 160 and steady["clients"]["requests"] is None
    assert bench["ttft_s"] > steady["ttft_s"] and bench["tpot_s"] == steady["tpot_s"]
    # the round itself: 16 prompts of 1000 tokens at once, above the mean, which weighs it by 16 / 160
    first = bench["clients"]["first_round_ttft_s"]
    assert first > bench["ttft_s"] and bench["ttft_s"] == pytest.approx(steady["ttft_s"] + (first - steady["ttft_s"]) / 10)
    code, out, _ = run_cli([*SERVE, "--concurrency", "16", "--requests", "160"], capsys)
    assert code == 0 and "a benchmark of 160 requests, its first round's mean TTFT" in out


def test_cli_requests_alone_is_refused(capsys):
    code, _, err = run_cli([*SERVE, "--requests", "160"], capsys)
    assert code == 2 and err.startswith("error: --requests") and "--concurrency" in err


def test_cli_closed_form_matches_a_desynchronised_simulation(capsys):
    # outputs of exponential length spread the clients after the first round, as a real benchmark's do: the
    # simulation's mean TTFT over its 400 requests is the closed form's benchmark mean
    code, out, _ = run_cli([*SERVE, "--concurrency", "16", "--requests", "400", "--simulate", "--output-dist",
                            "exponential", "--json"], capsys)
    d = json.loads(out)
    assert code == 0 and d["simulation"]["ttft_s"]["mean"] == pytest.approx(d["ttft_s"], rel=0.1)
