"""The cases the GPU suite runs, in priority order (the time budget skips from the end), and the toy cases of
`--cpu-smoke`. LLaMA-style models from ~0.5B to 8B: Llama 3.2 1B and 3B and Llama 3 8B as published, and a
0.5B of Qwen2.5-0.5B's shape (D 896, 24 layers, 14 heads, 2 KV heads, F 4864, vocab 151,936, tied; no QKV
bias, so LLaMA-style) built from the 1B preset. Where meshplan predicts that a case does not fit on the chip,
its model keeps only as many layers as fit, and the case's name says so.
"""

from __future__ import annotations

from typing import Any

from predict import Case, case_model, predict_decode, predict_train

from meshplan.cost.efficiency import default_efficiency
from meshplan.errors import InfeasibleError
from meshplan.specs.hardware import Chip

QWEN05_SHAPE = {"name": "llama-0.5b (Qwen2.5-0.5B shape)", "d_model": 896, "n_layers": 24, "n_heads": 14,
                "n_kv_heads": 2, "head_dim": 64, "d_ff": 4864, "vocab_size": 151936}
TINY = {"name": "tiny (smoke)", "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
        "d_ff": 128, "vocab_size": 256}
MODELS = {"0.5b": ("llama3.2-1b", QWEN05_SHAPE), "1b": ("llama3.2-1b", {}), "3b": ("llama3.2-3b", {}),
          "8b": ("llama3-8b", {}), "tiny": ("llama3.2-1b", TINY)}
FIT_FRACTION = 0.92  # a case is cut to the layers whose predicted peak stays under this share of usable HBM

# (model, seq_len, batch, recompute): 16k tokens per step for the small models, 8k for the cut 8B
GPU_TRAIN = [("1b", 4096, 4, "none"), ("1b", 4096, 4, "selective"), ("1b", 4096, 4, "full"),
             ("1b", 4096, 4, "gemm-last"), ("8b", 4096, 2, "full"), ("3b", 4096, 2, "selective"),
             ("0.5b", 4096, 4, "none"), ("1b", 2048, 8, "none"), ("1b", 8192, 2, "none"), ("8b", 8192, 1, "full"),
             ("3b", 8192, 1, "full"), ("0.5b", 2048, 8, "selective")]
GPU_TORCH = [("1b", 4096, 4, "none"), ("8b", 4096, 2, "full"), ("1b", 4096, 4, "selective")]
GPU_PREFILL = (512, 1024, 2048, 4096, 8192, 16384)
GPU_DECODE = [(1, 1024), (1, 32768), (16, 4096), (64, 1024), (64, 8192), (256, 1024), (256, 4096), (32, 32768)]
SERVE_MODELS = ("1b", "8b")
# (batch, context, prompt chunk): engine steps that carry decodes and a prompt chunk together (serve_jax
# make_mixed_steps), against the serving model's sum of the two (issue #14: TensorRT-LLM's online rows run slower than
# predicted as the running batch grows, benchmarks/README.md "Session 16"); after the decode cases of each model
GPU_MIXED = [(64, 1024, 512), (256, 1024, 512)]


def _base(key: str) -> tuple[str, dict[str, Any]]:
    preset, over = MODELS[key]
    return preset, dict(over)


def train_case(key: str, seq: int, batch: int, recompute: str, framework: str, attention: str, steps: int,
               compute_dtype: str = "bf16") -> Case:
    preset, over = _base(key)
    return {"kind": "train", "framework": framework, "model": preset, "overrides": over, "seq_len": seq,
            "batch": batch, "recompute": recompute, "attention": attention, "steps": steps,
            "compute_dtype": compute_dtype}


def cut_to_fit(case: Case, chip: Chip) -> Case:
    """The case with as many layers as the default prediction says fit (the name records the cut)."""
    eff = default_efficiency(chip)
    budget = FIT_FRACTION * chip.usable_hbm_bytes
    full = case_model(case)

    def fits(layers: int) -> bool:
        c = {**case, "overrides": {**case["overrides"], "n_layers": layers}}
        try:
            return predict_train(c, chip, eff)["memory_bytes"] <= budget
        except InfeasibleError:  # the planner finds no layout that fits
            return False

    if fits(full.n_layers):
        return case
    lo, hi = 1, full.n_layers  # memory grows with the layers: bisect for the most that fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    layers = lo
    over = {**case["overrides"], "n_layers": layers,
            "name": f"{full.name} cut to {layers} of {full.n_layers} layers (the full model does not fit)"}
    return {**case, "overrides": over}


def gpu_train_cases(chip: Chip, framework: str) -> list[Case]:
    grid = GPU_TRAIN if framework == "jax" else GPU_TORCH
    attention = "cudnn" if framework == "jax" else "sdpa"
    return [cut_to_fit(train_case(k, s, b, r, framework, attention, steps=5), chip) for k, s, b, r in grid]


def gpu_serve_cases(chip: Chip) -> list[list[Case]]:
    """One list per model (one process each): prefill lengths, decode (batch, context) that fit, then mixed steps."""
    eff = default_efficiency(chip)
    out = []
    for key in SERVE_MODELS:
        preset, over = _base(key)
        base = {"model": preset, "overrides": over, "dtype": "bf16"}
        cases = [{**base, "kind": "prefill", "prompt_len": T, "batch": 1, "attention": "cudnn", "repeats": 5}
                 for T in GPU_PREFILL]
        for B, C in GPU_DECODE:
            d = {**base, "kind": "decode", "batch": B, "context": C, "steps": 16}
            p = predict_decode(d, chip, eff)
            if p["kv_cache_bytes"] + p["weight_bytes"] <= 0.8 * chip.usable_hbm_bytes:
                cases.append(d)
        for B, C, P in GPU_MIXED:
            cases.append({**base, "kind": "mixed", "batch": B, "context": C, "prompt_len": P, "attention": "cudnn",
                          "steps": 16})
        out.append(cases)
    return out


def smoke_cases() -> dict[str, Any]:
    """Toy sizes for the CPU: every code path of the suite, in seconds."""
    preset, over = _base("tiny")
    serve = {"model": preset, "overrides": over, "dtype": "bf16"}  # the planner's serving formats are bf16
    return {"train": [train_case("tiny", 64, 2, "selective", "jax", "dpa", steps=2)],
            "torch": [train_case("tiny", 64, 2, "none", "torch", "sdpa", steps=2)],
            "serve": [[{**serve, "kind": "prefill", "prompt_len": 32, "batch": 1, "attention": "dpa", "repeats": 2},
                       {**serve, "kind": "decode", "batch": 2, "context": 32, "steps": 3},
                       {**serve, "kind": "mixed", "batch": 2, "context": 32, "prompt_len": 16, "attention": "dpa",
                        "steps": 3}]]}
