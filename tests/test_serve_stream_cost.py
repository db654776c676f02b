"""Streamed tokens' host cost on the server path (issue #14, session 20: serving.yaml frontend_token_s, step.py
`stream_responses`). Expected values derived by hand from the source's published pair and from the step's own parts."""

from __future__ import annotations

import json

import pytest

from meshplan.cost.efficiency import default_efficiency
from meshplan.infer.config import ServeConfig, Workload, frontend_token_s
from meshplan.infer.simulate import SimSpec, simulate
from meshplan.infer.step import step_cost
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

H100 = load_chip("h100-sxm")
EFF = default_efficiency(H100)
M8 = load_model("llama3.1-8b")
SERIAL = ServeConfig(engine="trtllm@0.17", frontend="triton-ensemble")  # the C++ executor: one step after the last
INPROC = ServeConfig(engine="trtllm@0.17")  # the same engine timed in process


def test_per_token_cost_is_the_published_streaming_pair():
    # triton-inference-server/server #8045: 200 in / 500 out at concurrency 100, 17.38 req/s streaming, 22.6 without:
    # the extra time per output token at the same concurrency and lengths
    by_hand = 1.0 / (17.38 * 500) - 1.0 / (22.6 * 500)
    assert by_hand == pytest.approx(26.6e-6, abs=0.05e-6)
    assert frontend_token_s(SERIAL, H100) == pytest.approx(by_hand, rel=0.01)
    assert frontend_token_s(INPROC, H100) == 0.0  # in process: no server path
    # vLLM's OpenAI server: no published pair, so not modelled (its output processing runs beside the engine core)
    assert frontend_token_s(ServeConfig(engine="vllm", frontend="vllm-openai"), H100) == 0.0


@pytest.mark.parametrize("batch", [1, 64, 512])
def test_a_serial_engine_pays_every_streamed_token_in_series(batch):
    c = frontend_token_s(SERIAL, H100)
    on = step_cost(M8, H100, SERIAL, EFF, batch, 1000.0)
    off = step_cost(M8, H100, INPROC, EFF, batch, 1000.0)
    assert on.parts["stream_responses"] == pytest.approx(c * batch)
    assert on.time_s - off.time_s == pytest.approx(c * batch)
    assert "stream_responses" not in off.parts
    # a step with 3 prompts beside the decodes streams their first tokens too (default count), or what the caller says
    mixed = step_cost(M8, H100, SERIAL, EFF, batch, 1000.0, 3 * 500, 250.0, batch + 3, prefill_seqs=3)
    assert mixed.parts["stream_responses"] == pytest.approx(c * (batch + 3))
    told = step_cost(M8, H100, SERIAL, EFF, batch, 1000.0, 3 * 500, 250.0, batch + 3, prefill_seqs=3,
                     streamed_tokens=batch)
    assert told.parts["stream_responses"] == pytest.approx(c * batch)


def test_an_engine_a_step_ahead_shows_only_the_excess_over_its_step():
    ahead = ServeConfig(engine="trtllm@0.17", frontend="triton-ensemble", overlap_scheduling=True)
    c = frontend_token_s(ahead, H100)
    small = step_cost(M8, H100, ahead, EFF, 16, 1000.0)
    assert small.parts["stream_responses"] == 0.0  # 16 x 26.6 us = 0.43 ms, hidden behind a ~6 ms step
    # a step whose host work exceeds the device step: the excess only, so the step lasts the host work
    big = 200_000
    s = step_cost(M8, H100, ahead, EFF, big, 10.0)
    device = s.time_s - s.parts["stream_responses"]
    assert c * big > device
    assert s.time_s == pytest.approx(c * big)
    # no host loop (the GPU suite's in-program reference steps): nothing streamed
    assert "stream_responses" not in step_cost(M8, H100, SERIAL, EFF, 64, 1000.0, engine_loop=False).parts


def test_the_simulated_gap_grows_by_the_streamed_tokens_of_each_step():
    # a closed loop of 32 clients with 1-token prompts and 200-token outputs: nearly every step decodes 32 sequences,
    # so the mean gap between two tokens grows by about 32 x 26.6 us = 0.85 ms over the in-process engine
    w = Workload(1, 200)
    spec = SimSpec(rate=float("inf"), n_requests=64, concurrency=32)
    on = simulate(M8, H100, 1, SERIAL, EFF, w, 256, spec)
    off = simulate(M8, H100, 1, INPROC, EFF, w, 256, spec)
    c = frontend_token_s(SERIAL, H100)
    grown = on["itl_s"]["p50"] - off["itl_s"]["p50"]
    assert grown == pytest.approx(32 * c, rel=0.05)
    assert on["throughput_tokens_per_s"] < off["throughput_tokens_per_s"]


def test_serve_json_reports_the_streamed_tokens_part(capsys):
    from conftest import run_cli

    base = ["serve", "--model", "llama3.1-8b", "--hardware", "h100-sxm", "--chips", "1", "--engine", "trtllm@0.17",
            "--batch", "64", "--input-len", "467", "--output-len", "256", "--json"]
    code, out, _ = run_cli(base + ["--frontend", "triton-ensemble"], capsys)
    assert code == 0
    parts = json.loads(out)["decode_step"]["parts"]
    # the mean step of 64 decodes plus the steady state's prompts (64 / 256 per step, each with its first token)
    assert parts["stream_responses"] == pytest.approx(frontend_token_s(SERIAL, H100) * (64 + 64 / 256), rel=1e-6)
    code, out, _ = run_cli(base, capsys)
    assert code == 0
    assert "stream_responses" not in json.loads(out)["decode_step"]["parts"]  # in process: nothing streamed out
