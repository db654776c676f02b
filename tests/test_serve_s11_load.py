"""Session 11 (issue #14, serving under load): what the TensorRT-LLM v0.14 online rows at QPS INF say about the
engine's schedule, and the schedule the simulator runs for TensorRT-LLM. No model change: the published scheduler
mixes decodes and whole prompts in one step, the rows look as if it did not (results/serving_accuracy_cpu_2026-12-04_s11_load.md).
Expected values derived by hand below."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from meshplan.cost.efficiency import default_efficiency
from meshplan.infer.config import ServeConfig, Workload, chunked_prefill, kv_reserved_per_sequence, step_token_budget
from meshplan.infer.simulate import _Replica, _Req
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

H100 = load_chip("h100-sxm")
EFF = default_efficiency(H100)
M8 = load_model("llama3.1-8b")
DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "serving_measurements_new.yaml"


def _tuning_row(row_id: str) -> dict:
    rows = yaml.safe_load(DATA.read_text())["measurements"]
    (e,) = [r for r in rows if r["id"] == row_id]
    assert e["split"] == "tuning"  # only the tuning half's measured values are read here
    return e


@pytest.mark.parametrize("row_id, run_s, e2e_s", [
    # run = 500 requests x output / output tok/s; mean E2E = mean TTFT + (output - 1) x mean ITL
    # H100 467/16: 500 x 16 / 1269 = 6.304 s; 3.280 + 15 x 0.193 = 6.175 s (0.98 of the run)
    ("trtllm_online_v014_h100_sxm_llama3p1_8b_tp1_467_16_qpsinf", 6.304, 6.175),
    # H200 467/16: 500 x 16 / 1291 = 6.197 s; 3.227 + 15 x 0.190 = 6.077 s (0.98)
    ("trtllm_online_v014_h200_llama3p1_8b_tp1_467_16_qpsinf", 6.197, 6.077),
    # H100 467/256: 500 x 256 / 9420 = 13.588 s; 3.335 + 255 x 0.039 = 13.280 s (0.98)
    ("trtllm_online_v014_h100_sxm_llama3p1_8b_tp1_467_256_qpsinf", 13.588, 13.280),
    # H200 467/256: 500 x 256 / 10121 = 12.647 s; 3.237 + 255 x 0.036 = 12.417 s (0.98)
    ("trtllm_online_v014_h200_llama3p1_8b_tp1_467_256_qpsinf", 12.647, 12.417),
])
def test_qps_inf_requests_of_the_online_table_finish_together(row_id, run_s, e2e_s):
    """The published QPS INF rows with fixed lengths: the mean request ends within ~2% of the end of the run, so
    nearly every request finishes in the run's last ~0.1-0.3 s although their first tokens are spread over it (mean
    TTFT about half the run). With decodes and prompts mixed in each step, the 467/16 requests admitted first would
    finish after 16 steps (~3 s), half a run before the last ones."""
    e = _tuning_row(row_id)
    m, n, out = e["measured"], e["arrivals"]["requests"], e["output_len"]
    run = n * out / m["output_tokens_per_s"]
    e2e = m["ttft_s"] + (out - 1) * m["tpot_s"]
    assert run == pytest.approx(run_s, abs=1e-3)
    assert e2e == pytest.approx(e2e_s, abs=1e-3)
    assert e2e / run > 0.97


def test_trtllm_schedule_is_the_documented_one():
    """The TensorRT-LLM preset is the executor's default schedule as the Triton backend v0.14.0 builds it
    (inflight_batcher_llm/src/model_instance_state.cc: ExecutorConfig(..., maxBatchSize = nullopt, maxNumTokens =
    nullopt, ...) so the engine's trtllm-build limits apply, default max_num_tokens 8192; enable_chunked_context
    default false; GUARANTEED_NO_EVICT reserves input + max_new_tokens at admission)."""
    cfg = ServeConfig(engine="trtllm")
    assert step_token_budget(H100, cfg) == 8192
    assert not chunked_prefill(cfg, H100)
    assert kv_reserved_per_sequence(cfg, H100, Workload(467, 16)) == 467 + 16


def test_trtllm_steps_mix_decodes_with_whole_prompts():
    """MicroBatchScheduler (TensorRT-LLM cpp/tensorrt_llm/batch_manager/microBatchScheduler.cpp): the active requests
    in arrival order, each generation request one token, each context request its whole prompt (no chunking), and
    the first one that does not fit max_num_tokens ends the step; the capacity scheduler lists running requests
    before new ones, so decodes go first. Four requests at t = 0, 6-token prompts, 3 output tokens, a 12-token budget,
    every step 1 s (stub):
      step 1 (t = 1): prompts A, B (12 tokens)                 -> A, B first token
      step 2 (t = 2): decodes A, B (2) + prompt C (6) = 8; D would make 14 > 12
                                                            -> A, B second token, C first token
      step 3 (t = 3): decodes A, B, C (3) + prompt D (6) = 9  -> A, B finish, C second, D first
      step 4 (t = 4): decodes C, D                            -> C finishes
      step 5 (t = 5): decode D                                -> D finishes
    A request admitted early ends long before the last one (A at 3 s, D at 5 s), unlike the published QPS INF rows
    (test above), where all end together."""
    cfg = ServeConfig(engine="trtllm", max_num_batched_tokens=12)
    reqs = [_Req(0.0, 6, 3) for _ in range(4)]
    rep = _Replica(M8, H100, cfg, EFF, 64)
    rep._cost = lambda *args, **kwargs: 1.0
    rep.run(reqs)
    assert [r.first_token for r in reqs] == [1.0, 1.0, 2.0, 3.0]
    assert [r.finish for r in reqs] == [3.0, 3.0, 4.0, 5.0]
