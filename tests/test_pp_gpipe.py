"""The all-forward-all-backward pipeline (Options.pp_schedule "gpipe"; issue #14, session 13): GPipe (Huang et al.
2019) and, with virtual stages, looped breadth-first (Lamy-Poirier 2023; torchtitan's GPipe and LoopedBFS). Expected
values are derived in the comments from meshplan's own 1F1B numbers and the schedules' definitions."""

from __future__ import annotations

import tomllib

import pytest
from test_export import CASES, _roundtrip

from meshplan.cost.efficiency import default_efficiency
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.costmodel import Options
from meshplan.train.planner import plan
from meshplan.train.space import Pins, Problem

H100 = load_chip("h100-sxm")
EFF = default_efficiency(H100)


def _plan(schedule: str, *, vpp: int, zero: int, gb: int = 64, pp: int = 4, dp: int = 8):
    prob = Problem(load_model("llama3-70b"), H100, dp * pp * 8, 4096, gb)
    pins = Pins(dp=dp, fsdp=1, tp=8, pp=pp, vpp=vpp, cp=1, ep=1, microbatch=1, recompute="none", zero=zero,
                sequence_parallel=True, offload=0.0, offload_optimizer=0, offload_params=0)
    opts = Options(pp_schedule=schedule, headroom=-1e6, pp_head_in_split=False)
    return plan(prob, pins, EFF, opts, top=1).plans[0]


def test_gpipe_holds_every_micro_batch_where_1f1b_holds_pp():
    # pp 4, dp 8, micro-batch 1: 32, 64 and 128 sequences are 4, 8 and 16 micro-batches. 1F1B's first stage holds
    # min(pp, m) = 4 micro-batches' layer activations at 8 micro-batches; all-forward-all-backward holds all m at the
    # turn: with 4 it holds what 1F1B holds, and each further micro-batch adds one micro-batch's stage activations
    def acts(schedule, gb):
        return _plan(schedule, vpp=1, zero=1, gb=gb)["memory_bytes_per_chip"]["activations"]

    one = _plan("1f1b", vpp=1, zero=1, gb=64)
    gp = _plan("gpipe", vpp=1, zero=1, gb=64)
    assert gp["micro_batches"] == one["micro_batches"] == 8
    assert acts("gpipe", 32) == pytest.approx(one["memory_bytes_per_chip"]["activations"])
    per_mb = (acts("gpipe", 64) - acts("gpipe", 32)) / 4
    assert per_mb > 0 and acts("gpipe", 128) - acts("gpipe", 64) == pytest.approx(8 * per_mb)
    for k in ("params", "grads", "optimizer"):
        assert gp["memory_bytes_per_chip"][k] == pytest.approx(one["memory_bytes_per_chip"][k])
    # the bubble is the same (p - 1) micro-batch slots in both (Huang et al. 2019 §2.2; Narayanan et al. 2021 §2.2)
    assert gp["time_breakdown_s"]["bubble"] == pytest.approx(one["time_breakdown_s"]["bubble"])


def test_looped_breadth_first_zero2_reduces_once_a_step():
    # ZeRO-2 reduce-scatters every micro-batch's gradients under 1F1B (8 reductions a step); a chunk-major backward
    # completes each chunk's gradients once, so one reduction a step, as ZeRO-1's: the DP traffic on the links is
    # ZeRO-1's, an eighth of 1F1B ZeRO-2's
    z2_1f1b = _plan("1f1b", vpp=2, zero=2)
    z2_bfs = _plan("gpipe", vpp=2, zero=2)
    z1_bfs = _plan("gpipe", vpp=2, zero=1)
    def dp_bytes(p):  # gradient reduce-scatter over the data axis, per step (the ledger's bytes per device)
        return p["ledger"]["collective_bytes"]["reduce_scatter/data"]

    assert dp_bytes(z2_bfs) == pytest.approx(dp_bytes(z1_bfs))
    assert dp_bytes(z2_1f1b) == pytest.approx(8 * dp_bytes(z2_bfs))
    # ZeRO-2 keeps 1/dp of the gradients plus the chunk in progress whole: 1/8 + 1/2 of ZeRO-1's whole gradients
    g1, g2 = z1_bfs["memory_bytes_per_chip"]["grads"], z2_bfs["memory_bytes_per_chip"]["grads"]
    assert g2 == pytest.approx(g1 * (1 / 8 + 1 / 2))
    # plain GPipe (one chunk a rank) keeps ZeRO-2's per-micro-batch reductions
    assert dp_bytes(_plan("gpipe", vpp=1, zero=2)) == pytest.approx(dp_bytes(_plan("1f1b", vpp=1, zero=2)))


def test_torchtitan_writes_and_reads_gpipe_and_looped_bfs():
    for vpp, name in ((1, "GPipe"), (2, "LoopedBFS")):
        case = dict(CASES["torchtitan"], vpp=vpp, opts=dict(CASES["torchtitan"]["opts"], pp_schedule="gpipe"))
        pe, _, text, job = _roundtrip(case)
        assert tomllib.loads(text)["parallelism"]["pipeline_parallel_schedule"] == name
        assert job.options["pp_schedule"] == "gpipe" and job.pins.vpp == vpp


def test_cli_accepts_gpipe():
    from typer.testing import CliRunner

    from meshplan.cli import app

    r = CliRunner().invoke(app, ["train", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "16",
                                 "--seq-len", "4096", "--global-batch", "64", "--pp", "2", "--pp-schedule", "gpipe",
                                 "--json"])
    assert r.exit_code == 0, r.output[-800:]
