"""Session 30 (issue #14): the serving engine's own MoE kernel bounds the routed-expert GEMMs, by release, chip and the
experts' format (serving.yaml engine_grouped_matmul_peak_fraction, read from aiconfigurator's measured vLLM FusedMoE
tables). Values here are re-derived from the table or computed by hand from the yaml constants."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from meshplan.cost.efficiency import default_efficiency
from meshplan.errors import MeshplanError
from meshplan.infer.config import SERVING_FILE, ServeConfig, engine_grouped_kernel, expert_gemm_format
from meshplan.infer.step import routed_expert_gemm_s
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import kernel_check  # noqa: E402

H200_FP8_PEAK = 1979e12  # NVIDIA H200 datasheet: 3,958 TFLOPS FP8 with sparsity, half dense
H200_BF16_PEAK = 989e12


def _yaml_entries() -> dict[tuple[str, str], dict]:
    table = yaml.safe_load(SERVING_FILE.read_text())
    out = {("vllm", chip): v for chip, v in table["engine_grouped_matmul_peak_fraction"]["vllm"].items()}
    for chip, v in table["engine_releases"]["vllm@0.14"]["engine_grouped_matmul_peak_fraction"].items():
        out[("vllm@0.14", chip)] = v
    return out


def test_every_yaml_curve_is_the_tables_fit() -> None:
    """fraction to two decimals, rows_half exactly: kernel_check.vllm_kernel_fits recomputes them from the CSV."""
    derived = kernel_check.vllm_kernel_fits()
    entries = _yaml_entries()
    assert set(entries) == {("vllm", "h100-sxm"), ("vllm", "h200"), ("vllm@0.14", "h100-sxm"), ("vllm@0.14", "h200"),
                            ("vllm@0.14", "a100-80gb")}
    checked = 0
    for (engine, chip), v in entries.items():
        assert "aiconfigurator" in v["source"] or v["source"].startswith("as ")
        for fmt in ("bf16", "fp8", "fp8_block", "mxfp4"):
            if fmt not in v:
                assert (engine, chip, fmt) not in derived  # no value without measured layers (vLLM 0.14: no MXFP4)
                continue
            got = derived[(engine, chip, fmt)]
            assert got["n"] >= 54
            assert v[fmt]["fraction"] == pytest.approx(got["fraction"], abs=0.005), (engine, chip, fmt)
            assert v[fmt]["rows_half"] == got["rows_half"], (engine, chip, fmt)
            checked += 1
    assert checked == 15


def test_the_fit_recovers_a_known_curve() -> None:
    """Points drawn from 0.3 x r / (r + 40) exactly: the fit returns them."""
    pts = [(r, 0.3 * r / (r + 40)) for r in (32, 64, 128, 256, 512, 1024)]
    c, r0, err = kernel_check.fit_kernel_curve(pts)
    assert (round(c, 6), r0, round(err, 9)) == (0.3, 40, 0.0)


def test_block_fp8_is_the_steadiest_format() -> None:
    """The measured point of the change: every chip and release runs block-scaled FP8 experts near a third of the FP8
    peak, and one curve fits every shape's layers within 8% (median)."""
    fits = [v for (_, _, fmt), v in kernel_check.vllm_kernel_fits().items() if fmt == "fp8_block"]
    assert len(fits) == 4
    for v in fits:
        assert 0.3 < v["fraction"] < 0.4 and v["median_abs_error"] < 0.08


def test_the_table_reads_in_the_units_its_header_states() -> None:
    """No measured layer does its expert FLOPs faster than its format's dense peak (the FP8 peak for fp8 formats, the
    bf16 peak otherwise; A100: 312 TFLOP/s bf16, NVIDIA A100 datasheet): a misread unit (us for ms) would break that by
    1000x."""
    rows = kernel_check.vllm_moe_rows()
    assert len(rows) == 5400 + 243
    for r in rows:
        m = load_model(r["model"])
        flops = 2 * float(r["tokens"]) * m.experts_per_token * 3 * m.d_model * m.d_ff / int(r["moe_tp"])
        peak = H200_FP8_PEAK if r["dtype"] in ("fp8", "fp8_block") else H200_BF16_PEAK
        if r["chip"] == "a100-80gb":
            peak = 312e12
        assert flops / (float(r["time_us"]) * 1e-6) < peak


def test_the_experts_format_follows_the_checkpoint() -> None:
    chip = load_chip("h200")
    # an FP8 release with block scales, served as released
    assert load_model("deepseek-v3").released_weight_block == 128
    assert load_model("qwen3-235b-a22b-fp8").released_weight_block == 128
    assert expert_gemm_format(load_model("qwen3-235b-a22b-fp8"), ServeConfig(weight_dtype="fp8"), chip) == "fp8_block"
    # the engine's own FP8 quantization of a bf16 checkpoint: one scale per tensor
    assert load_model("qwen3-235b-a22b").released_weight_block == 0
    assert expert_gemm_format(load_model("qwen3-235b-a22b"), ServeConfig(weight_dtype="fp8"), chip) == "fp8"
    assert expert_gemm_format(load_model("gpt-oss-120b"), ServeConfig(weight_dtype="mxfp4"), chip) == "mxfp4"
    assert expert_gemm_format(load_model("mixtral-8x7b"), ServeConfig(), chip) == "bf16"
    # no FP8 units: the GEMMs run bf16 whatever the weights
    assert expert_gemm_format(load_model("deepseek-v3"), ServeConfig(weight_dtype="fp8"), load_chip("a100-80gb")) == "bf16"


def test_a_bad_block_size_is_one_clear_error(tmp_path: Path) -> None:
    cfg = json.loads((Path(__file__).resolve().parents[1] / "src/meshplan/specs/data/models/qwen3-235b-a22b-fp8.json")
                     .read_text())
    cfg["quantization_config"]["weight_block_size"] = "128"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(MeshplanError, match="weight_block_size"):
        load_model(str(path))


def test_vllm_014_runs_block_fp8_experts_on_its_measured_curve_by_hand() -> None:
    """Qwen3-235B-A22B-FP8 at TP 2 on one H200, 8,192 tokens: 8192 x 8 routed rows over the 128 experts (all touched)
    = 512 rows each, experts 1,536/2 = 768 wide on each GPU (thin-dimension penalty 768/(768 + 256) = 0.75). vLLM 0.14's
    FusedMoE curve (serving.yaml): 0.33 x 512/(512 + 35) of the FP8 peak, times 0.75. TensorRT-LLM has no measured
    curve here: the generic rate, 0.62 (efficiency.yaml fp8_peak_fraction) x min(512/(512 + 128), 0.75)."""
    m, chip = load_model("qwen3-235b-a22b-fp8"), load_chip("h200")
    eff = default_efficiency(chip)
    flops = 2 * 8192 * 8 * 3 * 4096 * 1536 / 2
    vllm = routed_expert_gemm_s(m, chip, ServeConfig(tp=2, weight_dtype="fp8", engine="vllm@0.14"), eff, 8192.0)
    assert vllm == pytest.approx(flops / (H200_FP8_PEAK * 0.33 * 0.75 * 512 / 547), rel=1e-9)
    trt = routed_expert_gemm_s(m, chip, ServeConfig(tp=2, weight_dtype="fp8", engine="trtllm"), eff, 8192.0)
    assert trt == pytest.approx(flops / (H200_FP8_PEAK * 0.62 * 0.75), rel=1e-9)
    # the current preset's per-tensor FP8 kernel (0.18, rows_half 160) is slower than its block-scaled one (0.35, 37)
    bf16_ckpt = load_model("qwen3-235b-a22b")
    tensor = routed_expert_gemm_s(bf16_ckpt, chip, ServeConfig(tp=2, weight_dtype="fp8", engine="vllm"), eff, 8192.0)
    block = routed_expert_gemm_s(m, chip, ServeConfig(tp=2, weight_dtype="fp8", engine="vllm"), eff, 8192.0)
    assert tensor == pytest.approx(flops / (H200_FP8_PEAK * 0.18 * 0.75 * 512 / 672), rel=1e-9)
    assert block == pytest.approx(flops / (H200_FP8_PEAK * 0.35 * 0.75 * 512 / 549), rel=1e-9)


def test_small_problems_follow_the_engines_own_ramp() -> None:
    """At 64 tokens (128 (1 - (1 - 8/128)^64) = 126.1 experts touched, 4.06 rows each) vLLM 0.14's curve gives
    0.33 x 0.75 x 4.06/(4.06 + 35) of the FP8 peak, by hand."""
    m, chip = load_model("qwen3-235b-a22b-fp8"), load_chip("h200")
    eff = default_efficiency(chip)
    rows = 64 * 8 / (128 * (1 - (1 - 8 / 128) ** 64))
    flops = 2 * 64 * 8 * 3 * 4096 * 1536 / 2
    got = routed_expert_gemm_s(m, chip, ServeConfig(tp=2, weight_dtype="fp8", engine="vllm@0.14"), eff, 64.0)
    assert got == pytest.approx(flops / (H200_FP8_PEAK * 0.33 * 0.75 * rows / (rows + 35)), rel=1e-9)


def test_engines_and_chips_without_a_measurement_have_no_curve() -> None:
    for engine in ("default", "sglang", "trtllm", "trtllm@0.17", "lmdeploy"):
        assert engine_grouped_kernel(ServeConfig(engine=engine), load_chip("h200"), "fp8_block") is None
    assert engine_grouped_kernel(ServeConfig(engine="vllm"), load_chip("a100-80gb"), "bf16") is None
    assert engine_grouped_kernel(ServeConfig(engine="vllm@0.14"), load_chip("h200"), "mxfp4") is None
    assert engine_grouped_kernel(ServeConfig(engine="vllm"), load_chip("h200"), "fp8_block") == (0.35, 37.0)


def test_serve_json_names_the_experts_format_and_the_engines_curve(capsys) -> None:
    from conftest import run_cli

    base = ["serve", "--hardware", "h200", "--chips", "8", "--input-len", "1000", "--output-len", "200", "--tp", "8",
            "--json"]
    code, out, _ = run_cli(base + ["--model", "qwen3-235b-a22b-fp8", "--engine", "vllm"], capsys)
    assert code == 0
    o = json.loads(out)
    assert o["config"]["weight_dtype"] == "fp8"  # the release's own format, unasked
    assert o["expert_gemms"] == {"format": "fp8_block", "engine_fraction": 0.35, "engine_rows_half": 37.0}
    code, out, _ = run_cli(base + ["--model", "qwen3-235b-a22b", "--quant", "fp8", "--engine", "trtllm"], capsys)
    assert code == 0 and json.loads(out)["expert_gemms"] == {"format": "fp8", "engine_fraction": None,
                                                         "engine_rows_half": None}
    code, out, _ = run_cli(base + ["--model", "llama3.1-8b"], capsys)
    assert code == 0 and "expert_gemms" not in json.loads(out)


def test_serve_table_names_the_experts_format(capsys) -> None:
    from conftest import run_cli

    code, out, _ = run_cli(["serve", "--model", "qwen3-235b-a22b-fp8", "--hardware", "h200", "--chips", "8",
                            "--input-len", "1000", "--output-len", "200", "--tp", "8", "--engine", "vllm@0.14"], capsys)
    assert code == 0
    line = next(x for x in out.splitlines() if "MoE expert GEMMs" in x)
    assert "fp8_block" in line and "0.33" in line and "(rows + 35)" in line
