"""`meshplan measure`: real training steps of the reference JAX model (measure/jaxmodel.py) on the local
devices (all processes under jax.distributed), beside the planner's prediction for the same layout.

Measured MFU uses the DESIGN.md formula: model FLOPs per step ÷ (step time × chips × dense bf16 peak), model
FLOPs = 3 × (2 × matmul parameters + causal attention) per token × tokens per step (book ch.4).

By default the reference model computes attention by materialising the score matrix (no flash kernel) and runs
the whole global batch as one micro-batch, so the prediction is made with Options(flash_attention=False) and one
micro-batch per step (always as an XLA program, Options.xla_program, whose memory follows XLA's buffers, and as a
bare loop, efficiency.bare_loop); `run_training(attention="cudnn")` runs cuDNN's flash kernel instead (predict with
flash_attention=True, as `meshplan measure --attention` and benchmarks/gpu do).
"""

from __future__ import annotations

import gzip
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from meshplan.cost.efficiency import Efficiency, bare_loop
from meshplan.errors import MeshplanError
from meshplan.math import transformer as tm
from meshplan.measure import jaxmodel as jm
from meshplan.measure.layout import Layout
from meshplan.measure.verify import compiled_cost
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
    # XLA's own count for the compiled step (cost_analysis: "flops", "bytes accessed", ...; on GPUs the GEMMs are
    # cuBLAS custom calls, which XLA's GPU cost analysis counts too)
    xla_cost: dict[str, float] = field(default_factory=dict)
    # one more step under the profiler, its device time by kind of work (measure/kernels.py; {} on the CPU or
    # when not asked for)
    kernels: dict[str, Any] = field(default_factory=dict)

    @property
    def step_time_s(self) -> float:
        return statistics.median(self.step_times_s)

    def mfu(self, chip: Chip) -> float:
        return self.model_flops_per_step / (self.step_time_s * self.devices * chip.peak("bf16"))

    def as_dict(self) -> dict[str, Any]:
        return {"step_time_s": self.step_time_s, "step_times_s": self.step_times_s, "compile_s": self.compile_s,
                "peak_memory_bytes": self.peak_memory_bytes, "memory_source": self.memory_source,
                "losses": self.losses, "model_flops_per_step": self.model_flops_per_step, "devices": self.devices,
                "xla_cost": self.xla_cost, "kernels": self.kernels}


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


def memory_lower_bound_bytes(model: ModelConfig, layout: Layout, seq_len: int, param_dtype: Any,
                             attention: str = "materialized") -> float:
    """Bytes one device must hold at least: weights, gradients and AdamW's two moments in the parameter dtype
    (4 copies of the parameters, sharded over fsdp×tp), plus, with materialised attention, one layer's fp32
    attention scores: micro-batch × heads/tp × T² × 4 B."""
    params = tm.param_counts(model).total
    state = 4 * params * jnp.dtype(param_dtype).itemsize / (layout.fsdp * layout.tp)
    scores = layout.microbatch * model.n_heads / layout.tp * float(seq_len) ** 2 * 4
    return state + (scores if attention == "materialized" else 0.0)


def available_memory_bytes(platform: str) -> tuple[float, str]:
    """Memory the run can use: the host's available RAM on the CPU (all simulated devices share it), else the
    smallest device's allocator limit; (inf, 'unknown') when neither is reported."""
    if platform == "cpu":
        try:
            for line in open("/proc/meminfo").read().splitlines():
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024, "available host RAM (/proc/meminfo)"
        except OSError:
            pass
        return float("inf"), "unknown"
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in jax.local_devices()]
    if limits and all(limits):
        return float(min(limits)), "device memory limit (memory_stats)"
    return float("inf"), "unknown"


def check_memory(model: ModelConfig, layout: Layout, seq_len: int, param_dtype: Any,
                 attention: str = "materialized") -> None:
    """Refuse a run that cannot fit before compiling it (issue #18: 2.5 minutes, then an XLA out-of-memory)."""
    platform = jax.devices()[0].platform
    per_device = memory_lower_bound_bytes(model, layout, seq_len, param_dtype, attention)
    need = per_device * (layout.devices if platform == "cpu" else 1)
    have, what = available_memory_bytes(platform)
    if need > have:
        raise MeshplanError(
            f"{model.name} needs at least {need / 2**30:.1f} GiB ({'all devices' if platform == 'cpu' else 'per device'}"
            f": weights, gradients and AdamW state in {jnp.dtype(param_dtype).name}, and one layer's attention "
            f"scores) but the {what} is {have / 2**30:.1f} GiB; use --layers N, a shorter --seq-len or a smaller model")


def _check_compiled_memory(model: ModelConfig, compiled: Any, layout: Layout) -> None:
    """XLA's own estimate of the compiled step (arguments + outputs − aliased + temporaries) against what the
    machine has, before the first step runs."""
    ma = compiled.memory_analysis()
    if ma is None:
        return
    platform = jax.devices()[0].platform
    per_device = float(ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
                       + ma.temp_size_in_bytes)
    need = per_device * (layout.devices if platform == "cpu" else 1)
    have, what = available_memory_bytes(platform)
    if need > have:
        raise MeshplanError(f"{model.name}'s compiled step needs {need / 2**30:.1f} GiB (XLA's memory analysis) but "
                            f"the {what} is {have / 2**30:.1f} GiB; use --layers N, a shorter --seq-len or a smaller "
                            "model")


def run_training(model: ModelConfig, layout: Layout, seq_len: int, global_batch: int, steps: int,
                 param_dtype: Any = jnp.bfloat16, attention: str = "materialized",
                 compute_dtype: Any = None, progress: Any = None, hlo_path: str | Path | None = None,
                 profile_kernels: bool = False) -> StepRun:
    """Compile, warm up once, then time `steps` steps, each on a fresh random batch placed beforehand.
    `attention` and `compute_dtype` go to `jaxmodel.build_program` (e.g. "cudnn" and bf16 compute over fp32
    params: the mixed precision the planner's memory model assumes). `progress(message)` is called before each long
    stage (compile, warm-up, every timed step). `hlo_path`: also write the compiled (optimised) HLO there, gzipped.
    `profile_kernels`: after the timed steps, one more under JAX's profiler, its device time by kind of work
    (`kernels.profile_step`), so that the timed steps carry no profiler overhead."""
    say = progress or (lambda _msg: None)
    if steps < 1:
        raise MeshplanError(f"--steps must be at least 1, got {steps}")
    n = jax.device_count()
    if layout.devices > n or (jax.process_count() > 1 and layout.devices != n):
        raise MeshplanError(f"the layout uses {layout.devices} devices but JAX has {n}")
    check_memory(model, layout, seq_len, param_dtype, attention)
    say(f"building {model.name} on {layout.devices} device(s)")
    prog = jm.build_program(model, layout, seq_len, global_batch, jax.devices()[: layout.devices], attention,
                            compute_dtype)
    params, opt = jm.init_state(prog, seed=0, dtype=param_dtype)
    batches = [jm.place_batch(prog, jm.synthetic_batch(model, seq_len, global_batch, seed=i))
               for i in range(steps + 1)]
    say("compiling the training step")
    t0 = time.perf_counter()
    compiled = prog.step.lower(params, opt, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    _check_compiled_memory(model, compiled, layout)
    xla_cost = {k: float(v) for k, v in compiled_cost(compiled).items() if isinstance(v, int | float)}
    hlo_text = compiled.as_text() if hlo_path is not None or profile_kernels else ""
    if hlo_path is not None:
        Path(hlo_path).write_bytes(gzip.compress(hlo_text.encode()))
    say(f"compiled in {compile_s:.1f} s; warm-up step")
    try:
        params, opt, loss = jax.block_until_ready(compiled(params, opt, batches[0]))
    except jax.errors.JaxRuntimeError as exc:  # the allocator refused what XLA's estimate allowed
        if "RESOURCE_EXHAUSTED" not in str(exc):
            raise
        raise MeshplanError(f"{model.name} ran out of device memory in its first step "
                            f"({str(exc).splitlines()[0][:120]}); use --layers N, a shorter --seq-len or a smaller "
                            "model") from None
    times, losses = [], [float(loss)]
    for i, batch in enumerate(batches[1:], 1):
        jax.block_until_ready(batch)
        t0 = time.perf_counter()
        params, opt, loss = jax.block_until_ready(compiled(params, opt, batch))
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        say(f"step {i}/{steps}: {times[-1]:.3f} s")
    mem, source = _peak_memory(compiled)
    kernels: dict[str, Any] = {}
    if profile_kernels:
        from meshplan.measure.kernels import profile_step

        say("one step under the profiler")
        state = [params, opt]

        def once() -> None:
            state[0], state[1], _ = jax.block_until_ready(compiled(state[0], state[1], batches[0]))

        try:
            kernels = profile_step(once, hlo_text) or {"note": "the profile has no device kernels (the CPU)"}
        except Exception as exc:  # noqa: BLE001 - a profiler that will not start (CUPTI) leaves the timed steps
            kernels = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
    return StepRun(times, compile_s, mem, source, losses, model_flops_per_step(model, seq_len, global_batch),
                   layout.devices, xla_cost, kernels)


def predict(model: ModelConfig, chip: Chip, layout: Layout, seq_len: int, global_batch: int,
            eff: Efficiency, options: Options | None = None) -> dict[str, Any]:
    """The planner's plan for exactly this layout (one micro-batch; by default materialised attention, as
    the reference model computes it unless told otherwise)."""
    problem = Problem(model, chip, layout.devices, seq_len, global_batch)
    pins = Pins(dp=layout.dp, fsdp=layout.fsdp, tp=layout.tp, pp=1, vpp=1, cp=1, ep=1,
                microbatch=layout.microbatch, recompute=layout.recompute, zero=0, offload=0.0,
                offload_optimizer=0, offload_params=0,  # the measured program keeps its state on the device
                sequence_parallel=layout.sequence_parallel)
    opts = replace(options or Options(flash_attention=False), xla_program=True)  # the measured step is XLA's
    return plan(problem, pins, bare_loop(eff), opts, top=1).plans[0]
