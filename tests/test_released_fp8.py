"""A checkpoint released in FP8 is served as it ships (session 21, QA finding: DeepSeek-V3 on 8 x B200, its standard
deployment, was refused as 'does not fit' in bf16, 1.22 TiB, though its config.json says quant_method fp8)."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from meshplan.infer.config import native_weight_dtype
from meshplan.math.transformer import native_weight_bytes
from meshplan.specs.model import load_model


def test_deepseek_v3_ships_fp8_linear_weights():
    m = load_model("deepseek-v3")
    assert native_weight_dtype(m) == "fp8"
    # hand count: 671 B parameters (technical report, MTP module aside), the untied 129,280 x 7,168 embedding and
    # LM head in bf16, every other weight one byte
    tables = 2 * 129280 * 7168
    assert native_weight_bytes(m) == pytest.approx((671e9 - tables) * 1 + tables * 2, rel=0.01)
    assert native_weight_dtype(load_model("llama3-70b")) == "bf16"


def test_default_quant_serves_deepseek_v3_on_eight_b200(capsys):
    code, out, _ = run_cli(["serve", "--model", "deepseek-v3", "--hardware", "b200", "--chips", "8", "--input-len",
                            "2000", "--output-len", "500", "--json"], capsys)
    assert code == 0
    assert json.loads(out)["config"]["weight_dtype"] == "fp8"


def test_a_config_json_with_fp8_quantization_is_read(tmp_path, capsys):
    cfg = {"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
           "num_key_value_heads": 8, "intermediate_size": 2816, "vocab_size": 32000,
           "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert load_model(str(path)).released_weight_dtype == "fp8"
