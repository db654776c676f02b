"""gpt-oss served as it ships (session 21, QA finding: `serve --model gpt-oss-120b` on one H100 said "does not fit"
because every weight was timed and stored in bf16, 217 GiB, where the released checkpoint keeps its experts in MXFP4 and
vLLM serves it on one 80 GB GPU)."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from meshplan.infer.config import ServeConfig
from meshplan.infer.memory import weight_bytes_per_chip
from meshplan.specs.model import load_model

GPT_OSS = load_model("gpt-oss-120b")
ARGS = ["serve", "--model", "gpt-oss-120b", "--hardware", "h100-sxm", "--chips", "1", "--input-len", "1000",
        "--output-len", "1000", "--engine", "vllm", "--json"]


def test_mxfp4_weights_are_the_released_checkpoints_size():
    # hand count from config.json: 36 layers x 128 experts x 3 x 2880 x 2880 expert weights at 4.25 bits (32 E2M1
    # values and one E8M0 scale, OCP MX v1.0); the rest of the model card's 116.83 B parameters in bf16
    experts = 36 * 128 * 3 * 2880 * 2880
    hand = experts * 4.25 / 8 + (116.83e9 - experts) * 2
    assert weight_bytes_per_chip(GPT_OSS, ServeConfig(weight_dtype="mxfp4")) == pytest.approx(hand, rel=0.01)
    # about 61 GiB: what lets the 120B model run on one 80 GB GPU (gpt-oss model card)
    assert 60 * 2**30 < hand < 62 * 2**30


def test_default_quant_is_the_checkpoints_and_fits_one_h100(capsys):
    code, out, _ = run_cli(ARGS, capsys)
    assert code == 0
    d = json.loads(out)
    assert d["config"]["weight_dtype"] == "mxfp4" and d["batch"] > 1
    code, _, err = run_cli([*ARGS, "--quant", "bf16"], capsys)
    assert code == 2 and "does not fit" in err


def test_mxfp4_on_a_bf16_checkpoint_is_one_error_line(capsys):
    code, _, err = run_cli(["serve", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "1", "--input-len",
                            "100", "--output-len", "100", "--quant", "mxfp4"], capsys)
    assert code == 2 and err.startswith("error:") and err.count("\n") == 1 and "bf16" in err


def test_export_and_from_keep_the_checkpoint_format(tmp_path, capsys):
    code, out, _ = run_cli([*ARGS[:-1], "--export", "vllm", "--out", str(tmp_path), "--json"], capsys)
    assert code == 0
    planned = json.loads(out)
    text = (tmp_path / "vllm.sh").read_text()
    assert "--quantization" not in text  # vLLM reads MXFP4 from the checkpoint's config.json
    code, out, _ = run_cli(["serve", "--from", str(tmp_path / "vllm.sh"), "--hardware", "h100-sxm", "--input-len",
                            "1000", "--output-len", "1000", "--json"], capsys)
    assert code == 0
    yours = json.loads(out)["yours"]
    assert yours["config"]["weight_dtype"] == "mxfp4" and yours["tpot_s"] == pytest.approx(planned["tpot_s"])
