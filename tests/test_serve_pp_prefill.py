"""A prompt under pipeline parallelism rides whole in one micro-batch (session 21, QA finding): its pass crosses every
stage, so its time is its whole compute however many other sequences share the step, and TTFT cannot fall as the
batch grows. Before, step_cost spread the prompt's tokens over min(pp, sequences) micro-batches, which made the TTFT
of a tp1 pp8 Llama 3 70B fall from 432 ms at batch 1 to 112 ms at batch 8, under the 286 ms the prompt's FLOPs need
at the chip's peak."""

from __future__ import annotations

import pytest

from meshplan.cost.efficiency import default_efficiency
from meshplan.infer.config import ServeConfig, Workload
from meshplan.infer.metrics import evaluate
from meshplan.infer.step import stage_parts, step_cost
from meshplan.math.transformer import param_counts
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

M = load_model("llama3-70b")
CHIP = load_chip("h100-sxm")
EFF = default_efficiency(CHIP)
W = Workload(2000, 500)


def _ttft(cfg: ServeConfig, batch: int) -> float:
    return evaluate(M, CHIP, 8, cfg, EFF, W, batch).ttft_s


@pytest.mark.parametrize("tp,pp", [(1, 8), (2, 4)])
def test_ttft_does_not_fall_with_batch_under_pp(tp, pp):
    cfg = ServeConfig(tp=tp, pp=pp)
    ttfts = [_ttft(cfg, b) for b in (1, 2, 8, 64)]
    assert ttfts == sorted(ttfts), ttfts


@pytest.mark.parametrize("tp,pp", [(1, 8), (2, 4), (8, 1)])
def test_ttft_at_least_the_prompts_flops_at_peak(tp, pp):
    # hand floor: 2 x parameters x prompt tokens over the TP group's peak (each stage's chips run the stage's share of
    # the prompt one after another, so the pipeline adds no parallelism to one prompt)
    floor_s = 2.0 * param_counts(M).total * W.input_len / (tp * CHIP.peak("bf16"))
    cfg = ServeConfig(tp=tp, pp=pp)
    for batch in (1, 8, 64):
        assert _ttft(cfg, batch) >= floor_s, (tp, pp, batch)


def test_equal_micro_batches_keep_pp_times_the_stage():
    # a pure decode step: every micro-batch alike, so the step is pp stage times of one micro-batch
    cfg = ServeConfig(tp=1, pp=4)
    s = step_cost(M, CHIP, cfg, EFF, 64, 1000.0)
    stage = stage_parts(M, CHIP, cfg, EFF, 16, 1000.0, 0.0, 0.0)
    for k, v in stage.items():
        assert s.parts[k] == pytest.approx(4 * v)


def test_one_sequence_prefill_is_pp_stages_of_the_whole_chunk():
    cfg = ServeConfig(tp=1, pp=4)
    s = step_cost(M, CHIP, cfg, EFF, 0.0, 0.0, 2000.0, 1000.0, 1)
    stage = stage_parts(M, CHIP, cfg, EFF, 0.0, 0.0, 2000.0, 1000.0, 1.0)
    assert s.parts["compute"] == pytest.approx(4 * stage["compute"])


def test_many_prompts_fill_the_stages_in_turn():
    # eight 500-token prompts in a four-stage pipeline: four micro-batches of two prompts each; a stage runs the four
    # in turn, as long as one micro-batch's trip through the four stages: 4 x T_stage(1000 tokens). Separate prompts
    # do pipeline; only one prompt's own tokens do not
    cfg = ServeConfig(tp=1, pp=4)
    s = step_cost(M, CHIP, cfg, EFF, 0.0, 0.0, 8 * 500.0, 250.0, 8, prefill_seqs=8)
    stage = stage_parts(M, CHIP, cfg, EFF, 0.0, 0.0, 2 * 500.0, 250.0, 2.0)
    assert s.time_s - s.parts["step_overhead"] == pytest.approx(4 * sum(stage.values()))


def test_pp1_unchanged():
    cfg = ServeConfig(tp=8)
    s = step_cost(M, CHIP, cfg, EFF, 31, 1500.0, 2000.0, 1000.0, 32)
    stage = stage_parts(M, CHIP, cfg, EFF, 31, 1500.0, 2000.0, 1000.0, 1.0)
    for k, v in stage.items():
        assert s.parts[k] == pytest.approx(v)
