"""torchtitan's expert-parallel mesh since #1555 (2025-08-13): whole experts (expert_tensor_parallel_degree 1, its
default, and its only mode since #3167) with EP over dp_shard·cp·tp and the experts FSDP-sharded over
efsdp = dp_shard·cp·tp / ep (parallel_dims.py @1a36996b: the sparse mesh [pp, dp_replicate, efsdp, ep, etp]).
Found by the PyTorch/Nebius DeepSeek-V3 recipe (TP 2, PP 2, EP 32, ETP 1, dp_shard 64 on 256 B200s), whose experts
meshplan had sharded over all 64 FSDP ranks on top of EP: 16x too little optimizer state."""

from __future__ import annotations

import tomllib

import numpy as np
import pytest
from conftest import run_cli

from meshplan.cost.efficiency import default_efficiency
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.frameworks import preset
from meshplan.train.space import Problem


def _geometry(expert_tp: bool, **layout):
    prob = Problem(load_model("deepseek-v3"), load_chip("b200"), 256, 8192, 4096)
    cm = CostModel(prob, default_efficiency(prob.chip), Options(expert_tp=expert_tp))
    return cm, cm.geometry(LayoutArrays.from_configs([ParallelConfig(**layout)]))


NEBIUS = dict(fsdp=64, tp=2, pp=2, vpp=2, ep=32, microbatch=1, recompute="full")


def _f(x) -> float:
    return float(np.asarray(x).ravel()[0])


def test_experts_shard_over_efsdp_by_hand() -> None:
    """efsdp = dp_shard·cp·tp / (etp·ep): 64·1·2 / (1·32) = 4 with whole experts; 64·1 / 32 = 2 under ETP = TP (the
    experts split over the 2 tensor ranks). A rank holds (P - E)/64 of its dense parameters and E/efsdp of its
    experts (E already 1/ep of the stage's, and 1/etp)."""
    cm, g = _geometry(False, **NEBIUS)
    assert bool(np.asarray(g["ep_fsdp"]).ravel()[0]) and _f(g["etp"]) == 1 and _f(g["shard_expert"]) == 4
    P, E = _f(g["params_stage_local"]), _f(g["experts_stage_local"])
    assert _f(cm._sharded(g, P, E)) == pytest.approx((P - E) / 64 + E / 4)
    cm_tp, g_tp = _geometry(True, **NEBIUS)
    assert _f(g_tp["etp"]) == 2 and _f(g_tp["shard_expert"]) == 2
    # the same experts per rank either way: 1/(etp·ep·efsdp) = 1/128 of the stage's, over its 128 ranks
    assert _f(g["experts_stage_local"]) / 4 == pytest.approx(_f(g_tp["experts_stage_local"]) / 2)


def test_the_nebius_layout_holds_its_optimizer_state() -> None:
    """DeepSeek-V3 671B over 2 stages of 128 ranks: ~671e9/256 = 2.6e9 parameters a rank, whose fp32 sharded copy is
    ~10.5 GB and Adam's two moments ~21 GB (meshplan had 0.9 GiB and 1.7 GiB)."""
    from meshplan.train.planner import plan
    from meshplan.train.space import Pins

    prob = Problem(load_model("deepseek-v3"), load_chip("b200"), 256, 8192, 4096)
    pins = Pins(dp=1, cp=1, zero=0, offload=0.0, offload_optimizer=0, offload_params=0, **NEBIUS)
    best = plan(prob, pins, default_efficiency(prob.chip), Options(**preset("torchtitan")), top=1).plans[0]
    mem = best["memory_bytes_per_chip"]
    assert 9e9 < mem["params"] < 12e9 and 18e9 < mem["optimizer"] < 24e9


def test_ep_over_the_fsdp_groups_tensor_ranks_plans_and_across_replicas_does_not(capsys) -> None:
    base = ["train", "-m", "qwen3-30b-a3b", "--hardware", "h100-sxm", "--seq-len", "4096", "--global-batch", "64",
            "--framework", "torchtitan", "--microbatch", "1", "--recompute", "full"]
    # fsdp 4 x tp 4, ep 16: ep divides dp_shard·tp = 16 (whole experts), not dp_shard = 4
    code, _, err = run_cli(base + ["--chips", "16", "--fsdp", "4", "--tp", "4", "--ep", "16"], capsys)
    assert code == 0, err
    # HSDP 2 x (fsdp 4 x tp 2), ep 8: inside the FSDP group with its tensor ranks under whole experts; with the
    # experts split over TP (--etp 2) EP would span replicas and shards: no framework builds that
    code, _, err = run_cli(base + ["--chips", "16", "--dp", "2", "--fsdp", "4", "--tp", "2", "--ep", "8"], capsys)
    assert code == 0, err
    code, _, err = run_cli(base + ["--chips", "16", "--dp", "2", "--fsdp", "4", "--tp", "2", "--ep", "8", "--etp",
                                   "2"], capsys)
    assert code == 2 and "its tensor ranks too" in err and err.count("\n") == 1


def test_presets_by_release() -> None:
    """EP came to torchtitan after v0.1.0 (#1324) with the experts split over TP; whole experts are the default from
    #1555 (2025-08-13) on."""
    assert preset("torchtitan")["expert_tp"] is False and preset("torchtitan@2025.10")["expert_tp"] is False
    assert preset("torchtitan@2025.06")["expert_tp"] is True


@pytest.mark.parametrize(("etp", "written"), [(None, 1), ("2", 2)])
def test_export_writes_the_expert_tp_degree_and_reads_it_back(tmp_path, capsys, etp, written) -> None:
    from meshplan.export import torchtitan

    code, _, err = run_cli(["train", "-m", "qwen3-30b-a3b", "--hardware", "h100-sxm", "--chips", "16", "--seq-len",
                            "4096", "--global-batch", "64", "--fsdp", "8", "--tp", "2", "--ep", "8", "--microbatch",
                            "1", "--recompute", "full", "--framework", "torchtitan",
                            *(["--etp", etp] if etp else []), "--export", "torchtitan", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    text = (tmp_path / "torchtitan.toml").read_text()
    assert tomllib.loads(text)["parallelism"]["expert_tensor_parallel_degree"] == written
    assert torchtitan.load(text, 16).options["expert_tp"] is (written == 2)
