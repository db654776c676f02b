"""The server path's first-token latency (issue #14, TTFT under load: the Triton ensemble the TensorRT-LLM online
tables were measured through), and the one prefill/chunk rule shared by the closed form and the simulator.
Expected values derived by hand below."""

from __future__ import annotations

import json

import pytest

from meshplan.cost.efficiency import default_efficiency
from meshplan.errors import MeshplanError
from meshplan.infer.config import (
    ServeConfig,
    Workload,
    check_layout,
    frontend_first_token_s,
    prefill_len,
    prefill_room,
    prompt_chunk,
)
from meshplan.infer.frontier import frontier
from meshplan.infer.metrics import evaluate
from meshplan.infer.simulate import SimSpec, _Replica, _Req, simulate
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

H100 = load_chip("h100-sxm")
EFF = default_efficiency(H100)
M8 = load_model("llama3.1-8b")
TRITON = ServeConfig(engine="trtllm", frontend="triton-ensemble")


def test_prefill_length_and_chunk_rules_by_hand():
    vllm, trt, lmd = ServeConfig(engine="vllm", max_num_batched_tokens=8192), ServeConfig(engine="trtllm"), \
        ServeConfig(engine="lmdeploy")
    assert prefill_len(vllm, H100, 128) == 128
    assert prefill_len(lmd, H100, 128) == 127  # TurboMind's context pass stops one token short
    assert prefill_room(vllm, H100, 100) == 8192 - 100  # decodes first, the rest of the budget for prompts
    assert prefill_room(vllm, H100, 9000) == 1  # never below one token
    assert prompt_chunk(vllm, H100, 10_000, 8092) == 8092  # chunked: what fits
    assert prompt_chunk(vllm, H100, 500, 8092) == 500
    assert prompt_chunk(trt, H100, 10_000, 8092) == 10_000  # TensorRT-LLM without chunked context: the whole prompt


def test_triton_ensemble_latency_from_its_published_measurement():
    # tensorrtllm_backend v0.14.0 docs/encoder_decoder.md: streaming ensemble, t5-small, mean TTFT 4.69 ms and mean ITL
    # 0.63 ms; less the first decoder step (one ITL) and the encoder pass, which the source bounds by one ITL:
    # [4.69 - 2 x 0.63, 4.69 - 0.63] = [3.43, 4.06] ms. Session 9 costs the t5-small encoder pass (6 layers x 10 kernels
    # x 4 us + 7.55 GFLOP at 312 TFLOP/s x 0.84 x 512/768 = 0.28 ms): 4.69 - 0.63 - 0.28 = 3.78 ms -> 3.8 ms
    assert 4.69e-3 - 2 * 0.63e-3 <= frontend_first_token_s(TRITON, H100) <= 4.69e-3 - 0.63e-3
    assert frontend_first_token_s(TRITON, H100) == pytest.approx(4.69e-3 - 0.63e-3 - 0.28e-3, abs=0.05e-3)
    assert frontend_first_token_s(ServeConfig(engine="trtllm"), H100) == 0.0  # in process: no server path
    with pytest.raises(MeshplanError, match="unknown server path"):
        check_layout(M8, H100, 1, ServeConfig(frontend="nginx"))
    with pytest.raises(MeshplanError, match="no first-token latency"):
        frontend_first_token_s(TRITON, load_chip("tpu-v5e"))


# SGLang's HTTP server, from a mock model on SGLang's CPU engine (tt-sglang-plugin HOW_WE_MEASURE_OVERHEAD.md,
# tt-inference-server#3560): forward 1/380 s = 2.632 ms, median TPOT 2.94 ms (one forward + one scheduler tick) and
# median TTFT 9.54 ms (the path + one tick + one forward)
SGLANG_TICK_S = 2.94e-3 - 1 / 380
SGLANG_PATH_S = 9.54e-3 - 1 / 380 - SGLANG_TICK_S

# each server path with its engine and its first-token seconds: the Triton ensemble (3.8 ms, derived above), vLLM's
# OpenAI server (235 - 231 ms, tt-inference-server#190; tests/test_serve_s9.py) and SGLang's (6.6 ms, above)
PATHS = [pytest.param("trtllm", TRITON, 3.8e-3, id="triton-ensemble"),
         pytest.param("vllm", ServeConfig(engine="vllm", frontend="vllm-openai"), 4.0e-3, id="vllm-openai"),
         pytest.param("sglang", ServeConfig(engine="sglang", frontend="sglang-http"), 6.6e-3, id="sglang-http")]


def test_sglang_server_path_from_its_mock_model_measurement():
    sg = ServeConfig(engine="sglang", frontend="sglang-http")
    assert SGLANG_TICK_S == pytest.approx(0.31e-3, abs=0.01e-3)  # the source's "~0.31 ms" per token
    assert frontend_first_token_s(sg, H100) == pytest.approx(SGLANG_PATH_S, abs=0.05e-3)
    # the SGLang v0.3 preset takes the same path; another engine behind it is refused
    check_layout(M8, H100, 1, ServeConfig(engine="sglang@0.3", frontend="sglang-http"))
    with pytest.raises(MeshplanError, match="drives sglang"):
        check_layout(M8, H100, 1, ServeConfig(engine="vllm", frontend="sglang-http"))
    # SGLang-JAX keeps SGLang's host processes on TPU (session 37): the same path
    assert frontend_first_token_s(sg, load_chip("tpu-v5e")) == pytest.approx(SGLANG_PATH_S, abs=0.05e-3)


@pytest.mark.parametrize("mode", ["continuous", "static"])
@pytest.mark.parametrize(("engine", "cfg", "path_s"), PATHS)
def test_closed_form_adds_it_to_ttft_only(mode, engine, cfg, path_s):
    w = Workload(467, 256)
    base = evaluate(M8, H100, 1, ServeConfig(engine=engine), EFF, w, 16, mode)
    served = evaluate(M8, H100, 1, cfg, EFF, w, 16, mode)
    assert served.ttft_s - base.ttft_s == pytest.approx(path_s)
    assert served.tpot_s == base.tpot_s and served.throughput_tokens_per_s == base.throughput_tokens_per_s
    assert served.e2e_latency_s - base.e2e_latency_s == pytest.approx(path_s)  # e2e = TTFT + (O - 1) TPOT


@pytest.mark.parametrize(("engine", "cfg", "path_s"), PATHS)
def test_simulated_open_loop_ttft_shifts_by_it(engine, cfg, path_s):
    # Poisson arrivals reach the engine at the same moments (a constant shift of a Poisson process is one): every
    # request's TTFT grows by exactly the path's seconds, its inter-token gaps do not change
    w, spec = Workload(467, 16), SimSpec(rate=4.0, n_requests=30)
    base = simulate(M8, H100, 1, ServeConfig(engine=engine), EFF, w, 32, spec)
    served = simulate(M8, H100, 1, cfg, EFF, w, 32, spec)
    for q in ("p50", "p90", "mean"):
        assert served["ttft_s"][q] - base["ttft_s"][q] == pytest.approx(path_s)
        assert served["tpot_s"][q] == pytest.approx(base["tpot_s"][q])


def _one_client(cfg: ServeConfig) -> list[_Req]:
    """One closed-loop client, every step 1 s (the step cost is replaced): two requests of a 1-token prompt and 2
    output tokens."""
    reqs = [_Req(0.0, 1, 2), _Req(0.0, 1, 2)]
    rep = _Replica(M8, H100, cfg, EFF, 64, concurrency=1)
    rep._cost = lambda *args, **kwargs: 1.0
    rep.run(reqs)
    return reqs


def test_closed_loop_next_request_reaches_the_engine_after_the_server_path():
    F = 3.8e-3
    r0, r1 = _one_client(TRITON)
    # r0: prompt step [0, 1] (first token), decode [1, 2] (finish). The client gets that last token and its next
    # request reaches the engine F later, at 2 + F; the idle engine starts it then: first token at 3 + F, finish 4 + F
    assert r0.first_token == pytest.approx(1.0) and r0.finish == pytest.approx(2.0)
    assert r1.arrival == pytest.approx(2.0 + F)
    assert r1.first_token == pytest.approx(3.0 + F) and r1.finish == pytest.approx(4.0 + F)
    # the client's TTFT of r1 = engine time 1 s + F (its ways in and out)
    assert r1.first_token - r1.arrival + F == pytest.approx(1.0 + F)
    _, b1 = _one_client(ServeConfig(engine="trtllm"))
    assert b1.arrival == pytest.approx(2.0) and b1.first_token == pytest.approx(3.0)


def test_frontier_under_clients_evaluates_each_running_batch_once():
    # 8 clients on one replica: every batch limit >= 8 runs the same 8 sequences, so those points are one evaluation
    pts = frontier(M8, H100, 1, ServeConfig(engine="vllm"), EFF, Workload(1000, 200), clients=8)
    capped = [p for p in pts if p.batch == 8]
    assert len(capped) >= 2 and all(p is capped[0] for p in capped)
    assert [p.batch for p in pts[:4]] == [1, 2, 4, 8]
    assert pts[0].queue_wait_s > 0  # a limit of 1 with 8 clients: 7 wait for the slot


def test_cli_frontend_flag(capsys):
    from conftest import run_cli

    cmd = ["serve", "-m", "llama3.2-1b", "--hardware", "h100-sxm", "--chips", "1", "--tp", "1", "--batch", "16",
           "--input-len", "512", "--output-len", "64", "--engine", "trtllm", "--json"]
    code, out, err = run_cli(cmd, capsys)
    assert code == 0, err
    code, out2, err = run_cli(cmd + ["--frontend", "triton-ensemble"], capsys)
    assert code == 0, err
    a, b = json.loads(out), json.loads(out2)
    assert b["ttft_s"] - a["ttft_s"] == pytest.approx(3.8e-3) and b["tpot_s"] == a["tpot_s"]
    assert b["config"]["frontend"] == "triton-ensemble" and a["config"]["frontend"] is None
    code, _, err = run_cli(cmd + ["--frontend", "nginx"], capsys)
    assert code == 2 and err.startswith("error:")


def test_disaggregated_ttft_counts_it_too():
    from meshplan.infer.disagg import disaggregate

    w, cfg = Workload(2048, 256), ServeConfig(engine="trtllm")
    base = disaggregate(M8, H100, 8, cfg, cfg, EFF, w)
    served = disaggregate(M8, H100, 8, TRITON, TRITON, EFF, w)
    # TTFT = prefill + KV transfer (+ the server path): the pools and throughput do not change
    assert served.ttft_s - base.ttft_s == pytest.approx(3.8e-3)
    assert served.ttft_s == pytest.approx(served.prefill_s + served.kv_transfer_s + 3.8e-3)
    assert (served.prefill_instances, served.decode_instances) == (base.prefill_instances, base.decode_instances)
