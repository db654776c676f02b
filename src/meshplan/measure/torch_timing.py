"""Timing PyTorch CUDA work the way `measure.timing` times JAX work (METHOD.md: device events around the
region, warm-up first, the median of repeats, fresh random inputs for every repeat, never zeros).

Optional: torch is not a meshplan dependency; `available()` says whether torch with a CUDA device is importable.
"""

from __future__ import annotations

import importlib.util
import statistics
from collections.abc import Callable
from typing import Any

from meshplan.measure.timing import Timing


def available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def time_cuda(fn: Callable[..., Any], make_inputs: Callable[[int], tuple], repeats: int = 10,
              warmup: int = 2) -> Timing:
    """Median seconds of `fn(*make_inputs(seed))` between two CUDA events; inputs are made (untimed) for every
    repeat from a seed not used before."""
    import torch

    for i in range(warmup):
        fn(*make_inputs(i))
    torch.cuda.synchronize()
    times = []
    for i in range(repeats):
        args = make_inputs(100 + i)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
        del args
    return Timing(statistics.median(times), min(times), max(times), repeats, 1)


def time_sdpa(shape: tuple[int, int, int, int], repeats: int) -> tuple[Timing, Timing, str]:
    """Causal `scaled_dot_product_attention` in bf16 on [B, T, N, H] (as JAX lays it out; SDPA takes
    [B, N, T, H]): forward, and forward + backward. The backend is SDPA's own choice, as torchtitan runs it."""
    import torch
    import torch.nn.functional as F

    B, T, N, H = shape

    def make(seed: int, grad: bool) -> tuple:
        g = torch.Generator(device="cuda").manual_seed(seed)
        qkv = [torch.randn((B, N, T, H), generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_(grad)
               for _ in range(3)]
        return (*qkv, torch.randn((B, N, T, H), generator=g, device="cuda", dtype=torch.bfloat16))

    def fwd(q, k, v, do):
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd_bwd(q, k, v, do):
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)

    t_f = time_cuda(fwd, lambda s: make(s, False), repeats)
    t_fb = time_cuda(fwd_bwd, lambda s: make(s, True), repeats)
    return t_f, t_fb, f"default backend, torch {torch.__version__}"
