"""`meshplan measure`: real training steps of the reference JAX model (measure/jaxmodel.py) on the local
devices (all processes under jax.distributed), beside the planner's prediction for the same layout.

Measured MFU uses the DESIGN.md formula: model FLOPs per step ÷ (step time × chips × dense bf16 peak), model
FLOPs = 3 × (2 × matmul parameters + causal attention) per token × tokens per step (book ch.4).

By default the reference model computes attention by materialising the score matrix (no flash kernel) and runs
the whole global batch as one micro-batch, so the prediction is made with Options(flash_attention=False) and one
micro-batch per step; `run_training(attention="cudnn")` runs cuDNN's flash kernel instead (predict with
flash_attention=True, as `meshplan measure --attention` and benchmarks/gpu do).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from meshplan.cost.efficiency import Efficiency
from meshplan.errors import MeshplanError
from meshplan.math import transformer as tm
from meshplan.measure import jaxmodel as jm
from meshplan.measure.layout import Layout
from meshplan.specs.hardware import Chip
from meshplan.specs.model import ModelConfig
from meshplan.train.costmodel import Options
from meshplan.train.planner import plan
from meshplan.train.space import Pins, Problem


@dataclass(frozen=True)
class StepRun:
    """What one `measure` run saw."""

    step_times_s: list[float]
    compile_s: float
    peak_memory_bytes: float
    memory_source: str
    losses: list[float]
    model_flops_per_step: float
    devices: int

    @property
    def step_time_s(self) -> float:
        return statistics.median(self.step_times_s)

    def mfu(self, chip: Chip) -> float:
        return self.model_flops_per_step / (self.step_time_s * self.devices * chip.peak("bf16"))

    def as_dict(self) -> dict[str, Any]:
        return {"step_time_s": self.step_time_s, "step_times_s": self.step_times_s, "compile_s": self.compile_s,
                "peak_memory_bytes": self.peak_memory_bytes, "memory_source": self.memory_source,
                "losses": self.losses, "model_flops_per_step": self.model_flops_per_step, "devices": self.devices}


def default_layout(devices: int, dp: int | None, fsdp: int | None, tp: int | None, recompute: str,
                   global_batch: int) -> Layout:
    """Pinned degrees; dp takes whatever devices the others leave. One micro-batch per step."""
    fsdp, tp = fsdp or 1, tp or 1
    if dp is None:
        if devices % (fsdp * tp):
            raise MeshplanError(f"fsdp×tp = {fsdp * tp} does not divide the {devices} devices")
        dp = devices // (fsdp * tp)
    shards = dp * fsdp
    if global_batch % shards:
        raise MeshplanError(f"--global-batch {global_batch} does not divide by dp×fsdp = {shards}")
    return Layout(dp=dp, fsdp=fsdp, tp=tp, microbatch=global_batch // shards, recompute=recompute)


def model_flops_per_step(model: ModelConfig, seq_len: int, global_batch: int) -> float:
    return tm.flops_per_token(model, seq_len).training * seq_len * global_batch


def _peak_memory(compiled: Any) -> tuple[float, str]:
    """The allocator's peak on the busiest local device, or XLA's compiled estimate where there is none."""
    stats = [d.memory_stats() for d in jax.local_devices()]
    peaks = [s.get("peak_bytes_in_use") for s in stats if s]
    if peaks and all(p is not None for p in peaks):
        return float(max(peaks)), "allocator peak (memory_stats)"
    ma = compiled.memory_analysis()
    if ma is None:
        return float("nan"), "unavailable"
    total = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
             + ma.temp_size_in_bytes)
    return float(total), "XLA compiled estimate (arguments + outputs − aliased + temporaries)"


def run_training(model: ModelConfig, layout: Layout, seq_len: int, global_batch: int, steps: int,
                 param_dtype: Any = jnp.bfloat16, attention: str = "materialized",
                 compute_dtype: Any = None) -> StepRun:
    """Compile, warm up once, then time `steps` steps, each on a fresh random batch placed beforehand.
    `attention` and `compute_dtype` go to `jaxmodel.build_program` (e.g. "cudnn" and bf16 compute over fp32
    params: the mixed precision the planner's memory model assumes)."""
    if steps < 1:
        raise MeshplanError(f"--steps must be at least 1, got {steps}")
    n = jax.device_count()
    if layout.devices > n or (jax.process_count() > 1 and layout.devices != n):
        raise MeshplanError(f"the layout uses {layout.devices} devices but JAX has {n}")
    prog = jm.build_program(model, layout, seq_len, global_batch, jax.devices()[: layout.devices], attention,
                            compute_dtype)
    params, opt = jm.init_state(prog, seed=0, dtype=param_dtype)
    batches = [jm.place_batch(prog, jm.synthetic_batch(model, seq_len, global_batch, seed=i))
               for i in range(steps + 1)]
    t0 = time.perf_counter()
    compiled = prog.step.lower(params, opt, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    params, opt, loss = jax.block_until_ready(compiled(params, opt, batches[0]))
    times, losses = [], [float(loss)]
    for batch in batches[1:]:
        jax.block_until_ready(batch)
        t0 = time.perf_counter()
        params, opt, loss = jax.block_until_ready(compiled(params, opt, batch))
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    mem, source = _peak_memory(compiled)
    return StepRun(times, compile_s, mem, source, losses, model_flops_per_step(model, seq_len, global_batch),
                   layout.devices)


def predict(model: ModelConfig, chip: Chip, layout: Layout, seq_len: int, global_batch: int,
            eff: Efficiency, options: Options | None = None) -> dict[str, Any]:
    """The planner's plan for exactly this layout (one micro-batch; by default materialised attention, as
    the reference model computes it unless told otherwise)."""
    problem = Problem(model, chip, layout.devices, seq_len, global_batch)
    pins = Pins(dp=layout.dp, fsdp=layout.fsdp, tp=layout.tp, pp=1, vpp=1, cp=1, ep=1,
                microbatch=layout.microbatch, recompute=layout.recompute, zero=0, offload=0.0,
                sequence_parallel=layout.sequence_parallel)
    return plan(problem, pins, eff, options or Options(flash_attention=False), top=1).plans[0]
