"""MaxText on TPU (issue #14, tpu_host_offload / maxtext_tpu families): the peak memory of the program XLA compiles
and the attention kernels' MXU fill, each against a hand calculation."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_cli

from meshplan.cost.efficiency import default_efficiency
from meshplan.errors import MeshplanError
from meshplan.math import transformer as tm
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.frameworks import weight_dtype_bytes_of
from meshplan.train.planner import search
from meshplan.train.space import Pins, Problem

GIB = 2**30


def _pinned(model: str, hw: str, chips: int, seq: int, batch: int, options: Options | None = None, **kw) -> dict:
    base = dict(dp=1, fsdp=1, tp=1, pp=1, vpp=1, cp=1, ep=1, microbatch=1, recompute="none", zero=0, offload=0.0,
                offload_optimizer=0, offload_params=0)
    base.update(kw)
    prob = Problem(load_model(model), load_chip(hw), chips, seq, batch)
    ev, _, searched = search(prob, Pins(**base), default_efficiency(prob.chip), options)
    assert searched == 1
    return {k: float(v[0]) for k, v in ev.memory.items()}


def test_v6e_gives_xla_31_25_gib() -> None:
    # vLLM's usage report on one v6e chip (vllm-project/vllm#16211): gpu_memory_per_device 33,550,237,696 B
    chip = load_chip("tpu-v6e")
    assert chip.usable_hbm_bytes == 33_550_237_696
    assert chip.usable_hbm_bytes / GIB == pytest.approx(31.25, abs=0.01)  # XLA's "of 31.25G hbm"
    assert chip.hbm_bytes == 32.0e9  # the marketed capacity stays for reports


def test_xla_loss_holds_one_fp32_buffer_per_logit_beside_held_gradients() -> None:
    # Llama 3 8B on 8 v6e, DP8, micro-batch 1 of 2048 tokens, 2 micro-batches (the gradient accumulator is held
    # through the loss), no recompute, no FSDP: activations = 32 layers' saved bytes + the loss's fp32 logits buffer.
    # logits: 4 B x 2048 tokens x 128,256 vocabulary = 1,050,673,152 B (a fused GPU cross-entropy holds 6 B). XLA's
    # scanned layers save the matmul outputs (gemm-last's set; CostModel._xla_saved_layer), PyTorch Korthikanti's set;
    # the one layer rebuilt in XLA's backward (Korthikanti's set less the saved one) is below the logits buffer.
    m = load_model("llama3-8b")
    mem = _pinned("llama3-8b", "tpu-v6e", 8, 2048, 16, dp=8)
    saved = 32 * tm.activation_bytes_per_layer(m, 2048, 1, "gemm-last")["total"]
    assert mem["activations"] == pytest.approx(saved + 1_050_673_152, rel=1e-9)
    gpu = _pinned("llama3-8b", "h100-sxm", 8, 2048, 16, dp=8)
    korthikanti = 32 * tm.activation_bytes_per_layer(m, 2048, 1, "none")["total"]
    assert gpu["activations"] - korthikanti == pytest.approx(6 * 2048 * 128256, rel=1e-9)


def test_xla_loss_peak_comes_before_the_gradients_and_the_rematerialised_layer_stays_in_hbm() -> None:
    # Llama 3 8B on 8 v6e, FSDP8, one micro-batch of 8192 tokens, full recompute, layer inputs offloaded to the
    # host. Two peaks, never live together: the loss (fp32 logits 4 x 8192 x 128,256 = 4,202,692,608 B plus the
    # gathered bf16 output layer 2 x 128,256 x 4,096 = 1,050,673,152 B, before any layer gradient exists) and the
    # layer backward (the fp32 gradients 4 x P / 8 plus the one layer being rematerialised, no recompute inside, and
    # its MLP's gate/up gradient, bf16 2 x 8192 x 2 x 14,336 = 469,762,048 B; flash attention: no dP, dS).
    m = load_model("llama3-8b")
    pc = tm.param_counts(m)
    mem = _pinned("llama3-8b", "tpu-v6e", 8, 8192, 8, fsdp=8, recompute="full", offload=1.0)
    grads = 4 * pc.total / 8
    assert mem["grads"] == pytest.approx(grads, rel=1e-9)
    loss_peak = 4_202_692_608 + 1_050_673_152
    working = tm.activation_bytes_per_layer(m, 8192, 1, "none")["total"] + 469_762_048
    assert mem["activations"] == pytest.approx(max(loss_peak - grads, working), rel=1e-9)
    # the host holds the 32 layer inputs (bf16, 2 x 8192 x 4096 each = 67,108,864 B), not the working layer
    assert mem["offloaded"] == pytest.approx(32 * 67_108_864, rel=1e-9)


def test_maxtext_bf16_weight_dtype_stores_weights_gradients_and_moments_in_two_bytes() -> None:
    # Llama 3.1 70B on 32 v6e, FSDP32 (tpu-recipes llama3_1_70b_8192_bs2_bfloat16: weight_dtype bfloat16):
    # weights 2 B, gradients 2 B, Adam mu + nu 2 + 2 B per parameter, each over 32 shards
    pc = tm.param_counts(load_model("llama3-70b"))
    mem = _pinned("llama3-70b", "tpu-v6e", 32, 8192, 64, Options(weight_dtype_bytes=2.0), fsdp=32, microbatch=2,
                  recompute="full", offload=1.0)
    assert (mem["params"], mem["grads"], mem["optimizer"]) == pytest.approx(
        (2 * pc.total / 32, 2 * pc.total / 32, 4 * pc.total / 32), rel=1e-9)
    fp32 = _pinned("llama3-70b", "tpu-v6e", 32, 8192, 64, fsdp=32, microbatch=2, recompute="full", offload=1.0)
    assert fp32["params"] + fp32["grads"] + fp32["optimizer"] == pytest.approx(16 * pc.total / 32, rel=1e-9)


def test_weight_dtype_read_from_a_run_description() -> None:
    assert weight_dtype_bytes_of("maxtext pure fsdp: ici_fsdp_parallelism -1; weight_dtype bfloat16") == 2.0
    assert weight_dtype_bytes_of("bf16 activations (weight dtype fp32 default)") == 4.0
    assert weight_dtype_bytes_of("bf16 (maxtext, xla)") == 0.0


# H100: fractions measured at head dim 128, times cuDNN's tile factor at 2,048 keys per query over the 8K anchor,
# (1 + 3.65·128/2048) / (1 + 3.65·128/4096) = 1.228125 / 1.1140625 (efficiency.attention_tile_factor); A100: none
@pytest.mark.parametrize(("hw", "fill"), [("tpu-v6e", 0.5), ("tpu-v5e", 1.0), ("h100-sxm", 1.1140625 / 1.228125),
                                          ("a100-80gb", 1.0)])
def test_attention_fills_head_dim_over_mxu_width_of_a_tpu_array(hw: str, fill: float) -> None:
    # Llama 3 8B, 4096 tokens, head dim 128: forward core FLOPs 2 x 4096 tokens x 2048 keys (causal mean) x 32 heads
    # x 256 (QKᵀ + AV widths) = 137,438,953,472; v6e's 256x256 MXU is half-filled by a 128-wide head (book ch.2),
    # v5e's 128x128 fully; GPUs' fractions are measured at head dim 128
    chip = load_chip(hw)
    eff = default_efficiency(chip)
    cm = CostModel(Problem(load_model("llama3-8b"), chip, 1, 4096, 1), eff, Options())
    cfg = ParallelConfig(dp=1, fsdp=1, tp=1, pp=1, vpp=1, cp=1, ep=1, microbatch=1, recompute="none", zero=0)
    g = cm.geometry(LayoutArrays.from_configs([cfg]))
    core = cm._attention_core_term(g)
    f_core = 137_438_953_472
    assert float(core["flops_f"][0]) == pytest.approx(f_core, rel=1e-12)
    assert float(core["f_s"][0]) == pytest.approx(f_core / (chip.peak("bf16") * eff.attention_fwd_fraction * fill))


def test_weight_dtype_flag(capsys) -> None:
    # the tpu-recipes 70B layout on 32 v6e: bf16 weights, gradients and moments, 2 + 2 + 4 B x 70.6B / 32 = 17.6 GB
    pins = ["--fsdp", "32", "--dp", "1", "--tp", "1", "--pp", "1", "--cp", "1", "--ep", "1", "--vpp", "1",
            "--microbatch", "2", "--recompute", "full", "--offload", "1", "--zero", "0", "--offload-optimizer", "0",
            "--offload-params", "0"]
    base = ["train", "--model", "llama3-70b", "--hardware", "tpu-v6e", "--chips", "32", "--seq-len", "8192",
            "--global-batch", "64", *pins, "--headroom", "0", "--json"]
    rc, out, _ = run_cli([*base, "--weight-dtype", "bf16"], capsys)
    assert rc == 0
    mem = json.loads(out)["plans"][0]["memory_bytes_per_chip"]
    p = tm.param_counts(load_model("llama3-70b")).total
    assert (mem["params"], mem["grads"], mem["optimizer"]) == pytest.approx((2 * p / 32, 2 * p / 32, 4 * p / 32))
    rc, _, err = run_cli([*base, "--weight-dtype", "fp16"], capsys)
    assert rc == 2 and err.startswith("error:") and "--weight-dtype" in err


def test_maxtext_custom_policy_keeps_the_named_projections_on_the_host() -> None:
    # Llama 3.1 70B on 32 v6e, 2 x 8192 tokens per chip, MaxText remat_policy custom with decoder_layer_input,
    # query_proj, key_proj and value_proj offloaded (tpu-recipes llama3_1_70b_8192_bs2): the host holds per layer
    # the input (8192 wide) and q, k, v (8192 + 1024 + 1024): 80 x 16384 x 2 B x 18432 = 48,318,382,080 B, and the
    # backward does not rerun the q/k/v GEMMs: 80 layers x 2 x 16384 x 8192 x 10240 = 219,902,325,555,200 FLOPs fewer
    prob = Problem(load_model("llama3-70b"), load_chip("tpu-v6e"), 32, 8192, 64)
    pins = Pins(dp=1, fsdp=32, tp=1, pp=1, vpp=1, cp=1, ep=1, microbatch=2, recompute="full", zero=0, offload=1.0,
                offload_optimizer=0, offload_params=0)
    kept = Options(kept_projections=("query_proj", "key_proj", "value_proj"))
    ev, _, _ = search(prob, pins, default_efficiency(prob.chip), kept)
    base, _, _ = search(prob, pins, default_efficiency(prob.chip), Options())
    assert float(ev.memory["offloaded"][0]) == pytest.approx(48_318_382_080, rel=1e-9)
    flops = float(base.ledger.plan(0)["flops"]["matmul"]) - float(ev.ledger.plan(0)["flops"]["matmul"])
    assert flops == pytest.approx(219_902_325_555_200, rel=1e-9)
    assert ev.step_time_s[0] < base.step_time_s[0]
    with pytest.raises(MeshplanError, match="unknown MaxText checkpoint name 'mlpwo'"):
        Options(kept_projections=("mlpwo",))  # refused where the options are made, before any cost term


def test_maxtext_dropping_moe_runs_capacity_buffers_and_one_hot_einsums() -> None:
    # Mixtral 8x7B, one 4096-token sequence (tpu-recipes mixtral_8x7b_dropped: capacity_factor 1.25, megablox and
    # sparse_matmul off). Expert buffers: C = ceil(4096 x 2 / 8) x 1.25 = 1280 slots each, 8 x 1280 = 10240 = 1.25 x
    # the 8192 routed token copies, so the expert GEMMs cost 0.25 x 2 x 4096 x 2 x (3 x 4096 x 14336) =
    # 721,554,505,728 FLOPs more; dispatch + combine einsums 2 x (2 x 4096 x 10240 x 4096) = 687,194,767,360 FLOPs
    chip = load_chip("tpu-v6e")
    cfg = ParallelConfig(dp=1, fsdp=1, tp=1, pp=1, vpp=1, cp=1, ep=1, microbatch=1, recompute="none", zero=0)
    flops = {}
    for cf in (0.0, 1.25):
        cm = CostModel(Problem(load_model("mixtral-8x7b"), chip, 1, 4096, 1), default_efficiency(chip),
                       Options(moe_capacity_factor=cf))
        flops[cf] = float(cm._matmul_term(cm.geometry(LayoutArrays.from_configs([cfg])))["flops"][0])
    assert flops[1.25] - flops[0.0] == pytest.approx(721_554_505_728 + 687_194_767_360, rel=1e-9)


@pytest.mark.parametrize(("seq", "bq", "bkv", "ratio"), [
    (8192, 2048, 2048, 1.25),  # 1 + 2 + 3 + 4 = 10 of 16 blocks: 10 x 2048² / (8192² / 2) = 41,943,040 / 33,554,432
    (8192, 512, 512, 1.0625),  # 16 x 17 / 2 = 136 of 256 blocks (marin-community/marin#6332): 136 / 128
    (4096, 2048, 512, 1.5),  # q block 0 reaches 4 kv blocks, q block 1 all 8: 12 x 2048 x 512 / (4096² / 2)
    (1024, 2048, 2048, 2.0),  # blocks capped at S (MaxText min(sa_block_q, S)): one 1024² block over 1024² / 2
    (8192, 0, 0, 1.0),  # no block grid: the causal half
])
def test_splash_attention_computes_every_causal_block_that_is_not_empty(seq: int, bq: int, bkv: int,
                                                                        ratio: float) -> None:
    assert tm.causal_block_visit_ratio(seq, bq, bkv) == pytest.approx(ratio, rel=1e-12)


def test_splash_block_grid_scales_the_tpu_attention_core_only() -> None:
    # Llama 3.1 70B, one 8192-token sequence on a v6e: forward core FLOPs 2 x 8192 tokens x 4096 keys (causal mean)
    # x 64 heads x 256 = 1,099,511,627,776; 2048 x 2048 blocks compute 1.25 x that forward and backward (the
    # backward 2.5 x the forward's), so every core time is 1.25 x; a 1024 x 512 forward grid 1.125 x (1, 2, ..., 8
    # q blocks of 1024 reach 2, 4, ..., 16 kv blocks of 512: 72 x 1024 x 512 / (8192² / 2))
    def core(hw: str, model: str, **kw) -> dict:
        chip = load_chip(hw)
        cm = CostModel(Problem(load_model(model), chip, 1, 8192, 1), default_efficiency(chip), Options(**kw))
        cfg = ParallelConfig(dp=1, fsdp=1, tp=1, pp=1, vpp=1, cp=1, ep=1, microbatch=1, recompute="none", zero=0)
        return {k: float(v[0]) if hasattr(v, "__len__") else float(v)
                for k, v in cm._attention_core_term(cm.geometry(LayoutArrays.from_configs([cfg]))).items()}

    blocks = dict(attention_block_fwd=(2048, 2048), attention_block_bwd=(2048, 2048))
    plain, grid = core("tpu-v6e", "llama3.1-70b"), core("tpu-v6e", "llama3.1-70b", **blocks)
    assert plain["flops_f"] == pytest.approx(1_099_511_627_776, rel=1e-12)
    assert grid["flops_f"] == pytest.approx(1.25 * 1_099_511_627_776, rel=1e-12)
    assert grid["flops_b"] == pytest.approx(1.25 * 2.5 * 1_099_511_627_776, rel=1e-12)
    for key in ("f_s", "b_s", "qk_f_s"):
        assert grid[key] == pytest.approx(1.25 * plain[key], rel=1e-12)
    fwd_only = core("tpu-v6e", "llama3.1-70b", attention_block_fwd=(1024, 512))
    assert fwd_only["f_s"] == pytest.approx(1.125 * plain["f_s"], rel=1e-12)
    assert fwd_only["b_s"] == pytest.approx(plain["b_s"], rel=1e-12)
    # GPUs (FlashAttention's own tiles) and windowed layers (gemma2: blocks follow the window) are left as they were
    assert core("h100-sxm", "llama3.1-70b", **blocks)["f_s"] == pytest.approx(core("h100-sxm", "llama3.1-70b")["f_s"])
    assert core("tpu-v6e", "gemma2-9b", **blocks)["f_s"] == pytest.approx(core("tpu-v6e", "gemma2-9b")["f_s"])
    with pytest.raises(MeshplanError, match=r"attention_block_fwd must be \(block_q, block_kv\)"):
        Options(attention_block_fwd=(2048,))
    with pytest.raises(MeshplanError, match=r"attention_block_bwd\[1\]"):
        Options(attention_block_bwd=(2048, -1))


def test_maxtext_iota_embedding_is_a_one_hot_matmul_forward_and_for_the_table_gradient() -> None:
    """MaxText use_iota_embed (layers/embeddings.py @tpu-recipes-v0.1.4: jnp.dot(one_hot(ids), embedding)): Llama 3 8B
    (V = 128,256, D = 4,096) on one v6e, one sequence of 4,096 tokens: 2 x 4096 x 128256 x 4096 = 4.3036e12 FLOPs
    forward and the same for the table's gradient = 8.6072e12 more matmul FLOPs a step, each pass at the matmul rate
    of its shape: 0.92 x 4096/(4096 + 256) (matmul_half_dim, the narrowest dim D) x 9.2e14 FLOP/s."""
    prob = Problem(load_model("llama3-8b"), load_chip("tpu-v6e"), 1, 4096, 1)
    eff = default_efficiency(prob.chip)
    L = LayoutArrays.from_configs([ParallelConfig(microbatch=1, recompute="none")])
    out = {}
    for on in (False, True):
        cm = CostModel(prob, eff, Options(iota_embedding=on))
        g = cm.geometry(L)
        ct = cm.compute_terms(L, g)
        out[on] = (float(np.ravel(g["ledger"]["flops/matmul"])[0]), float(np.ravel(ct["fwd"] + ct["bwd"])[0]))
    f_pass = 2 * 4096 * 128_256 * 4096
    assert f_pass == pytest.approx(4.3036e12, rel=1e-4)
    assert out[True][0] - out[False][0] == pytest.approx(2 * f_pass, rel=1e-9)
    rate = 0.92 * 4096 / (4096 + 256) * 9.2e14
    assert out[True][1] - out[False][1] == pytest.approx(2 * f_pass / rate, rel=1e-6)
