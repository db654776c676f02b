"""FP8 scaling recipes (`--fp8-recipe`, cost/data/fp8_recipes.yaml) and versioned framework presets
(`--framework name@version`), issue #14. Every expected number is worked out by hand below, not read from the
data file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import run_cli

from meshplan.cost.efficiency import default_efficiency
from meshplan.errors import MeshplanError
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.frameworks import fp8_recipe_of, framework_options
from meshplan.train.space import Problem

# Llama 3 8B, one chip, one micro-batch of 4096 tokens: the operands the casts touch
T, D, F, KV = 4096, 4096, 14336, 1024
NORMED = T * (D + D)  # qkv and gate/up inputs, the norms' outputs
OTHERS = T * (D + F)  # output-projection and down-projection inputs
INPUTS = NORMED + OTHERS
WEIGHTS = 2 * D * D + 2 * D * KV + 3 * D * F
GRAD_OUTS = T * ((D + 2 * KV) + D + 2 * F + D)  # output gradients of qkv, output, gate/up, down

# (forward, backward) cast bytes per recipe, by hand (bf16 read 2 B, fp8 write 1 B, amax read 2 B):
UNFUSED = {  # torchao's Float8Linear under torch.compile, kernel by kernel as torchao's roofline counts them
    # (torchao/testing/training/roofline_utils.py): the amax pass of an input or output gradient rides in the kernel
    # producing it, so an input costs read 2 + write fp8 twice (row- and column-major) 1 + 1 = 4, all in the forward;
    # an output gradient the same 4 in the backward; a weight amax 2 + cast 2 + 1 forward (5) and its column-major
    # cast 2 + 1 backward (3)
    "tensorwise": (4 * INPUTS + 5 * WEIGHTS, 4 * GRAD_OUTS + 3 * WEIGHTS),
    # delayed (not in torchao's roofline): the cast read 2 + write 1 = 3 per operand and per transposed copy
    "delayed": (3 * (INPUTS + WEIGHTS), 3 * GRAD_OUTS + 3 * (INPUTS + WEIGHTS)),
    # rowwise: no amax pass; an input's first kernel writes its fp8 copy 1 and a bf16 transposed copy 2 (its read rides
    # in the producer), the second reads that copy 2 and writes fp8 1; a gradient both in the backward (1 + 2 + 3 = 6);
    # a weight cast 2 + 1 forward, transposed 2 + 2 and cast 2 + 1 backward
    "rowwise": (3 * INPUTS + 3 * WEIGHTS, 3 * INPUTS + 6 * GRAD_OUTS + 7 * WEIGHTS),
    # tile amax in the casting kernel (3); the other tiling again from bf16 (3), gradients twice (3 + 3)
    "blockwise": (3 * (INPUTS + WEIGHTS), (3 + 3) * GRAD_OUTS + 3 * (INPUTS + WEIGHTS)),
}
FUSED = {  # torchao: one kernel per cast
    # amax 2 + read 2 + write 1 = 5 per operand; backward: grads 5, transposed copies read 2 + write 1 = 3
    "tensorwise": (5 * (INPUTS + WEIGHTS), 5 * GRAD_OUTS + 3 * (INPUTS + WEIGHTS)),
    # scale from the history: read 2 + write 1 = 3 everywhere
    "delayed": (3 * (INPUTS + WEIGHTS), 3 * GRAD_OUTS + 3 * (INPUTS + WEIGHTS)),
    # row scales do not survive a transpose: the backward's copies are requantised from bf16 (5), and the
    # gradients quantised twice, once per axis (5 + 5)
    "rowwise": (5 * (INPUTS + WEIGHTS), (5 + 5) * GRAD_OUTS + 5 * (INPUTS + WEIGHTS)),
    # tile amax in the casting kernel (3); the other tiling again from bf16 (3), gradients twice (3 + 3)
    "blockwise": (3 * (INPUTS + WEIGHTS), (3 + 3) * GRAD_OUTS + 3 * (INPUTS + WEIGHTS)),
}
FUSED = {  # Transformer Engine: one cast-transpose writes both fp8 copies (read 2, write 1 + 1)
    # amax pass 2 + 4 = 6, and the norm cannot emit fp8 before the amax is known: its outputs cast too (6)
    "tensorwise": (6 * (OTHERS + WEIGHTS), 6 * GRAD_OUTS + 6 * NORMED),
    # 4; the norm emits fp8, leaving an fp8 transpose (read 1, write 1) of its outputs for the backward
    "delayed": (4 * (OTHERS + WEIGHTS), 4 * GRAD_OUTS + 2 * NORMED),
    # one pass for both axes' amax (2) + read 2 + write 1 + 1 = 6, norm outputs like any other
    "rowwise": (6 * (OTHERS + WEIGHTS), 6 * GRAD_OUTS + 6 * NORMED),
    # no amax pass: 4, norm outputs cast like any other (4)
    "blockwise": (4 * (OTHERS + WEIGHTS), 4 * GRAD_OUTS + 4 * NORMED),
}


def _cast_seconds(hardware: str, opts: Options) -> tuple[float, float, float]:
    """(forward, backward) pointwise seconds and the forward GEMM seconds of one layer."""
    prob = Problem(load_model("llama3-8b"), load_chip(hardware), 1, T, 1)
    cm = CostModel(prob, default_efficiency(prob.chip), opts)
    L = LayoutArrays.from_configs([ParallelConfig(microbatch=1, recompute="none")])
    ct = cm.compute_terms(L, cm.geometry(L))
    elem_f = float((ct["layer_fwd"] - ct["layer_matmul_fwd"] - ct["layer_core_fwd"])[0])
    elem_b = float((ct["layer_bwd"] - 2 * ct["layer_matmul_fwd"] - ct["layer_core_bwd"])[0])
    return elem_f, elem_b, float(ct["layer_matmul_fwd"][0])


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise", "blockwise"])
def test_each_recipe_casts_its_bytes(recipe: str, fused: bool) -> None:
    bf16_f, bf16_b, _ = _cast_seconds("h100-sxm", Options())
    f, b, _ = _cast_seconds("h100-sxm", Options(compute_dtype="fp8", fp8_recipe=recipe, fp8_fused_casts=fused))
    chip = load_chip("h100-sxm")
    hbm = chip.hbm_bandwidth_bytes_per_s * default_efficiency(chip).hbm_fraction
    want_f, want_b = (FUSED if fused else UNFUSED)[recipe]
    assert f - bf16_f == pytest.approx(want_f / hbm, rel=1e-9)
    assert b - bf16_b == pytest.approx(want_b / hbm, rel=1e-9)


def test_the_default_recipe_follows_the_cast_implementation() -> None:
    """Before --fp8-recipe existed, fused casts meant TE's delayed scaling and unfused ones torchao's tensorwise:
    with no recipe given the plan is what it was."""
    assert Options().fp8_scaling == "delayed"
    assert Options(fp8_fused_casts=False).fp8_scaling == "tensorwise"
    assert Options(fp8_fused_casts=False, fp8_recipe="rowwise").fp8_scaling == "rowwise"


@pytest.mark.parametrize(("hardware", "recipe", "fraction"), [
    ("h100-sxm", "delayed", 1.0),  # the same per-tensor cuBLAS GEMM
    ("h100-sxm", "rowwise", 0.9),  # pytorch/pytorch#147971: most shapes at 90-100% of tensorwise
    ("h100-sxm", "blockwise", 1042 / 1227),  # DeepGEMM M=4096 median 1042 TFLOPS / tensorwise 0.62 x 1979 = 1227
    # MXFP8 on Blackwell: TE's GEMM profiling guide (B300, kernels only): 163.493 ms per-tensor / 171.869 ms MXFP8
    ("b200", "blockwise", 163.493 / 171.869),
])
def test_each_recipe_runs_its_gemms_at_its_fraction(hardware: str, recipe: str, fraction: float) -> None:
    _, _, tensorwise = _cast_seconds(hardware, Options(compute_dtype="fp8", fp8_recipe="tensorwise"))
    _, _, other = _cast_seconds(hardware, Options(compute_dtype="fp8", fp8_recipe=recipe))
    assert tensorwise / other == pytest.approx(fraction, rel=2e-3)  # 1042/1227 = 0.849, the file says 0.85


ARGS = ["train", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len", "8192",
        "--global-batch", "16", "--fsdp", "8", "--dp", "1", "--tp", "1", "--pp", "1", "--cp", "1",
        "--microbatch", "2", "--recompute", "full", "--dtype", "fp8", "--json"]


def test_fp8_recipe_flag_through_the_cli(capsys) -> None:
    steps = {}
    for recipe in ("tensorwise", "rowwise"):
        code, out, _ = run_cli(ARGS + ["--framework", "torchtitan", "--fp8-recipe", recipe], capsys)
        assert code == 0
        steps[recipe] = json.loads(out)["plans"][0]["step_time_s"]
    # slower GEMMs and requantised backward operands: rowwise costs more than tensorwise
    assert steps["rowwise"] > steps["tensorwise"]
    code, out, err = run_cli(ARGS + ["--fp8-recipe", "per-block"], capsys)
    assert code == 2 and out == ""
    assert err.startswith("error: --fp8-recipe must be one of") and "rowwise" in err and len(err.splitlines()) == 1


def test_versioned_framework_presets() -> None:
    base = Options(compute_dtype="fp8")
    # the newest listed version is the current preset
    assert framework_options("torchtitan@2026.02", base, {}) == framework_options("torchtitan", base, {})
    assert framework_options("torchtitan@2025.06", base, {}).fp8_scaling == "tensorwise"
    assert framework_options("torchtitan", base, {}).fp8_scaling == "tensorwise"
    # NeMo 24.07 ran TE delayed scaling; its current recipes scale by the current amax
    assert framework_options("nemo@24.07", base, {}).fp8_scaling == "delayed"
    assert framework_options("nemo", base, {}).fp8_scaling == "tensorwise"
    # an explicit flag wins over the versioned preset too
    assert framework_options("nemo@24.07", base, {"fp8_recipe": "blockwise"}).fp8_scaling == "blockwise"
    with pytest.raises(MeshplanError, match=r"unknown version '2023.01' of framework 'torchtitan' "
                                            r"\(known versions: 2024.12, 2025.06, 2025.10, 2026.02\)"):
        framework_options("torchtitan@2023.01", base, {})
    with pytest.raises(MeshplanError, match="known versions: none"):
        framework_options("maxtext@2024.01", base, {})
    with pytest.raises(MeshplanError, match="did you mean: torchtitan"):
        framework_options("titan@2025.06", base, {})


def test_versioned_preset_through_the_cli(capsys) -> None:
    code, out, _ = run_cli(ARGS + ["--framework", "torchtitan@2026.02"], capsys)
    code2, out2, _ = run_cli(ARGS + ["--framework", "torchtitan"], capsys)
    assert code == code2 == 0 and json.loads(out)["plans"][0] == json.loads(out2)["plans"][0]
    code, out, err = run_cli(ARGS + ["--framework", "torchtitan@1999.01"], capsys)
    assert code == 2 and out == "" and err.startswith("error: unknown version '1999.01'") and "2025.06" in err


@pytest.mark.parametrize(("text", "recipe"), [
    ("delayed", "delayed"),
    ("rowwise", "rowwise"),
    ("fp8 current scaling (tensorwise)", "tensorwise"),
    ("fp8 blockwise (mxfp8, 1x32 blocks; on h100 fp8-mx is 128x128 weights / 1x128 activations)", "blockwise"),
    ("float8 linears; torch.compile", None),
])
def test_recipe_named_in_a_description(text: str, recipe: str | None) -> None:
    assert fp8_recipe_of(text) == recipe


def test_harness_passes_each_runs_recipe() -> None:
    """The benchmark harness plans each published run with the recipe its source names, and torchtitan runs that
    name none with torchtitan's default (tensorwise)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import _measurements as H
    from _split import load_new_training

    named = {"delayed": "delayed", "rowwise": "rowwise", "tensorwise": "tensorwise",
             "fp8 current scaling (tensorwise)": "tensorwise"}
    seen = set()
    for e in load_new_training() + H.load_entries():
        text = str(e["training"].get("fp8_recipe") or "")
        opts = H.options_of(e)
        if text in named:
            assert opts.fp8_scaling == named[text], e["id"]
            seen.add(named[text])
        elif text.startswith("fp8 blockwise"):
            assert opts.fp8_scaling == "blockwise", e["id"]
            seen.add("blockwise")
        elif e["group"].startswith("torchtitan_h100_2024_12") and opts.compute_dtype == "fp8":
            assert opts.fp8_scaling == "tensorwise", e["id"]
    assert seen == {"delayed", "rowwise", "tensorwise", "blockwise"}


def test_eager_float8_reads_its_inputs_once_more() -> None:
    """Without torch.compile nothing folds the amax pass (tensorwise) into the kernel producing an input or output
    gradient: 2 B more per element of each, forward and backward, torchao's roofline without `fuse_with_prev`."""
    compiled = _cast_seconds("h100-sxm", Options(compute_dtype="fp8", fp8_recipe="tensorwise", fp8_fused_casts=False))
    eager = _cast_seconds("h100-sxm", Options(compute_dtype="fp8", fp8_recipe="tensorwise", fp8_fused_casts=False,
                                              fused_elementwise=False))
    bf16_c, bf16_e = _cast_seconds("h100-sxm", Options()), _cast_seconds("h100-sxm", Options(fused_elementwise=False))
    chip = load_chip("h100-sxm")
    hbm = chip.hbm_bandwidth_bytes_per_s * default_efficiency(chip).hbm_fraction
    assert (eager[0] - bf16_e[0]) - (compiled[0] - bf16_c[0]) == pytest.approx(2 * INPUTS / hbm, rel=1e-9)
    assert (eager[1] - bf16_e[1]) - (compiled[1] - bf16_c[1]) == pytest.approx(2 * GRAD_OUTS / hbm, rel=1e-9)


def test_fsdp_float8_all_gather_casts_the_shard() -> None:
    """torchao's FSDP float8 all-gather (fsdp_param_bytes 1, tensorwise): the weight is cast on its shard before each
    gather (read fp32 4 + write 1, over 8 shards: 5/8 B per weight element, forward and backward) and the backward
    transposes the gathered fp8 copy (read 1 + write 1); without it the full weight costs 5 forward, 3 backward."""
    prob = Problem(load_model("llama3-8b"), load_chip("h100-sxm"), 8, T, 8)
    L = LayoutArrays.from_configs([ParallelConfig(fsdp=8, microbatch=1, recompute="none")])
    cast = {}
    for fpb in (2.0, 1.0):
        opts = Options(compute_dtype="fp8", fp8_recipe="tensorwise", fp8_fused_casts=False, fsdp_param_bytes=fpb)
        cm = CostModel(prob, default_efficiency(prob.chip), opts)
        t = cm._fp8_cast_term(cm.geometry(L))
        cast[fpb] = (float(t["hbm_f"][0]), float(t["hbm_b"][0]))
    assert cast[2.0][0] - cast[1.0][0] == pytest.approx((5 - 5 / 8) * WEIGHTS, rel=1e-9)
    assert cast[2.0][1] - cast[1.0][1] == pytest.approx((3 - (2 + 5 / 8)) * WEIGHTS, rel=1e-9)


def test_float8_tp_casts_the_sequence_shard() -> None:
    """torchao's float8 TP under sequence parallelism (tensorwise): the norms' outputs (qkv and gate/up inputs, T x D
    each) are cast on their sequence shard before the all-gather (amax folded, read 2 + write 1 = 3, over TP 2: 1.5)
    and the backward makes the gathered copy's other layout (read 1 + write 1 = 2) instead of the cast writing both
    from the full tensor (4, forward); the output gradients of wo and w2 (T x D each) likewise in the backward:
    1.5 + 2 instead of 4. Forward -2.5, backward +2 - 0 + 3.5 - 4 = +1.5 per element of those 2·T·D."""
    prob = Problem(load_model("llama3-8b"), load_chip("h100-sxm"), 2, T, 1)
    cast = {}
    for sp in (False, True):
        cm = CostModel(prob, default_efficiency(prob.chip),
                       Options(compute_dtype="fp8", fp8_recipe="tensorwise", fp8_fused_casts=False))
        L = LayoutArrays.from_configs([ParallelConfig(tp=2, microbatch=1, recompute="none", sequence_parallel=sp)])
        t = cm._fp8_cast_term(cm.geometry(L))
        cast[sp] = (float(t["hbm_f"][0]), float(t["hbm_b"][0]))
    assert cast[True][0] - cast[False][0] == pytest.approx(-2.5 * 2 * T * D, rel=1e-9)
    assert cast[True][1] - cast[False][1] == pytest.approx(1.5 * 2 * T * D, rel=1e-9)


def test_the_output_layer_stays_in_bf16() -> None:
    """torchtitan converts every linear but `output` to float8, Megatron-Core's output layer is no TE module,
    DeepSeek-V3 keeps the output head in bf16: the unembedding GEMM takes the same time in an FP8 plan."""
    times = {}
    for dtype in ("bf16", "fp8"):
        prob = Problem(load_model("llama3-8b"), load_chip("h100-sxm"), 1, T, 1)
        cm = CostModel(prob, default_efficiency(prob.chip), Options(compute_dtype=dtype))
        L = LayoutArrays.from_configs([ParallelConfig(microbatch=1, recompute="none")])
        times[dtype] = float(cm._loss_term(cm.geometry(L))["f_s"][0])
    assert times["fp8"] == pytest.approx(times["bf16"], rel=1e-12)


def test_recipes_against_torchaos_published_llama3_8b_runs() -> None:
    """torchao float8 README, "Training benchmarks" (pytorch/ao#1793, @8c81863ba, unchanged through 2025-08): Llama 3
    8B on 8 H100, FSDP2, batch 1, seq 8192, torch.compile, per-op SAC: bf16 6150, tensorwise with float8 all-gather
    7689.5, rowwise with bf16 all-gather 6768 tokens/s. No constant was chosen on these runs; the ratios check the
    recipes end to end: tensorwise/bf16 = 7689.5/6150 = 1.250, rowwise/bf16 = 6768/6150 = 1.100, rowwise/tensorwise
    = 6768/7689.5 = 0.880. meshplan: 1.183, 1.086, 0.918 (before torchao's compiled casts and the bf16 output layer:
    1.160, 1.064, 0.917); the tensorwise gap is the FP8 GEMM rate (efficiency.yaml fp8_peak_fraction), not the casts."""
    from meshplan.train.planner import plan
    from meshplan.train.space import Pins

    prob = Problem(load_model("llama3-8b"), load_chip("h100-sxm"), 8, 8192, 8)
    pins = Pins(dp=1, fsdp=8, tp=1, pp=1, cp=1, microbatch=1, recompute="selective")
    step = {}
    for name, dtype, recipe, gather_bytes in (("bf16", "bf16", None, 2.0), ("tensorwise", "fp8", "tensorwise", 1.0),
                                              ("rowwise", "fp8", "rowwise", 2.0)):
        opts = framework_options("torchtitan", Options(compute_dtype=dtype, fsdp_param_bytes=gather_bytes),
                                 {"fp8_recipe": recipe})
        step[name] = plan(prob, pins, default_efficiency(prob.chip), opts, top=1).plans[0]["step_time_s"]
    assert step["bf16"] / step["rowwise"] == pytest.approx(6768 / 6150, abs=0.03)
    assert step["tensorwise"] / step["rowwise"] == pytest.approx(6768 / 7689.5, abs=0.05)
    assert step["bf16"] / step["tensorwise"] == pytest.approx(7689.5 / 6150, abs=0.08)


@pytest.mark.parametrize(("framework", "hardware", "recipe", "written"), [
    ("torchtitan", "h100-sxm", "rowwise", 'recipe_name = "rowwise"'),  # torchao Float8LinearRecipeName
    ("megatron", "h100-sxm", "tensorwise", "--fp8-recipe tensorwise"),  # Megatron-LM --fp8-recipe choices
    ("megatron", "b200", "blockwise", "--fp8-recipe mxfp8"),  # Blackwell's block recipe is MXFP8
    ("nemo", "h100-sxm", "delayed", "fp8_recipe: delayed"),
])
def test_export_writes_the_plans_recipe(capsys, tmp_path, framework, hardware, recipe, written) -> None:
    args = ["train", "--model", "llama3-8b", "--hardware", hardware, "--chips", "8", "--seq-len", "8192",
            "--global-batch", "16", "--dtype", "fp8", "--fp8-recipe", recipe, "--export", framework,
            "--out", str(tmp_path)]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    text = " ".join(f.read_text() for f in tmp_path.iterdir())
    assert written in " ".join(text.replace("\\\n", " ").split())


def test_export_refuses_a_recipe_the_framework_lacks(capsys, tmp_path) -> None:
    args = ["train", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len", "8192",
            "--global-batch", "16", "--dtype", "fp8", "--fp8-recipe", "blockwise", "--export", "torchtitan",
            "--out", str(tmp_path)]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and err.startswith("error: torchtitan has no 'blockwise' FP8 recipe")


def test_an_unknown_recipe_in_options_is_a_clear_error() -> None:
    with pytest.raises(MeshplanError, match="unknown FP8 recipe 'row-wise' \\(did you mean: rowwise"):
        _cast_seconds("h100-sxm", Options(compute_dtype="fp8", fp8_recipe="row-wise"))
