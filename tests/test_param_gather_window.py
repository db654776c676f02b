"""Issue #14: the distributed optimizer's parameter all-gather under `overlap_param_gather` hides only behind the next
step's first micro-batch forward (Megatron-Core distributed_data_parallel.py `_make_forward_pre_hook`: each module's
pre-hook waits on its bucket and dispatches the next), so a gather longer than that forward shows its excess. Worked
on a plain zero-latency network so the sums are by hand."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.cost.efficiency import default_efficiency
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.space import Problem


def _dp_step(overlap: bool, bw: float) -> tuple[float, float, float]:
    """(dp_step seconds, the parameter all-gather's seconds, the stage's first forward) for Qwen3-30B-A3B on 16 B200,
    DP 16 with EP 8 (the experts reduced and gathered over 16 / 8 = 2 replicas), ZeRO-1, micro-batch 1."""
    prob = Problem(load_model("qwen3-30b-a3b"), load_chip("b200"), 16, 4096, 64)
    cm = CostModel(prob, default_efficiency(prob.chip), Options(overlap_param_gather=overlap))
    cm.comm.time = lambda kind, nbytes, size, stride: (nbytes / bw) * (size > 1)
    L = LayoutArrays.from_configs([ParallelConfig(dp=16, ep=8, microbatch=1, zero=1, recompute="none")])
    g = cm.geometry(L)
    ct = cm.compute_terms(L, g)
    out = cm.comm_terms(L, g, ct)
    # the plain network times a group's bytes alone: the dense part over 16 replicas plus the experts' over 2 is
    # 2 B (bf16 parameters) x every parameter on the rank
    ag = 2.0 * float(g["params_stage_local"][0]) / bw
    return float(out["dp_step"][0]), ag, float((g["layers_stage"] * ct["layer_fwd"])[0])


def test_param_gather_shows_its_excess_over_the_first_forward() -> None:
    # 10 GB/s: Qwen3-30B-A3B's rank holds 48 layers x (16 local experts x 3 x 2048 x 768 = 75.5M, attention
    # 2048 x 5120 + 4096 x 2048 = 18.9M, router 0.26M) + 2 x 151936 x 2048 embeddings = 5.16e9 parameters -> 10.3 GB
    # -> 1.03 s of gather against a 0.046 s forward: the gather is exposed but for that forward, where a blocking
    # gather shows in full
    blocking, ag, fwd = _dp_step(False, 1e10)
    lapped, ag2, fwd2 = _dp_step(True, 1e10)
    assert ag == ag2 and fwd == fwd2 and ag > fwd > 0
    assert blocking - lapped == pytest.approx(fwd, rel=1e-9)
    # a fast network: the gather fits inside the forward and shows nothing under the overlap
    blocking, ag, fwd = _dp_step(False, 1e15)
    lapped, _, _ = _dp_step(True, 1e15)
    assert ag < fwd and blocking - lapped == pytest.approx(ag, rel=1e-9)
    assert np.isfinite(lapped)
