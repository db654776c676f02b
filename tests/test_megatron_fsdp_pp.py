"""FSDP under pipelining, by implementation (Options.fsdp_pp_gathered_stage): PyTorch FSDP2 under
torch.distributed.pipelining (torchtitan) keeps the stage gathered and its gradients unsharded through the step;
Megatron-FSDP (the megatron and nemo presets) frees the unsharded weights after every fprop/dgrad and reduce-scatters
the gradients every backward (Megatron-LM docs/user-guide/features/megatron_fsdp.md), pipeline or not. Llama 3 405B on
256 GB200, FSDP 64 x TP 2 x PP 2, full recompute: the values below are worked by hand from the parameter count."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_cli

from meshplan.cost.efficiency import default_efficiency
from meshplan.math.transformer import param_counts
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.frameworks import framework_options
from meshplan.train.space import Problem

PROB = Problem(load_model("llama3-405b"), load_chip("gb200-nvl72"), 256, 4096, 256)
CFG = ParallelConfig(fsdp=64, tp=2, pp=2, microbatch=1, recompute="full", sequence_parallel=True)


def _terms(framework: str) -> tuple[dict, dict]:
    opts = framework_options(framework, Options(), {})
    cm = CostModel(PROB, default_efficiency(PROB.chip), opts)
    L = LayoutArrays.from_configs([CFG])
    g = cm.geometry(L)
    mem = cm.memory_terms(L, g)
    comm = cm.comm_terms(L, g, cm.compute_terms(L, g))
    return ({k: float(np.asarray(v).ravel()[0]) for k, v in mem.items() if np.asarray(v).size == 1},
            {k: float(np.asarray(v).ravel()[0]) for k, v in comm.items() if np.asarray(v).size == 1})


def test_presets_name_their_fsdp() -> None:
    assert framework_options("torchtitan", Options(), {}).fsdp_pp_gathered_stage
    assert not framework_options("megatron", Options(), {}).fsdp_pp_gathered_stage
    assert not framework_options("nemo", Options(), {}).fsdp_pp_gathered_stage


def test_megatron_fsdp_shards_the_gradients_under_pp() -> None:
    # a stage holds about half of the 405B parameters, split over TP 2: ~101e9 a rank group; Megatron-FSDP keeps
    # 1/64 of them as bf16 gradients (the nemo preset's reduction dtype): ~3.2e9 B. FSDP2 under pipelining holds the
    # stage's whole gradients (fp32 in torchtitan): 64 x 2 x that, and the gathered stage beside them
    stage_params = param_counts(PROB.model).total / (2 * 2)
    mem_n, comm_n = _terms("nemo")
    assert mem_n["grads"] == pytest.approx(2.0 * stage_params / 64, rel=0.05)
    mem_t, _ = _terms("torchtitan")
    assert mem_t["grads"] == pytest.approx(4.0 * stage_params, rel=0.05)
    assert mem_t["total"] > 10 * mem_n["total"]
    # and the gathers follow: per micro-batch (forward and backward) under Megatron-FSDP, none per step
    assert comm_n["fsdp_link_mb"] > 0 and comm_n["fsdp_link_step"] == 0


def test_the_cli_plans_megatron_fsdp_with_pp(capsys) -> None:
    args = ["train", "-m", "llama3-405b", "--hardware", "gb200-nvl72", "--chips", "256", "--seq-len", "4096",
            "--global-batch", "256", "--fsdp", "64", "--tp", "2", "--pp", "2", "--microbatch", "1", "--recompute",
            "full", "--top", "1"]
    code, out, err = run_cli([*args, "--framework", "megatron"], capsys)
    assert code == 0, err
    code, _, err = run_cli([*args, "--framework", "torchtitan"], capsys)
    assert code == 2 and "no layout fits in HBM" in err
