"""When a new request can join a step (issue #14, TTFT under load): a closed-loop client's next request misses the
step the engine schedules as its predecessor ends; an engine that schedules one step ahead (SGLang's overlap
scheduler, vLLM --async-scheduling) admits a request one step later; and the steady-state (closed-form) TTFT waits
behind the other clients' prompts (M/D/1). Expected values derived by hand below, or from the simulator."""

from __future__ import annotations

import pytest

from meshplan.cost.efficiency import default_efficiency
from meshplan.infer.config import ServeConfig, Workload, schedules_ahead
from meshplan.infer.metrics import evaluate, prefill_queue_wait_s, scheduler_wait_s, ttft_continuous
from meshplan.infer.simulate import SimSpec, _Replica, _Req, simulate
from meshplan.infer.step import step_cost
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

H100 = load_chip("h100-sxm")
EFF = default_efficiency(H100)
M8 = load_model("llama3.1-8b")


def test_engines_that_schedule_ahead():
    assert schedules_ahead(ServeConfig(engine="sglang"), H100)  # SGLang v0.4+: overlap scheduler on by default
    assert not schedules_ahead(ServeConfig(engine="vllm"), H100)  # vLLM: --async-scheduling is opt-in
    assert schedules_ahead(ServeConfig(engine="trtllm"), H100)  # PyTorch backend (1.x): overlap scheduler on by default
    assert not schedules_ahead(ServeConfig(engine="trtllm@0.17"), H100)  # C++ executor: serial executionLoop
    assert not schedules_ahead(ServeConfig(), H100)
    assert schedules_ahead(ServeConfig(engine="vllm", overlap_scheduling=True), H100)  # the layout's own flag wins
    assert not schedules_ahead(ServeConfig(engine="sglang", overlap_scheduling=False), H100)


def test_scheduler_wait_of_an_engine_one_step_ahead():
    # random arrival into a 20 ms step: residual 10 ms; the next step's batch is already chosen: + 20 ms = 30 ms
    assert scheduler_wait_s(0.020, others=3, ahead=True) == pytest.approx(0.030)
    assert scheduler_wait_s(0.020, others=3) == pytest.approx(0.010)
    assert scheduler_wait_s(0.020, others=0, ahead=True) == 0.0  # an idle engine starts it at once


def test_continuous_ttft_of_an_overlap_engine_waits_one_more_step():
    w = Workload(1000, 200)
    ahead = ttft_continuous(M8, H100, ServeConfig(engine="sglang"), EFF, w, 65, busy_step_s=0.030)
    serial = ttft_continuous(M8, H100, ServeConfig(engine="sglang", overlap_scheduling=False), EFF, w, 65,
                             busy_step_s=0.030)
    assert ahead - serial == pytest.approx(0.030)


def _closed_loop_run(cfg: ServeConfig) -> list[_Req]:
    """Two closed-loop clients, every step 1 s (the step cost is replaced): request 0 wants 3 tokens, requests 1 and
    2 want 1 token; prompts of 1 token."""
    reqs = [_Req(0.0, 1, 3), _Req(0.0, 1, 1), _Req(0.0, 1, 1)]
    rep = _Replica(M8, H100, cfg, EFF, 64, concurrency=2)
    rep._cost = lambda *args, **kwargs: 1.0
    rep.run(reqs)
    return reqs


def test_closed_loop_request_misses_the_step_scheduled_as_its_predecessor_ends():
    r0, r1, r2 = _closed_loop_run(ServeConfig())
    # step [0, 1]: both prompts; r1's only token ends it, so client 2 sends r2 at t = 1. The engine schedules the
    # step [1, 2] at that same instant (r0's decode), without r2; r2 rides step [2, 3] beside r0's last decode
    assert r1.finish == pytest.approx(1.0) and r2.arrival == pytest.approx(1.0)
    assert r2.first_token == pytest.approx(3.0)  # TTFT = 2 steps: the missed one, then its own prompt step
    assert r0.finish == pytest.approx(3.0)


def test_closed_loop_request_on_an_engine_one_step_ahead():
    r0, _, r2 = _closed_loop_run(ServeConfig(overlap_scheduling=True))
    # r2 arrives at t = 1; step [1, 2] was chosen at t = 0 and step [2, 3] at t = 1 (as step [1, 2] began): neither
    # holds r2. r0 finishes at t = 3, the engine is then idle and starts r2 at once: its token at t = 4
    assert r0.finish == pytest.approx(3.0)
    assert r2.first_token - r2.arrival == pytest.approx(3.0)


def test_prefill_queue_wait_by_hand():
    # M/D/1 (Pollaczek-Khinchine, deterministic service): 2 prompts/s of 0.25 s each -> rho = 0.5,
    # W = 2 x 0.25^2 / (2 x (1 - 0.5)) = 0.125 s
    assert prefill_queue_wait_s(2.0, 0.25, others=3) == pytest.approx(0.125)
    # rho = 5 x 0.25 = 1.25 >= 1: at most the other 3 clients' prompts are ahead, 3 x 0.25 = 0.75 s
    assert prefill_queue_wait_s(5.0, 0.25, others=3) == pytest.approx(0.75)
    # rho = 0.9: W = 3.6 x 0.0625 / 0.2 = 1.125 s, more than the 2 other clients' 0.5 s of prompts: the bound holds
    assert prefill_queue_wait_s(3.6, 0.25, others=2) == pytest.approx(0.5)
    assert prefill_queue_wait_s(0.0, 0.25, others=3) == 0.0


@pytest.mark.parametrize("rate", [5.0, 7.0])
def test_closed_form_ttft_matches_the_simulated_queue(rate):
    # Poisson arrivals of 4000-token prompts (50 output tokens) to Llama 3.1 8B on one H100, whole prompts per step:
    # the steady-state TTFT at the batch Little's law gives (rate x simulated e2e) agrees with the simulator's mean
    # within 10% once the prompts queue behind each other (prefill_queue_wait_s); without that term it is 20-45% short
    w, cfg = Workload(4000, 50), ServeConfig(engine="trtllm")
    sim = simulate(M8, H100, 1, cfg, EFF, w, 512, SimSpec(rate=rate, n_requests=1500, seed=1))
    batch = round(rate * (sim["ttft_s"]["mean"] + 49 * sim["tpot_s"]["mean"]))
    p = evaluate(M8, H100, 1, cfg, EFF, w, batch)
    assert p.ttft_s == pytest.approx(sim["ttft_s"]["mean"], rel=0.10)
    no_queue = ttft_continuous(M8, H100, cfg, EFF, w, batch, p.tpot_s)
    assert no_queue < 0.8 * sim["ttft_s"]["mean"]


def test_closed_loop_client_waits_a_whole_step():
    # the next request is sent as a step ends, after the engine picked the next batch: the whole 20 ms step
    assert scheduler_wait_s(0.020, others=3, closed_loop=True) == pytest.approx(0.020)
    assert scheduler_wait_s(0.020, others=3, ahead=True, closed_loop=True) == pytest.approx(0.040)
    assert scheduler_wait_s(0.020, others=0, closed_loop=True) == 0.0  # one client: the engine is idle
    # steady state at batch 32: the closed loop waits a whole (mean) step, B / (output tokens/s), where a random
    # arrival waits the mean residual E[S^2] / (2 E[S]) of steps of which 16% carry a 1000-token prompt (32 x 1000 /
    # 200 = 160 prompt tokens per step; test_serve_scheduler derives these by hand)
    w = Workload(1000, 200)
    open_ = evaluate(M8, H100, 1, ServeConfig(), EFF, w, 32)
    closed = evaluate(M8, H100, 1, ServeConfig(), EFF, w, 32, closed_loop=True)
    step = 32 / open_.throughput_tokens_per_s
    long = step_cost(M8, H100, ServeConfig(), EFF, 32, 1100.0, 1000, 500.0, 32, prefill_seqs=1.0).time_s
    short = step_cost(M8, H100, ServeConfig(), EFF, 32, 1100.0).time_s
    assert closed.ttft_s - open_.ttft_s == pytest.approx(step - (0.16 * long**2 + 0.84 * short**2) / (2 * step))
    assert closed.tpot_s == open_.tpot_s


def test_a_closed_loop_request_behind_a_server_path_lands_inside_the_running_step():
    """Session 24: a closed-loop client's next request reaches the engine the server path's time (frontend_first_token_s:
    the last token's way out, the next request's way in) after the step boundary, so it waits what is left of the step
    it lands in. The simulation did so (closed-loop TTFT +3.3 ms for SGLang's 6.6 ms path, session 23); the closed form
    had added the whole path on top of a whole step."""
    assert scheduler_wait_s(0.020, others=3, closed_loop=True, arrival_delay_s=0.004) == pytest.approx(0.016)
    assert scheduler_wait_s(0.020, others=3, closed_loop=True, arrival_delay_s=0.026) == pytest.approx(0.014)
    assert scheduler_wait_s(0.020, others=3, ahead=True, closed_loop=True, arrival_delay_s=0.004) == \
        pytest.approx(0.036)  # the next step's batch was picked as the running one started
    assert scheduler_wait_s(0.020, others=3, arrival_delay_s=0.004) == pytest.approx(0.010)  # open loop: random phase
    # end to end: with a path shorter than the step the client's TTFT is unchanged (sent at t + out, reaches the engine
    # at t + out + in, admitted at t + step, first token back at t + step + prefill + out: TTFT = step + prefill)
    w = Workload(1000, 200)
    bare = evaluate(M8, H100, 1, ServeConfig(engine="vllm"), EFF, w, 32, closed_loop=True)
    served = evaluate(M8, H100, 1, ServeConfig(engine="vllm", frontend="vllm-openai"), EFF, w, 32, closed_loop=True)
    assert served.tpot_s == pytest.approx(bare.tpot_s)
    assert 0.004 < bare.tpot_s  # the path (4 ms, serving.yaml) is shorter than the step
    assert served.ttft_s == pytest.approx(bare.ttft_s)
    # open loop: the path adds in full
    bare = evaluate(M8, H100, 1, ServeConfig(engine="vllm"), EFF, w, 32)
    served = evaluate(M8, H100, 1, ServeConfig(engine="vllm", frontend="vllm-openai"), EFF, w, 32)
    assert served.ttft_s == pytest.approx(bare.ttft_s + 0.004)
