"""The accuracy harness plans each published run with the flags its job ran (issue #14): a few rows' derived flags
against the values in their sources, each cited. Flags only: no prediction is compared here."""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

from meshplan.math.transformer import RECOMPUTE_POLICIES
from meshplan.train.frameworks import megatron_selective_policy, names, options_from_notes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _measurements as H  # noqa: E402  (the benchmark harness, not part of the package)

DATA = ROOT / "benchmarks" / "data"


@lru_cache(maxsize=1)
def _rows() -> dict[str, dict]:
    return {e["id"]: e for e in yaml.safe_load((DATA / "training_measurements_new.yaml").read_text())}


def _row(ident: str) -> dict:
    return dict(_rows()[ident], group=_rows()[ident].get("group", "ungrouped"))


def test_a_negated_feature_is_not_named() -> None:
    # torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md: the "vanilla TP" column ran without AsyncTP
    assert options_from_notes("fsdp=8 x tp=8; vanilla tp (no async tp)")["tp_overlap"] is None
    assert options_from_notes("fsdp=8 x tp=8; asynctp")["tp_overlap"] is True
    assert not names("without userbuffer overlap", ("userbuffer",))
    assert names("no ep overlap; tp comm overlap", ("tp comm overlap",))
    # a later, un-negated mention still counts
    assert names("no async tp in warm-up, async tp after", ("async tp",))


def test_torchtitan_async_tp_rows_differ_only_in_tp_overlap() -> None:
    vanilla = _row("torchtitan_asynctp_202506_llama3p1-70b_bf16_vanilla")
    asynctp = _row("torchtitan_asynctp_202506_llama3p1-70b_bf16_async")
    ov, oa = H.options_of(vanilla), H.options_of(asynctp)
    assert not ov.overlaps("gpu")[0] and oa.overlaps("gpu")[0]
    assert H.pins_of(vanilla) == H.pins_of(asynctp)


def test_megatron_recompute_modules_as_meshplan_policies() -> None:
    # megatron/core/transformer/transformer_config.py: recompute_modules defaults to ["core_attn"]
    assert megatron_selective_policy(None) == "selective"
    assert megatron_selective_policy(["core_attn"]) == "selective"
    # Megatron-Bridge v0.5.0 GPT_OSS_120B_PRETRAIN_CONFIG_GB200_FP8_MX_V2: recompute_modules=[] (nothing rerun)
    assert megatron_selective_policy([]) == "none"
    # GPT_OSS_120B_PRETRAIN_CONFIG_GB200_BF16_V2: ["layernorm", "moe_act"]; model zoo "norm, act"
    assert megatron_selective_policy(["layernorm", "moe_act"]) == "gemm-last"
    assert megatron_selective_policy(["norm", "act"]) == "gemm-last"
    # DeepSeek-V3 presets: ["mla_up_proj"] is meshplan's mla-up-proj; with other modules, or ["mlp"], it reruns
    # GEMMs no meshplan policy names
    assert megatron_selective_policy(["mla_up_proj"]) == "mla-up-proj"
    assert megatron_selective_policy(["mla_up_proj", "moe_act"]) is None
    assert megatron_selective_policy(["mlp"]) is None


def test_recipe_file_covers_every_megatron_bridge_row() -> None:
    recipes = yaml.safe_load((DATA / "mbridge_recipes.yaml").read_text())
    mbridge = {i for i, e in _rows().items() if e["source"]["key"].startswith("megatron-bridge-perf")}
    assert set(recipes) == mbridge
    for entry in recipes.values():
        assert entry["recompute"] in (*RECOMPUTE_POLICIES, None)
        assert isinstance(entry["tp_overlap"], bool) and isinstance(entry["overlap_param_gather"], bool)
        assert 0.0 <= entry.get("offload", 0.0) <= 1.0 and " @ v0." in entry["recipe"]


@pytest.mark.parametrize("ident, recompute, tp_overlap, param_gather, offload", [
    # Megatron-Bridge v0.5.0 LLAMA31_405B_PRETRAIN_CONFIG_GB200_FP8_CS_V2 (tp4 pp16 vpp4, no recompute override);
    # recipes/llama/llama3.py llama31_405b_pretrain_config: recompute_granularity None, CommOverlapConfig(
    # tp_comm_overlap=True), ddp.overlap_param_gather True
    ("mbridge_26p06_llama3p1-405b_gb200_256_fp8", "none", True, True, 0.0),
    # v0.4.0 qwen3_llm_pretrain.py qwen3_235b_a22b_pretrain_config_h100: CommOverlapConfig(tp_comm_overlap=False);
    # set_qwen3_common_configs: recompute_granularity None
    ("mbridge_26p04_qwen3-235b-a22b_h100_256_fp8", "none", False, True, 0.0),
    # v0.2.0 llama31_llm_pretrain.py llama31_405b_b200_config: fp8_mx turns overlap_param_gather off ("NaN grad norm")
    ("mbridge_25p11_llama3p1-405b_b200_128_fp8-mx", "none", True, False, 0.0),
    # v0.4.0 GPT_OSS_120B_PRETRAIN_CONFIG_GB200_BF16_V2: recompute_modules ["layernorm", "moe_act"]
    ("mbridge_26p04_gpt-oss-120b_gb200_64_bf16", "gemm-last", False, True, 0.0),
    # v0.3.0 LLAMA3_70B_PRETRAIN_CONFIG_GB200_FP8_CS_V2: use_megatron_fsdp, cpu_offloading_num_layers=40 of 80 layers
    ("mbridge_26p02_llama3-70b_gb200_64_fp8", "none", True, True, 0.5),
])
def test_megatron_bridge_rows_run_their_recipe(ident, recompute, tp_overlap, param_gather, offload) -> None:
    e = _row(ident)
    pins, opts = H.pins_of(e), H.options_of(e)
    assert pins.recompute == recompute
    assert pins.offload == offload
    assert opts.overlap_param_gather is param_gather
    if pins.tp > 1:
        assert opts.tp_overlap is tp_overlap


def test_an_unexpressible_recipe_recompute_is_left_to_meshplan() -> None:
    # v0.4.0 DEEPSEEK_V3_PRETRAIN_CONFIG_GB200_FP8_MX_V2: selective over ["mlp"] (the dense layers' MLP)
    assert H.pins_of(_row("mbridge_26p04_deepseek-v3_gb200_256_mxfp8")).recompute is None


def test_the_mla_up_projection_recipes_run_mla_up_proj() -> None:
    # v0.5.0 DEEPSEEK_V3_PRETRAIN_CONFIG_GB200_FP8_MX_V2 and v0.4.0 ..._GB300_FP8_MX_V2: selective over ["mla_up_proj"]
    for ident in ("mbridge_26p06_deepseek-v3_gb200_256_mxfp8", "mbridge_26p04_deepseek-v3_gb300_256_mxfp8"):
        assert H.pins_of(_row(ident)).recompute == "mla-up-proj"


def test_model_zoo_rows_carry_the_launch_flags() -> None:
    # yanring/Megatron-MoE-ModelZoo @ e8650517: the H100 table's recompute "norm, act" (run_h100_235b.sh:
    # --recompute-modules moe_act layernorm); sbatch_benchmarking.sh adds --tp-comm-overlap for bf16;
    # model_configs/benchmarking/Qwen3-235B-A22B.yaml: --overlap-param-gather, --account-for-*-in-pipeline-split;
    # Megatron-LM overlaps interleaved pipeline sends by default (the "megatron" preset)
    e = _row("moezoo_qwen3_235b_h100_256_0")
    pins, opts = H.pins_of(e), H.options_of(e)
    assert (pins.tp, pins.pp, pins.vpp, pins.ep, pins.recompute) == (2, 8, 4, 32, "gemm-last")
    assert opts.tp_overlap and opts.overlap_param_gather and opts.pp_head_in_split and opts.pp_overlap
    assert opts.moe_dispatcher == "deepep"


def test_maxtext_and_torchtitan_rows_get_their_presets() -> None:
    # framework: maxtext -> the "maxtext" preset's JAX behaviour (train/frameworks.py: remat_dce on for maxtext/jax)
    tpu = H.options_of(_row("tpurecipes_v6e_mistral-7b_8x1"))
    assert tpu.remat_dce and tpu.fold_all_reduces
    # torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md: "fsdp float8 all-gather" -> 1-byte gathers
    titan = H.options_of(_row("torchtitan_trainy_h200_llama3p1_8b_32"))
    assert titan.fsdp_param_bytes == 1.0 and titan.fp8_recipe == "tensorwise"
    # the async-TP benchmark names no float8 all-gather: bf16 gathers
    assert H.options_of(_row("torchtitan_asynctp_202506_llama3p1-8b_float8_tensorwise_async")).fsdp_param_bytes == 2.0


def test_megatron_bridge_fp8_rows_get_fp8_weights_fused_swiglu_and_the_405b_split() -> None:
    """mixed_precision.py bf16_with_fp8_current_scaling_mixed / bf16_with_mxfp8_mixed: fp8_param_gather; the Llama
    provider's bias_activation_fusion; llama31_405b_pretrain_config: account_for_{embedding,loss}_in_pipeline_split
    (Megatron-Bridge @v0.5.0). The 70B recipe sets no split."""
    opts = H.options_of(_row("mbridge_26p06_llama3p1-405b_gb200_256_fp8"))
    assert opts.pp_head_in_split and opts.glu_saves_input and opts.fp8_params and opts.compute_dtype == "fp8"
    assert not H.options_of(_row("mbridge_26p04_llama3-70b_h100_64_fp8")).pp_head_in_split


def test_tpu_recipes_rows_get_their_splash_block_grid() -> None:
    # tpu-recipes Llama3.1-70B-MaxText/v6e-64 README (llama3_1_70b_8192_bs2): every sa_block_* 2048; Mixtral-8x7B
    # (mixtral_8x7b_dropped): sa_block_q and sa_block_q_dkv 2048, the kv blocks at base.yml's 512
    assert H.options_of(_row("tpurecipes_v6e_llama3p1-70b_64x1")).attention_block_fwd == (2048, 2048)
    mixtral = H.options_of(_row("tpurecipes_v6e_mixtral-8x7b_256x1"))
    assert (mixtral.attention_block_fwd, mixtral.attention_block_bwd) == ((2048, 512), (2048, 512))
    # a MaxText row the table does not list: the preset's base.yml default; a GPU row: no block grid
    other = dict(_row("tpurecipes_v6e_mistral-7b_8x1"), id="not_in_the_table")
    assert H.options_of(other).attention_block_fwd == (512, 512)
    assert H.options_of(_row("torchtitan_trainy_h200_llama3p1_8b_32")).attention_block_fwd == (0, 0)
    # every row of the table is a MaxText row of the data
    table = yaml.safe_load((DATA / "maxtext_recipes.yaml").read_text())
    assert all(_rows()[k]["framework"] == "maxtext" for k in table)


def test_tpu_recipes_rows_that_offload_the_gradient_reduction_to_the_sparsecores_and_embed_by_matmul() -> None:
    # tpu-recipes @c8cfe2f "Workload Details": Mistral-7B-MaxText (mistral_7b) lists
    # xla_flags_library.ENABLE_SPARSECORE_OFFLOADING_FOR_ALL_REDUCE; Llama3.1-70B-MaxText/v6e-64 (llama3_1_70b_8192_bs2)
    # and Mixtral-8x7B-MaxText (mixtral_8x7b_dropped) do not
    assert H.options_of(_row("tpurecipes_v6e_mistral-7b_8x1")).sparsecore_reduce
    assert not H.options_of(_row("tpurecipes_v6e_llama3p1-70b_64x1")).sparsecore_reduce
    assert not H.options_of(_row("tpurecipes_v6e_mixtral-8x7b_256x1")).sparsecore_reduce
    # a row the table does not list, and a GPU row: no offload
    assert not H.options_of(dict(_row("tpurecipes_v6e_mistral-7b_8x1"), id="not_in_the_table")).sparsecore_reduce
    assert not H.options_of(_row("torchtitan_trainy_h200_llama3p1_8b_32")).sparsecore_reduce
    # every recipe of the table sets use_iota_embed True (the one-hot embedding matmul); base.yml's default is False
    assert all(H.options_of(_row(k)).iota_embedding for k in ("tpurecipes_v6e_llama3p1-70b_64x1",
                                                              "tpurecipes_v6e_mixtral-8x7b_256x1",
                                                              "tpurecipes_v6e_mistral-7b_8x1"))
    assert not H.options_of(dict(_row("tpurecipes_v6e_mistral-7b_8x1"), id="not_in_the_table")).iota_embedding


def test_maxtext_per_device_batch_is_one_pass_of_the_tensor_parallel_group() -> None:
    # MaxText largest_job/128b.sh (reference maxtext_v5e_128b_*): per_device_batch_size=1, ici_fsdp 16 x
    # ici_tensor 16 on 256 chips: global batch 256, each of the 16 FSDP ranks runs its 16 sequences in one pass
    # (base.yml of that commit has no gradient accumulation), not 16 micro-batches of one
    row = next(e for e in H.load_entries() if e["id"] == "maxtext_v5e_128b_1x256")
    pins = H.pins_of(row)
    assert (pins.fsdp, pins.tp, pins.microbatch) == (16, 16, 16)
    # a tensor-parallel-free MaxText row keeps its per-device batch (tpu-recipes 70B on v6e-64: 2)
    assert H.pins_of(_row("tpurecipes_v6e_llama3p1-70b_64x1")).microbatch == 2


@pytest.mark.parametrize(("ident", "dispatcher", "scope", "expert_tp"), [
    # PyTorch/Nebius DeepSeek-V3 (train_671b.sh: EP_BACKEND standard|deepep, ETP=1; mxfp8_default: grouped GEMMs only)
    ("torchtitan_nebius_202602_deepseek-v3_b200_256_bf16_standard_ep", "alltoall", "all", False),
    ("torchtitan_nebius_202602_deepseek-v3_b200_256_bf16_deepep", "deepep", "all", False),
    ("torchtitan_nebius_202602_deepseek-v3_b200_256_mxfp8_experts_deepep", "deepep", "experts", False),
    # torchtitan's DeepEP README: "14,796 vs 9,930 tok/s/GPU at EP=8" against its default expert parallelism
    ("torchtitan_deepep_202511_qwen3-30b-a3b_b200_8gpu_standard_ep", "alltoall", "all", False),
    ("torchtitan_deepep_202511_qwen3-30b-a3b_b200_8gpu_deepep", "deepep", "all", False)])
def test_torchtitan_moe_rows_run_their_dispatcher_and_fp8_scope(ident, dispatcher, scope, expert_tp) -> None:
    o = H.options_of(_row(ident))
    assert (o.moe_dispatcher, o.fp8_scope, o.expert_tp, o.moe_force_balance) == (dispatcher, scope, expert_tp, True)
