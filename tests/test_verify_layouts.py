"""The layouts `meshplan verify` builds beyond DP/FSDP/TP/CP/EP (issue 13 item 3): ZeRO-1/2, ZeRO-3 as FSDP,
gradient accumulation, pipeline parallelism (one SPMD loop over `stage`, GPipe and circular), ring context parallelism, EP8 and the
refusals. Each compiled program is checked against properties derived by hand (arithmetic in comments) and
its sharded loss against the one-device loss.

JAX must see XLA_FLAGS before it starts, so every case compiles and runs in one subprocess (module fixture).

The tiny dense model (same as tests/test_verify.py): L=2 D=256 N=8 K=4 (G=N/K=2) H=32 F=512 V=512, SwiGLU,
untied embeddings, fp32. Parameter elements, by hand:
  per layer: wqkv D·K·(G+2)·H = 256·4·4·32 = 131072; wo N·H·D = 65536; w_gate_up D·2·F = 262144;
             w_down F·D = 131072; two norms 2·D = 512 → 590336
  embedding V·D = 131072, unembedding D·V = 131072, final norm D = 256
  L=2: 2·590336 + 131072 + 131072 + 256 = 1443072 elements → PARAM_BYTES = 4·1443072 = 5772288 (5.505 MiB)
T=128, B=16 sequences, 8 devices.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")
pytestmark = pytest.mark.jax

LAYER_ELEMS = 131072 + 65536 + 262144 + 131072 + 512
OUTSIDE_ELEMS = 131072 + 131072 + 256  # embedding, unembedding, final norm
PARAM_BYTES = 4 * (2 * LAYER_ELEMS + OUTSIDE_ELEMS)  # 5772288
T, B, D = 128, 16, 256

CASES = {
    "zero1_dp8": ("dense", dict(dp=8, zero=1)),
    "zero1_dp8_mb1": ("dense", dict(dp=8, zero=1, microbatch=1)),
    "zero2_dp8_mb1": ("dense", dict(dp=8, zero=2, microbatch=1)),
    "dp8_mb1": ("dense", dict(dp=8, microbatch=1)),
    "zero3_dp8": ("dense", dict(dp=8, zero=3)),
    "pp2_dp4": ("dense", dict(dp=4, pp=2, microbatch=1)),
    "pp2_tp2_dp2": ("dense", dict(dp=2, tp=2, pp=2, microbatch=2)),
    "pp2_tp2_dp2_full": ("dense", dict(dp=2, tp=2, pp=2, microbatch=2, recompute="full")),
    "pp4_dp2": ("dense4", dict(dp=2, pp=4, microbatch=2)),
    "pp4_dp2_vpp2": ("dense8", dict(dp=2, pp=4, vpp=2, microbatch=2)),
    "cp4_tp2_ring": ("dense", dict(cp=4, tp=2, cp_impl="ring")),
    "cp4_tp2_allgather": ("dense", dict(cp=4, tp=2, cp_impl="allgather")),
    "ep8": ("moe", dict(ep=8)),
}
REFUSED = {"vpp2_one_micro": dict(dp=2, pp=4, vpp=2, microbatch=8), "offload": dict(dp=8, offload=0.5)}

_SCRIPT = r"""
import json, sys
from meshplan.errors import MeshplanError
from meshplan.measure import verify as v
from meshplan.measure.layout import Layout
from meshplan.specs.model import ModelConfig
v.ensure_host_devices(8)
import jax
from meshplan.measure import jaxmodel as jm
cases, refused = json.loads(sys.argv[1]), json.loads(sys.argv[2])
base = dict(n_layers=2, d_model=256, n_heads=8, n_kv_heads=4, head_dim=32, d_ff=512, vocab_size=512)
models = {"dense": ModelConfig(name="tiny", **base), "dense4": ModelConfig(name="tiny4", **{**base, "n_layers": 4}),
          "dense8": ModelConfig(name="tiny8", **{**base, "n_layers": 8}),
          "moe": ModelConfig(name="tiny-moe", n_experts=8, experts_per_token=2, **base)}
S, B, STEPS = 128, 16, 2
refs, out = {}, {}
for name, (mk, kw) in cases.items():
    m, lay = models[mk], Layout(**kw)
    if mk not in refs:
        refs[mk] = jm.run_steps(jm.build_program(m, Layout(), S, B, jax.devices()), S, B, STEPS)
    prog, exe = v.compile_step(m, lay, S, B)
    meas = v.measure_compiled(prog, exe)
    lc = v.loss_check(m, lay, S, B, STEPS, compiled=(prog, exe), reference=refs[mk])
    colls = [{"kind": c.kind, "axes": "+".join(c.axes), "dtype": c.dtype, "bytes": c.bytes, "note": c.note}
             for c in meas.pop("collectives")]
    out[name] = {"measured": meas, "collectives": colls, "loss_check": lc,
                 "built": prog.layout.as_dict(), "n_micro": lay.n_micro(B)}
for name, kw in refused.items():
    try:
        v.compile_step(models["dense4"], Layout(**kw), S, B)
        out[name] = {"refused": None}
    except MeshplanError as e:
        out[name] = {"refused": str(e)}
print("JSON" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results() -> dict:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(CASES), json.dumps(REFUSED)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("JSON"))
    return json.loads(line[4:])


def _bytes(res: dict, case: str, kind: str, axes: str, dtype: str = "f32") -> float:
    """Bytes (full-array convention, docs/verify.md) of one collective kind over exactly these mesh axes."""
    return sum(c["bytes"] for c in res[case]["collectives"]
               if c["kind"] == kind and c["axes"] == axes and c["dtype"] == dtype)


def _kinds(res: dict, case: str) -> set[tuple[str, str]]:
    return {(c["kind"], c["axes"]) for c in res[case]["collectives"] if c["bytes"] > 8}  # the 4-byte loss mean aside


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_loss_equals_unsharded(results, case):
    lc = results[case]["loss_check"]
    assert lc["matches"], lc
    assert lc["sharded"] == pytest.approx(lc["unsharded"], rel=1e-4)


def test_zero1_shards_the_optimizer_and_reduce_scatters_gradients(results):
    """ZeRO-1 DP8 (one micro-batch): the gradients are reduce-scattered over `data` (full array: every param,
    PARAM_BYTES), the updated 1/8 shards all-gathered (PARAM_BYTES), and nothing else of that size moves."""
    assert _bytes(results, "zero1_dp8", "reduce-scatter", "data") == PARAM_BYTES
    assert _bytes(results, "zero1_dp8", "all-gather", "data") == PARAM_BYTES
    assert _kinds(results, "zero1_dp8") == {("reduce-scatter", "data"), ("all-gather", "data")}
    # Arguments: params (replicated) + AdamW m and v at 1/8 each + the int32 batch of this device
    # (2 sequences × 128 tokens × 4 B, tokens and targets) + positions (128 × 4 B) + the int32 step.
    args = PARAM_BYTES + 2 * PARAM_BYTES / 8 + 2 * (B // 8) * T * 4 + T * 4 + 4
    assert results["zero1_dp8"]["measured"]["memory: arguments"] == pytest.approx(args, abs=64)


def test_zero1_vs_zero2_with_accumulation(results):
    """DP8 with microbatch 1: 16 / (8·1) = 2 micro-batches. ZeRO-1 accumulates full gradients and reduce-scatters
    once (PARAM_BYTES); ZeRO-2 reduce-scatters each micro-batch's gradients into its 1/8 accumulator
    (2 × PARAM_BYTES). Both all-gather the updated parameters once (PARAM_BYTES)."""
    assert results["zero1_dp8_mb1"]["n_micro"] == 2
    assert _bytes(results, "zero1_dp8_mb1", "reduce-scatter", "data") == PARAM_BYTES
    assert _bytes(results, "zero2_dp8_mb1", "reduce-scatter", "data") == 2 * PARAM_BYTES
    for case in ("zero1_dp8_mb1", "zero2_dp8_mb1"):
        assert _bytes(results, case, "all-gather", "data") == PARAM_BYTES
        assert _bytes(results, case, "all-reduce", "data") <= 8  # only the loss mean


def test_gradient_accumulation_reduces_once(results):
    """Plain DP8 with 2 micro-batches: the replicas accumulate locally and all-reduce the gradients once per
    step (PARAM_BYTES), not once per micro-batch; the matmul FLOPs equal one pass over the batch:
    3 (fwd+bwd) × 256 tokens × (2 layers × 1310720 + 262144) = 2214592512, where a layer's forward is
    2·589824 (weights) + 2·2·T·N·H = 131072 (materialised QKᵀ and AV) per token and the head 2·D·V = 262144."""
    assert _bytes(results, "dp8_mb1", "all-reduce", "data") == PARAM_BYTES + 4  # + the loss mean
    assert results["dp8_mb1"]["measured"]["matmul flops"] == 3 * 256 * (2 * 1310720 + 262144)


def test_zero3_is_fsdp_over_the_data_ranks(results):
    """--zero 3 with dp=8 builds FSDP over the 8 data ranks (the ranks move to the `fsdp` axis): every weight
    gathered for the forward and the layers' again for the backward, gradients reduce-scattered."""
    r = results["zero3_dp8"]
    assert r["built"]["fsdp"] == 8 and r["built"]["dp"] == 1 and r["built"]["zero"] == 0
    # AG = the layers' weights twice (forward, backward: 2 × 2 × 590336, matrices and norm scales: the layer scan's
    # backward gathers the scales again too; unrolled, XLA kept them from the forward), embedding + unembedding +
    # final norm once (262400): 4 B × 2623744; RS = PARAM_BYTES
    assert _bytes(results, "zero3_dp8", "all-gather", "fsdp") == 4 * (2 * 2 * LAYER_ELEMS + OUTSIDE_ELEMS)
    assert _bytes(results, "zero3_dp8", "reduce-scatter", "fsdp") == PARAM_BYTES
    args = 3 * PARAM_BYTES / 8 + 2 * (B // 8) * T * 4 + T * 4 + 4  # params, m, v at 1/8
    assert r["measured"]["memory: arguments"] == pytest.approx(args, abs=64)


def _pp_checks(results, case, pp, n_micro, act_mb_bytes, stage_param_bytes):
    """GPipe over `stage`: n_micro + pp − 1 ticks, a send after every tick but the last, forward and backward
    (the ppermute's transpose): collective-permute = 2 (n_micro + pp − 2) × the micro-batch activation. The
    last stage's outputs reach every stage by one all-reduce over `stage` (n_micro × activation) and the input
    gradients are summed over `stage` in the backward (again): 2 n_micro × activation. The gradients are
    all-reduced over `data` once: this stage's layers, the embedding, unembedding and final norm."""
    assert results[case]["n_micro"] == n_micro
    assert _bytes(results, case, "collective-permute", "stage") == 2 * (n_micro + pp - 2) * act_mb_bytes
    assert _bytes(results, case, "all-reduce", "stage") == 2 * n_micro * act_mb_bytes
    assert _bytes(results, case, "all-reduce", "data") == stage_param_bytes + 4  # + the loss mean


def test_pp2_dp4(results):
    """PP2 × DP4, microbatch 1: 16 / 4 = 4 sequences per replica → 4 micro-batches of 1 sequence;
    activation per micro-batch 1 × 128 × 256 × 4 B = 131072; permute 2 × (4 + 2 − 2) × 131072 = 1 MiB.
    Stage params: 1 layer + outside = 4 × (590336 + 262400). Matmul FLOPs show the bubble: each stage runs its
    layer on 5 ticks of 128 tokens (4 useful): 3 × 5 × 128 × 1310720, plus the head, replicated over `stage`,
    on this replica's 4 × 128 tokens: 3 × 512 × 262144 → 2919235584."""
    _pp_checks(results, "pp2_dp4", 2, 4, 131072, 4 * (LAYER_ELEMS + OUTSIDE_ELEMS))
    assert results["pp2_dp4"]["measured"]["matmul flops"] == 3 * 5 * 128 * 1310720 + 3 * 512 * 262144
    assert {k for k, _ in _kinds(results, "pp2_dp4")} == {"collective-permute", "all-reduce"}


def test_pp2_tp2_dp2_four_microbatches(results):
    """PP2 × TP2 × DP2, microbatch 2: 16 / 2 = 8 per replica → 4 micro-batches of 2 sequences; under
    sequence parallelism a stage's output is split over `tensor`: 2 × 128/2 × 256 × 4 B = 131072 per
    micro-batch; permute 2 × 4 × 131072 = 1 MiB. The data all-reduce carries this device's TP shard of the
    stage's gradients: a layer's weights / 2 except its norms (590336 − 512) / 2 + 512, the embedding and
    unembedding / 2 and the final norm 256: 4 × (294912 + 512 + 131072 + 256) = 1707008."""
    _pp_checks(results, "pp2_tp2_dp2", 2, 4, 131072, 4 * ((LAYER_ELEMS - 512) // 2 + 512 + 131072 + 256))


def test_pp_with_full_recompute(results):
    """Full recompute inside the pipeline reruns each layer's forward in the backward, less the MLP
    down-projection (its output only feeds the residual; docs/verify.md, learned 3): per tick a stage's layer
    redoes 1310720 − 2·D·F = 1048576 FLOPs per token on 2 × 128 tokens, split over tp = 2, for 5 ticks:
    5 × 256 × 1048576 / 2 = 671088640 more matmul FLOPs, and the same permutes (the sends are outside the
    layers)."""
    base, full = (results[c]["measured"]["matmul flops"] for c in ("pp2_tp2_dp2", "pp2_tp2_dp2_full"))
    assert full - base == 5 * 256 * (1310720 - 2 * 256 * 512) / 2
    assert (_bytes(results, "pp2_tp2_dp2_full", "collective-permute", "stage")
            == _bytes(results, "pp2_tp2_dp2", "collective-permute", "stage"))


def test_pp4_dp2(results):
    """PP4 × DP2 on the 4-layer twin, microbatch 2: 16 / 2 = 8 per replica → 4 micro-batches of 2 sequences;
    activation 2 × 128 × 256 × 4 B = 262144; permute 2 × (4 + 4 − 2) × 262144 = 3 MiB; one layer per stage."""
    _pp_checks(results, "pp4_dp2", 4, 4, 262144, 4 * (LAYER_ELEMS + OUTSIDE_ELEMS))


def test_pp4_dp2_interleaved(results):
    """PP4 × DP2 with 2 virtual stages (circular, MaxText's num_pipeline_repeats = 2) on the 8-layer twin,
    microbatch 2: M = 16 / (2 · 2) = 4 micro-batches of 2 sequences; stage s holds layers s and 4 + s (one per
    repeat). The loop runs M·v + pp − 1 = 4·2 + 3 = 11 iterations of one layer each and rotates the state after
    every one but the last: permute 2 × 10 × 262144 (2 × 128 × 256 × 4 B) = 5 MiB over `stage`; the last stage's
    outputs and the input gradients cross `stage` once per micro-batch each: 2 × 4 × 262144 = 2 MiB. The data
    all-reduce carries the stage's 2 layers and the outside weights once. Matmul FLOPs: 11 iterations × 256 tokens
    × a layer (3 × 1310720 per token), and the head on this replica's 1024 tokens: 3 × 1024 × 262144."""
    assert results["pp4_dp2_vpp2"]["n_micro"] == 4
    assert _bytes(results, "pp4_dp2_vpp2", "collective-permute", "stage") == 2 * 10 * 262144
    assert _bytes(results, "pp4_dp2_vpp2", "all-reduce", "stage") == 2 * 4 * 262144
    assert _bytes(results, "pp4_dp2_vpp2", "all-reduce", "data") == 4 * (2 * LAYER_ELEMS + OUTSIDE_ELEMS) + 4
    assert results["pp4_dp2_vpp2"]["measured"]["matmul flops"] == 3 * 11 * 256 * 1310720 + 3 * 1024 * 262144
    assert {k for k, _ in _kinds(results, "pp4_dp2_vpp2")} == {"collective-permute", "all-reduce"}


def test_ring_cp_permutes_kv_blocks(results):
    """Ring CP4 × TP2: each layer passes its K and V blocks cp − 1 = 3 hops forward and their gradients 3 hops
    back: 2 layers × 2 × 3 × 2 blocks × (16 seqs × 128/4 tokens × 4/2 KV heads × 32 × 4 B = 131072) = 3 MiB of
    f32, plus the int32 positions of a block (32 × 4 B) per hop, and no all-gather over `context`. The all-gather
    form gathers K/V over `context` and moves no block by permute."""
    assert _bytes(results, "cp4_tp2_ring", "collective-permute", "context") == 2 * 2 * 3 * 2 * 131072
    assert _bytes(results, "cp4_tp2_ring", "collective-permute", "context", "s32") % (32 * 4) == 0
    assert ("all-gather", "context") not in _kinds(results, "cp4_tp2_ring")
    assert ("all-gather", "context") in _kinds(results, "cp4_tp2_allgather")
    assert ("collective-permute", "context") not in _kinds(results, "cp4_tp2_allgather")
    ring, ag = (results[c]["measured"]["matmul flops"] for c in ("cp4_tp2_ring", "cp4_tp2_allgather"))
    assert ring == ag  # the same QKᵀ and AV blocks, computed in a different order


def test_ep8_all_to_all(results):
    """EP8 (8 experts, one per device; dp = 1): capacity C = ⌈1.0 × 128 × 2 / 8⌉ = 32 slots per expert per
    sequence; a device's 2 sequences send 2 × 8 × 32 × 256 × 4 B = 524288 per all-to-all, 2 forward and 2
    backward per layer, 2 layers: 8 × 524288 = 4 MiB over `expert`."""
    assert _bytes(results, "ep8", "all-to-all", "expert") == 8 * 524288


def test_layouts_not_built_are_refused_with_the_reason(results):
    assert "needs at least pp=4 micro-batches" in results["vpp2_one_micro"]["refused"]
    assert "host offload" in results["offload"]["refused"]


def test_hlo_attributes_permutes_and_reduce_scatters_to_mesh_axes():
    """measure/hlo.py on hand-written HLO: mesh (data=4, stage=2), device id = 2·data + stage. A permute between
    ids 2d and 2d+1 crosses `stage`; a reduce-scatter over the groups {0,2,4,6}, {1,3,5,7} spans `data` and
    counts its operand (result × 4)."""
    from meshplan.measure.hlo import parse_collectives

    hlo = """HloModule m
ENTRY %main (p: f32[4,8]) -> f32[4,8] {
  %p = f32[4,8]{1,0} parameter(0)
  %cp = f32[4,8]{1,0} collective-permute(%p), channel_id=1, source_target_pairs={{0,1},{2,3},{4,5},{6,7}}
  ROOT %rs = f32[1,8]{1,0} reduce-scatter(%cp), channel_id=2, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}
}
"""
    coords = {2 * d + s: (d, s) for d in range(4) for s in range(2)}
    colls = {c.kind: c for c in parse_collectives(hlo, coords, ("data", "stage"))}
    assert colls["collective-permute"].axes == ("stage",) and colls["collective-permute"].bytes == 4 * 32
    assert colls["reduce-scatter"].axes == ("data",) and colls["reduce-scatter"].bytes == 4 * 8 * 4


def test_hlo_folds_an_all_reduce_of_an_all_reduce():
    """measure/hlo.py folds an all-reduce chain as XLA's GPU/TPU AllReduceFolder does. Mesh (data=4, stage=2),
    id = 2·data + stage: %a reduces (f32[4,8], f32[]) over `stage` ({0,1},...); %b reduces both results again over
    `data` ({0,2,4,6},{1,3,5,7}) together with an f32[2] of its own (the CPU combiner's tuple). Folded: one
    all-reduce over data+stage of 4·32 + 4 = 132 B (group 2 × 4 = 8), and the f32[2] over `data` alone (8 B)."""
    from meshplan.measure.hlo import parse_collectives

    hlo = """HloModule m
ENTRY %main (p: f32[4,8], q: f32[], r: f32[2]) -> (f32[4,8], f32[], f32[2]) {
  %p = f32[4,8]{1,0} parameter(0)
  %q = f32[] parameter(1)
  %r = f32[2]{0} parameter(2)
  %a = (f32[4,8]{1,0}, f32[]) all-reduce(%p, %q), channel_id=1, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  %g0 = f32[4,8]{1,0} get-tuple-element(%a), index=0
  %g1 = f32[] get-tuple-element(%a), index=1
  ROOT %b = (f32[4,8]{1,0}, f32[], f32[2]{0}) all-reduce(%g0, %g1, %r), channel_id=2, replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%add
}
"""
    coords = {2 * d + s: (d, s) for d in range(4) for s in range(2)}
    colls = parse_collectives(hlo, coords, ("data", "stage"))
    got = sorted((c.axes, c.bytes, c.group_size, c.note) for c in colls)
    assert got == [(("data",), 8.0, 4, ""), (("data", "stage"), 132.0, 8, "all-reduce+all-reduce")]
    unfolded = parse_collectives(hlo, coords, ("data", "stage"), fold_reduce_scatter=False)
    assert sorted((c.axes, c.bytes) for c in unfolded) == [(("data",), 140.0), (("stage",), 132.0)]


def test_hlo_reads_a_sliced_all_reduce_of_an_all_reduce_as_a_reduce_scatter():
    """An all-reduce %b of an all-reduce %a whose result is only dynamic-sliced to 1/4 (its group size) is the
    partitioner's reduce-scatter (a layer scan's weight gradient sliced into the stacked gradient), not an AR+AR
    chain to fold: %a stays an all-reduce over `stage` of f32[4,8] = 128 B; %b is a reduce-scatter over `data` of
    the same 128 B (operand bytes, as a real reduce-scatter counts). Mesh (data=4, stage=2) as above."""
    from meshplan.measure.hlo import parse_collectives

    hlo = """HloModule m
ENTRY %main (p: f32[4,8], i: s32[]) -> f32[1,8] {
  %p = f32[4,8]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  %a = f32[4,8]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  %b = f32[4,8]{1,0} all-reduce(%a), channel_id=2, replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%add
  ROOT %s = f32[1,8]{1,0} dynamic-slice(%b, %i, %z), dynamic_slice_sizes={1,8}
}
"""
    coords = {2 * d + s: (d, s) for d in range(4) for s in range(2)}
    got = sorted((c.kind, c.axes, c.bytes, c.note) for c in parse_collectives(hlo, coords, ("data", "stage")))
    assert got == [("all-reduce", ("stage",), 128.0, ""),
                   ("reduce-scatter", ("data",), 128.0, "all-reduce+dynamic-slice")]


def test_layout_micro_batches_and_zero3():
    """Pure Python: the planner's micro-batch (sequences per micro-batch per batch shard) and ZeRO-3."""
    from meshplan.errors import MeshplanError
    from meshplan.measure.layout import Layout

    assert Layout(dp=4, pp=2, microbatch=1).n_micro(16) == 4  # 16 / (4 shards × 1)
    assert Layout(dp=2, tp=2, pp=2, microbatch=2).n_micro(16) == 4  # 16 / (2 × 2)
    assert Layout(dp=8).n_micro(16) == 1  # microbatch 0: the whole per-shard batch
    z3 = Layout(dp=8, zero=3).resolved()
    assert (z3.dp, z3.fsdp, z3.zero) == (1, 8, 0)
    assert Layout(dp=8, zero=1).resolved() == Layout(dp=8, zero=1)
    with pytest.raises(MeshplanError, match="cp_impl"):
        Layout(cp=2, cp_impl="ulysses")
