"""Options.xla_program: a step that XLA compiles keeps XLA's buffers on a GPU as on a TPU. The first H200 run
(benchmarks/results/gpu_h200_2026-12-04.json) measured the JAX reference step of Llama 3.2 1B at 4k x 4 with XLA's
peak bytes in use at 35.6 GiB, where the PyTorch-style (Korthikanti) activations gave a 54.8 GiB need and XLA's
buffer model (`_xla_saved_layer`, built against `meshplan verify` on the CPU) gives 36.5 GiB."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.cost.efficiency import default_efficiency
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.costmodel import Options
from meshplan.train.frameworks import framework_options
from meshplan.train.planner import plan
from meshplan.train.space import Pins, Problem


def _memory(chip_name: str, opts: Options) -> dict:
    chip, m = load_chip(chip_name), load_model("llama3.2-1b")
    pins = Pins(dp=1, fsdp=1, tp=1, pp=1, vpp=1, cp=1, ep=1, microbatch=4, recompute="none", zero=0, offload=0.0,
                offload_optimizer=0, offload_params=0, sequence_parallel=False)
    return plan(Problem(m, chip, 1, 4096, 4), pins, default_efficiency(chip), opts, top=1).plans[0][
        "memory_bytes_per_chip"]


def test_an_xla_program_on_a_gpu_keeps_what_it_keeps_on_a_tpu() -> None:
    base = Options(flash_attention=True, fused_loss=True)
    gpu_xla = _memory("h200", replace(base, xla_program=True))["activations"]
    tpu = _memory("tpu-v5p", base)["activations"]  # unset: every TPU program is XLA's
    gpu_torch = _memory("h200", base)["activations"]
    assert gpu_xla == pytest.approx(tpu)
    assert gpu_xla < 0.6 * gpu_torch  # XLA's fusions rebuild the norm outputs and the MLP's products


def test_maxtext_preset_and_the_reference_program_are_xla_programs() -> None:
    assert framework_options("maxtext", Options(), {}).xla_program is True
    assert framework_options("jax", Options(), {}).xla_program is True
    assert framework_options("megatron", Options(), {}).xla_program is None


def test_the_h200_jax_step_need_matches_xlas_peak() -> None:
    """The prediction less the 3 GB runtime reserve against XLA's measured peak bytes in use, 35.62 GiB
    (gpu_h200_2026-12-04.json, recompute none): within 3%."""
    mem = _memory("h200", Options(flash_attention=True, fused_loss=True, attention_kernel="fused", xla_program=True))
    need = mem["total"] - default_efficiency(load_chip("h200")).memory_reserved_bytes
    assert need / (35.62 * 2**30) - 1 == pytest.approx(0.0, abs=0.03)


@pytest.mark.jax
def test_measures_bare_loop_is_predicted_without_the_framework_step_overhead() -> None:
    """`meshplan measure` times bare steps (batches placed beforehand, nothing else per iteration): its prediction
    is the planner's for the same layout less efficiency.yaml's GPU step_overhead_s (0.02 s), nothing else."""
    pytest.importorskip("jax")
    from meshplan.measure import steps as st
    from meshplan.measure.layout import Layout

    chip, m = load_chip("h100-sxm"), load_model("llama3.2-1b")
    eff = default_efficiency(chip)
    layout = st.default_layout(1, 1, 1, 1, "none", 4)
    assert isinstance(layout, Layout)
    got = st.predict(m, chip, layout, 2048, 4, eff)
    opts = Options(flash_attention=False, xla_program=True)
    pins = Pins(dp=1, fsdp=1, tp=1, pp=1, vpp=1, cp=1, ep=1, microbatch=layout.microbatch, recompute="none", zero=0,
                offload=0.0, offload_optimizer=0, offload_params=0, sequence_parallel=False)
    framework = plan(Problem(m, chip, 1, 2048, 4), pins, eff, opts, top=1).plans[0]
    assert eff.step_overhead_s == 0.02
    assert framework["step_time_s"] - got["step_time_s"] == pytest.approx(0.02, rel=1e-9)
