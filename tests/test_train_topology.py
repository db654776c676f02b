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
