"""Issue #14: FP8 on the routed experts alone (Options.fp8_scope "experts": torchtitan's `quantize.grouped_mm`
converters without a linear one, as the PyTorch/Nebius DeepSeek-V3 recipe ran MXFP8): the dense GEMMs keep the bf16
rate, the grouped GEMMs take the FP8 one, and the casts cover the experts' operands only; worked by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_cli

from meshplan.cost.efficiency import default_efficiency
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.frameworks import fp8_scope_of
from meshplan.train.space import Problem

TORCHAO = dict(fp8_fused_casts=False, fp8_weight_cache=False, fp8_recipe="tensorwise")  # torchtitan's float8


def _cm(dtype: str = "fp8", scope: str = "all", model: str = "qwen3-30b-a3b"):
    prob = Problem(load_model(model), load_chip("h100-sxm"), 8, 4096, 8)
    opts = Options(compute_dtype=dtype, fp8_scope=scope, **(TORCHAO if dtype == "fp8" else {}))
    cm = CostModel(prob, default_efficiency(prob.chip), opts)
    L = LayoutArrays.from_configs([ParallelConfig(fsdp=8, ep=8, microbatch=1)])
    return cm, cm.geometry(L)


def _f(x) -> float:
    return float(np.asarray(x).ravel()[0])


def test_dense_gemms_at_the_bf16_rate_and_experts_at_the_fp8_rate() -> None:
    """The attention projections (dense) time as under bf16; the routed experts' grouped GEMM as under FP8 for every
    linear; the step lands between bf16 and all-FP8."""
    (bf, gb), (ex, ge), (al, ga) = _cm("bf16"), _cm(scope="experts"), _cm(scope="all")
    t, routed = 4096, 2 * 4096 * ex.c["routed_w_active"]
    assert _f(ex._attention_projections(t, 1)[0]) == pytest.approx(_f(bf._attention_projections(t, 1)[0]))
    assert _f(ex._attention_projections(t, 1)[0]) > _f(al._attention_projections(t, 1)[0])
    assert _f(ex._grouped_gemm_s(ge, routed)) == pytest.approx(_f(al._grouped_gemm_s(ga, routed)))
    assert _f(ex._grouped_gemm_s(ge, routed)) < _f(bf._grouped_gemm_s(gb, routed))
    assert ex.mm_peak == bf.peak_bf16 and ex.expert_mm_peak == al.mm_peak


def test_expert_casts_by_hand() -> None:
    """Qwen3-30B-A3B (D 2048, expert F 768, top-8, every layer MoE), 4096 tokens, tp 1 (t_expert = 4096), torchao's
    compiled tensorwise float8 (fp8_recipes.yaml unfused: input [6, 0], weight [5, 3], grad_output 6, producer read 2):
    the experts' GEMM inputs are 4096·8·2048 routed copies into fc1 plus 4096·8·768 fc2 inputs = 92,274,688 elements,
    their output gradients 4096·2·8·768 + 4096·8·2048 = 117,440,512, their weights 3·2048·768·8 = 37,748,736 (cast on
    every forward). Forward (6 - 2)·92,274,688 + 5·37,748,736 = 557,842,432 B; backward (6 - 2)·117,440,512 +
    3·37,748,736 = 583,008,256 B."""
    cm, g = _cm(scope="experts")
    cast = cm._fp8_cast_term(g)
    assert _f(cast["hbm_f"]) == pytest.approx(557_842_432)
    assert _f(cast["hbm_b"]) == pytest.approx(583_008_256)
    # every linear casts more: the projections' and router's operands join
    al, ga = _cm(scope="all")
    assert _f(al._fp8_cast_term(ga)["hbm_f"]) > _f(cast["hbm_f"])


def test_cli_scope_moves_only_the_time_and_refuses_a_dense_model(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["train", "-m", "qwen3-30b-a3b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len", "4096",
            "--global-batch", "64", "--fsdp", "8", "--ep", "8", "--microbatch", "1", "--recompute", "full",
            "--framework", "torchtitan", "--json"]
    steps, flops = {}, {}
    for name, extra in (("bf16", []), ("experts", ["--dtype", "fp8", "--fp8-scope", "experts"]),
                        ("all", ["--dtype", "fp8"])):
        code, out, _ = run_cli(base + extra, capsys)
        assert code == 0
        best = json.loads(out)["plans"][0]
        steps[name], flops[name] = best["step_time_s"], best["ledger"]["flops"]
    assert steps["all"] < steps["experts"] < steps["bf16"]
    assert flops["experts"] == flops["bf16"]  # the same work, at other rates
    code, _, err = run_cli(["train", "-m", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len", "4096",
                            "--global-batch", "64", "--dtype", "fp8", "--fp8-scope", "experts"], capsys)
    assert code == 2 and err.startswith("error: --fp8-scope experts needs a MoE model") and err.count("\n") == 1


def test_a_dense_model_is_refused_in_python_too() -> None:
    with pytest.raises(Exception, match="has none"):
        _cm(scope="experts", model="llama3-8b")


@pytest.mark.parametrize(("text", "scope"), [
    ("mxfp8 on the routed experts grouped gemms only, bf16 elsewhere", "experts"),
    ("fp8 current scaling (tensorwise)", None), ("bf16", None)])
def test_descriptions_name_the_scope(text: str, scope: str | None) -> None:
    assert fp8_scope_of(text) == scope


def _export(tmp_path, capsys, *extra: str) -> tuple[int, str, str]:
    code, _, err = run_cli(["train", "-m", "qwen3-30b-a3b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len",
                            "4096", "--global-batch", "64", "--fsdp", "8", "--ep", "8", "--microbatch", "1",
                            "--recompute", "full", "--framework", "torchtitan", "--dtype", "fp8", "--fp8-recipe",
                            "rowwise", *extra, "--export", "torchtitan", "--out", str(tmp_path)], capsys)
    text = (tmp_path / "torchtitan.toml").read_text() if code == 0 else ""
    return code, text, err


@pytest.mark.parametrize(("scope", "converters"), [
    ("all", ["quantize.linear.float8", "quantize.grouped_mm.float8"]), ("experts", ["quantize.grouped_mm.float8"])])
def test_torchtitan_export_quantizes_the_experts_and_reads_back_its_scope(tmp_path, capsys, scope, converters) -> None:
    """torchtitan's float8 linear converter leaves the experts' grouped GEMMs alone (torchtitan float8.py @e347b1e:
    Float8GroupedMMConverter is a converter of its own, `quantize.grouped_mm.float8`): an FP8 MoE plan names both, an
    experts-only plan the grouped one alone, and the file reads back as that scope."""
    import tomllib

    from meshplan.export import torchtitan

    code, text, err = _export(tmp_path, capsys, "--fp8-scope", scope)
    assert code == 0, err
    doc = tomllib.loads(text)
    assert doc["model"]["converters"] == converters
    assert doc["quantize"]["grouped_mm"]["float8"]["fqns"] == ["experts"]
    assert ("linear" in doc["quantize"]) == (scope == "all")
    job = torchtitan.load(text, 8)
    assert job.options["compute_dtype"] == "fp8" and job.options.get("fp8_scope", "all") == scope


def test_torchtitan_export_refuses_fp8_experts_under_pipelining(tmp_path, capsys) -> None:
    # Float8GroupedMMConverter asserts pipeline_parallel_degree == 1 (torchtitan float8.py @e347b1e)
    code, _, err = run_cli(["train", "-m", "qwen3-30b-a3b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len",
                            "4096", "--global-batch", "64", "--fsdp", "4", "--pp", "2", "--ep", "4", "--microbatch", "1",
                            "--recompute", "full", "--dtype", "fp8", "--fp8-recipe", "rowwise", "--export",
                            "torchtitan", "--out", str(tmp_path)], capsys)
    assert code == 2 and "Float8GroupedMMConverter" in err and err.count("\n") == 1


def test_megatron_export_refuses_the_experts_only_scope(tmp_path, capsys) -> None:
    # Transformer Engine's fp8_autocast covers every TE linear; Megatron-LM has no experts-only FP8 switch
    code, _, err = run_cli(["train", "-m", "qwen3-30b-a3b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len", "4096",
                            "--global-batch", "64", "--ep", "8", "--dtype", "fp8", "--fp8-scope", "experts",
                            "--export", "megatron", "--out", str(tmp_path)], capsys)
    assert code == 2 and "megatron cannot express this plan: GEMMs in FP8" in err and err.count("\n") == 1
