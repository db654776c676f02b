"""Layouts whose parallel groups cannot map onto the physical topology are rejected, not crashes."""

from __future__ import annotations

from meshplan.cost.efficiency import default_efficiency
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.planner import plan
from meshplan.train.space import Pins, Problem


def test_nvl72_search_skips_groups_that_do_not_tile_the_domain():
    # 72 GPUs per NVLink domain: a 16-wide tensor group cannot tile it, a 2- or 8-wide one can.
    prob = Problem(load_model("llama3-8b"), load_chip("gb200-nvl72"), 144, 8192, 144)
    res = plan(prob, Pins(), default_efficiency(prob.chip), top=3)
    assert res.plans and all(p["step_time_s"] < float("inf") for p in res.plans)
    assert res.infeasible.get("a parallel group does not map onto the topology", 0) > 0
    for p in res.plans:
        assert 72 % p["config"]["tp"] == 0


def test_no_fused_makes_gpu_steps_slower(capsys):
    """Eager PyTorch (--no-fused) multiplies pointwise HBM traffic (efficiency.yaml), so the same pinned
    layout can only get slower."""
    import json

    from conftest import run_cli

    args = ["train", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len", "4096",
            "--global-batch", "16", "--fsdp", "8", "--dp", "1", "--tp", "1", "--pp", "1", "--cp", "1",
            "--microbatch", "1", "--recompute", "full", "--json"]
    code, out, _ = run_cli(args, capsys)
    fused = json.loads(out)["plans"][0]["step_time_s"]
    code2, out2, _ = run_cli(args + ["--no-fused"], capsys)
    eager = json.loads(out2)["plans"][0]["step_time_s"]
    assert code == code2 == 0
    assert eager > fused


def test_zero3_fetch_flag(capsys):
    """`--zero3-fetch broadcast` (the ZeRO paper's owner broadcast) exposes the FSDP traffic that the default
    all-gather hides across two nodes; a misspelt value is one clear error."""
    import json

    from conftest import run_cli

    args = ["train", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "16", "--seq-len", "4096",
            "--global-batch", "16", "--fsdp", "16", "--dp", "1", "--tp", "1", "--pp", "1", "--cp", "1",
            "--microbatch", "1", "--recompute", "full", "--json"]
    code, out, _ = run_cli(args, capsys)
    code2, out2, _ = run_cli(args + ["--zero3-fetch", "broadcast"], capsys)
    assert code == code2 == 0
    gather, bcast = json.loads(out)["plans"][0], json.loads(out2)["plans"][0]
    assert bcast["time_s"]["exposed_comm"] > 10 * gather["time_s"]["exposed_comm"]
    assert bcast["bottleneck"] == "comm/fsdp" and "--zero3-fetch allgather" in bcast["explanation"]
    code3, _, err = run_cli(args + ["--zero3-fetch", "bcast"], capsys)
    assert code3 == 2 and err.startswith("error:") and "allgather or broadcast" in err


def test_framework_presets_and_explicit_flags():
    """`--framework` applies a framework's documented behaviour; an explicit flag wins over it."""
    from meshplan.train.costmodel import Options
    from meshplan.train.frameworks import FRAMEWORKS, framework_options

    base = Options()
    titan = framework_options("torchtitan", base, {})
    assert (titan.fused_loss, titan.fp8_weight_cache, titan.fsdp_over_cp) == (False, False, True)
    assert framework_options("torchtitan", base, {"fused_loss": True}).fused_loss is True
    assert framework_options(None, base, {"fused_loss": None}) == base
    assert framework_options("nemo", base, {}).tp_overlap is True
    assert framework_options("maxtext", base, {}).dp_overlap is False
    assert set(FRAMEWORKS) == {"megatron", "nemo", "torchtitan", "maxtext", "deepspeed", "jax"}
    # DeepSpeed runs eager PyTorch modules: unfused pointwise ops and loss, SDPA attention
    ds = framework_options("deepspeed", base, {})
    assert (ds.fused_elementwise, ds.fused_loss, ds.attention_kernel) == (False, False, "sdpa")
    # "jax": the reference program of `meshplan verify`, MaxText's schedule with that program's fp32 facts
    assert framework_options("jax", base, {}).act_bytes == 4.0 and framework_options("jax", base, {}).remat_dce


def test_framework_flag_through_the_cli(capsys):
    import json

    from conftest import run_cli

    args = ["train", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len", "8192",
            "--global-batch", "16", "--fsdp", "8", "--dp", "1", "--tp", "1", "--pp", "1", "--cp", "1",
            "--microbatch", "2", "--recompute", "full", "--offload", "0", "--offload-optimizer", "0",
            "--offload-params", "0", "--json"]  # the layout torchtitan runs (no host offload), pinned whole
    code, out, _ = run_cli(args, capsys)
    code2, out2, _ = run_cli(args + ["--framework", "torchtitan"], capsys)
    code3, out3, _ = run_cli(args + ["--framework", "torchtitan", "--fused-loss"], capsys)
    assert code == code2 == code3 == 0
    mem = [json.loads(o)["plans"][0]["memory_bytes_per_chip"]["activations"] for o in (out, out2, out3)]
    # the eager loss holds 6 more bytes per logit: 2 x 8192 tokens x 128,256 vocabulary
    assert mem[1] - mem[0] == 6 * 2 * 8192 * 128256 and mem[2] == mem[0]
    code4, _, err = run_cli(args + ["--framework", "titan"], capsys)
    assert code4 == 2 and "did you mean: torchtitan" in err


def test_human_output_states_the_assumptions(capsys):
    from conftest import run_cli

    args = ["train", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len", "4096",
            "--global-batch", "16", "--top", "1"]
    code, out, _ = run_cli(args, capsys)
    assert code == 0 and "assumes:" in out and "fused loss" in out and "TP collectives exposed" in out
    code, out, _ = run_cli(args + ["--framework", "torchtitan"], capsys)
    assert code == 0 and "eager fp32 loss" in out


def test_multislice_puts_the_replicas_on_dcn(capsys):
    """Two v5p-128 slices (4x4x4 chips each) joined over DCN: the pinned data-parallel axis of 2 crosses DCN, so
    the same layout is slower than on one 128-chip ICI slice; the gradient reduction across slices (MaxText: after
    the backward) is bound by the DCN egress of 6.25 GB/s per chip (book ch.2), 6.25/90 of an ICI link."""
    import json

    from conftest import run_cli

    base = ["train", "--model", "maxtext-synthetic-32b", "--hardware", "tpu-v5p", "--chips", "128", "--seq-len",
            "2048", "--global-batch", "896", "--tp", "4", "--fsdp", "16", "--dp", "2", "--microbatch", "7",
            "--recompute", "gemm-last", "--framework", "maxtext", "--json"]
    code, out, _ = run_cli([*base, "--slice", "4x4x4"], capsys)
    assert code == 0
    two = json.loads(out)["plans"][0]
    code, out, _ = run_cli(base, capsys)
    one = json.loads(out)["plans"][0]
    assert "data=2 → dcn" in two["mesh"] and "dcn" not in one["mesh"]
    assert two["time_breakdown_s"]["exposed_comm/dp"] > 3 * one["time_breakdown_s"]["exposed_comm/dp"]
    assert two["step_time_s"] > one["step_time_s"]
    code, _, err = run_cli([*base, "--slice", "4x4x3"], capsys)
    assert code == 2 and "slice shape 4x4x3 (48 chips) does not divide 128 chips" in err
