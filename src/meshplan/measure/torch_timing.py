"""Timing PyTorch CUDA work the way `measure.timing` times JAX work (METHOD.md: device events around the
region, warm-up first, the median of repeats, fresh random inputs for every repeat, never zeros).

Optional: torch is not a meshplan dependency; `available()` says whether torch is installed. `sdpa_in_subprocess`
times SDPA in a process of its own, so that PyTorch's CUDA libraries never share a process with JAX's
(`python -m meshplan.measure.torch_timing SHAPES_JSON REPEATS` prints the timings as JSON).
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from meshplan.measure.timing import Timing


def available() -> bool:
    return importlib.util.find_spec("torch") is not None


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
    kernel = _slowest_cuda_kernel(fwd, make(7, False))
    return t_f, t_fb, f"default backend: {backend_of_kernel(kernel)}, torch {torch.__version__}"


# SDPA backends by a fragment of their CUDA kernel's name (PyTorch's bundled FlashAttention-2 `pytorch_flash::
# flash_fwd_kernel`, cuDNN's `cudnn_generated_fort_native_sdpa_sm90_...`, the memory-efficient `fmha_cutlassF_...`;
# the names seen in pytorch/pytorch#142132 and meta-pytorch/tritonbench#41), first match wins
SDPA_KERNEL_BACKENDS = (("cudnn", "cudnn"), ("flash_fwd", "flash (FlashAttention-2)"),
                        ("fmha_cutlass", "efficient (memory-efficient, CUTLASS)"), ("flash", "flash"))


def backend_of_kernel(kernel: str | None) -> str:
    """The SDPA backend a forward kernel's name belongs to (SDPA_KERNEL_BACKENDS), or the name itself."""
    if not kernel:
        return "not identified"
    low = kernel.lower()
    return next((backend for frag, backend in SDPA_KERNEL_BACKENDS if frag in low), f"kernel {kernel[:80]}")


def _slowest_cuda_kernel(fn: Callable[..., Any], args: tuple) -> str | None:
    """Name of the CUDA kernel with the most device time in one call of `fn` (torch.profiler); None if the profiler
    gives nothing (the backend then stays unnamed, the timing stands)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(*args)
            torch.cuda.synchronize()
        stats = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0]
        return max(stats, key=lambda e: e.device_time_total).key if stats else None
    except Exception:  # noqa: BLE001 - naming the backend is a report, never a failure
        return None


def sdpa_in_subprocess(shapes: list[tuple[int, int, int, int]], repeats: int,
                       timeout_s: float = 600.0) -> list[tuple[Timing, Timing, str]]:
    """`time_sdpa` for each shape, in a fresh Python process (raises RuntimeError with its last error line)."""
    proc = subprocess.run([sys.executable, "-m", "meshplan.measure.torch_timing", json.dumps(shapes), str(repeats)],
                          capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode:
        lines = proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"]
        raise RuntimeError(lines[-1])
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    return [(Timing(**f), Timing(**fb), backend) for f, fb, backend in rows]


def _main(argv: list[str]) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("torch sees no CUDA device")
    shapes, repeats = json.loads(argv[0]), int(argv[1])
    out = []
    for shape in shapes:
        f, fb, backend = time_sdpa(tuple(shape), repeats)
        out.append([f.as_dict(), fb.as_dict(), backend])
    print(json.dumps(out))


if __name__ == "__main__":
    _main(sys.argv[1:])
