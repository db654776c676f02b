"""A closed loop with a finite request rate (session 21, QA finding): request j goes out at its Poisson time or when a
client frees, whichever is later (vLLM benchmark_serving --request-rate with --max-concurrency). Before, the first C
kept their Poisson times while the later ones were sent as clients freed, and the engine took them in index order, so
a request sent early waited behind clients that had not yet arrived: TTFT p90 386 s at 0.1 requests/s."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from meshplan.cost.efficiency import default_efficiency
from meshplan.infer.config import ServeConfig, Workload
from meshplan.infer.simulate import SimSpec, simulate
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

M = load_model("llama3-70b")
CHIP = load_chip("h100-sxm")
EFF = default_efficiency(CHIP)
CFG = ServeConfig(tp=8, engine="vllm")
W = Workload(2000, 500)


@pytest.mark.parametrize("rate", [0.1, 1.0])
def test_a_cap_that_never_binds_is_the_open_loop(rate):
    # 64 clients at these rates never have 64 requests in flight (a request lasts a few seconds), so the cap changes
    # nothing: the same Poisson sample (same seed) must give the open loop's numbers exactly
    open_loop = simulate(M, CHIP, 8, CFG, EFF, W, 64, SimSpec(rate, 100, seed=3))
    capped = simulate(M, CHIP, 8, CFG, EFF, W, 64, SimSpec(rate, 100, seed=3, concurrency=64))
    for key in ("ttft_s", "tpot_s", "itl_s"):
        assert capped[key] == pytest.approx(open_loop[key])
    assert capped["throughput_tokens_per_s"] == pytest.approx(open_loop["throughput_tokens_per_s"])


def test_a_binding_cap_delays_requests_past_their_arrival():
    # two clients at 50 requests/s: the engine is always full, so requests queue at the client and the achieved rate
    # is what two sequences in flight can do, far below 50 requests/s
    sim = simulate(M, CHIP, 8, CFG, EFF, W, 64, SimSpec(50.0, 40, seed=1, concurrency=2))
    one = sim["ttft_s"]["p50"] + (W.output_len - 1) * sim["tpot_s"]["p50"]  # one request's end-to-end
    assert sim["throughput_tokens_per_s"] == pytest.approx(2 * W.output_len / one, rel=0.1)


BASE = ["serve", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "1", "--input-len", "200",
        "--output-len", "50", "--simulate", "--requests", "20"]


def test_cli_concurrency_simulates_without_rate(capsys):
    code_a, out_a, _ = run_cli([*BASE, "--concurrency", "4", "--json"], capsys)
    code_b, out_b, _ = run_cli([*BASE, "--concurrency", "4", "--rate", "inf", "--json"], capsys)
    assert code_a == 0 and code_b == 0
    assert json.loads(out_a)["simulation"] == json.loads(out_b)["simulation"]


def test_cli_simulate_needs_rate_or_concurrency(capsys):
    code, _, err = run_cli(BASE, capsys)
    assert code == 2 and err.startswith("error:") and "--rate" in err and "--concurrency" in err
