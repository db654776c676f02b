"""Session 9, issue #14 (serving TTFT): the server path of vLLM's OpenAI-compatible server (`vllm serve` timed by
`vllm bench serve`) and the Triton ensemble's path costed from its published t5-small run. Expected values derived by
hand from the sources' numbers below, not from the model's output."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from meshplan.cost.efficiency import default_efficiency
from meshplan.errors import MeshplanError
from meshplan.infer.config import FRONTENDS, ServeConfig, check_layout, frontend_first_token_s
from meshplan.infer.simulate import _Replica, _Req
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

H100 = load_chip("h100-sxm")
V6E = load_chip("tpu-v6e")
EFF = default_efficiency(H100)
M8 = load_model("llama3.1-8b")
VLLM = ServeConfig(engine="vllm", frontend="vllm-openai")
DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "serving_measurements_new.yaml"

# tenstorrent/tt-inference-server issue #190 (2025-05-08): Llama-3.3-70B, batch 32, 128 input tokens, the same engine
# offline (in process) avg TTFT 231 ms and through the vLLM online server avg TTFT 235 ms
VLLM_PATH_S = 235e-3 - 231e-3


def test_vllm_openai_path_from_the_offline_online_difference():
    assert "vllm-openai" in FRONTENDS
    assert frontend_first_token_s(VLLM, H100) == pytest.approx(VLLM_PATH_S)  # 4 ms
    # host code (API server, ZMQ hops, detokenizer): the same on a TPU host
    assert frontend_first_token_s(VLLM, V6E) == pytest.approx(VLLM_PATH_S)
    assert frontend_first_token_s(ServeConfig(engine="vllm"), V6E) == 0.0  # in process (LLM.generate): none
    check_layout(M8, H100, 1, VLLM)  # a known server path
    with pytest.raises(MeshplanError, match="no first-token latency"):  # the Triton ensemble is a GPU path
        frontend_first_token_s(ServeConfig(engine="trtllm", frontend="triton-ensemble"), V6E)


def test_triton_ensemble_path_costs_the_t5_encoder_pass():
    # tensorrtllm_backend v0.14.0 docs/encoder_decoder.md §7: streaming ensemble, t5-small on A100-80GB, mean TTFT
    # 4.69 ms, mean ITL 0.63 ms. Engine share = first decoder step (one ITL) + the encoder pass over 200 tokens:
    #   kernels: 6 layers x 10 kernels x 4 us = 0.24 ms
    #   GEMMs:   2 x 200 x 6 x (4 x 512^2 + 2 x 512 x 2048) = 7.55e9 FLOP at 312e12 x 0.84 x 512/(512 + 256) = 0.043 ms
    encoder_s = 6 * 10 * 4e-6 + 2 * 200 * 6 * (4 * 512**2 + 2 * 512 * 2048) / (312e12 * 0.84 * 512 / 768)
    assert encoder_s == pytest.approx(0.283e-3, abs=0.002e-3)
    path_s = 4.69e-3 - 0.63e-3 - encoder_s  # 3.777 ms
    triton = ServeConfig(engine="trtllm", frontend="triton-ensemble")
    assert frontend_first_token_s(triton, H100) == pytest.approx(path_s, abs=0.05e-3)  # 3.8 ms
    # inside the source's own bounds (encoder pass between nothing and one ITL)
    assert 4.69e-3 - 2 * 0.63e-3 < frontend_first_token_s(triton, H100) < 4.69e-3 - 0.63e-3


# the closed form and the open-loop simulation add the path to TTFT only: tests/test_serve_frontend.py (PATHS)


def test_closed_loop_client_on_a_tpu_host_resends_after_the_path():
    # one closed-loop client, every step 1 s (stubbed): r0 prompt step [0, 1], decode [1, 2]; its successor reaches
    # the engine 4 ms after r0's last step, at 2.004 s; the idle engine starts it then: first token 3.004 s
    cfg = ServeConfig(tp=1, engine="vllm", frontend="vllm-openai")
    reqs = [_Req(0.0, 1, 2), _Req(0.0, 1, 2)]
    rep = _Replica(M8, V6E, cfg, default_efficiency(V6E), 64, concurrency=1)
    rep._cost = lambda *args, **kwargs: 1.0
    rep.run(reqs)
    r0, r1 = reqs
    assert r0.first_token == pytest.approx(1.0) and r0.finish == pytest.approx(2.0)
    assert r1.arrival == pytest.approx(2.0 + 4.0e-3)
    assert r1.first_token == pytest.approx(3.0 + 4.0e-3)


def test_the_tpu_rows_name_the_vllm_server():
    rows = [e for e in yaml.safe_load(DATA.read_text())["measurements"] if e["id"].startswith("vllm_tpu_")]
    assert len(rows) == 2
    for e in rows:
        assert e["frontend"] == "vllm-openai" and "vllm serve" in e["notes"]
