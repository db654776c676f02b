"""`meshplan serve --concurrency C` without --simulate: the closed form ranks the plan under C closed-loop clients,
those beyond the engine's batch limit waiting for a slot (Little's law, infer.metrics.admission_queue_wait_s).
Expected values are derived by hand from the JSON's own throughput and batch."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

# one H100, llama3.2-1b, the layout and the batch limit pinned (16 sequences), the default engine (it schedules each
# step after the previous one ends: no extra step per slot turnover)
SERVE = ["serve", "-m", "llama3.2-1b", "--hardware", "h100-sxm", "--chips", "1", "--tp", "1", "--batch", "16",
         "--input-len", "512", "--output-len", "64", "--json"]


def _plan(capsys, clients: int) -> dict:
    code, out, err = run_cli(SERVE + ["--concurrency", str(clients)], capsys)
    assert code == 0, err
    return json.loads(out)


def test_twice_the_batch_limit_of_clients_waits_littles_law(capsys):
    at, over = _plan(capsys, 16), _plan(capsys, 32)
    b = at["batch"]
    assert b == over["batch"] == 16  # the limit runs; the other 16 clients wait
    assert at["clients"] == {"clients": 16, "running": 16, "waiting": 0, "queue_wait_s": 0.0,
                                           "requests": None, "first_round_ttft_s": None,
                                           "rounds_in_phase": False, "spread_ttft_s": None}
    assert over["clients"]["running"] == 16 and over["clients"]["waiting"] == 16
    # the running batch is the same, so throughput is too; each slot turns over every O = 64 steps:
    # request throughput X = (output tokens/s) / O, and Little's law on the waiting queue: W = (C - B) / X
    tokens_per_s = over["throughput_tokens_per_s"]
    assert tokens_per_s == at["throughput_tokens_per_s"]
    x_per_s = tokens_per_s / 64
    wait_s = (32 - b) / x_per_s
    assert over["clients"]["queue_wait_s"] == pytest.approx(wait_s, rel=1e-12)
    # a queued request is admitted as its slot frees, so it skips the one running step a closed-loop client with a
    # slot waits (B sequences per step: step = B / tokens_per_s): TTFT(2B) = TTFT(B) + W - step
    step_s = b / tokens_per_s
    assert over["ttft_s"] - at["ttft_s"] == pytest.approx(wait_s - step_s, rel=1e-9)
    # W = 16 / (16 / (64 steps)) = 64 steps: the wait dominates the one step
    assert over["ttft_s"] > at["ttft_s"] + 0.9 * wait_s


def test_clients_key_and_human_line(capsys):
    # fewer clients than the limit: the engine runs only theirs, no queue; --json without --concurrency has no key
    few = _plan(capsys, 4)
    assert few["batch"] == 4 and few["clients"] == {"clients": 4, "running": 4, "waiting": 0, "queue_wait_s": 0.0,
                                           "requests": None, "first_round_ttft_s": None,
                                           "rounds_in_phase": False, "spread_ttft_s": None}
    code, out, err = run_cli(SERVE, capsys)
    assert code == 0 and "clients" not in json.loads(out)
    code, out, err = run_cli(SERVE[:-1] + ["--concurrency", "32"], capsys)
    assert code == 0, err
    assert "32 clients, 16 running, 16 waiting; queue wait" in out


@pytest.mark.parametrize("bad", ["0", "-1", "100001", "2.5", "x"])
def test_concurrency_out_of_range_is_one_error(capsys, bad):
    code, out, err = run_cli(SERVE + [f"--concurrency={bad}"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and "--concurrency" in lines[0], err
