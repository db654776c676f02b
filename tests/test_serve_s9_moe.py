"""Session 9, issue #14 (MoE serving): pins the mechanism behind the Qwen3-235B-A22B TP8 H100/H200 gap found on the
tuning half (benchmarks/results/serving_accuracy_cpu_2026-12-03_s9_moe.md). No model constant changed; these tests
fix the step terms the analysis rests on. Expected values by hand from the formulas and the sources' numbers:

- Qwen/Qwen3-235B-A22B config.json: d_model 4096, 128 experts, top-8.
- TensorRT-LLM CustomAllReduceHelper.max_workspace_size_auto (tensorrt_llm/plugin/plugin.py): 8,000,000 bytes for
  tp > 2 (serving.yaml custom_allreduce_max_bytes gpu: 8e6), above it the AUTO strategy falls back to NCCL.
- serving.yaml custom_allreduce_latency_s h100-sxm/h200 4.55 us, custom_allreduce_nvlink_fraction 0.648 (session 36,
  measured kernel tables; 6 us and 0.75 before); H100/H200 NVLink
  450 GB/s per direction; collective_efficiency.yaml nvlink 0.333 below 58 MB, sharp allreduce_speedup 1.3.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan.infer.config import ServeConfig
from meshplan.infer.step import _allreduce_s, tokens_per_expert
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

QWEN3 = load_model(str(Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "models" / "qwen3-235b-a22b.json"))
H100 = load_chip("h100-sxm")
H200 = load_chip("h200")
TRTLLM = ServeConfig(tp=8, weight_dtype="fp8", kv_dtype="fp8", engine="trtllm")
ACT_BYTES = 2  # bf16 activations
D = 4096


def test_rows_per_expert_at_the_tuning_batches():
    # each expert's grouped-GEMM rows: B * k / E = B * 8 / 128
    assert tokens_per_expert(QWEN3, 903) == pytest.approx(903 * 8 / 128)  # 56.4 rows (H100 128/2048 batch)
    assert tokens_per_expert(QWEN3, 2023) == pytest.approx(2023 * 8 / 128)  # 126.4 rows (H200 128/2048 batch)


def test_h100_batch_all_reduce_stays_on_the_custom_kernel():
    # 903 decode tokens x 4096 x 2 B = 7,397,376 B <= 8e6: two-shot custom all-reduce over NVLink
    nbytes = 903 * D * ACT_BYTES
    assert nbytes == 7_397_376
    w = 450e9 * 0.648
    two_shot = 2 * 4.55e-6 + 2 * nbytes * 7 / 8 / w  # 9.1 us + 44.39 us = 53.49 us
    one_shot = 4.55e-6 + nbytes * 7 / w  # 182.1 us
    assert two_shot == pytest.approx(53.494e-6, rel=1e-3)
    assert _allreduce_s(H100, TRTLLM, nbytes, 8) == pytest.approx(min(one_shot, two_shot))


def test_h200_batch_all_reduce_falls_back_to_nccl():
    # 2023 decode tokens x 4096 x 2 B = 16,572,416 B > 8e6: NCCL (collectives model): a ring's 2(n-1)/n of the bytes
    # at 450 GB/s x 0.333 x 1.3 (SHARP) = 194.8 GB/s bus bandwidth: 148.9 us
    nbytes = 2023 * D * ACT_BYTES
    assert nbytes == 16_572_416
    nccl = 2 * 7 / 8 * nbytes / (450e9 * 0.333 * 1.3)
    assert nccl == pytest.approx(148.9e-6, rel=1e-3)
    t = _allreduce_s(H200, TRTLLM, nbytes, 8)
    assert t == pytest.approx(nccl, rel=0.01)
    # 2.78x the H100 batch's time for 2.24x the bytes: per byte (148.9 / 16.57) / (53.49 / 7.40) = 1.24x
    per_byte_custom = _allreduce_s(H100, TRTLLM, 903 * D * ACT_BYTES, 8) / (903 * D * ACT_BYTES)
    assert t / nbytes / per_byte_custom == pytest.approx((148.9 / 16_572_416) / (53.494 / 7_397_376), rel=0.01)


@pytest.mark.parametrize("model,hw,chips", [("gpt-oss-120b", "h200", 1), ("qwen3-235b-a22b", "h100-sxm", 8)])
def test_fine_grained_moe_decode_step_rises_with_the_batch(model, hw, chips):
    """Session 25: the routed experts' GEMMs run at tokens x k / touched rows. Decode steps of a fine-grained MoE
    (128 experts, top-4 / top-8) grow with the batch from 1 to 512 sequences, and a batch of 4 is no slower than
    twice a batch of 1 (at 4 sequences gpt-oss touches ~15 experts a layer where one sequence touches 4: the weight
    read grows, nothing prices the untouched experts)."""
    from meshplan.cost.efficiency import default_efficiency
    from meshplan.infer.config import ServeConfig
    from meshplan.infer.step import step_cost
    from meshplan.specs.hardware import load_chip
    from meshplan.specs.model import load_model

    m, chip = load_model(model), load_chip(hw)
    cfg = ServeConfig(tp=chips, ep=chips if chips > 1 else 1, weight_dtype="mxfp4" if model.startswith("gpt-oss") else "fp8",
                      kv_dtype="fp8", engine="trtllm")
    eff = default_efficiency(chip)
    times = [step_cost(m, chip, cfg, eff, b, 1024.0).time_s for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)]
    assert times == sorted(times), times
    assert times[2] < 2 * times[0], times
    # one sequence's step reads at most every weight once, plus the fixed costs of its kernels (at most 20 a layer
    # at efficiency.kernel_overhead_s) and the step: before session 25 gpt-oss's was 43 ms on one H200, where reading
    # all 65 GB of its weights takes 17 ms
    from meshplan.infer.memory import weight_bytes_per_chip

    bound = (weight_bytes_per_chip(m, cfg) / (chip.hbm_bandwidth_bytes_per_s * eff.hbm_fraction)
             + m.n_layers * 20 * eff.kernel_overhead_s + 1e-3)
    assert times[0] < bound, (times[0], bound)
