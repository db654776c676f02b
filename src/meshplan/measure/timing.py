"""Timing JAX work properly (asv style, STYLE.md §11): inputs built in an untimed setup, warm-up runs that
compile, `block_until_ready` on both sides of the timed region, the median of repeats, and fresh random
inputs for every repeat (never zeros: some kernels and links skip or compress zeros).

Short kernels are timed in batches of `inner` calls on *distinct* inputs, dispatched back to back and
synchronised once, so the host dispatch cost is amortised without letting the inputs sit in cache.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Inputs = tuple[Any, ...]


@dataclass(frozen=True)
class Timing:
    """Seconds per call: the median over `repeats` timed batches (each of `inner` calls)."""

    median_s: float
    min_s: float
    max_s: float
    repeats: int
    inner: int
    setup_s: float | None = None  # compilation and the trial call before the timed batches, where measured
    wall_s: float | None = None  # the whole measurement, setup included

    def as_dict(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {"median_s": self.median_s, "min_s": self.min_s, "max_s": self.max_s,
                                       "repeats": self.repeats, "inner": self.inner}
        out.update({k: v for k, v in (("setup_s", self.setup_s), ("wall_s", self.wall_s)) if v is not None})
        return out


Specs = tuple[tuple[tuple[int, ...], Any], ...]


def _normal(k: jax.Array, shape: tuple[int, ...], dt: Any) -> jax.Array:
    if jnp.issubdtype(dt, jnp.integer):
        return jax.random.randint(k, shape, -8, 8, dtype=dt)
    return jax.random.normal(k, shape, jnp.float32).astype(dt)


@functools.lru_cache(maxsize=128)
def _generator(specs: Specs, sharding: Any) -> Callable[[jax.Array], tuple[jax.Array, ...]]:
    """One compiled generator per list of (shape, dtype): every array of a call in one program."""

    def make(key: jax.Array) -> tuple[jax.Array, ...]:
        keys = jax.random.split(key, len(specs))
        return tuple(_normal(k, s, d) for k, (s, d) in zip(keys, specs, strict=True))

    return jax.jit(make, out_shardings=None if sharding is None else (sharding,) * len(specs))


def _host_normal(seed: int, specs: Specs) -> tuple[jax.Array, ...]:
    """On the CPU backend numpy is quicker than compiling a generator per shape."""
    rng = np.random.default_rng(seed)
    return tuple(jax.device_put(rng.standard_normal(s, dtype=np.float32).astype(d)) for s, d in specs)


def random_inputs(seed: int, specs: Sequence[tuple[Sequence[int], Any]], sharding: Any = None) -> Inputs:
    """Fresh standard-normal arrays (fp8 by casting, ints uniform in [-8, 8)) for (shape, dtype) specs,
    ready on device; never all zeros. `sharding` (one for all) places them across processes."""
    key_specs: Specs = tuple((tuple(int(d) for d in s), jnp.dtype(dt)) for s, dt in specs)
    floats = all(not jnp.issubdtype(d, jnp.integer) for _, d in key_specs)
    if sharding is None and floats and jax.default_backend() == "cpu":
        return jax.block_until_ready(_host_normal(seed, key_specs))
    return jax.block_until_ready(_generator(key_specs, sharding)(jax.random.key(seed)))


def _run_batch(fn: Callable[..., Any], batch: list[Inputs]) -> float:
    jax.block_until_ready(batch)
    t0 = time.perf_counter()
    outs = [fn(*args) for args in batch]
    jax.block_until_ready(outs)
    return time.perf_counter() - t0


def time_fn(fn: Callable[..., Any], make_inputs: Callable[[int], Inputs], *, warmup: int = 2,
            repeats: int = 5, inner: int = 1) -> Timing:
    """Time `fn(*make_inputs(seed))`: `warmup` untimed calls (compilation; 0 when the caller has run it
    already), then `repeats` batches of `inner` calls, each call on inputs from a seed not used before."""
    seed = 1000
    for _ in range(warmup):
        jax.block_until_ready(fn(*make_inputs(seed)))
        seed += 1
    per_call = []
    for _ in range(repeats):
        batch = [make_inputs(seed + j) for j in range(inner)]
        seed += inner
        per_call.append(_run_batch(fn, batch) / inner)
        del batch
    return Timing(statistics.median(per_call), min(per_call), max(per_call), repeats, inner)


def auto_inner(fn: Callable[..., Any], make_inputs: Callable[[int], Inputs], target_s: float,
               input_bytes: float, max_bytes: float = 2**30, cap: int = 64) -> int:
    """How many calls per timed batch make it last about `target_s`, within `max_bytes` of inputs."""
    args = make_inputs(7)
    jax.block_until_ready(fn(*args))  # compile
    once = _run_batch(fn, [args])
    by_time = int(np.ceil(target_s / max(once, 1e-7)))
    by_mem = int(max_bytes // max(input_bytes, 1))
    return int(max(1, min(cap, by_time, by_mem)))


def time_host(setup: Callable[[int], Any], fn: Callable[[Any], Any], repeats: int = 5,
              warmup: int = 1) -> Timing:
    """Time a blocking host-side operation `fn(setup(seed))` (a transfer); setup is not timed."""
    for i in range(warmup):
        fn(setup(i))
    per_call = []
    for i in range(repeats):
        obj = setup(100 + i)
        t0 = time.perf_counter()
        fn(obj)
        per_call.append(time.perf_counter() - t0)
        del obj
    return Timing(statistics.median(per_call), min(per_call), max(per_call), repeats, 1)
