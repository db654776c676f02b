"""Issue #14 (fine-grained MoE, session s10): Megatron-Core's unfused YaRN RoPE (Options.unfused_yarn_rope). gpt-oss
scales its RoPE by YaRN (config.json rope_scaling: rope_type "yarn", factor 32); Megatron-Core's concentration factor
0.1·ln(32) + 1 = 1.347 != 1 sends `apply_rotary_pos_emb` to the op-by-op `_apply_rotary_pos_emb_bshd` (rope_utils.py),
12 element passes forward and 13 backward per element of q and k where the fused kernel moves 2 (costmodel.py
UNFUSED_ROPE_*). Every number below is worked by hand."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from meshplan.cost.efficiency import default_efficiency
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model, model_from_hf
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.frameworks import preset
from meshplan.train.space import Problem

# gpt-oss-120b: 64 query and 8 KV heads of 64: (64 + 8) x 64 = 4,608 elements of q and k a token
Q_K_ELEMENTS = (64 + 8) * 64


def _cm(options: Options, model: str = "gpt-oss-120b", tp: int = 1, mb: int = 1):
    prob = Problem(load_model(model), load_chip("b200"), 8, 4096, 8)
    cm = CostModel(prob, default_efficiency(prob.chip), options)
    L = LayoutArrays.from_configs([ParallelConfig(dp=8 // tp, tp=tp, microbatch=mb, recompute="none")])
    return cm, cm.geometry(L)


def _pointwise(options: Options, **kw) -> tuple[float, float]:
    cm, g = _cm(options, **kw)
    out = cm._pointwise_term(g)
    return float(out["hbm"][0]), float(out["hbm_b"][0])


def test_gpt_oss_catalog_model_is_yarn() -> None:
    assert load_model("gpt-oss-120b").rope_scaling == "yarn"
    assert load_model("gpt-oss-20b").rope_scaling == "yarn"
    assert load_model("qwen3-30b-a3b").rope_scaling == ""
    # Megatron-Core's concentration factor for gpt-oss (yarn_rotary_pos_embedding.py _yarn_get_mscale): not 1
    assert 0.1 * math.log(32.0) + 1.0 == pytest.approx(1.3466, abs=1e-4)


def test_hf_config_rope_scaling_is_read() -> None:
    """config.json's rope_scaling (or transformers' newer rope_parameters) gives its rope_type, or its older `type`."""
    base = {"model_type": "llama", "hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
            "intermediate_size": 1024, "vocab_size": 1000}
    assert model_from_hf(base, "t", "test").rope_scaling == ""
    assert model_from_hf(dict(base, rope_scaling={"rope_type": "llama3"}), "t", "test").rope_scaling == "llama3"
    assert model_from_hf(dict(base, rope_scaling={"type": "YaRN"}), "t", "test").rope_scaling == "yarn"
    assert model_from_hf(dict(base, rope_parameters={"rope_type": "yarn"}), "t", "test").rope_scaling == "yarn"


def test_unfused_yarn_rope_bytes_by_hand() -> None:
    """One micro-batch of 4,096 tokens, bf16 (2 B). Forward: (12 - 2) passes x 4,608 elements x 2 B x 4,096 tokens =
    377,487,360 B more; backward: (13 - 4) x 4,608 x 2 x 4,096 = 339,738,624 B more."""
    f0, b0 = _pointwise(Options())
    f1, b1 = _pointwise(Options(unfused_yarn_rope=True))
    assert 10 * Q_K_ELEMENTS * 2 * 4096 == 377_487_360
    assert 9 * Q_K_ELEMENTS * 2 * 4096 == 339_738_624
    assert (f1 - f0, b1 - b0) == (pytest.approx(377_487_360), pytest.approx(339_738_624))
    # under TP 2 the heads halve: half the bytes
    g0, _ = _pointwise(Options(), tp=2)
    g1, _ = _pointwise(Options(unfused_yarn_rope=True), tp=2)
    assert g1 - g0 == pytest.approx(377_487_360 / 2)


def test_unfused_yarn_rope_seconds_and_launches() -> None:
    """The extra bytes are timed at the chip's HBM rate (B200: 8e12 B/s x 0.80 = 6.4e12 B/s) and the 10 extra launches
    (5 on each of q and k) at kernel_overhead_s (4 us): forward 377,487,360 / 6.4e12 + 10 x 4e-6 = 98.98 us."""
    cm0, g0 = _cm(Options())
    cm1, g1 = _cm(Options(unfused_yarn_rope=True))
    assert float(cm1.layer_kernels_fwd(g1)["attn"]) == 15 + 10
    assert float(cm0.layer_kernels_fwd(g0)["attn"]) == 15
    assert cm1.hbm == pytest.approx(8.0e12 * 0.80)
    df = float(cm1._pointwise_term(g1)["f_s"][0] - cm0._pointwise_term(g0)["f_s"][0])
    assert df == pytest.approx(377_487_360 / 6.4e12 + 10 * 4e-6)
    assert df == pytest.approx(98.98e-6, rel=1e-3)


def test_only_yarn_models_and_megatron_presets() -> None:
    """No effect on a model without YaRN (Qwen3-30B-A3B's plain RoPE); on for the Megatron-Core presets only."""
    assert _pointwise(Options(unfused_yarn_rope=True), model="qwen3-30b-a3b") == _pointwise(
        Options(), model="qwen3-30b-a3b")
    assert preset("nemo")["unfused_yarn_rope"] and preset("megatron")["unfused_yarn_rope"]
    assert not preset("torchtitan").get("unfused_yarn_rope", False)


def test_measurement_rows_carry_yarn_and_the_option() -> None:
    """The Megatron-Bridge gpt-oss rows take rope_scaling from the catalog model and the option from the nemo preset."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from _measurements import model_of, options_of
    from _split import load_new_training

    rows = [e for e in load_new_training() if e.get("split") == "tuning" and "gpt-oss" in e["id"]
            and e["id"].startswith("mbridge_")]
    assert rows
    for e in rows:
        assert model_of(e).rope_scaling == "yarn", e["id"]
        assert options_of(e).unfused_yarn_rope, e["id"]
