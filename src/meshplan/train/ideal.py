"""The book's idealised training step (ch.6 'Training LLaMA 3 on TPUs', ch.5): every chip at its peak FLOPs,
communication perfectly overlapped, no pipeline bubble, no kernel overhead. T = model FLOPs per step /
(N x C); the book's ch.6 time-to-train divides by an assumed MFU instead (6.3e24 / (8960 x 4.59e14 x 0.4)).
`train --ideal` prints it beside meshplan's realistic step for each plan.
"""

from __future__ import annotations

from meshplan.errors import MeshplanError


def ideal_training(plan: dict, chips: int, peak_flops_per_s: float) -> dict:
    """For one plan of `train --json`: the ideal step from its model FLOPs (MFU = 1) and from its hardware
    FLOPs (recomputation included), and how far the realistic step is from the first."""
    if chips <= 0 or peak_flops_per_s <= 0:
        raise MeshplanError("chips and peak FLOP/s must be positive")
    step = plan["model_flops_per_step"] / (chips * peak_flops_per_s)
    return {
        "step_time_s": step,
        "step_time_with_recompute_s": plan["hardware_flops_per_step"] / (chips * peak_flops_per_s),
        "mfu": 1.0,
        "tokens_per_s": plan["tokens_per_s"] * plan["step_time_s"] / step,
        "realistic_over_ideal": plan["step_time_s"] / step,
    }
