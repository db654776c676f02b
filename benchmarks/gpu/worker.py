"""One measurement process of the GPU suite: `python worker.py KIND CASES_JSON OUT_JSON`.

KIND: train_jax (one case), train_torch (one case), serve (prefill, decode and mixed cases of one model, weights
loaded once). Every case runs in a fresh process so the allocator's peak belongs to it alone and an OOM or a
crash loses one case. After each case the results so far are rewritten to OUT_JSON, so a process killed at its
time limit still returns what it finished. Device memory used is read with NVML where it is installed, before
the framework starts and after the case (the framework's whole footprint: context, allocator pool).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from predict import case_model, decode_capacity, decode_context  # noqa: E402

Case = dict[str, Any]


def nvml_used_bytes() -> float | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return float(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    except Exception:  # noqa: BLE001 - no NVML (CPU, or the package is missing): report None
        return None


def _dtype(name: str) -> Any:
    import jax.numpy as jnp

    return {"bf16": jnp.bfloat16, "fp32": jnp.float32}[name]


def device_info() -> dict[str, Any]:
    import jax

    from meshplan.measure.cluster import local_device_summary, versions

    return {**local_device_summary(), "versions": versions(), "backend": jax.default_backend()}


def memory_measured(peak_alloc: float, source: str, used_before: float | None) -> dict[str, Any]:
    """The compared figure is the framework's whole device footprint (NVML used after − before) where NVML
    answers, since the planner's total includes the framework reserve; else the allocator's peak."""
    used_after = nvml_used_bytes()
    out = {"allocator_peak_bytes": peak_alloc, "allocator_source": source, "nvml_used_before_bytes": used_before,
           "nvml_used_after_bytes": used_after}
    if used_before is not None and used_after is not None:
        out.update(memory_bytes=used_after - used_before, memory_source="NVML device memory used, after − before")
    else:
        out.update(memory_bytes=peak_alloc, memory_source=source)
    return out


# --- training: JAX ---------------------------------------------------------------------------------

def train_jax(case: Case, used_before: float | None, hlo_path: Path | None = None) -> dict[str, Any]:
    """`hlo_path`: where the compiled step's optimised HLO goes (gzipped), for reading offline what XLA ran."""
    import jax.numpy as jnp

    from meshplan.measure import steps as st

    m = case_model(case)
    layout = st.default_layout(1, 1, 1, 1, case["recompute"], case["batch"])
    compute = _dtype(case.get("compute_dtype", "bf16"))
    run = st.run_training(m, layout, case["seq_len"], case["batch"], case["steps"], param_dtype=jnp.float32,
                          attention=case["attention"], compute_dtype=compute, hlo_path=hlo_path,
                          profile_kernels=bool(case.get("profile_kernels", True)))
    hlo: dict[str, Any] = {}
    if hlo_path is not None and hlo_path.exists():
        import gzip

        from meshplan.measure.hlo import dot_flops

        # the GEMM FLOPs the GPU compiler kept (cuBLAS calls and Triton GEMM fusions, times their loops' trips)
        hlo = {"hlo_file": str(hlo_path), "hlo_matmul_flops": dot_flops(gzip.decompress(hlo_path.read_bytes()).decode())}
    return {"step_time_s": run.step_time_s, "step_times_s": run.step_times_s, "compile_s": run.compile_s,
            "losses": run.losses, "model_flops_per_step": run.model_flops_per_step, "xla_cost": run.xla_cost,
            "kernels": run.kernels, **hlo,
            **memory_measured(run.peak_memory_bytes, run.memory_source, used_before)}


# --- training: PyTorch -----------------------------------------------------------------------------

def train_torch(case: Case, used_before: float | None) -> dict[str, Any]:
    import torch
    import torch_model

    from meshplan.measure.torch_timing import time_cuda

    m = case_model(case)
    model, opt = torch_model.build(m, case["recompute"])
    B, T = case["batch"], case["seq_len"]

    def make(seed: int) -> tuple:
        g = torch.Generator(device="cuda").manual_seed(seed)
        toks = torch.randint(0, m.vocab_size, (B, T + 1), generator=g, device="cuda")
        return model, opt, toks[:, :-1], toks[:, 1:]

    t0 = time.perf_counter()
    torch_model.train_step(*make(0))  # compiles
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    t = time_cuda(torch_model.train_step, make, repeats=case["steps"], warmup=1)
    peak = float(torch.cuda.max_memory_allocated())
    return {"step_time_s": t.median_s, "step_time_min_s": t.min_s, "compile_s": compile_s,
            "torch": torch.__version__, "timing": t.as_dict(),
            **memory_measured(peak, "torch.cuda.max_memory_allocated", used_before)}


# --- serving ---------------------------------------------------------------------------------------

def _median_time(fn, args_for, n: int) -> tuple[float, list[float]]:
    import jax

    times = []
    for i in range(n):
        args = args_for(i)
        jax.block_until_ready(args)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def serve(cases: list[Case], write: Any) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import serve_jax as sj

    m = case_model(cases[0])
    dt = _dtype(cases[0].get("dtype", "bf16"))
    params = sj.init_weights(m, dt)
    jax.block_until_ready(params)
    dev = jax.local_devices()[0]
    rng = np.random.default_rng(0)

    def in_use() -> float:
        s = dev.memory_stats() or {}
        return float(s.get("bytes_in_use", float("nan")))

    for case in cases:
        t_case = time.perf_counter()  # each record's setup_s: inputs, compile and warm-up (where a case's time goes)
        try:
            if case["kind"] == "prefill":
                B, T = case["batch"], case["prompt_len"]
                fn = sj.make_prefill(m, case["attention"], T)

                def args_for(i, B=B, T=T):
                    return params, jnp.asarray(rng.integers(0, m.vocab_size, (B, T), dtype=np.int32))

                fn(*args_for(-1))  # compile and warm up
                setup_s = time.perf_counter() - t_case
                med, times = _median_time(fn, args_for, case["repeats"])
                write(case, {"step_time_s": med, "times_s": times, "setup_s": setup_s,
                             "wall_s": time.perf_counter() - t_case})
            else:  # decode, or mixed: decode steps that also carry a prompt chunk through the same GEMMs
                B, C, n = case["batch"], case["context"], case["steps"]
                mixed = case["kind"] == "mixed"
                before = in_use()
                cache = sj.random_cache(m, B, decode_capacity(case), dt, seed=1)
                jax.block_until_ready(cache)
                kv_bytes = float(sum(k.nbytes + v.nbytes for k, v in cache))
                kv_alloc = in_use() - before
                # n greedy steps in one program (serve_jax.make_decode_steps / make_mixed_steps)
                fn = sj.make_mixed_steps(m, case["attention"], n) if mixed else sj.make_decode_steps(m, n)
                tok0 = jnp.asarray(rng.integers(0, m.vocab_size, (B,), dtype=np.int32))
                extra = (jnp.asarray(rng.integers(0, m.vocab_size, (1, case["prompt_len"]), dtype=np.int32)),) \
                    if mixed else ()
                pos0 = jnp.int32(C)
                _, cache = fn(params, cache, tok0, pos0, *extra)  # compile and warm up
                jax.block_until_ready(cache)
                setup_s = time.perf_counter() - t_case
                times = []
                for _ in range(3):  # each call writes positions C .. C + n − 1 again: the same work every call
                    t0 = time.perf_counter()
                    _, cache = fn(params, cache, tok0, pos0, *extra)
                    jax.block_until_ready(cache)
                    times.append((time.perf_counter() - t0) / n)
                measured = {"step_time_s": statistics.median(times), "times_s": times,
                            "attended_context": decode_context(case), "setup_s": setup_s,
                            "wall_s": time.perf_counter() - t_case}
                if not mixed:
                    # compared: what the allocator holds for the cache (live bytes after − before); the arrays' own
                    # size where the backend keeps no statistics (the CPU)
                    measured.update(kv_cache_bytes=kv_alloc if kv_alloc == kv_alloc and kv_alloc > 0 else kv_bytes,
                                    kv_cache_array_bytes=kv_bytes, kv_cache_allocated_bytes=kv_alloc)
                write(case, measured)
                del cache
        except Exception as exc:  # noqa: BLE001 - one case failing (OOM) must not lose the others
            write(case, {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"})


def main(argv: list[str]) -> int:
    kind, cases_json, out_path = argv
    used_before = nvml_used_bytes()  # before any framework touches the device
    cases = json.loads(cases_json)
    cases = cases if isinstance(cases, list) else [cases]
    result: dict[str, Any] = {"kind": kind, "results": []}

    def write(case: Case, measured: dict[str, Any]) -> None:
        result["results"].append({"case": case, "measured": measured})
        Path(out_path).write_text(json.dumps(result, default=float))

    try:
        if kind != "train_torch":
            result["device"] = device_info()
        if kind == "serve":
            serve(cases, write)
        else:
            measured = (train_jax(cases[0], used_before, Path(out_path + ".hlo.txt.gz")) if kind == "train_jax"
                        else train_torch(cases[0], used_before))
            write(cases[0], measured)
    except Exception as exc:  # noqa: BLE001 - reported in the results, the suite goes on
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        Path(out_path).write_text(json.dumps(result, default=float))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
