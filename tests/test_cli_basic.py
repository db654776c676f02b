"""CLI contract tests for `model`, `hardware`, `roofline` (DESIGN.md JSON shapes and the error contract)."""

from __future__ import annotations

import json

from conftest import run_cli


def test_model_json_contract(capsys):
    code, out, _ = run_cli(["model", "llama3-70b", "--json"], capsys)
    assert code == 0
    d = json.loads(out)
    for key in ("name", "params_total", "params_active", "flops_per_token_forward", "flops_per_token_training",
                "kv_cache_bytes_per_token"):
        assert key in d
    assert set(d["kv_cache_bytes_per_token"]) >= {"bf16", "fp8", "int8"}
    # Llama 3 70B: 2 (K and V) x 80 layers x 8 KV heads x 128 dims x 2 bytes
    assert d["kv_cache_bytes_per_token"]["bf16"] == 2 * 80 * 8 * 128 * 2
    assert abs(d["params_total"] / 70.6e9 - 1) < 0.005


def test_hardware_json_contract(capsys):
    code, out, _ = run_cli(["hardware", "h100-sxm", "--json"], capsys)
    assert code == 0
    d = json.loads(out)
    for key in ("name", "peak_flops_per_s", "hbm_bytes", "hbm_bandwidth_bytes_per_s",
                "host_bandwidth_bytes_per_s", "links", "price_per_chip_hour"):
        assert key in d
    assert d["peak_flops_per_s"]["bf16"] == 9.89e14  # datasheet 1979 TFLOPS sparse / 2
    assert set(d["peak_flops_per_s"]) >= {"bf16", "fp8", "int8"}


def test_hardware_list_has_every_preset(capsys):
    code, out, _ = run_cli(["hardware", "--json"], capsys)
    names = {c["name"] for c in json.loads(out)}
    assert code == 0
    assert names >= {"tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "a100-40gb", "a100-80gb", "h100-sxm", "h200",
                     "h800", "b200"}


def test_roofline_json_and_plot(capsys, tmp_path):
    png = tmp_path / "r.png"
    code, out, _ = run_cli(["roofline", "--model", "llama3-70b", "--hardware", "tpu-v5e", "--json",
                            "--plot", str(png)], capsys)
    assert code == 0 and png.stat().st_size > 1000
    d = json.loads(out)
    assert abs(d["critical_intensity"] - 1.97e14 / 8.2e11) < 1e-6
    by_name = {o["name"]: o for o in d["ops"]}
    # 4096 tokens per chip through the 8192x28672 MLP: intensity well above 240, compute-bound
    assert by_name["mlp/up"]["bound"] == "compute"
    assert by_name["norm/attn"]["bound"] == "memory"


def test_roofline_op_mode(capsys):
    code, out, _ = run_cli(["roofline", "--hardware", "h100-sxm", "--op", "matmul:128,8192,8192", "--json"], capsys)
    op = json.loads(out)["ops"][0]
    # 2·128·8192·8192 FLOPs; bytes 2·(128·8192 + 8192² + 128·8192)
    assert code == 0
    assert op["flops"] == 2 * 128 * 8192 * 8192
    assert op["bytes"] == 2 * (2 * 128 * 8192 + 8192 * 8192)
    assert op["bound"] == "memory"  # intensity ≈ 124 < 295


def test_unknown_hardware_suggests(capsys):
    code, _, err = run_cli(["hardware", "h100"], capsys)
    assert code == 2 and err.startswith("error:") and "h100-sxm" in err
    assert len(err.strip().splitlines()) == 1


def test_bad_option_is_one_error_line(capsys):
    code, _, err = run_cli(["roofline", "--bogus"], capsys)
    assert code == 2 and err.startswith("error:")


def test_user_hardware_yaml_missing_field(capsys, tmp_path):
    bad = tmp_path / "chip.yaml"
    bad.write_text("name: mychip\nkind: gpu\npeak_flops_per_s: {bf16: 1.0e+15}\n")
    code, _, err = run_cli(["hardware", str(bad)], capsys)
    assert code == 2 and err.startswith("error:") and "hbm_bytes" in err
