"""A closed loop of equal requests on an engine that takes whole prompts (session 32): the clients that are prefilled in
one step end their last decode in one step and send their next requests together, so every round their prompts reach
the engine in the same groups (metrics.in_phase_ttft_s), not at the spread-out ages of the steady state. The
expectations come from a hand count of the steps and from the simulator, which runs the closed loop step by step with
its own scheduler; engines that chunk prompts keep the spread steady state."""

import math

import pytest
from conftest import run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.cost.efficiency import default_efficiency
from meshplan.infer.config import ServeConfig, Workload, frontend_first_token_s
from meshplan.infer.metrics import benchmark_mean_ttft_s, evaluate, first_round_ttft_s, in_phase_ttft_s
from meshplan.infer.simulate import SimSpec, simulate
from meshplan.infer.step import step_cost
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model


def _setup(model: str = "llama3.1-8b", hardware: str = "h100-sxm"):
    chip = load_chip(hardware)
    return load_model(model), chip, default_efficiency(chip)


def test_one_group_is_its_prompt_step_on_an_idle_engine():
    # 4 prompts of 1024 tokens fit one step of an 8,192-token budget: the four finish together, the engine idles until
    # they send again (no wait for a running step), and their prompts share one step with no decode beside them
    m, chip, eff = _setup()
    cfg = ServeConfig(tp=1, engine="trtllm@0.17", max_num_batched_tokens=8192)
    w = Workload(1024, 128)
    want = step_cost(m, chip, cfg, eff, 0, w.mean_decode_context, 4 * 1024, 512, 4, 4).time_s
    assert in_phase_ttft_s(m, chip, cfg, eff, w, 4) == pytest.approx(want, rel=1e-12)


# 4 clients, prompts of 5,000 tokens, a budget of 8,192: one prompt a step beside the three others' decodes
# (2 x 5,000 > 8,192 - 2), so four groups of one; each group's prompt step and the others' decode step at the round's end
FOUR_GROUPS = (Workload(5000, 256), 4)


@pytest.mark.parametrize("engine,waits", [
    # TensorRT-LLM's C++ executor picks the next step before the new request arrives (it schedules each step after
    # the last, trtllm@0.17): the round's first group waits the last decode step of the group after it, each later
    # group the prompt step of the group before it
    ("trtllm@0.17", lambda p, d: [d, p, p, p]),
    # its PyTorch executor picks step n + 1 while step n runs (config.schedules_ahead): a request arrives after two
    # steps were picked, so group j waits the prompt steps of groups j - 2 and j - 1, or a decode step of the others
    # where the round has no such group (a round is O + 2 steps)
    ("trtllm", lambda p, d: [2 * d, d + p, 2 * p, 2 * p]),
])
def test_groups_take_turns_each_waiting_the_steps_picked_before_it(engine, waits):
    m, chip, eff = _setup()
    cfg = ServeConfig(tp=1, engine=engine, max_num_batched_tokens=8192)
    w, clients = FOUR_GROUPS
    prompt = step_cost(m, chip, cfg, eff, 3, w.mean_decode_context, 5000, 2500, 4, 1).time_s
    decode = step_cost(m, chip, cfg, eff, 3, 5000 + 256).time_s
    want = sum(x + prompt for x in waits(prompt, decode)) / clients
    assert in_phase_ttft_s(m, chip, cfg, eff, w, clients) == pytest.approx(want, rel=1e-12)


def test_rounds_that_cannot_stay_whole_are_not_grouped():
    m, chip, eff = _setup()
    cfg = ServeConfig(tp=1, engine="trtllm@0.17", max_num_batched_tokens=8192)
    assert in_phase_ttft_s(m, chip, cfg, eff, Workload(5000, 1), 4) is None  # every step a prompt step
    assert in_phase_ttft_s(m, chip, cfg, eff, Workload(5000, 3), 4) is None  # 4 groups, 2 decode steps a round


CASES = [  # engines that take whole prompts, on one replica
    ("llama3.1-8b", "h100-sxm", ServeConfig(tp=1, engine="trtllm@0.17", max_num_batched_tokens=8192)),
    ("llama3.1-8b", "h100-sxm", ServeConfig(tp=1, engine="trtllm", max_num_batched_tokens=8192)),
    ("llama3.1-70b", "h200", ServeConfig(tp=4, weight_dtype="fp8", engine="trtllm", max_num_batched_tokens=8192)),
]


ADP_CASES = [  # attention data parallel: each rank takes its share of a group. Not listed: long prompts (4,096
    # tokens, 32 clients over 8 ranks, two groups a rank), where the simulator reads about 1.28x the closed form: its
    # ranks take a round's requests in turn, not one group's share each, which the closed form does not follow
    ("deepseek-v3", "h200", ServeConfig(tp=8, ep=8, attention_dp=True, engine="trtllm"), (1024, 128), 16),
    ("qwen3-235b-a22b", "h200", ServeConfig(tp=8, ep=8, attention_dp=True, weight_dtype="fp8", engine="trtllm",
                                            max_num_batched_tokens=8192), (2048, 256), 64),
]


LOOPS = [(model, hardware, cfg, lengths, clients) for model, hardware, cfg in CASES
         for lengths, clients in [((4096, 128), 8), ((2048, 256), 32), ((1024, 128), 8), ((1024, 128), 16),
                                  ((1000, 200), 64), ((300, 100), 64)]] + ADP_CASES


@pytest.mark.parametrize("model,hardware,cfg,lengths,clients", LOOPS,
                         ids=[f"{c[0]}-{c[2].engine}-{c[3][0]}x{c[3][1]}-c{c[4]}" for c in LOOPS])
def test_the_grouped_closed_form_agrees_with_the_simulated_loop(model, hardware, cfg, lengths, clients):
    # a benchmark of 10 rounds (clients x 10 requests), every request the same: the simulator's mean TTFT against the
    # closed form's, the first round weighed in as evaluate does (benchmark_mean_ttft_s)
    m, chip, eff = _setup(model, hardware)
    w = Workload(*lengths)
    n = clients * 10
    sim = simulate(m, chip, cfg.chips_per_replica, cfg, eff, w, clients,
                   SimSpec(rate=math.inf, n_requests=n, concurrency=clients))
    simulated = sim["ttft_s"]["mean"] - frontend_first_token_s(cfg, chip)
    grouped = in_phase_ttft_s(m, chip, cfg, eff, w, clients)
    closed = benchmark_mean_ttft_s(grouped, first_round_ttft_s(m, chip, cfg, eff, w, clients), clients, n)
    assert closed == pytest.approx(simulated, rel=0.1)


def test_evaluate_groups_whole_prompt_engines_only():
    m, chip, eff = _setup()
    w = Workload(2048, 256)
    whole = ServeConfig(tp=1, engine="trtllm@0.17", max_num_batched_tokens=8192)
    p = evaluate(m, chip, 1, whole, eff, w, 256, clients=16)
    assert p.rounds_in_phase is True
    assert p.ttft_s == pytest.approx(in_phase_ttft_s(m, chip, whole, eff, w, 16) + frontend_first_token_s(whole, chip),
                                     rel=1e-12)
    # the same engine told to chunk (its --enable_chunked_context) spreads: the steady state, as vLLM's
    chunked = ServeConfig(tp=1, engine="trtllm@0.17", max_num_batched_tokens=8192, chunked_prefill=True)
    q = evaluate(m, chip, 1, chunked, eff, w, 256, clients=16)
    assert q.rounds_in_phase is False and q.ttft_s < p.ttft_s and q.spread_ttft_s is None
    # the in-phase point carries the other bound, its own steady state (the spread-out closed form without grouping)
    assert p.spread_ttft_s < p.ttft_s
    with_round = evaluate(m, chip, 1, whole, eff, w, 256, clients=16, requests=160)
    first = with_round.first_round_ttft_s - frontend_first_token_s(whole, chip)
    grouped = in_phase_ttft_s(m, chip, whole, eff, w, 16)
    spread = p.spread_ttft_s - frontend_first_token_s(whole, chip)
    assert with_round.ttft_s - frontend_first_token_s(whole, chip) == pytest.approx(
        benchmark_mean_ttft_s(grouped, first, 16, 160), rel=1e-12)
    assert with_round.spread_ttft_s - frontend_first_token_s(whole, chip) == pytest.approx(
        benchmark_mean_ttft_s(spread, first, 16, 160), rel=1e-12)
    # the grouping moves TTFT only: the prompt work per round is the same
    assert (p.tpot_s, p.throughput_tokens_per_s) == pytest.approx((q.tpot_s, q.throughput_tokens_per_s), rel=0.02)
    # more clients than the engine runs: they queue for a slot (admission_queue_wait_s), not grouped
    assert evaluate(m, chip, 1, whole, eff, w, 8, clients=16).rounds_in_phase is False
    assert evaluate(m, chip, 1, whole, eff, w, 8).rounds_in_phase is None  # no closed loop


def test_cli_says_which(capsys):
    base = ["serve", "-m", "llama3.1-8b", "--hardware", "h100-sxm", "--chips", "1", "--tp", "1", "--input-len", "2048",
            "--output-len", "256", "--concurrency", "16"]
    code, out, err = run_cli([*base, "--engine", "trtllm@0.17"], capsys)
    assert code == 0, err
    assert "rounds in phase" in out and "were their phases spread" in out
    code, out, err = run_cli([*base, "--engine", "vllm"], capsys)
    assert code == 0, err
    assert "steady state (the clients' phases spread)" in out


@settings(max_examples=40, deadline=None)
@given(i=st.integers(1, 20000), o=st.integers(1, 3000), clients=st.integers(1, 400),
       budget=st.sampled_from([512, 2048, 8192, 32768]), engine=st.sampled_from(["trtllm", "trtllm@0.17"]))
def test_grouped_ttft_is_bounded_by_one_prompt_step_and_a_whole_round(i, o, clients, budget, engine):
    # whatever the lengths, clients and budget: a grouped TTFT is finite, at least one prompt step of one prompt, and
    # at most three groups' prompt steps (the two an engine one step ahead picked before the group's requests arrived,
    # and its own), each of k prompts no longer than k steps of one prompt beside every other client's decode; three
    # groups hold at most 1.5 x clients prompts (three groups only when each is under half of the clients)
    m, chip, eff = _setup()
    cfg = ServeConfig(tp=1, engine=engine, max_num_batched_tokens=budget)
    w = Workload(i, o)
    got = in_phase_ttft_s(m, chip, cfg, eff, w, clients)
    if got is None:
        assert o <= 1 or clients > o - 1  # more groups than a round has decode steps needs more clients than that
        return
    one = step_cost(m, chip, cfg, eff, 0, w.mean_decode_context, i, i / 2.0, 1, 1).time_s
    alone = step_cost(m, chip, cfg, eff, clients - 1, w.mean_decode_context, i, i / 2.0, clients, 1).time_s
    assert math.isfinite(got) and one * (1 - 1e-9) <= got <= (1.5 * clients + 2) * alone * (1 + 1e-9)
