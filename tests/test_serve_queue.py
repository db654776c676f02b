"""Serving under load (issue #14): clients beyond the engine's batch limit wait for a slot (Little's law), and a
request's inter-token gaps are a mix of steps that carry a prompt chunk and pure decode steps. Expected values are
derived by hand in the comments, or are meshplan's own step-by-step simulator."""

from __future__ import annotations

import math

import pytest

from meshplan.cost.efficiency import default_efficiency
from meshplan.errors import MeshplanError
from meshplan.infer.config import ServeConfig, Workload
from meshplan.infer.metrics import admission_queue_wait_s, evaluate, mean_step_s, prefill_first_steps, step_residual_s
from meshplan.infer.simulate import SimSpec, _Replica, _Req, make_requests
from meshplan.infer.step import decode_step, prefill_step, step_cost
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

H100 = load_chip("h100-sxm")
EFF = default_efficiency(H100)
M8 = load_model("llama3.1-8b")
W = Workload(1000, 200)


def test_admission_queue_wait_by_hand():
    # 120 clients, 100 slots, 4 requests/s served: 20 requests wait, W = 20 / 4 = 5 s (Little's law)
    assert admission_queue_wait_s(120, 100, 4.0) == pytest.approx(5.0)
    assert admission_queue_wait_s(100, 100, 4.0) == 0.0  # every client has a slot
    assert admission_queue_wait_s(50, 100, 4.0) == 0.0
    with pytest.raises(MeshplanError):
        admission_queue_wait_s(120, 100, 0.0)


def _sixteen_slots(cfg):
    """16 clients and 48 clients on an engine of 16 slots, and the steady (mean) step."""
    full = evaluate(M8, H100, 1, cfg, EFF, W, 16, clients=16)
    over = evaluate(M8, H100, 1, cfg, EFF, W, 16, clients=48)
    return full, over, full.step.time_s


def test_closed_form_clients_beyond_the_batch_limit():
    # 48 clients over 16 slots, 1000/200 tokens: at steady state 16 run, 32 wait. Request throughput X = 16 / (200
    # steps x step) (each slot turns over every O steps), so the wait is 32 / X = 400 steps. A queued request is
    # admitted as its slot frees, so it does not wait the running step a closed-loop client with a slot waits:
    # TTFT(48) - TTFT(16) = 400 steps - 1 step = 399 steps; TPOT and throughput are those of the 16 running
    cfg = ServeConfig(engine="vllm")
    full, over, step = _sixteen_slots(cfg)
    assert over.ttft_s - full.ttft_s == pytest.approx(399 * step)
    assert over.tpot_s == full.tpot_s and over.throughput_tokens_per_s == full.throughput_tokens_per_s
    assert over.batch == 16
    # `clients` implies the closed loop: 16 clients on 16 slots is the closed-loop point
    assert full.ttft_s == pytest.approx(evaluate(M8, H100, 1, cfg, EFF, W, 16, closed_loop=True).ttft_s)
    # fewer clients than the limit: the engine runs only the clients' sequences
    assert evaluate(M8, H100, 1, cfg, EFF, W, 64, clients=16).ttft_s == pytest.approx(full.ttft_s)
    # two replicas share the clients (as simulate spreads them): 96 clients over 2 x 16 slots = the 48-on-16 point
    two = evaluate(M8, H100, 2, cfg, EFF, W, 16, clients=96)
    assert two.ttft_s == pytest.approx(over.ttft_s) and two.batch == 16


def test_closed_form_queue_on_an_engine_one_step_ahead():
    # An overlap scheduler reuses a freed slot one step later: each slot turns over every O + 1 = 201 decode steps,
    # X = 16 / (201 cycles) (a cycle: the decode step, and on SGLang its share of prompt-only steps), the queue waits
    # 32 x 201 / 16 = 402 cycles plus the one engine step before the slot is seen free; a closed-loop client with a
    # slot waits the running engine step and the one already picked (2 engine steps): 402 cycles - 1 engine step.
    # With the decodes beside the prompts (mixing) an engine step is a cycle: 401 cycles
    full, over, step = _sixteen_slots(ServeConfig(engine="sglang", mixed_prompts=True, overlap_scheduling=True))
    assert over.ttft_s - full.ttft_s == pytest.approx(401 * step)
    # SGLang prefills first: an engine step is the mean of its decode steps and its q prompt-only steps per decode
    # step (q = 16 / 201 prompts of 1000 tokens per decode step over one 1000-token prompt per prompt step)
    full, over, step = _sixteen_slots(ServeConfig(engine="sglang"))
    q, pre = prefill_first_steps(M8, H100, ServeConfig(engine="sglang"), EFF, W, 16 / 201)
    assert q == pytest.approx(16 / 201)
    dec = decode_step(M8, H100, ServeConfig(engine="sglang"), EFF, 16, W.mean_decode_context).time_s
    engine_step = (q * pre.time_s + dec) / (1 + q)
    assert step == pytest.approx(dec + q * pre.time_s)
    assert over.ttft_s - full.ttft_s == pytest.approx(402 * step - engine_step)


def test_static_batches_queue_the_other_clients():
    # static batching: a batch of 8 ends every e2e; 24 clients -> 16 wait, X = 8 / e2e, W = 16 e2e / 8 = 2 e2e
    w = Workload(128, 128)
    alone = evaluate(M8, H100, 1, ServeConfig(), EFF, w, 8, "static")
    over = evaluate(M8, H100, 1, ServeConfig(), EFF, w, 8, "static", clients=24)
    assert over.ttft_s - alone.ttft_s == pytest.approx(2 * alone.e2e_latency_s)


def test_clients_must_be_positive():
    with pytest.raises(MeshplanError, match="clients must be positive"):
        evaluate(M8, H100, 1, ServeConfig(), EFF, W, 16, clients=0)


def _toy(cfg: ServeConfig, clients: int, slots: int, out: int) -> float:
    """Steady-state mean TTFT, in steps, of `clients` closed-loop clients over `slots` slots, every step 1 s,
    1-token prompts and `out` output tokens (the first from the prompt step)."""
    reqs = [_Req(0.0, 1, out) for _ in range(300)]
    rep = _Replica(M8, H100, cfg, EFF, slots, concurrency=clients)
    rep._cost = lambda *args, **kwargs: 1.0
    rep.run(reqs)
    late = reqs[150:]
    return sum(r.first_token - r.arrival for r in late) / len(late)


def test_simulated_queue_follows_littles_law():
    # 5 clients, 2 slots, 4 tokens: a request holds its slot 4 steps (prompt step + 3 decodes), X = 2/4 per step;
    # W = (5 - 2) / 0.5 = 6 steps, then its prompt step: TTFT = 7
    assert _toy(ServeConfig(), 5, 2, 4) == pytest.approx(7.0)
    # 3 clients, 2 slots, 3 tokens: X = 2/3, W = 1.5, TTFT = 2.5
    assert _toy(ServeConfig(), 3, 2, 3) == pytest.approx(2.5)
    # one step ahead (SGLang overlap): a freed slot is reused a step later, X = 2/5; W = 3 / 0.4 + 1 = 8.5, TTFT 9.5
    assert _toy(ServeConfig(overlap_scheduling=True), 5, 2, 4) == pytest.approx(9.5)
    # and 3 on 2 with 3 tokens: X = 2/4, W = 1 / 0.5 + 1 = 3, TTFT = 4
    assert _toy(ServeConfig(overlap_scheduling=True), 3, 2, 3) == pytest.approx(4.0)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_closed_form_queue_matches_the_simulator(engine):
    # 48 closed-loop clients over 16 slots (Llama 3.1 8B, one H100, 1000/200, 2048-token steps): the closed form's
    # TTFT (Little's law at its own throughput) and TPOT agree with the simulator's steady state within 5%. Outputs
    # drawn uniformly around 200 (mean 200): with every output exactly 200 the clients finish in waves, and a
    # prefill-first engine (SGLang) then prefills a whole wave back to back, which the closed form's steady state
    # (requests at random phases) does not describe (session 23: 9.0 ms simulated against 10.2 ms; 10.1 ms with
    # the drawn lengths)
    cfg = ServeConfig(engine=engine, max_num_batched_tokens=2048)
    reqs = make_requests(SimSpec(rate=math.inf, n_requests=800, concurrency=48, output_dist="uniform"), W)
    _Replica(M8, H100, cfg, EFF, 16, 48).run(reqs)
    late = [r for r in reqs[200:] if r.out > 1]
    ttft = sum(r.first_token - r.arrival for r in late) / len(late)
    tpot = sum((r.finish - r.first_token) / (r.out - 1) for r in late) / len(late)
    p = evaluate(M8, H100, 1, cfg, EFF, W, 16, clients=48)
    assert p.ttft_s == pytest.approx(ttft, rel=0.05)
    assert p.tpot_s == pytest.approx(tpot, rel=0.05)
    assert ttft > 20 * evaluate(M8, H100, 1, cfg, EFF, W, 16, clients=16).ttft_s  # the queue dominates


def test_tpot_mixes_prompt_steps_and_decode_steps():
    # batch 32, 1000/200: a request's gaps carry the prompts of the other 31 sequences, 31 x 1000 / 200 = 155 tokens
    # per step on average; a step carries a whole 1000-token prompt (the 8192 budget holds it) or none, so 15.5% of
    # the gaps are prompt steps
    p = evaluate(M8, H100, 1, ServeConfig(), EFF, W, 32)
    long = step_cost(M8, H100, ServeConfig(), EFF, 32, 1100.0, 1000, 500.0, 32, prefill_seqs=1.0).time_s
    short = decode_step(M8, H100, ServeConfig(), EFF, 32, 1100.0).time_s
    assert p.tpot_s == pytest.approx(0.155 * long + 0.845 * short)
    # the step carrying the mean 155 tokens (the earlier mean field) is shorter: the prompt step is compute-bound
    mean_field = step_cost(M8, H100, ServeConfig(), EFF, 32, 1100.0, 155, 500.0, 32, prefill_seqs=0.155).time_s
    assert p.tpot_s > 1.05 * mean_field
    # a 512-token budget: a step holds 512 - 32 = 480 prompt tokens, 155 / 480 of the steps carry them
    small = ServeConfig(max_num_batched_tokens=512)
    got = mean_step_s(M8, H100, small, EFF, W, 32, 31 / 200)
    chunk = step_cost(M8, H100, small, EFF, 32, 1100.0, 480, 500.0, 32, prefill_seqs=480 / 1000).time_s
    assert got.time_s == pytest.approx(155 / 480 * chunk + (1 - 155 / 480) * short)
    assert sum(got.parts.values()) == pytest.approx(got.time_s)
    # prompts faster than a step holds: every step carries them (the mean field again)
    assert mean_step_s(M8, H100, small, EFF, W, 32, 1.0).time_s == pytest.approx(
        step_cost(M8, H100, small, EFF, 32, 1100.0, 1000, 500.0, 32, prefill_seqs=1.0).time_s)


def test_one_client_sees_only_decode_steps():
    # vLLM benchmark_serving TPOT = (latency - TTFT) / (output - 1) and AIPerf/genai-perf ITL exclude the first token,
    # so a lone client's own prompt is in its TTFT, never in its gaps: TPOT = the batch-1 decode step
    p = evaluate(M8, H100, 1, ServeConfig(), EFF, W, 1)
    assert p.tpot_s == pytest.approx(decode_step(M8, H100, ServeConfig(), EFF, 1, 1100.0).time_s)
    # its throughput: 200 tokens per (prompt step + 199 decode steps)
    pre = step_cost(M8, H100, ServeConfig(), EFF, 1, 1100.0, 1000, 500.0, 1, prefill_seqs=1.0).time_s
    assert p.throughput_tokens_per_s == pytest.approx(200 / (pre + 199 * p.tpot_s))
    assert prefill_step(M8, H100, ServeConfig(), EFF, 1, 1000).time_s < pre  # the decode token rides the prompt step


def test_closed_form_tpot_matches_the_simulator_at_moderate_load():
    # 16 closed-loop clients, 1000/200, 2048-token steps: the simulator prices every step by what it carries; the
    # closed form's step mix is within 5% of its mean TPOT, where the mean-field step was 10% short
    cfg = ServeConfig(engine="vllm", max_num_batched_tokens=2048)
    reqs = make_requests(SimSpec(rate=math.inf, n_requests=160, concurrency=16), W)
    _Replica(M8, H100, cfg, EFF, 64, 16).run(reqs)
    late = reqs[40:]
    sim = sum((r.finish - r.first_token) / 199 for r in late) / len(late)
    p = evaluate(M8, H100, 1, cfg, EFF, W, 16, clients=16)
    assert p.tpot_s == pytest.approx(sim, rel=0.05)
    mean_field = step_cost(M8, H100, cfg, EFF, 16, 1100.0, 80, 500.0, 16, prefill_seqs=0.08).time_s
    assert mean_field < 0.92 * sim


def test_residual_of_unequal_steps_by_hand():
    # 10% of steps last 0.1 s, 90% 0.01 s: E[S] = 0.019, E[S^2] = 0.001 + 0.00009 = 0.00109; residual = 0.00109 /
    # 0.038 = 0.028684 s, far above E[S]/2 = 0.0095 (a random moment more likely falls in a long step)
    assert step_residual_s(0.1, 0.1, 0.01) == pytest.approx(0.00109 / 0.038)
    assert step_residual_s(0.0, 0.1, 0.01) == pytest.approx(0.005)  # equal steps: half a step
