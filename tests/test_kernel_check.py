"""benchmarks/kernel_check.py (session 25): NVIDIA's measured H100 kernel tables read in the units their headers state,
and meshplan's terms compared with every row. The tables are checked against the H100's datasheet, independently of
meshplan: no decode GEMM streams its weights faster than the HBM's 3.35 TB/s, no ring reduce-scatter or all-gather
moves more than NVLink's 450 GB/s per GPU, and times grow with message size."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import kernel_check  # noqa: E402

H100_HBM_BYTES_PER_S = 3.35e12  # NVIDIA H100 SXM5 datasheet
H100_NVLINK_BYTES_PER_S = 450e9  # 18 NVLink 4 links x 25 GB/s per direction


def test_the_tables_read_in_the_units_their_headers_state() -> None:
    gemms = kernel_check._rows("aic_h100_vllm_decode_gemm_bf16.csv")
    assert len(gemms) > 900
    for r in gemms:
        weights_bytes = int(r["n"]) * int(r["k"]) * 2
        assert weights_bytes / (float(r["time_us"]) * 1e-6) < H100_HBM_BYTES_PER_S
    nccl = kernel_check._rows("aic_h100_nccl_tests.csv")
    for r in nccl:
        g, b, t = int(r["gpus"]), float(r["bytes"]), float(r["time_us"]) * 1e-6
        if r["op"] != "all_reduce":  # a ring RS / AG busbw = (g-1)/g x bytes / time (nccl-tests PERFORMANCE.md)
            assert (g - 1) / g * b / t < H100_NVLINK_BYTES_PER_S
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        big = [float(r["time_us"]) for r in nccl if r["op"] == op and r["gpus"] == "8" and float(r["bytes"]) >= 2**24]
        assert big == sorted(big) and len(big) >= 5


def test_every_row_gets_a_prediction() -> None:
    res = kernel_check.report()
    assert res["chip"] == "h100-sxm"
    n = {k: sum(s["n"] for s in res[k].values())
         for k in ("nccl_tests", "vllm_custom_allreduce", "decode_gemm_bf16", "moe_prefill")}
    assert n == {"nccl_tests": len(kernel_check._rows("aic_h100_nccl_tests.csv")),
                 "vllm_custom_allreduce": len(kernel_check._rows("aic_h100_vllm_custom_allreduce.csv")),
                 "decode_gemm_bf16": len(kernel_check._rows("aic_h100_vllm_decode_gemm_bf16.csv")),
                 "moe_prefill": len(kernel_check.moe_prefill_rows())}
    # every row is compared or, in the MoE table, screened out (kernel_check.dominated_rows) and counted apart
    assert all(math.isfinite(s["signed_median"]) for k in n for g, s in res[k].items() if g != "screened out")
    assert set(res["moe_prefill"]["screened out"]["rows"]) <= {f"{m} moe_tp {t}" for m in (
        "mixtral-8x7b", "mixtral-8x22b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3") for t in (1, 2, 4, 8)}


def _layer(tokens: int, tp: int, time_us: float, dist: str = "balanced") -> dict:
    return {"model": "m", "dtype": "bfloat16", "distribution": dist, "tokens": str(tokens), "moe_tp": str(tp),
            "time_us": str(time_us)}


def test_a_layer_slower_than_one_doing_more_work_per_gpu_is_screened_out() -> None:
    """Session 29: a MoE layer cannot take longer with fewer tokens or a narrower shard per GPU. By hand on a small
    table: B (1024 tokens, moe_tp 2) at 120 us is slower than A (same tokens, moe_tp 1: twice B's work per GPU) at 100
    us and than C (2048 tokens at moe_tp 2) at 60 us; D at 105 us against A's 100 us is within the 10% run-to-run
    tolerance; E is another routing, compared only with its own."""
    a, b, c, d = _layer(1024, 1, 100.0), _layer(1024, 2, 120.0), _layer(2048, 2, 60.0), _layer(512, 1, 105.0)
    e = _layer(1024, 2, 500.0, dist="power_law_1.01")
    assert kernel_check.dominated_rows([a, b, c, d, e]) == [b]


def test_the_trtllm_moe_table_screens_out_its_measured_anomalies() -> None:
    """The measured Mixtral 8x22B layer at moe_tp 8 takes longer than at moe_tp 4, where each GPU holds twice the
    expert columns (bf16, balanced, 4,096 tokens: 4,673.7 us against 1,623.2 us in the file), so it is screened
    out; Mixtral 8x7B's layers fall with moe_tp as they should and all are kept."""
    rows = kernel_check.moe_prefill_rows()

    def row(model: str, tp: str) -> dict:
        return next(r for r in rows if (r["model"], r["dtype"], r["tokens"], r["moe_tp"], r["distribution"])
                    == (model, "bfloat16", "4096", tp, "balanced"))

    assert float(row("mixtral-8x22b", "8")["time_us"]) > 2 * float(row("mixtral-8x22b", "4")["time_us"])
    screened = kernel_check.dominated_rows(rows)
    assert any(r is row("mixtral-8x22b", "8") for r in screened)
    assert not any(r["model"] == "mixtral-8x7b" for r in screened)


def test_measured_moe_layers_stream_their_experts_at_the_models_rate() -> None:
    """NVIDIA's 19,683 measured H100 MoE layers (vLLM fused_moe, TensorRT-LLM CUTLASS; bf16 / fp8 / fp8_block) stream
    their touched experts, once the serving step's own fixed terms of the layer are taken out, at a median within 0.05
    of the HBM fraction the step assumes, from one row per touched expert to 32 (session 25: 0.73-0.79 of peak against
    0.80). A table read in the wrong units, or a streaming model far off the kernels, fails here."""
    from meshplan.cost.efficiency import default_efficiency
    from meshplan.specs.hardware import load_chip

    chip = load_chip("h100-sxm")
    hbm = default_efficiency(chip).hbm_fraction
    both = {k: v for k, v in kernel_check.moe_layers(chip).items() if k.startswith("both")}
    assert sum(v["n"] for v in both.values()) == len(kernel_check._rows("aic_h100_moe_layers.csv"))
    for v in both.values():
        assert abs(v["measured_fraction"] - hbm) < 0.08
    assert abs(statistics.median(r["fraction"] for r in kernel_check.moe_layer_rows(chip)) - hbm) < 0.05


def test_a_decode_batch_of_a_fine_grained_moe_runs_one_row_per_touched_expert() -> None:
    """gpt-oss-120b (top-4 of 128 experts) at 4 sequences: 16 routed rows touch E(1 - (1 - k/E)^4) = 15.3 experts, about
    one row each, where the balanced share over all 128 is 0.125 (hand calculation)."""
    from meshplan.infer.step import rows_per_touched_expert, tokens_per_expert
    from meshplan.specs.model import load_model

    m = load_model("gpt-oss-120b")
    touched = 128 * (1 - (1 - 4 / 128) ** 4)
    assert rows_per_touched_expert(m, 4) == pytest.approx(16 / touched) == pytest.approx(1.048, abs=1e-3)
    assert tokens_per_expert(m, 4) == pytest.approx(0.125)
    assert rows_per_touched_expert(m, 4096) == pytest.approx(tokens_per_expert(m, 4096))


def test_a_prefill_moe_layer_is_timed_by_the_steps_own_terms_by_hand() -> None:
    """Session 28: the prefill MoE table (TensorRT-LLM 1.2 CUTLASS, the H100 bf16 / fp8 rows of aic_trtllm_moe_prefill.csv) is compared with
    the serving step's MoE terms. Mixtral 8x7B's layer at 8,192 tokens on one H100 in bf16, by hand from the
    constants: each of the 8 experts runs 8192 x 2 / 8 = 2048 rows, at 0.75 (efficiency.yaml matmul_peak_fraction h100-sxm)
    x min(2048/(2048 + 128), 4096/(4096 + 256)) of 989 TFLOP/s for 2 x 8192 x 2 x 3 x 4096 x 14336 FLOPs; the permute
    moves 2 x 8192 x 4096 x (2 + 1) bf16 elements at 0.8 x 3.35 TB/s; 4 routing kernels + gate/up, activation and
    down at 4 us each. The table's rows measure the presets' own expert shapes, bf16 and fp8, both routings."""
    rows = kernel_check.moe_prefill_rows()
    assert {r["model"] for r in rows} == {"mixtral-8x7b", "mixtral-8x22b", "qwen3-30b-a3b", "qwen3-235b-a22b",
                                          "deepseek-v3"}
    assert {r["dtype"] for r in rows} == {"bfloat16", "fp8"} and {r["moe_tp"] for r in rows} == {"1", "2", "4", "8"}
    r = next(r for r in rows if (r["model"], r["dtype"], r["tokens"], r["moe_tp"], r["distribution"])
             == ("mixtral-8x7b", "bfloat16", "8192", "1", "balanced"))
    flops = 2 * 8192 * 2 * 3 * 4096 * 14336
    gemm = flops / (989e12 * 0.75 * min(2048 / (2048 + 128), 4096 / (4096 + 256)))
    permute = 2 * 8192 * 4096 * 3 * 2 / (0.8 * H100_HBM_BYTES_PER_S)
    hand = gemm + permute + (4 + 3) * 4e-6
    chip = kernel_check.load_chip("h100-sxm")
    assert kernel_check.moe_prefill_predicted_s(r, chip) == pytest.approx(hand, rel=1e-6)
    # the measured layer itself: 5.77 TFLOP in the row's time is a plausible H100 bf16 GEMM rate (below the peak)
    assert flops / (float(r["time_us"]) * 1e-6) < 989e12


def test_a_deepseek_moe_layer_is_timed_whole_not_as_the_steps_mean_layer() -> None:
    """Session 30: DeepSeek-V3 has 58 MoE layers among 61 (3 dense layers first), so the serving step's mean layer
    carries 58/61 of a MoE layer's routed experts; a measured row is one MoE layer, timed whole. By hand at 8,192 tokens
    on one H100 in bf16: 8192 x 8 routed rows over the 256 experts (all touched: 256 (1 - (1 - 8/256)^8192) = 256) =
    256 rows each, at 0.75 x min(256/(256 + 128), 2048/(2048 + 256)) = 0.5 of 989 TFLOP/s (the grouped ceiling on
    H100 is the dense fraction, 0.75 x 2048/2304 = 0.667, not binding) for 2 x 8192 x 8 x 3 x 7168 x 2048 FLOPs =
    11.7 ms, longer than the 256 experts' 22.5 GB read at 0.8 x 3.35 TB/s = 8.4 ms; plus the permute, 2 x 8192 x 7168
    x (8 + 1) bf16 elements at 0.8 x 3.35 TB/s, and 4 routing + 3 expert kernels at 4 us each."""
    rows = kernel_check.moe_prefill_rows()
    r = next(r for r in rows if (r["model"], r["dtype"], r["tokens"], r["moe_tp"], r["distribution"])
             == ("deepseek-v3", "bfloat16", "8192", "1", "balanced"))
    flops = 2 * 8192 * 8 * 3 * 7168 * 2048
    gemm = flops / (989e12 * 0.75 * min(256 / (256 + 128), 2048 / (2048 + 256)))
    read = 256 * 3 * 7168 * 2048 * 2 / (0.8 * H100_HBM_BYTES_PER_S)
    assert gemm > read
    permute = 2 * 8192 * 7168 * 9 * 2 / (0.8 * H100_HBM_BYTES_PER_S)
    hand = gemm + permute + (4 + 3) * 4e-6
    chip = kernel_check.load_chip("h100-sxm")
    assert kernel_check.moe_prefill_predicted_s(r, chip) == pytest.approx(hand, rel=1e-6)
