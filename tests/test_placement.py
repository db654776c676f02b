"""Published layouts that meshplan used to refuse now plan, each on the topology its deployment used (issue #14:
"every published layout in your data can be planned"). Each test builds the problem by hand, plans the published
degrees and asserts where each parallel axis lands."""

from __future__ import annotations

import pytest

from meshplan.cost.efficiency import default_efficiency
from meshplan.cost.topology import make_cluster
from meshplan.errors import MeshplanError
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import ModelConfig, load_model
from meshplan.train.planner import plan
from meshplan.train.space import Pins, Problem

# Qwen3-235B-A22B (Hugging Face config.json): 94 layers, d_model 4096, 64 query / 4 KV heads of 128, 128 experts of
# width 1536, 8 active, vocabulary 151,936
QWEN3_235B = ModelConfig("qwen3-235b-a22b", 94, 4096, 64, 4, 128, 1536, 151936, n_experts=128, experts_per_token=8)
# PaLM 540B (Chowdhery et al. 2022, Table 1): 118 layers, d_model 18432, 48 heads of 256, one shared K/V head
# (multi-query), d_ff = 4 x d_model = 73728, 256k vocabulary
PALM_540B = ModelConfig("palm-540b", 118, 18432, 48, 1, 256, 73728, 256000, max_seq_len=2048)


def _plan(prob: Problem, **pins) -> dict:
    return plan(prob, Pins(**pins), default_efficiency(prob.chip), top=1).plans[0]


def test_256_gb200s_use_64_gpus_of_each_of_4_nvl72_racks():
    # 256 = 3 x 72 + 40: not whole racks. Largest divisor of 256 made of whole 4-GPU trays that fits 72: 64
    # (NVIDIA's segment of 16 trays), so 4 racks of 64; an 8-GPU server is used whole when the job is whole servers.
    chip = load_chip("gb200-nvl72")
    c = make_cluster(chip, 256)
    assert (c.domain_size, c.n_domains) == (64, 4)
    assert make_cluster(chip, 144).domain_size == 72  # whole racks when the job is a multiple of 72
    with pytest.raises(MeshplanError, match="NVLink domains"):
        make_cluster(load_chip("h100-sxm"), 12, (8,))  # a pinned whole 8-GPU server cannot tile 12 GPUs
    # unpinned, 12 H100s span gcd(12, 8) = 4 GPUs per server (issue #18: such deployments run; not refused)
    assert make_cluster(load_chip("h100-sxm"), 12).slice_shape == (4,)
    # Megatron-Bridge's Llama 3.1 405B on 256 GB200 (TP 4, PP 16, VP 4, DP 4), refused before ("256 GPUs is not a
    # whole number of 72-GPU NVLink domains"). Tensor innermost: tp 4 at stride 1 and dp 4 at stride 4 stay in one
    # 64-GPU rack share; pp 16 at stride 16 spans 256 chips: 4 racks, so it crosses InfiniBand.
    prob = Problem(load_model("llama3-405b"), chip, 256, 8192, 256)
    p = _plan(prob, tp=4, pp=16, vpp=4, dp=4, fsdp=1, cp=1, microbatch=1)
    assert (p["config"]["tp"], p["config"]["pp"], p["config"]["dp"]) == (4, 16, 4)
    assert p["mesh"] == "tensor=4 → nvlink; data=4 → nvlink; pipeline=16 → nvlink+infiniband"


def test_moe_parallel_folding_lets_expert_parallelism_exceed_data_parallelism():
    # Megatron-MoE-ModelZoo Qwen3-235B on 256 H100: TP 2, PP 8, VP 4, DP 16, EP 32. MCore needs world_size divisible
    # by ETP x EP x PP = 1 x 32 x 8 = 256 (expert TP 1): EP 32 folds over the TP x DP = 32 ranks of a stage.
    prob = Problem(QWEN3_235B, load_chip("h100-sxm"), 256, 4096, 2048)
    p = _plan(prob, tp=2, pp=8, vpp=4, dp=16, fsdp=1, cp=1, ep=32, microbatch=1, zero=1)
    assert (p["config"]["ep"], p["config"]["dp"], p["config"]["tp"]) == (32, 16, 2)
    assert p["mesh"] == "tensor=2 → nvlink; data=16 → nvlink+infiniband; pipeline=8 → infiniband"
    # EP 64 does not divide TP x CP x DP = 32: no folding places it
    with pytest.raises(MeshplanError, match="tensor × context × data-parallel"):
        _plan(prob, tp=2, pp=8, vpp=4, dp=16, fsdp=1, cp=1, ep=64, microbatch=1, zero=1)


def test_pipeline_may_have_embedding_and_loss_stages():
    # Megatron-MoE-ModelZoo Qwen3-235B at PP 32 x VP 3 = 96 virtual stages for 94 layers: with the embedding and
    # the loss counted as a layer each (account_for_embedding/loss_in_pipeline_split) there are 94 + 2 = 96
    prob = Problem(QWEN3_235B, load_chip("h100-sxm"), 256, 4096, 2048)
    p = _plan(prob, tp=2, pp=32, vpp=3, dp=4, fsdp=1, cp=1, ep=8, microbatch=1, zero=1)
    assert (p["config"]["pp"], p["config"]["vpp"]) == (32, 3)
    with pytest.raises(MeshplanError, match="at most 96"):  # 32 x 4 = 128 > 96
        _plan(prob, tp=2, pp=32, vpp=4, dp=4, fsdp=1, cp=1, ep=8, microbatch=1, zero=1)


@pytest.mark.parametrize("slice_shape", [None, (16, 16, 12)])
def test_palm_two_v4_pods_over_dcn(slice_shape):
    # PaLM 540B: 6144 TPU v4 = two 3072-chip pods over DCN, 12-way model parallel and 256-way FSDP in each pod,
    # 2-way data parallel across the pods (Chowdhery et al. 2022 §4). A slice printed 16x16x12 puts 16 first in
    # the chip order, where a 12-wide tensor group cannot tile; the slice's axes may be walked in any order
    # (12x16x16), which places it.
    chip = load_chip("tpu-v4")
    c = make_cluster(chip, 6144)
    assert (c.n_slices, c.domain_size) == (2, 3072)
    prob = Problem(PALM_540B, chip, 6144, 2048, 2048, slice_shape)
    p = _plan(prob, tp=12, fsdp=256, dp=2, pp=1, cp=1)
    assert p["mesh"] == "tensor=12 → ici; fsdp=256 → ici; data=2 → dcn"
