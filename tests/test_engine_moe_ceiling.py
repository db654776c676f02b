"""Sessions 30-31 (issue #14): the serving engine's own MoE kernel bounds the routed-expert GEMMs, by release, chip and
the experts' format (serving.yaml engine_grouped_matmul_peak_fraction, read from aiconfigurator's measured vLLM FusedMoE
and TensorRT-LLM MoE tables: fraction x rows / (rows + rows_half) x d / (d + half_dim)). Values here are re-derived from
the tables or computed by hand from the yaml constants."""

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


@pytest.fixture(scope="module")
def fits() -> dict:
    return kernel_check.engine_kernel_fits()


def _yaml_entries() -> dict[tuple[str, str], dict]:
    table = yaml.safe_load(SERVING_FILE.read_text())
    out = {(engine, chip): v for engine, chips in table["engine_grouped_matmul_peak_fraction"].items()
           for chip, v in chips.items()}
    for chip, v in table["engine_releases"]["vllm@0.14"]["engine_grouped_matmul_peak_fraction"].items():
        out[("vllm@0.14", chip)] = v
    return out


def test_every_yaml_curve_is_the_tables_fit(fits) -> None:
    """fraction to two decimals, rows_half and half_dim exactly: kernel_check.engine_kernel_fits recomputes them from
    the CSVs."""
    entries = _yaml_entries()
    assert set(entries) == {("vllm", "h100-sxm"), ("vllm", "h200"), ("vllm@0.14", "h100-sxm"), ("vllm@0.14", "h200"),
                            ("vllm@0.14", "a100-80gb"), ("trtllm", "h100-sxm"), ("trtllm", "h200")}
    checked = 0
    for (engine, chip), v in entries.items():
        assert "aiconfigurator" in v["source"] or v["source"].startswith("as ")
        for fmt in ("bf16", "fp8", "fp8_block", "mxfp4"):
            if fmt not in v:
                assert (engine, chip, fmt) not in fits  # no value without measured layers (vLLM 0.14: no MXFP4)
                continue
            got = fits[(engine, chip, fmt)]
            assert got["n"] >= 54
            assert v[fmt]["fraction"] == pytest.approx(got["fraction"], abs=0.005), (engine, chip, fmt)
            assert (v[fmt]["rows_half"], v[fmt]["half_dim"]) == (got["rows_half"], got["half_dim"]), (engine, chip, fmt)
            checked += 1
    assert checked == 23 == len(fits)


def test_the_fit_recovers_a_known_curve() -> None:
    """Points drawn from 0.3 x r / (r + 40) x d / (d + 160) exactly, over rows and expert widths: the fit returns
    them."""
    pts = [(r, d, 0.3 * r / (r + 40) * d / (d + 160)) for r in (32, 64, 128, 256, 512, 1024) for d in (96, 384, 1536)]
    c, r0, h0, err = kernel_check.fit_kernel_curve(pts)
    assert (round(c, 6), r0, h0, round(err, 9)) == (0.3, 40, 160, 0.0)


def test_block_fp8_is_the_steadiest_format(fits) -> None:
    """The measured point of session 30: every chip and vLLM release runs block-scaled FP8 experts near a third of the
    FP8 peak, one curve fitting every shape's layers within 8% (median). Session 31's: TensorRT-LLM's block-FP8 kernel
    needs an expert several times wider than its bf16 kernel to reach half its rate (half_dim), on both chips."""
    vllm = [v for (e, _, fmt), v in fits.items() if fmt == "fp8_block" and e.startswith("vllm")]
    assert len(vllm) == 4
    for v in vllm:
        assert 0.3 < v["fraction"] < 0.4 and v["median_abs_error"] < 0.08
    for chip in ("h100-sxm", "h200"):
        block, bf16 = fits[("trtllm", chip, "fp8_block")], fits[("trtllm", chip, "bf16")]
        assert block["half_dim"] > 4 * bf16["half_dim"] and block["median_abs_error"] < 0.06


def test_the_tables_read_in_the_units_their_headers_state() -> None:
    """No measured layer does its expert FLOPs faster than its format's dense peak (the FP8 peak for fp8 formats, the
    bf16 peak otherwise; A100: 312 TFLOP/s bf16, NVIDIA A100 datasheet; H100 SXM has H200's peaks): a misread unit (us
    for ms) would break that by 1000x."""
    vllm, trt = kernel_check.vllm_moe_rows(), kernel_check.trtllm_moe_rows()
    assert (len(vllm), len(trt)) == (5400 + 243, 3168)
    for r in vllm + trt:
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


def test_block_fp8_experts_run_each_engines_measured_curve_by_hand() -> None:
    """Qwen3-235B-A22B-FP8 at TP 2 on one H200, 8,192 tokens: 8192 x 8 routed rows over the 128 experts (all touched)
    = 512 rows each, experts 1,536/2 = 768 wide on each GPU. vLLM 0.14's FusedMoE curve (serving.yaml): 0.30 x
    512/(512 + 48) x 768/(768 + 128) of the FP8 peak; TensorRT-LLM's: 0.50 x 512/(512 + 44) x 768/(768 + 1232); the
    engine without a curve (SGLang): the generic rate, 0.62 (efficiency.yaml fp8_peak_fraction) x min(512/(512 + 128),
    768/(768 + 256))."""
    m, chip = load_model("qwen3-235b-a22b-fp8"), load_chip("h200")
    eff = default_efficiency(chip)
    flops = 2 * 8192 * 8 * 3 * 4096 * 1536 / 2

    def t(engine: str, model=m) -> float:
        return routed_expert_gemm_s(model, chip, ServeConfig(tp=2, weight_dtype="fp8", engine=engine), eff, 8192.0)

    assert t("vllm@0.14") == pytest.approx(flops / (H200_FP8_PEAK * 0.30 * 512 / 560 * 768 / 896), rel=1e-9)
    assert t("trtllm") == pytest.approx(flops / (H200_FP8_PEAK * 0.50 * 512 / 556 * 768 / 2000), rel=1e-9)
    assert t("trtllm@0.17") == t("trtllm")  # the release preset keeps the current kernel's curve
    assert t("sglang") == pytest.approx(flops / (H200_FP8_PEAK * 0.62 * 0.75), rel=1e-9)
    # the current vLLM preset's per-tensor FP8 kernel (0.18 / 181 / 208) is slower than its block-scaled one (0.34 / 42
    # / 192)
    tensor, block = t("vllm", load_model("qwen3-235b-a22b")), t("vllm")
    assert tensor == pytest.approx(flops / (H200_FP8_PEAK * 0.18 * 512 / 693 * 768 / 976), rel=1e-9)
    assert block == pytest.approx(flops / (H200_FP8_PEAK * 0.34 * 512 / 554 * 768 / 960), rel=1e-9)
    assert tensor > block


def test_small_problems_follow_the_engines_own_ramp() -> None:
    """At 64 tokens (128 (1 - (1 - 8/128)^64) = 126.1 experts touched, 4.06 rows each) vLLM 0.14's curve gives
    0.30 x 768/(768 + 128) x 4.06/(4.06 + 48) of the FP8 peak, by hand."""
    m, chip = load_model("qwen3-235b-a22b-fp8"), load_chip("h200")
    eff = default_efficiency(chip)
    rows = 64 * 8 / (128 * (1 - (1 - 8 / 128) ** 64))
    flops = 2 * 64 * 8 * 3 * 4096 * 1536 / 2
    got = routed_expert_gemm_s(m, chip, ServeConfig(tp=2, weight_dtype="fp8", engine="vllm@0.14"), eff, 64.0)
    assert got == pytest.approx(flops / (H200_FP8_PEAK * 0.30 * 768 / 896 * rows / (rows + 48)), rel=1e-9)


def test_engines_and_chips_without_a_measurement_have_no_curve() -> None:
    for engine in ("default", "sglang", "lmdeploy"):
        assert engine_grouped_kernel(ServeConfig(engine=engine), load_chip("h200"), "fp8_block") is None
    assert engine_grouped_kernel(ServeConfig(engine="vllm"), load_chip("a100-80gb"), "bf16") is None
    assert engine_grouped_kernel(ServeConfig(engine="trtllm"), load_chip("a100-80gb"), "bf16") is None
    assert engine_grouped_kernel(ServeConfig(engine="vllm@0.14"), load_chip("h200"), "mxfp4") is None
    assert engine_grouped_kernel(ServeConfig(engine="vllm"), load_chip("h200"), "fp8_block") == (0.34, 42.0, 192.0)
    for engine in ("trtllm", "trtllm@0.17"):
        assert engine_grouped_kernel(ServeConfig(engine=engine), load_chip("h200"), "fp8_block") == (0.50, 44.0, 1232.0)


def test_serve_json_names_the_experts_format_and_the_engines_curve(capsys) -> None:
    from conftest import run_cli

    base = ["serve", "--hardware", "h200", "--chips", "8", "--input-len", "1000", "--output-len", "200", "--tp", "8",
            "--json"]
    code, out, _ = run_cli(base + ["--model", "qwen3-235b-a22b-fp8", "--engine", "vllm"], capsys)
    assert code == 0
    o = json.loads(out)
    assert o["config"]["weight_dtype"] == "fp8"  # the release's own format, unasked
    assert o["expert_gemms"] == {"format": "fp8_block", "engine_fraction": 0.34, "engine_rows_half": 42.0,
                                 "engine_half_dim": 192.0}
    code, out, _ = run_cli(base + ["--model", "qwen3-235b-a22b", "--quant", "fp8", "--engine", "trtllm"], capsys)
    assert code == 0 and json.loads(out)["expert_gemms"] == {"format": "fp8", "engine_fraction": 0.74,
                                                         "engine_rows_half": 76.0, "engine_half_dim": 576.0}
    code, out, _ = run_cli(base + ["--model", "qwen3-235b-a22b", "--quant", "fp8", "--engine", "sglang"], capsys)
    assert code == 0 and json.loads(out)["expert_gemms"] == {"format": "fp8", "engine_fraction": None,
                                                         "engine_rows_half": None, "engine_half_dim": None}
    code, out, _ = run_cli(base + ["--model", "llama3.1-8b"], capsys)
    assert code == 0 and "expert_gemms" not in json.loads(out)


def test_serve_table_names_the_experts_format(capsys) -> None:
    from conftest import run_cli

    code, out, _ = run_cli(["serve", "--model", "qwen3-235b-a22b-fp8", "--hardware", "h200", "--chips", "8",
                            "--input-len", "1000", "--output-len", "200", "--tp", "8", "--engine", "vllm@0.14"], capsys)
    assert code == 0
    line = next(x for x in out.splitlines() if "MoE expert GEMMs" in x)
    assert "fp8_block" in line and "0.30" in line and "(rows + 48)" in line and "(d + 128)" in line
