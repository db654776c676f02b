"""SGLang-JAX's host iteration on TPU (issue #14, session 39: serving.yaml engine_host_step_s, step.py `host_step`):
the SGLang-JAX launch blog measures ~7 ms of CPU gap between decode batches on a v6e-4 without the overlap scheduler.
Expected values derived by hand from that figure and the step's own device parts."""

from __future__ import annotations

import pytest

from meshplan.cost.efficiency import default_efficiency
from meshplan.infer.config import ServeConfig, engine_host_step_s
from meshplan.infer.step import step_cost
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

V6E = load_chip("tpu-v6e")
H100 = load_chip("h100-sxm")
BLOG_GAP_S = 7e-3  # 'from approximately 7ms to 24us' (blog/2025-10-29-sglang-jax.md, Reducing Scheduling Overhead)
SGL = ServeConfig(tp=4, engine="sglang")  # SGLang-JAX: the overlap scheduler on by default
SGL_SERIAL = ServeConfig(tp=4, engine="sglang", overlap_scheduling=False)


def test_the_constant_is_the_blogs_gap_for_sglang_on_tpu_only():
    assert engine_host_step_s(SGL, V6E) == pytest.approx(BLOG_GAP_S)
    assert engine_host_step_s(ServeConfig(tp=4, engine="vllm"), V6E) == 0.0  # no measurement of vLLM-TPU's host path
    assert engine_host_step_s(ServeConfig(engine="sglang"), H100) == 0.0  # GPU SGLang: decode_step_overhead_s


def test_serial_pays_it_in_series_and_ahead_only_its_excess():
    m, eff = load_model("qwen3-8b"), default_efficiency(V6E)
    serial = step_cost(m, V6E, SGL_SERIAL, eff, 8, 1500.0)
    assert serial.parts["host_step"] == pytest.approx(BLOG_GAP_S)
    ahead = step_cost(m, V6E, SGL, eff, 8, 1500.0)
    device = ahead.time_s - ahead.parts["host_step"]
    assert device < BLOG_GAP_S  # Qwen3-8B on a v6e-4 at 8 sequences: ~4.5 ms of device step
    assert ahead.time_s == pytest.approx(BLOG_GAP_S)  # the device waits for the host: the step lasts 7 ms
    assert serial.time_s == pytest.approx(device + BLOG_GAP_S)
    # a device step longer than the host work hides it whole
    big = step_cost(load_model("qwen3-32b"), V6E, SGL, eff, 256, 4000.0)
    assert big.parts["host_step"] == 0.0 and big.time_s > BLOG_GAP_S
    # no host loop (an in-program reference step): nothing
    assert "host_step" not in step_cost(m, V6E, SGL, eff, 8, 1500.0, engine_loop=False).parts
