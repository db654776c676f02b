"""`meshplan calibrate`: microbenchmarks on the local accelerator(s), fitted to the efficiency model.

Benchmarks (each a named task over a grid, timed by `measure.timing`):
  matmul       [m,k]·[k,n] in bf16 (fp8 where the chip has it) over square and thin shapes
  hbm          a large elementwise copy y = a·x + b: bytes read plus bytes written
  attention    jax.nn.dot_product_attention, causal, at several lengths: forward and forward+backward; then
               other (heads, head dim) shapes at one length
  sdpa         the same through PyTorch's scaled_dot_product_attention (GPU, where torch is installed)
  norm         memory-bound layer kernels: RMSNorm, SwiGLU's silu(g)·u, the residual add
  host         host→device (jax.device_put) and device→host (jax.device_get) bandwidth
  overhead     a chain of tiny dependent matmuls: the fixed cost of one more kernel
  layer        one decoder layer of the reference JAX model (measure/jaxmodel.py), forward and backward
  collectives  all-reduce (psum) and all-gather across every device (all processes) under shard_map

Each benchmark returns records (dicts) with the work done, the median time, the achieved rate and its
fraction of the chip's catalog peak; `measure/fit.py` turns them into the efficiency fields and the profile.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshplan.math import transformer as tm
from meshplan.measure.timing import Timing, auto_inner, random_inputs, time_fn, time_host
from meshplan.specs.hardware import Chip
from meshplan.specs.model import ModelConfig, load_model

BENCHMARKS = ("matmul", "hbm", "attention", "sdpa", "norm", "host", "overhead", "layer", "collectives")
MiB = 2**20
Record = dict[str, Any]


@dataclass(frozen=True)
class Grid:
    """What to measure and how often: one per (platform, quick/full)."""

    matmul_square: tuple[int, ...]
    matmul_thin: tuple[int, ...]  # m of [m, big]·[big, big]
    matmul_big: int
    fp8_square: tuple[int, ...]
    dtype: str
    hbm_bytes: tuple[int, ...]
    attn_lengths: tuple[int, ...]
    attn_tokens: int  # batch × length per call
    attn_heads: int
    head_dim: int
    host_bytes: int
    collective_bytes: tuple[int, ...]
    layer_seq: int
    repeats: int
    target_s: float  # each timed batch lasts about this long
    attn_shapes: tuple[tuple[int, int], ...] = ()  # further (heads, head_dim) timed at attn_shape_seq
    attn_shape_seq: int = 0
    norm_tokens: int = 0  # rows of the norm/elementwise kernels (0: not run)
    # GEMMs and copies per timed program (each on its own operands): one short kernel per program is timed at the
    # host's dispatch rate, not the device's (seen on an H200 with JAX 0.11: ~46 us per program, more than a
    # 2048^3 bf16 GEMM takes; benchmarks/results/gpu_h200_2026-12-04.json)
    ops_per_program: int = 1
    # a GEMM program needs no more copies than make it last this long at the chip's peak (0: always ops_per_program):
    # ten times the ~46 us dispatch floor. Each copy costs compile time: on the H200 (session 15, setup_s in
    # benchmarks/results/profile_h200_2026-12-04_s15.json) the 16-copy programs of 4096^3, 2048^3 and 1024^3 took
    # 31-37 s each to compile and autotune, the 5-copy 8192^3 one 5 s
    program_min_s: float = 0.0
    program_bytes: int = 2 * 1024 * MiB  # cap on one program's operands and results
    batch_bytes: int = 1024 * MiB  # cap on the inputs of one timed batch of programs (timing.auto_inner)
    norm_width: int = 0  # D of the norm and residual; the SwiGLU product runs at 3.5·D (LLaMA 3's F/D)
    # fp32 buffer sizes of the dependent copy chain (bench_overhead): time per copy against bytes gives the fixed
    # cost of one memory-bound kernel (the intercept), what the cost model adds per kernel (kernel_overhead_s).
    # On GPUs every size is past the largest L2 (B200: 126 MB with in- and output; the H200's 256 KiB-16 MiB chain of
    # session 15 ran from its 50 MB L2 at 8.7 TB/s, fit.fit_efficiency)
    chain_copy_bytes: tuple[int, ...] = ()
    # D of the dependent GEMV chain (bench_overhead: one row against GEMV_CHAIN distinct D×D weights, as a decode
    # step reads its layers' matrices): time per GEMV against the weight's bytes gives a decode kernel's fixed cost
    # (the intercept) and the rate it reads weights at. 16 distinct weights of at least 8 MiB (bf16 2048²) pass
    # 128 MiB through the H100's and H200's 50 MB L2 each run, so the reads come from HBM
    chain_gemv_dims: tuple[int, ...] = ()


GPU_QUICK = Grid((512, 1024, 2048, 4096, 8192), (64, 128, 256, 512, 1024, 2048), 8192, (2048, 4096, 8192),
                 "bfloat16", (256 * MiB, 1024 * MiB), (1024, 2048, 4096, 8192), 16384, 16, 128, 256 * MiB,
                 (1 * MiB, 16 * MiB, 256 * MiB), 4096, 5, 0.01)
GPU_FULL = replace(GPU_QUICK, matmul_square=(256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384),
                   matmul_thin=(16, 32, 64, 128, 256, 512, 1024, 2048, 4096), fp8_square=(1024, 2048, 4096, 8192, 16384),
                   hbm_bytes=(64 * MiB, 256 * MiB, 1024 * MiB, 4096 * MiB), attn_lengths=(512, 1024, 2048, 4096, 8192, 16384),
                   host_bytes=1024 * MiB, collective_bytes=(64 * 1024, MiB, 16 * MiB, 256 * MiB, 1024 * MiB),
                   repeats=15, target_s=0.05)
GPU_QUICK = replace(GPU_QUICK, norm_tokens=16384, norm_width=4096, ops_per_program=16, program_min_s=5e-4,
                    batch_bytes=8 * 1024 * MiB, chain_copy_bytes=(64 * MiB, 128 * MiB, 256 * MiB),
                    chain_gemv_dims=(2048, 4096, 8192))
GPU_FULL = replace(GPU_FULL, attn_shapes=((32, 64), (8, 256)), attn_shape_seq=4096, norm_tokens=16384,
                   norm_width=8192, ops_per_program=16, program_min_s=5e-4, batch_bytes=8 * 1024 * MiB,
                   chain_copy_bytes=(64 * MiB, 128 * MiB, 256 * MiB, 512 * MiB),
                   chain_gemv_dims=(2048, 3072, 4096, 6144, 8192))
# The CPU grid reaches 512 so that at least two GEMM sizes stay above fit.DISPATCH_BOUND_FACTOR × the program
# time on a loaded runner (a CI run with 64-256 only kept one size and fell back to the defaults).
CPU_QUICK = Grid((32, 64, 128, 256, 512), (8, 32, 128), 256, (), "float32", (4 * MiB, 16 * MiB), (64, 128), 256,
                 4, 32, 8 * MiB, (64 * 1024, 1 * MiB), 64, 3, 0.002, norm_tokens=256, norm_width=256,
                 ops_per_program=2, chain_copy_bytes=(MiB // 4, MiB, 4 * MiB), chain_gemv_dims=(128, 256, 512))
CPU_FULL = replace(CPU_QUICK, matmul_square=(32, 64, 128, 256, 512, 1024), matmul_thin=(8, 16, 32, 64, 128),
                   matmul_big=512, hbm_bytes=(16 * MiB, 64 * MiB), attn_lengths=(128, 256, 512, 1024), attn_tokens=1024,
                   repeats=7, target_s=0.02, attn_shapes=((8, 16),), attn_shape_seq=256, norm_width=512)


def grid_for(platform: str, quick: bool) -> Grid:
    if platform == "cpu":
        return CPU_QUICK if quick else CPU_FULL
    return GPU_QUICK if quick else GPU_FULL


@dataclass(frozen=True)
class Context:
    """Everything a benchmark needs: the chip it is compared with, the grid, the layer's model."""

    chip: Chip
    grid: Grid
    platform: str
    model: ModelConfig
    deadline_s: float | None = None  # time.monotonic() past which no further measurement starts (--time-limit)

    def out_of_time(self) -> bool:
        return self.deadline_s is not None and time.monotonic() >= self.deadline_s


TIME_LIMIT = "stopped at calibrate's time limit"


def _record(bench: str, name: str, t: Timing, peak: float, work: float, unit: str, **extra: Any) -> Record:
    """One measurement: `work` FLOPs or bytes in `t.median_s`, achieved rate and its fraction of `peak`."""
    achieved = work / t.median_s
    return {"benchmark": bench, "name": name, "time_s": t.median_s, "work": work, "unit": unit,
            "achieved_per_s": achieved, "peak_per_s": peak, "fraction": achieved / peak if peak else None,
            "timing": t.as_dict(), **extra}


def _timed(fn: Callable, specs: list[tuple[tuple[int, ...], Any]], grid: Grid, sharding: Any = None,
           inner: int | None = None) -> Timing:
    """Median seconds per call. `inner` None: chosen from a trial run (which is also the warm-up); give it
    when several processes must issue the same number of collectives."""
    def make(seed: int) -> tuple:
        return random_inputs(seed, specs, sharding)

    if inner is not None:
        return time_fn(fn, make, warmup=2, repeats=grid.repeats, inner=inner)
    nbytes = sum(int(np.prod(s)) * jnp.dtype(d).itemsize for s, d in specs)
    t0 = time.monotonic()
    inner = auto_inner(fn, make, grid.target_s, nbytes, grid.batch_bytes)  # compiles and runs twice: the warm-up
    setup_s = time.monotonic() - t0  # compilation (with XLA's GEMM autotuning) and the trial: where a run's time goes
    return replace(time_fn(fn, make, warmup=0, repeats=grid.repeats, inner=inner), setup_s=setup_s,
                   wall_s=time.monotonic() - t0)


# --- matmul ----------------------------------------------------------------------------------------

def _many(op: Callable, arity: int, n: int) -> Callable:
    """One program of `n` independent copies of `op`, each on its own `arity` operands (so no copy reuses another's
    operands from cache and XLA merges none of them)."""
    def f(*args):
        return tuple(op(*args[i * arity:(i + 1) * arity]) for i in range(n))

    return jax.jit(f)


def _timed_many(op: Callable, specs: list[tuple[tuple[int, ...], Any]], out_bytes: float,
                grid: Grid, ideal_s: float = 0.0) -> tuple[Timing, int]:
    """(seconds per `op`, copies per program): `op` timed as Grid.ops_per_program copies in one program (fewer where
    the operands would pass Grid.program_bytes, or where `ideal_s`, the op's time at the chip's peak, already makes
    the program last Grid.program_min_s), divided by the copies: the program's dispatch is paid once."""
    op_bytes = sum(int(np.prod(s)) * jnp.dtype(d).itemsize for s, d in specs) + out_bytes
    n = int(max(1, min(grid.ops_per_program, grid.program_bytes // max(op_bytes, 1))))
    if grid.program_min_s > 0 and ideal_s > 0:
        n = max(1, min(n, math.ceil(grid.program_min_s / ideal_s)))
    t = _timed(_many(op, len(specs), n), specs * n, grid)
    return replace(t, median_s=t.median_s / n, min_s=t.min_s / n, max_s=t.max_s / n), n


def matmul_shapes(grid: Grid) -> list[tuple[int, int, int]]:
    """(m, n, k): the squares and the thin m against a big square weight, together, the most FLOPs first (a square
    before a thin shape of the same FLOPs): under a time limit the points cut are the small ones, the likeliest to
    be bound by the host's dispatch (fit.DISPATCH_BOUND_FACTOR), and both kinds keep points (the H200's quick grid
    of session 15, squares first, lost every thin shape)."""
    shapes = ([(d, d, d) for d in grid.matmul_square]
              + [(m, grid.matmul_big, grid.matmul_big) for m in grid.matmul_thin])
    return sorted(shapes, key=lambda s: (-s[0] * s[1] * s[2], s[1] != s[0]))


def _stopped(bench: str, what: list[str]) -> list[Record]:
    """The measurements a time limit left out, named, so that the profile says what it lacks."""
    return [{"benchmark": bench, "name": name, "skipped": TIME_LIMIT} for name in what]


def bench_matmul(ctx: Context) -> list[Record]:
    out = []
    dt = jnp.dtype(ctx.grid.dtype)
    shapes = matmul_shapes(ctx.grid)
    for i, (m, n, k) in enumerate(shapes):
        if ctx.out_of_time():
            return out + _stopped("matmul", [f"{a}x{b}x{c}" for a, b, c in shapes[i:]]) + bench_fp8(ctx)
        op = partial(jnp.dot, preferred_element_type=dt)
        t, ops = _timed_many(op, [((m, k), dt), ((k, n), dt)], m * n * dt.itemsize, ctx.grid,
                             2.0 * m * n * k / ctx.chip.peak("bf16"))
        out.append(_record("matmul", f"{m}x{n}x{k}", t, ctx.chip.peak("bf16"), 2.0 * m * n * k, "FLOP",
                           dtype=str(dt), m=m, n=n, k=k, ops_per_program=ops))
    return out + bench_fp8(ctx)


def bench_fp8(ctx: Context) -> list[Record]:
    """fp8 (e4m3) GEMMs with bf16 output, where the chip has an fp8 unit and XLA runs it."""
    if ctx.platform != "gpu" or "fp8" not in ctx.chip.peak_flops_per_s or not ctx.grid.fp8_square:
        return []
    f8 = jnp.float8_e4m3fn
    out = []
    sizes = sorted(ctx.grid.fp8_square, reverse=True)  # the largest first: the fit reads the largest (fit.py)
    for i, d in enumerate(sizes):
        if ctx.out_of_time():
            return out + _stopped("matmul", [f"fp8 {x}x{x}x{x}" for x in sizes[i:]])
        try:
            op = partial(jnp.dot, preferred_element_type=jnp.bfloat16)
            t, ops = _timed_many(op, [((d, d), f8), ((d, d), f8)], d * d * 2, ctx.grid,
                                 2.0 * d**3 / ctx.chip.peak("fp8"))
        except Exception as exc:  # noqa: BLE001 - an XLA build without fp8 GEMMs: record and go on
            return out + [{"benchmark": "matmul", "name": f"fp8 {d}", "skipped": str(exc).splitlines()[0]}]
        out.append(_record("matmul", f"fp8 {d}x{d}x{d}", t, ctx.chip.peak("fp8"), 2.0 * d**3, "FLOP",
                           dtype="float8_e4m3fn", m=d, n=d, k=d, ops_per_program=ops))
    return out


# --- memory, host, overhead ------------------------------------------------------------------------

def bench_hbm(ctx: Context) -> list[Record]:
    """y = 1.5·x + 0.5 over a large fp32 array: reads and writes every byte once."""
    out = []
    for i, nbytes in enumerate(ctx.grid.hbm_bytes):
        if ctx.out_of_time():
            return out + _stopped("hbm", [f"copy {x // MiB} MiB" for x in ctx.grid.hbm_bytes[i:]])
        t, ops = _timed_many(lambda x: x * 1.5 + 0.5, [((nbytes // 4,), jnp.float32)], nbytes, ctx.grid)
        out.append(_record("hbm", f"copy {nbytes // MiB} MiB", t, ctx.chip.hbm_bandwidth_bytes_per_s,
                           2.0 * nbytes, "B", bytes=nbytes, ops_per_program=ops))
    return out


def bench_host(ctx: Context) -> list[Record]:
    """Host→device with jax.device_put, device→host with jax.device_get, fresh host data each repeat."""
    n = ctx.grid.host_bytes // 4
    dev = jax.local_devices()[0]
    peak = ctx.chip.host_bandwidth_bytes_per_s

    def host_data(seed: int) -> np.ndarray:
        return np.random.default_rng(seed).random(n, dtype=np.float32) + 0.5  # fast; never zeros

    def dev_data(seed: int) -> jax.Array:
        return random_inputs(seed, [((n,), jnp.float32)])[0]

    h2d = time_host(host_data, lambda x: jax.device_put(x, dev).block_until_ready(), repeats=ctx.grid.repeats)
    d2h = time_host(dev_data, lambda x: np.asarray(jax.device_get(x)), repeats=ctx.grid.repeats)
    note = "the CPU backend may alias host buffers: not a transfer" if ctx.platform == "cpu" else ""
    return [_record("host", f"host->device {ctx.grid.host_bytes // MiB} MiB", h2d, peak, 4.0 * n, "B", note=note),
            _record("host", f"device->host {ctx.grid.host_bytes // MiB} MiB", d2h, peak, 4.0 * n, "B", note=note)]


def _chain(n: int) -> Callable:
    def f(x, w):
        for _ in range(n):
            x = jnp.tanh(x @ w)
        return x

    return jax.jit(f)


CHAIN_LENGTH = 32  # dependent copies per program in _copy_chain
GEMV_CHAIN = 16  # dependent GEMVs per program in _gemv_chain, each on its own weights (one random array each)


def _chain_records(ctx: Context, chain: Callable, what: str, key: str, length: int,
                   points: list[tuple[str, list[tuple[tuple[int, ...], Any]], float]]) -> list[Record]:
    """One record per (name, input specs, bytes per kernel) point of a dependent chain of `length` kernels in one
    program: seconds per kernel (the program's time over its kernels, its dispatch paid once) against the bytes
    one kernel moves, marked `key` for fit.fit_kernel_chain; the points a time limit leaves out, named."""
    out: list[Record] = []
    for i, (name, specs, nbytes) in enumerate(points):
        if ctx.out_of_time():
            return out + _stopped("overhead", [f"{what} {p[0]}" for p in points[i:]])
        t = _timed(chain, specs, ctx.grid)
        out.append({"benchmark": "overhead", "name": f"{what} {name}", "time_s": t.median_s / length,
                    "bytes": float(nbytes), key: length, "timing": t.as_dict()})
    return out


def _copy_chain(ctx: Context) -> list[Record]:
    """y = 1.5·x + 0.5, CHAIN_LENGTH times in a row in one program, each step its own kernel (an optimization
    barrier between steps keeps XLA from fusing them into one), at each of Grid.chain_copy_bytes: seconds per copy
    against the bytes it moves (read and write). fit.py fits t = t0 + bytes / rate (Hockney's latency-bandwidth
    model, Parallel Computing 20(3), 1994): t0 is one memory-bound kernel's fixed cost (launch, ramp-up and tail),
    which the cost model adds per kernel."""
    @jax.jit
    def chain(x):
        for _ in range(CHAIN_LENGTH):
            x = jax.lax.optimization_barrier(x * 1.5 + 0.5)
        return x

    points = [(_fmt_size(b), [((b // 4,), jnp.float32)], 2.0 * b) for b in ctx.grid.chain_copy_bytes]
    return _chain_records(ctx, chain, "copy chain", "chain", CHAIN_LENGTH, points)


def _gemv_chain(ctx: Context) -> list[Record]:
    """y = y·W_i for GEMV_CHAIN distinct D×D weights in a row, one row of activations (a decode step's GEMVs, each
    its own kernel and each on weights no earlier one read), at each D of Grid.chain_gemv_dims: seconds per GEMV
    against the weight's bytes. fit.py fits t = t0 + bytes / rate (Hockney 1994): t0 is the fixed cost of a
    memory-bound kernel as decode runs them (launch, ramp-up, tail), the cost model's kernel_overhead_s."""
    dt = jnp.dtype(ctx.grid.dtype)

    @jax.jit
    def chain(y, *ws):
        for w in ws:
            y = jnp.dot(y, w, preferred_element_type=dt)
        return y

    points = [(f"{d}x{d}", [((1, d), dt)] + [((d, d), dt)] * GEMV_CHAIN, d * d * dt.itemsize)
              for d in ctx.grid.chain_gemv_dims]
    return _chain_records(ctx, chain, "gemv chain", "gemv_chain", GEMV_CHAIN, points)


def bench_overhead(ctx: Context) -> list[Record]:
    """Kernels per program 1 and 65 (each a dependent 32×32 matmul + tanh): the slope is one kernel's cost."""
    specs = [((32, 32), jnp.float32), ((32, 32), jnp.float32)]
    t1, t65 = (_timed(_chain(n), specs, ctx.grid) for n in (1, 65))
    per_kernel = max((t65.median_s - t1.median_s) / 64, 0.0)
    out = [{"benchmark": "overhead", "name": "program of 1 tiny kernel", "time_s": t1.median_s,
            "timing": t1.as_dict()},
           {"benchmark": "overhead", "name": "program of 65 tiny kernels", "time_s": t65.median_s,
            "timing": t65.as_dict(), "per_kernel_s": per_kernel}]
    out += _gemv_chain(ctx) + _copy_chain(ctx)
    n = ctx.grid.ops_per_program
    # the GEMM benchmark's program with no work to speak of: its own dispatch floor (fit.device_bound). GPUs only: on
    # the CPU the host is the device (there is no dispatch to hide), and a loaded CI runner timed this 2-GEMM program
    # at 2.3 ms (median), which left the CPU fit no GEMM at all
    if n > 1 and ctx.platform == "gpu":
        t = _timed(_many(jnp.dot, 2, n), specs * n, ctx.grid)
        out.append({"benchmark": "overhead", "name": f"program of {n} tiny matmuls", "time_s": t.median_s,
                    "timing": t.as_dict(), "ops_per_program": n})
    return out


# --- attention -------------------------------------------------------------------------------------

def attention_impl(platform: str, dtype: Any) -> str:
    """cuDNN flash attention on NVIDIA GPUs when it compiles, else XLA's."""
    if platform != "gpu":
        return "xla"
    try:
        q = jnp.ones((1, 128, 2, 64), dtype)
        jax.jit(lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True, implementation="cudnn"))(q)
        return "cudnn"
    except Exception:  # noqa: BLE001 - no cuDNN attention in this build or for this GPU
        return "xla"


def _attention_fns(impl: str) -> tuple[Callable, Callable]:
    def fwd(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)

    def fwd_bwd(q, k, v, do):
        _, vjp = jax.vjp(fwd, q, k, v)
        return vjp(do)

    return jax.jit(fwd), jax.jit(fwd_bwd)


def bench_attention(ctx: Context) -> list[Record]:
    g = ctx.grid
    impl = attention_impl(ctx.platform, jnp.dtype(g.dtype))
    fwd, fwd_bwd = _attention_fns(impl)
    peak = ctx.chip.peak("bf16")
    out = []
    for i, T in enumerate(g.attn_lengths):
        if ctx.out_of_time():
            return out + _stopped("attention", [f"fwd T={x}" for x in g.attn_lengths[i:]])
        out += _attention_pair(fwd, fwd_bwd, g, T, g.attn_heads, g.head_dim, impl, peak, "")
    for heads, head_dim in g.attn_shapes:  # other head shapes at one length; the fit reads only the above
        if ctx.out_of_time():
            break
        suffix = f" N={heads} H={head_dim}"
        try:
            out += _attention_pair(fwd, fwd_bwd, g, g.attn_shape_seq, heads, head_dim, impl, peak, suffix,
                                   sweep="head_shape")
        except Exception as exc:  # noqa: BLE001 - a head dim the kernel lacks (cuDNN and 256): keep the rest
            out.append({"benchmark": "attention", "name": f"T={g.attn_shape_seq}{suffix}", "sweep": "head_shape",
                        "skipped": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"})
    return out


def attention_shape(g: Grid, T: int, heads: int, head_dim: int) -> tuple[tuple[int, int, int, int], float]:
    """[B, T, N, H] holding about attn_tokens·attn_heads·head_dim elements per tensor, and its causal forward
    FLOPs: QKᵀ and AV, 4·B·T·(T/2)·N·H (FlashAttention-2 paper §4.1, causal halves the pairs)."""
    B = max(1, g.attn_tokens * g.attn_heads * g.head_dim // (T * heads * head_dim))
    return (B, T, heads, head_dim), 4.0 * B * T * (T / 2.0) * heads * head_dim


def _attention_pair(fwd: Callable, fwd_bwd: Callable, g: Grid, T: int, heads: int, head_dim: int, impl: str,
                    peak: float, suffix: str, **tags: Any) -> list[Record]:
    dt = jnp.dtype(g.dtype)
    shape, flops = attention_shape(g, T, heads, head_dim)
    tf = _timed(fwd, [(shape, dt)] * 3, g)
    tfb = _timed(fwd_bwd, [(shape, dt)] * 4, g)
    extra = {"impl": impl, "dtype": str(dt), "batch": shape[0], "seq": T, "heads": heads, "head_dim": head_dim,
             **tags}
    return [_record("attention", f"fwd T={T}{suffix}", tf, peak, flops, "FLOP", **extra),
            _record("attention", f"fwd+bwd T={T}{suffix}", tfb, peak, flops, "FLOP", **extra,
                    bwd_time_s=max(tfb.median_s - tf.median_s, 1e-9))]


def bench_sdpa(ctx: Context) -> list[Record]:
    """PyTorch's scaled_dot_product_attention (torchtitan's kernel) at the attention lengths, on a GPU, timed in
    a separate process (measure/torch_timing.py) so PyTorch's CUDA libraries stay out of JAX's process."""
    if ctx.platform != "gpu":
        return [{"benchmark": "sdpa", "name": "sdpa", "skipped": "PyTorch SDPA is timed on GPUs only"}]
    from meshplan.measure import torch_timing

    if not torch_timing.available():
        return [{"benchmark": "sdpa", "name": "sdpa", "skipped": "torch is not installed"}]
    g, peak = ctx.grid, ctx.chip.peak("bf16")
    shapes = [attention_shape(g, T, g.attn_heads, g.head_dim) for T in g.attn_lengths]
    timings = torch_timing.sdpa_in_subprocess([s for s, _ in shapes], g.repeats)
    out = []
    for T, (shape, flops), (t_f, t_fb, backend) in zip(g.attn_lengths, shapes, timings, strict=True):
        extra = {"impl": f"torch sdpa ({backend})", "dtype": "bfloat16", "batch": shape[0], "seq": T,
                 "heads": g.attn_heads, "head_dim": g.head_dim}
        out.append(_record("sdpa", f"fwd T={T}", t_f, peak, flops, "FLOP", **extra))
        out.append(_record("sdpa", f"fwd+bwd T={T}", t_fb, peak, flops, "FLOP", **extra,
                           bwd_time_s=max(t_fb.median_s - t_f.median_s, 1e-9)))
    return out


# --- memory-bound layer kernels --------------------------------------------------------------------

def bench_norm(ctx: Context) -> list[Record]:
    """RMSNorm (read x, write y), SwiGLU's silu(g)·u (read 2, write 1) and the residual add (read 2, write 1)
    over [tokens, width] in the grid's dtype: bytes moved over time, against the HBM peak."""
    from meshplan.measure import jaxmodel as jm

    g = ctx.grid
    if not g.norm_tokens:
        return []
    dt = jnp.dtype(g.dtype)
    T, D = g.norm_tokens, g.norm_width
    F = int(3.5 * D)
    item = dt.itemsize
    cases = {"rmsnorm": (jax.jit(jm.rmsnorm), [((T, D), dt), ((D,), dt)], 2.0 * T * D * item),
             "silu(g)*u": (jax.jit(lambda a, b: jax.nn.silu(a) * b), [((T, F), dt)] * 2, 3.0 * T * F * item),
             "residual add": (jax.jit(jnp.add), [((T, D), dt)] * 2, 3.0 * T * D * item)}
    out = []
    for name, (fn, specs, nbytes) in cases.items():
        t = _timed(fn, specs, g)
        out.append(_record("norm", f"{name} {T}x{specs[0][0][1]}", t, ctx.chip.hbm_bandwidth_bytes_per_s, nbytes,
                           "B", dtype=str(dt), bytes=nbytes))
    return out


# --- one decoder layer of the reference model ------------------------------------------------------

def layer_model(ctx: Context) -> ModelConfig:
    """The model whose layer is timed; on the CPU a narrow copy, so CI stays fast."""
    m = ctx.model.with_overrides(n_layers=1)
    if ctx.platform == "cpu":
        m = m.with_overrides(name=f"{m.name} (narrowed for CPU)", d_model=256, n_heads=4, n_kv_heads=2,
                             head_dim=64, d_ff=768, n_experts=0, experts_per_token=0)
    return m


def _layer_fns(model: ModelConfig, seq: int, attention: str) -> tuple[Callable, Callable, Any]:
    from meshplan.measure import jaxmodel as jm
    from meshplan.measure.layout import Layout

    layout = Layout()
    sh = jm.make_sharder(layout, model, jm.make_mesh(layout, jax.local_devices()[:1]))
    pos = jnp.arange(seq, dtype=jnp.int32)

    def fwd(lp, x):
        return jm.decoder_layer(lp, x, pos, model, sh, "none", attention)

    def fwd_bwd(lp, x, dy):
        _, vjp = jax.vjp(fwd, lp, x)
        return vjp(dy)

    shapes = jm.param_shapes(model)["layers"][0]
    return jax.jit(fwd), jax.jit(fwd_bwd), shapes


def bench_layer(ctx: Context) -> list[Record]:
    m, g = layer_model(ctx), ctx.grid
    dt = jnp.dtype(g.dtype)
    # the attention kernel the attention benchmark found (cuDNN flash on NVIDIA GPUs), else the score matrix
    attention = "cudnn" if attention_impl(ctx.platform, dt) == "cudnn" else "materialized"
    fwd, fwd_bwd, shapes = _layer_fns(m, g.layer_seq, attention)
    names = list(shapes)
    x_shape = (1, g.layer_seq, m.d_model)

    def make(seed: int, cot: bool) -> tuple:
        specs = [(shapes[n], dt) for n in names] + [(x_shape, dt)] * (2 if cot else 1)
        arrs = random_inputs(seed, specs)
        lp = {n: a * (0.02 if len(a.shape) > 1 else 1.0) for n, a in zip(names, arrs, strict=False)}
        return (lp, *arrs[len(names):])

    flops = g.layer_seq * (2.0 * (tm.matmul_params_active(m) - m.d_model * m.vocab_size)
                           + tm.attention_flops_per_token(m, g.layer_seq))
    tf = time_fn(fwd, lambda s: make(s, False), warmup=1, repeats=g.repeats)
    tfb = time_fn(fwd_bwd, lambda s: make(s, True), warmup=1, repeats=g.repeats)
    extra = {"model": m.name, "seq": g.layer_seq, "batch": 1, "dtype": str(dt), "attention": attention}
    peak = ctx.chip.peak("bf16")
    return [_record("layer", f"{m.name} fwd", tf, peak, flops, "FLOP", **extra),
            _record("layer", f"{m.name} fwd+bwd", tfb, peak, 3 * flops, "FLOP", **extra)]


# --- collectives across every device (all processes) -----------------------------------------------

def bench_collectives(ctx: Context) -> list[Record]:
    """psum and all_gather over a 1-D mesh of all devices. Sizes are per-device buffers (all-reduce) and the
    full gathered array (all-gather, DESIGN.md's X). busbw follows NCCL: 2(n−1)/n·X/t and (n−1)/n·X/t."""
    n = jax.device_count()
    if n < 2:
        return []
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    kinds = {"all-reduce": (lambda a: jax.lax.psum(a, "x"), 2.0 * (n - 1) / n, 1),
             "all-gather": (lambda a: jax.lax.all_gather(a, "x", tiled=True), (n - 1) / n, n)}
    out = []
    for kind, (body, bus, split) in kinds.items():
        # out_specs P("x"): each device keeps its own result (no replication check needed)
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        for nbytes in ctx.grid.collective_bytes:
            local = max(nbytes // 4 // split, 1)  # elements each device contributes
            inner = int(min(16, max(1, 16 * MiB // nbytes)))  # the same on every process: no timing decides it
            t = _timed(fn, [((n * local,), jnp.float32)], ctx.grid, sharding, inner)
            x = 4.0 * local * split  # DESIGN.md's X: the reduced buffer, or the full gathered array
            out.append(_record("collectives", f"{kind} {_fmt_size(x)} over {n}", t, 0.0, x, "B", collective=kind,
                               devices=n, processes=jax.process_count(), bytes=x,
                               bus_bytes_per_s=bus * x / t.median_s))
    return out


def _fmt_size(nbytes: float) -> str:
    return f"{nbytes / MiB:.0f} MiB" if nbytes >= MiB else f"{nbytes / 1024:.0f} KiB"


BENCH_FNS: dict[str, Callable[[Context], list[Record]]] = {
    "matmul": bench_matmul, "hbm": bench_hbm, "attention": bench_attention, "sdpa": bench_sdpa, "norm": bench_norm,
    "host": bench_host,
    "overhead": bench_overhead, "layer": bench_layer, "collectives": bench_collectives}


def make_context(chip: Chip, platform: str, quick: bool, model: str | None,
                 time_limit_s: float | None = None) -> Context:
    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
    return Context(chip, grid_for(platform, quick), platform, load_model(model or "llama3.2-1b"), deadline)


def run_benchmarks(ctx: Context, names: list[str], on_done: Callable[[str, int], None] | None = None) -> list[Record]:
    """Run the named benchmarks in order. One that fails (an OOM, a missing kernel) is recorded as skipped
    with its reason, and the rest go on."""
    records: list[Record] = []
    for name in names:
        if ctx.out_of_time():
            recs = [{"benchmark": name, "name": name, "skipped": TIME_LIMIT}]
            records.extend(recs)
            if on_done:
                on_done(name, 0)
            continue
        try:
            recs = BENCH_FNS[name](ctx)
        except Exception as exc:  # noqa: BLE001 - keep the other measurements
            recs = [{"benchmark": name, "name": name, "skipped": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}]
        records.extend(recs)
        if on_done:
            on_done(name, len(recs))
    return records
