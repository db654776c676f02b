"""meshplan's predictions for one case of the GPU suite, shared by the suite (when it writes a row) and by
tests/test_gpu_results.py (when it re-predicts a committed row with the current model). No JAX, no torch.

A case is a plain dict (it is stored in the results file):
  train   {"kind": "train", "framework": "jax"|"torch", "model", "overrides", "seq_len", "batch", "recompute",
           "attention": "cudnn"|"dpa"|"sdpa"|"materialized", "steps"}
  prefill {"kind": "prefill", "model", "overrides", "prompt_len", "batch"}
  decode  {"kind": "decode", "model", "overrides", "batch", "context", "steps"}
  mixed   {"kind": "mixed", "model", "overrides", "batch", "context", "prompt_len", "attention", "steps"}
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshplan.cost.efficiency import Efficiency, bare_loop
from meshplan.infer.config import ServeConfig
from meshplan.infer.memory import memory_per_chip
from meshplan.infer.step import decode_step, prefill_step, step_cost
from meshplan.specs.hardware import Chip
from meshplan.specs.model import ModelConfig, load_model
from meshplan.train.costmodel import Options
from meshplan.train.frameworks import framework_options

Case = dict[str, Any]


def case_model(case: Case) -> ModelConfig:
    """The preset with the case's overrides (a narrower shape, fewer layers); the name says what changed."""
    m = load_model(case["model"])
    over = dict(case.get("overrides") or {})
    return m.with_overrides(**over) if over else m


def train_options(case: Case) -> Options:
    """How the planner should model the run. JAX: XLA fuses pointwise chains and the loss; flash attention when
    the reference model runs jax.nn.dot_product_attention (cuDNN's fused kernel: the chip's best, "fused").
    PyTorch: torchtitan's behaviour (framework preset), SDPA attention, the loss eager on fp32 logits, but one fused
    QKV GEMM as the suite's own model has (torch_model.py `wqkv`; torchtitan's Llama has three, Options.separate_qkv)."""
    if case["framework"] == "torch":
        return replace(framework_options("torchtitan", Options(), {}), separate_qkv=False)
    flash = case["attention"] != "materialized"
    # remat_dce: XLA drops what the backward never reads from the rematerialised forward (the compiled HLO of the
    # full-recompute case, results/hlo_h200_2026-12-04_s15.tar: the backward loop body reruns QKV, attention,
    # out-projection and gate/up, not the down-projection), as for MaxText (train/frameworks.py)
    # weight_dtype_bytes: the program keeps fp32 weights and no other master copy, Adam's moments fp32 (worker.py
    # train_jax: param_dtype float32, bf16 compute), as MaxText's weight_dtype float32
    return Options(flash_attention=flash, attention_kernel="fused", fused_loss=True, xla_program=True,
                   remat_dce=True, weight_dtype_bytes=4.0)


def predict_train(case: Case, chip: Chip, eff: Efficiency) -> dict[str, float]:
    """Step time, MFU and peak memory of one training step on one chip (dp = 1, one micro-batch)."""
    from meshplan.train.planner import plan
    from meshplan.train.space import Pins, Problem

    m = case_model(case)
    problem = Problem(m, chip, 1, case["seq_len"], case["batch"])
    pins = Pins(dp=1, fsdp=1, tp=1, pp=1, vpp=1, cp=1, ep=1, microbatch=case["batch"], recompute=case["recompute"],
                zero=0, offload=0.0, offload_optimizer=0, offload_params=0,  # the measured step keeps all on the GPU
                sequence_parallel=False)
    opts = train_options(case)
    p = plan(problem, pins, bare_loop(eff), opts, top=1).plans[0]  # the suite's loops time bare steps
    total = p["memory_bytes_per_chip"]["total"]
    return {"step_time_s": p["step_time_s"], "mfu": p["mfu"], "memory_bytes": total,
            # what the framework's allocator should hold at its peak: the total less the runtime reserve (CUDA
            # context, communicator buffers, fragmentation), which no allocator statistic counts
            "memory_allocated_bytes": total - (eff.memory_reserved_bytes if opts.runtime_reserve else 0.0),
            "fits": bool(p["fits"]),
            # the ledger's GEMM FLOPs per step (recompute included), what the compiled program's GEMMs add up to
            # (measured side: hlo.dot_flops of the case's compiled HLO, worker.train_jax)
            "matmul_flops": p["ledger"]["flops"]["matmul"]}


def predict_prefill(case: Case, chip: Chip, eff: Efficiency) -> dict[str, float]:
    m = case_model(case)
    # one jitted call per prefill: the host dispatches a program, no serving engine iterates (engine_loop False)
    cost = prefill_step(m, chip, ServeConfig(), eff, case["batch"], case["prompt_len"], engine_loop=False)
    return {"step_time_s": cost.time_s, "bound": cost.bound}


def decode_context(case: Case) -> float:
    """Cached tokens a timed decode step attends: the context plus, on average, half the timed steps."""
    return case["context"] + case["steps"] / 2.0


def decode_capacity(case: Case) -> int:
    """Positions the decode cache holds: the context, the timed steps and the two warm-up steps."""
    return case["context"] + case["steps"] + 2


def reference_config(case: Case) -> ServeConfig:
    """The reference loop as a serving layout: its decode attention reads every position of the cache under a mask
    (serve_jax._attend_cache), a dense cache of decode_capacity positions (ServeConfig.dense_kv_cache)."""
    return ServeConfig(dense_kv_cache=decode_capacity(case))


def predict_decode(case: Case, chip: Chip, eff: Efficiency) -> dict[str, float]:
    m = case_model(case)
    # the reference loop runs its 16 greedy steps in one XLA program (serve_jax.make_decode_steps): no engine
    # iteration on the host between steps, so none of the serving engines' per-step host overhead
    cfg = reference_config(case)
    cost = decode_step(m, chip, cfg, eff, case["batch"], decode_context(case), engine_loop=False)
    mem = memory_per_chip(m, chip, cfg, eff, case["batch"], decode_capacity(case))
    return {"step_time_s": cost.time_s, "bound": cost.bound, "kv_cache_bytes": mem.kv_cache,
            "weight_bytes": mem.weights}


def predict_mixed(case: Case, chip: Chip, eff: Efficiency) -> dict[str, float]:
    """A step of `batch` decode tokens and one prompt chunk of `prompt_len` tokens (serve_jax.make_mixed_steps): the
    engine step the serving model sums (step.step_cost: one set of GEMMs over every row, the decodes' cache read,
    the chunk's causal attention at mean context prompt_len / 2), in one program (no engine loop)."""
    m = case_model(case)
    B, P = case["batch"], case["prompt_len"]
    cost = step_cost(m, chip, reference_config(case), eff, B, decode_context(case), P, P / 2.0, B + 1,
                     prefill_seqs=1, engine_loop=False)
    return {"step_time_s": cost.time_s, "bound": cost.bound,
            **{f"part_{k}_s": v for k, v in cost.parts.items() if v}}


PREDICTORS = {"train": predict_train, "prefill": predict_prefill, "decode": predict_decode, "mixed": predict_mixed}


def predict_case(case: Case, chip: Chip, eff: Efficiency) -> dict[str, Any]:
    return PREDICTORS[case["kind"]](case, chip, eff)


# measured key -> predicted key of the quantities a row compares (relative error = predicted / measured - 1)
# train memory, two ways: the allocator's peak (XLA's peak bytes in use, torch.cuda.max_memory_allocated) against
# the prediction less its runtime reserve, the program's own need; and NVML's device memory used (after − before)
# against the whole prediction, which for JAX without preallocation is the pool XLA's allocator grew to (64.6 GiB for
# a 35.6 GiB peak on the first H200 run), so it is reported, and the bound is checked on the allocator's peak
COMPARED = {"train": {"step_time_s": "step_time_s", "allocator_peak_bytes": "memory_allocated_bytes",
                      "memory_bytes": "memory_bytes", "hlo_matmul_flops": "matmul_flops"},
            "prefill": {"step_time_s": "step_time_s"},
            "decode": {"step_time_s": "step_time_s", "kv_cache_bytes": "kv_cache_bytes"},
            "mixed": {"step_time_s": "step_time_s"}}


def errors(kind: str, measured: dict[str, Any], predicted: dict[str, Any]) -> dict[str, float]:
    """predicted / measured − 1 for each compared quantity both sides have."""
    out = {}
    for mk, pk in COMPARED[kind].items():
        mv, pv = measured.get(mk), predicted.get(pk)
        if isinstance(mv, int | float) and isinstance(pv, int | float) and mv > 0:
            out[mk] = pv / mv - 1.0
    return out

