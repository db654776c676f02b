"""torchtitan's behaviour by release (`--framework torchtitan@VERSION`, train/frameworks.py VERSIONS), each term
checked against a hand sum: the FSDP2 group nothing hides (the root module until v0.1.0, the token embedding
since v0.2.0), RoPE's complex product that torch.compile leaves eager, and the K/V repeat before SDPA (until
v0.2.1)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from meshplan.cost.efficiency import default_efficiency
from meshplan.errors import MeshplanError
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import LayoutArrays, ParallelConfig
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.frameworks import date_of, framework_options, preset, version_at
from meshplan.train.space import Problem

# Llama 3 8B: vocab 128,256, d_model 4,096, untied output layer, 32 query and 8 KV heads of 128
VOCAB, D, N_HEADS, KV_HEADS, HEAD_DIM = 128_256, 4_096, 32, 8, 128
TABLE = VOCAB * D  # 525,336,576 parameters in the embedding table, as many in the output layer
BW = 1.0e11  # a plain 100 GB/s, zero-latency network, so the sums are by hand


def _cost(options: Options, cfg: ParallelConfig, seq: int = 8192, batch: int = 16, fake_comm: bool = False):
    prob = Problem(load_model("llama3-8b"), load_chip("h100-sxm"), 8, seq, batch)
    cm = CostModel(prob, default_efficiency(prob.chip), options)
    if fake_comm:  # `nbytes` is the whole (gathered) array, as the CommModel takes it
        cm.comm.time = lambda kind, nbytes, size, stride: (nbytes / BW) * (size > 1)
    L = LayoutArrays.from_configs([cfg])
    g = cm.geometry(L)
    return cm, L, g


def _fsdp_seconds(edge: str) -> tuple[float, float, float]:
    """(exposed FSDP seconds per micro-batch, layer forward compute, layer backward compute) under FSDP8."""
    cm, L, g = _cost(Options(fsdp_edge_group=edge), ParallelConfig(fsdp=8, microbatch=2, recompute="none"),
                     fake_comm=True)
    ct = cm.compute_terms(L, g)
    out = cm.comm_terms(L, g, ct)
    return float(out["fsdp_mb"][0]), float(ct["layer_fwd"][0]), float(ct["layer_bwd"][0])


def test_root_group_gather_and_reduce_scatter_are_exposed() -> None:
    """FSDP8 over 8 GPUs, layers' traffic hidden: the root group (both tables and the final norm, 1,050,677,248
    parameters) adds its bf16 all-gather before the first layer and its fp32 reduce-scatter after the backward:
    (2 + 4) B x 1,050,677,248 / 100 GB/s = 63.04 ms."""
    none, layer_f, layer_b = _fsdp_seconds("none")
    root, _, _ = _fsdp_seconds("root")
    # the layers' traffic hides: one layer's bf16 gather (218,112,000 params: 4.36 ms) is below its forward
    layer_params = 2 * D * D + 2 * D * KV_HEADS * HEAD_DIM + 3 * D * 14_336 + 2 * D  # q, o; k, v; MLP; norms
    assert layer_params == 218_112_000
    assert 2 * layer_params / BW < layer_f and 6 * layer_params / BW < layer_b
    root_params = 2 * TABLE + D
    assert root - none == pytest.approx((2 + 4) * root_params / BW, rel=1e-9)
    assert root - none == pytest.approx(0.06304, rel=1e-4)


def test_embedding_group_exposes_only_the_token_table() -> None:
    """Since torchtitan v0.2.0 the output layer and final norm are their own group, hidden behind the layers: only
    the token embedding's 525,336,576 parameters show, (2 + 4) B each over 100 GB/s = 31.52 ms."""
    none, _, _ = _fsdp_seconds("none")
    emb, _, _ = _fsdp_seconds("embedding")
    assert emb - none == pytest.approx((2 + 4) * TABLE / BW, rel=1e-9)


def _pointwise(**kw) -> tuple[float, float]:
    cfg = kw.pop("cfg", ParallelConfig(microbatch=1, recompute="none"))
    cm, _, g = _cost(Options(**kw), cfg, batch=8)
    out = cm._pointwise_term(g)
    return float(out["hbm"][0]), float(out["hbm_b"][0])


def test_complex_rope_and_kv_repeat_bytes_by_hand() -> None:
    """One micro-batch of 8,192 tokens, bf16. RoPE on q and k, (32 + 8) x 128 = 5,120 elements a token: the three
    kernels move 20 B each way where the fused pass counts 4 (forward) and 8 (backward): 8,192 x 5,120 x 16 =
    671,088,640 B forward, x 12 = 503,316,480 B backward. The repeat of K and V to 32 heads: read 2 x 1,024, write
    2 x 4,096 elements a token, 2 B each: 8,192 x 20,480 = 167,772,160 B each way."""
    f0, b0 = _pointwise()
    f1, b1 = _pointwise(complex_rope=True)
    assert (f1 - f0, b1 - b0) == (pytest.approx(671_088_640), pytest.approx(503_316_480))
    f2, b2 = _pointwise(repeat_kv=True)
    assert (f2 - f0, b2 - b0) == (pytest.approx(167_772_160), pytest.approx(167_772_160))
    f3, b3 = _pointwise(complex_rope=True, repeat_kv=True)
    assert (f3 - f0, b3 - b0) == (pytest.approx(838_860_800), pytest.approx(671_088_640))
    # under TP 2 every head count halves: half the bytes
    tp2 = ParallelConfig(tp=2, microbatch=1, recompute="none")
    g0, _ = _pointwise(cfg=tp2)
    g3, _ = _pointwise(cfg=tp2, complex_rope=True, repeat_kv=True)
    assert g3 - g0 == pytest.approx(838_860_800 / 2)


def test_eager_rope_is_left_to_the_unfused_factor() -> None:
    """Eager PyTorch's RoPE is already inside unfused_elementwise_factor: complex_rope adds nothing without fusion."""
    assert _pointwise(fused_elementwise=False, complex_rope=True) == _pointwise(fused_elementwise=False)


def test_foreach_adamw_update_bytes_by_hand() -> None:
    """Llama 3 8B (8,030,261,248 parameters) sharded over FSDP8: 1,003,782,656 local fp32 parameters. The foreach
    AdamW moves 80 B each (8 passes), the fused one 30: the update takes 50 x 1,003,782,656 B more of HBM time."""
    cfg = ParallelConfig(fsdp=8, microbatch=2, recompute="none")
    (cm0, L0, g0), (cm1, L1, g1) = (_cost(Options(optimizer_impl=impl), cfg) for impl in ("fused", "foreach"))
    local = 8_030_261_248 / 8
    assert float(g0["params_stage_local"][0]) == pytest.approx(8_030_261_248)
    hbm = cm0.hbm  # achieved HBM bytes/s of the chip
    extra = float(cm1.optimizer_terms(L1, g1)[0] - cm0.optimizer_terms(L0, g0)[0])
    assert extra == pytest.approx((80 - 30) * local / hbm, rel=1e-9)


def test_versioned_torchtitan_presets() -> None:
    old, mid, new = preset("torchtitan@2024.12"), preset("torchtitan@2025.10"), preset("torchtitan")
    assert (old["fsdp_edge_group"], old["repeat_kv"], old["optimizer_impl"]) == ("root", True, "foreach")
    assert preset("torchtitan@2025.06") == {**old, "optimizer_impl": "fused"}  # fused AdamW since February 2025
    assert (mid["fsdp_edge_group"], mid["repeat_kv"]) == ("embedding", True)
    assert (new["fsdp_edge_group"], new["repeat_kv"], new["complex_rope"]) == ("embedding", False, True)
    assert preset("torchtitan@2026.02") == new
    # an explicit flag still wins over the versioned preset
    assert framework_options("torchtitan@2024.12", Options(), {"repeat_kv": False}).repeat_kv is False
    with pytest.raises(MeshplanError, match=r"known versions: 2024.12, 2025.06, 2025.10, 2026.02"):
        preset("torchtitan@2025.07")


@pytest.mark.parametrize(("text", "version"), [
    ("pytorch/torchtitan benchmarks -- Llama 3.1 on H100 (torchtitan team, Dec 2024)", "torchtitan@2024.12"),
    ("benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md", "torchtitan@2025.06"),
    ("run of 2025/09/30", "torchtitan@2025.06"),  # v0.2.0 came out in October
    ("March 2026", "torchtitan@2026.02"),
    ("a 2023 run", "torchtitan@2024.12"),  # before every listed release: the oldest
    ("no date at all", "torchtitan"),
])
def test_version_of_a_dated_run(text: str, version: str) -> None:
    assert version_at("torchtitan", date_of(text)) == version


def test_harness_plans_the_december_2024_runs_with_that_release() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import _measurements as H

    rows = [e for e in H.load_entries() if e["group"] == "torchtitan_h100_2024_12"]
    assert rows
    for e in rows:
        opts = H.options_of(e)
        assert (opts.fsdp_edge_group, opts.repeat_kv, opts.complex_rope) == ("root", True, True), e["id"]
