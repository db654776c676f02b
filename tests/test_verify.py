"""`meshplan verify` on 8 simulated CPU devices: the planner's ledger against XLA's compiled program.

JAX must see XLA_FLAGS before it starts, and conftest or another test may already have imported it, so
every case compiles (and some run) in one subprocess (module fixture) and the tests read its JSON.
Tolerances (issue 13): matmul FLOPs within 2%, each collective kind's bytes (per kind, and per kind and mesh
axes) within 5%, argument memory within 1%, total memory (arguments + temp) within 15%; sharded loss equal to
the one-device loss (rtol 1e-4, fp32). The predicted side is `measure.verify.plan_ledger`: the cost model
`meshplan train` ranks by, never the compiled program.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("jax")
pytestmark = pytest.mark.jax

# name: (model, layout, run the loss check). The models are the tiny twins `verify` builds (measure.verify.tiny_model).
CASES = {
    "dp8": ("llama3-8b", dict(dp=8), False),
    "fsdp8": ("llama3-8b", dict(fsdp=8), True),
    "tp8": ("llama3-8b", dict(tp=8), True),
    "fsdp4_tp2": ("llama3-8b", dict(fsdp=4, tp=2), False),
    "dp2_tp2_cp2": ("llama3-8b", dict(dp=2, tp=2, cp=2), True),
    "ep4": ("mixtral-8x7b", dict(dp=2, ep=4), True),
    "ep8": ("mixtral-8x7b", dict(ep=8), False),
    "fsdp4_tp2_selective": ("llama3-8b", dict(fsdp=4, tp=2, recompute="selective"), False),
    "fsdp4_tp2_full": ("llama3-8b", dict(fsdp=4, tp=2, recompute="full"), True),
    "fsdp4_tp2_gemm_last": ("llama3-8b", dict(fsdp=4, tp=2, recompute="gemm-last"), False),
    # the flash core (`verify --attention flash`; `attention` is taken out of the layout): the planner's flash ledger
    "tp8_flash": ("llama3-8b", dict(tp=8, attention="flash"), True),
    "fsdp4_tp2_flash": ("llama3-8b", dict(fsdp=4, tp=2, attention="flash"), False),
    # the layouts of issue 13 item 3 (their losses are checked in tests/test_verify_layouts.py)
    "zero1_dp8": ("llama3-8b", dict(dp=8, zero=1), False),
    "zero2_dp8_2mb": ("llama3-8b", dict(dp=8, zero=2, microbatch=1), False),
    # ZeRO under TP (docs/verify.md "Layouts beyond the test matrix"): the optimizer's `data` split on a dim TP leaves
    # whole; ZeRO-2 reduces every micro-batch's gradients, the norm scales' over `tensor` with them
    "zero2_dp4_tp2": ("llama3-8b", dict(dp=4, tp=2, zero=2), True),
    "zero2_dp4_tp2_2mb": ("llama3-8b", dict(dp=4, tp=2, zero=2, microbatch=2), False),
    "zero1_dp4_tp2": ("llama3-8b", dict(dp=4, tp=2, zero=1), False),
    # ZeRO over the replicas data×context (Megatron's data-parallel-with-context group), each layer's gradients
    # reduce-scattered onto the shard inside the backward (jaxmodel.layer_grads)
    "zero2_dp2_tp2_cp2": ("llama3-8b", dict(dp=2, tp=2, cp=2, zero=2), True),
    # ZeRO with EP: the dense weights' state over data×expert, the experts' over data (Megatron's expert-DP group)
    "zero1_dp2_ep4": ("mixtral-8x7b", dict(dp=2, ep=4, zero=1), True),
    "cp4_tp2_allgather": ("llama3-8b", dict(cp=4, tp=2, cp_impl="allgather"), False),
    # ring CP: K/V forward cp − 1 times, dK/dV back cp − 1 times (the ledger's ring_saves_kv for jax)
    "cp4_tp2_ring": ("llama3-8b", dict(cp=4, tp=2, cp_impl="ring"), False),
    "pp2_dp4": ("llama3-8b", dict(dp=4, pp=2, microbatch=1), False),
    "pp2_tp2_dp2": ("llama3-8b", dict(dp=2, tp=2, pp=2, microbatch=2), False),
    # the circular (interleaved) pipeline: 4 stages × 2 repeats on the 8-layer twin, 4 micro-batches (its loss is
    # checked in tests/test_verify_layouts.py); PP with CP and with EP inside the stages
    "pp4_dp2_vpp2": ("llama3-8b", dict(dp=2, pp=4, vpp=2, microbatch=2), False),
    "pp2_cp4": ("llama3-8b", dict(cp=4, pp=2, microbatch=4), False),
    "pp2_cp2_tp2": ("llama3-8b", dict(cp=2, tp=2, pp=2, microbatch=4), True),
    "pp2_ep4": ("mixtral-8x7b", dict(ep=4, pp=2, microbatch=1), True),
    "pp2_cp2_tp2_ring": ("llama3-8b", dict(cp=2, tp=2, pp=2, microbatch=4, cp_impl="ring"), False),
    # FSDP under PP: the stage gathered once per step, its gradients reduce-scattered once (the ledger's rule)
    "pp2_fsdp4": ("llama3-8b", dict(fsdp=4, pp=2, microbatch=1), True),
    # FSDP×EP with the expert ranks carved out of the FSDP group (issue 13, `train | verify --plan`: the planner's
    # dp 2 fsdp 4 ep 4, dp 1 fsdp 8 ep 4, dp 1 fsdp 4 ep 4 pp 2; Layout.ep_in_fsdp, torchtitan's dp_shard_in_ep): the
    # dense weights FSDP-sharded over fsdp×expert, the experts over `fsdp` alone. Compiled only: running the dp 2
    # program's steps stops in XLA:CPU's collectives (an all-gather over `expert` whose rendezvous one device never
    # joins, 40 s timeout; docs/verify.md "EP inside the FSDP group")
    "dp2_fsdp4_ep4": ("mixtral-8x7b", dict(dp=2, ep=4, ep_in_fsdp=True), False),
    "fsdp8_ep4": ("mixtral-8x7b", dict(fsdp=2, ep=4, ep_in_fsdp=True), False),
    "pp2_fsdp4_ep4": ("mixtral-8x7b", dict(ep=4, pp=2, microbatch=1, ep_in_fsdp=True), False),
}
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

# Known residuals (docs/verify.md), each a strict xfail so that a fix shows up as a failure to update. None left:
# DP×CP's two-step gradient all-reduce is folded as XLA's GPU/TPU AllReduceFolder folds it (measure/hlo.py), and the
# ZeRO-2 program reduces its loss once a step, as XLA's TPU compiler does for MaxText's scanned accumulation.
COLLECTIVE_RESIDUALS: set[tuple[str, str]] = set()
# (the SPMD pipeline's bubble FLOPs, replicated embedding/head and `stage` all-reduce are in the maxtext/jax ledger
# since Options.pp_spmd_loop: no FLOP residual is left)
FLOP_RESIDUALS: set[str] = set()
# Temp memory the planner's peak rules do not hold (docs/verify.md "Memory", read from the CPU buffer assignment of
# the program with its layers, and the pipeline's iterations, scanned): the flash backward's blocks scheduled all at
# once (TP8 flash), CP×TP inside the pipeline, all-gather and ring (not broken down). (fsdp8 holds since the layers are a scan: +21.4% → +13.0%; pp2_ep4 and
# pp2_fsdp4 since the SPMD pipeline's rule: +46.4% → +4.1%, +55.9% → +1.5%; pp2_dp4, pp2_cp4, pp2_tp2_dp2 and
# pp4_dp2_vpp2 since the pipeline's iterations are a scan that picks each repeat's weights inside the layer's
# checkpoint: +19.8% → +2.6%, +19.6% → +5.1%, +41.2% → +13.1%, +23.9% → −7.0%; zero2_dp8_2mb since the ledger holds
# XLA's whole micro-batch gradients under ZeRO-2: +35.1% → −7.3%; fsdp4_tp2 and fsdp4_tp2_flash since the gate/up
# split's gradient is one buffer: +24.2% → +14.3%, → +13.0%; tp8, fsdp4_tp2_selective, fsdp4_tp2_gemm_last,
# dp2_tp2_cp2 and cp4_tp2_allgather since XLA's saved set and one layer's backward working set, CostModel
# `_xla_saved_layer` / `_xla_layer_backward`, and the scanned selective policy saving no attention-core dots:
# +86.2% → +9.7%, +39.8% → +8.3%, +66.3% → +7.5%, +22.3% → +11.9%, → +13.5%; fsdp4_tp2_full and cp4_tp2_ring
# since the backward's output gradients re-gathered over `tensor` under SP: +19.9% → +12.1%, +17.8% → +13.9%.)
MEMORY_RESIDUALS = {"tp8_flash", "pp2_cp2_tp2", "pp2_cp2_tp2_ring"}

_SCRIPT = r"""
import json, sys
from dataclasses import replace
from meshplan.measure import verify as v
v.ensure_host_devices(8)  # before JAX starts: device count and the memory-minimising CPU schedule
import jax
from meshplan.measure import jaxmodel as jm
from meshplan.measure.layout import Layout
from meshplan.specs.model import load_model
cases = json.loads(sys.argv[1])
S, B, STEPS = 128, 16, 2
refs = {}
out = {}
for name, (model, kw, loss) in cases.items():
    flash = kw.pop("attention", "materialized") == "flash"
    lay = Layout(**kw).resolved()
    m = v.tiny_model(load_model(model), layers=max(2, lay.pp * lay.vpp), min_kv_heads=lay.tp)  # as the CLI
    if loss and m not in refs:  # one-device losses, no recompute: every layout and policy must reproduce them
        refs[m] = jm.run_steps(jm.build_program(m, Layout(), S, B, jax.devices()), S, B, STEPS)
    rep = v.run_verify(m, lay, S, B, loss_model=m if loss else None, loss_seq_len=S, loss_batch=B, steps=STEPS,
                       reference=refs.get(m), options=replace(v.program_options(), flash_attention=flash))
    out[name] = {k: rep.get(k) for k in ("rows", "loss_check", "collectives", "cp_causal_balance", "compile_s",
                                         "ledger")}
print("JSON" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results() -> dict:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(CASES)], capture_output=True, text=True,
                          env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("JSON"))
    data = json.loads(line[4:])
    data["_elapsed_s"] = time.time() - t0
    return data


def _row(res: dict, case: str, quantity: str) -> dict:
    return next(r for r in res[case]["rows"] if r["quantity"] == quantity)


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.xfail(
    strict=True, reason="the SPMD pipeline computes in its bubble ticks")] if c in FLOP_RESIDUALS else [])
    for c in CASES])
def test_matmul_flops_within_2_percent(results, case):
    r = _row(results, case, "matmul flops")
    assert abs(r["rel_error"]) <= 0.02, (case, r)


def _kind_params():
    for case in CASES:
        for kind in KINDS:
            marks = [pytest.mark.xfail(strict=True, reason="known collective residual (docs/verify.md)")] \
                if (case, kind) in COLLECTIVE_RESIDUALS else []
            yield pytest.param(case, kind, marks=marks, id=f"{case}-{kind}")


@pytest.mark.parametrize(("case", "kind"), list(_kind_params()))
def test_collective_bytes_within_5_percent(results, case, kind):
    """Each kind in total, and each kind over each set of mesh axes (ledger key `all_gather/tensor`, ...)."""
    rows = [_row(results, case, f"{kind} bytes")]
    prefix = {"all-gather": "all_gather/", "reduce-scatter": "reduce_scatter/", "all-reduce": "all_reduce/",
              "all-to-all": "all_to_all/", "collective-permute": "permute/"}[kind]
    rows += [r for r in results[case]["rows"] if r["quantity"].startswith(prefix)]
    for r in rows:
        if r["predicted"] == 0:
            assert r["compiled"] == 0, (case, r)
        else:
            assert abs(r["rel_error"]) <= 0.05, (case, r)


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][2]])
def test_sharded_loss_equals_unsharded(results, case):
    lc = results[case]["loss_check"]
    assert lc["matches"], lc
    assert lc["sharded"] == pytest.approx(lc["unsharded"], rel=1e-4)


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.xfail(
    strict=True, reason="the SPMD pipeline replicates the embedding and head on every stage")]
    if c in FLOP_RESIDUALS else []) for c in CASES])
def test_argument_memory_within_1_percent(results, case):
    """Parameters and AdamW moments in their shardings (the ledger's params + optimizer) against XLA's arguments
    (which also hold the int32 batch)."""
    r = _row(results, case, "memory: arguments")
    assert abs(r["rel_error"]) <= 0.01, (case, r)


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.xfail(
    strict=True, reason="CPU temp buffers the planner's peak rules do not hold (docs/verify.md)")]
    if c in MEMORY_RESIDUALS else []) for c in CASES])
def test_total_memory_within_15_percent(results, case):
    r = _row(results, case, "memory")
    assert abs(r["rel_error"]) <= 0.15, (case, r)


def test_rows_are_read_from_the_ledger(results):
    """`predicted` is the ledger the report carries: matmul FLOPs = ledger matmul + attention (XLA's dots include
    QKᵀ and AV), each kind's bytes = the sum of its ledger keys."""
    for case in CASES:
        led = results[case]["ledger"]
        assert _row(results, case, "matmul flops")["predicted"] == led["flops"]["matmul"] + led["flops"]["attention"]
        ag = sum(v for k, v in led["collective_bytes"].items() if k.startswith("all_gather/"))
        assert _row(results, case, "all-gather bytes")["predicted"] == ag


def test_each_parallelism_uses_its_axis(results):
    axes = {c: {(x["kind"], x["axes"]) for x in results[c]["collectives"]} for c in CASES}
    assert ("all-reduce", "data") in axes["dp8"]
    assert ("all-gather", "fsdp") in axes["fsdp8"] and ("reduce-scatter", "fsdp") in axes["fsdp8"]
    assert ("all-gather", "tensor") in axes["tp8"] and ("reduce-scatter", "tensor") in axes["tp8"]
    assert ("all-gather", "context") in axes["dp2_tp2_cp2"]
    assert ("all-to-all", "expert") in axes["ep4"]
    assert ("collective-permute", "stage") in axes["pp4_dp2_vpp2"] and ("all-to-all", "expert") in axes["pp2_ep4"]
    assert ("all-gather", "context") in axes["pp2_cp2_tp2"] and ("collective-permute", "context") in axes["pp2_cp2_tp2_ring"]


def test_load_balanced_cp_is_even(results):
    bal = results["dp2_tp2_cp2"]["cp_causal_balance"]
    assert bal["load_balanced"] == pytest.approx(1.0)
    assert bal["contiguous"] == pytest.approx((2 * 2 - 1) / 2, rel=0.05)


def test_recompute_adds_the_flops_it_should(results):
    """gemm-last adds no matmul FLOPs; full adds the layer forward (less the MLP down-projection)."""
    none = _row(results, "fsdp4_tp2", "matmul flops")["compiled"]
    assert _row(results, "fsdp4_tp2_gemm_last", "matmul flops")["compiled"] == pytest.approx(none, rel=1e-9)
    assert _row(results, "fsdp4_tp2_full", "matmul flops")["compiled"] > 1.2 * none


def test_collective_matmuls_equal_plain_matmul():
    code = r"""
import numpy as np
from meshplan.measure.verify import ensure_host_devices
ensure_host_devices(4)
import jax, jax.numpy as jnp
from jax.sharding import Mesh
from meshplan.measure.jaxmodel import collective_matmul_allgather, collective_matmul_reducescatter
mesh = Mesh(np.array(jax.devices()[:4]), ("tensor",))
x = jax.random.normal(jax.random.key(0), (64, 32)); w = jax.random.normal(jax.random.key(1), (32, 48))
ref = x @ w
y1 = jax.jit(lambda a, b: collective_matmul_allgather(a, b, mesh))(x, w)
y2 = jax.jit(lambda a, b: collective_matmul_reducescatter(a, b, mesh))(x, w)
hlo = jax.jit(lambda a, b: collective_matmul_allgather(a, b, mesh)).lower(x, w).compile().as_text()
assert np.allclose(y1, ref, rtol=1e-5, atol=1e-4) and np.allclose(y2, ref, rtol=1e-5, atol=1e-4)
assert "collective-permute" in hlo and "all-gather" not in hlo
print("OK")
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_verify_without_jax_is_a_clean_error():
    """With jax hidden from importlib, `meshplan verify` prints the install hint and exits 2."""
    code = ("import importlib.util as u; _f = u.find_spec; "
            "u.find_spec = lambda n, *a, **k: None if n == 'jax' else _f(n, *a, **k); "
            "from meshplan.cli import main; main(['verify', '--model', 'llama3-8b'])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: meshplan verify needs the jax extra")


def test_ledger_needs_no_jax():
    """The planner side is the cost model: asking for the ledger of a program must not import JAX."""
    code = ("import sys; from meshplan.measure.verify import plan_ledger; "
            "from meshplan.measure.layout import Layout; from meshplan.specs.model import load_model; "
            "q = plan_ledger(load_model('llama3-8b'), Layout(fsdp=4, tp=2), 4096, 16); "
            "assert 'jax' not in sys.modules and q['collective_bytes']['all_gather/tensor'] > 0; print('OK')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]


TINY_CONFIG = {  # the twin verify compiles for llama3-8b (tiny_model): L=2, D=256, N=8, K=2, H=32, F=896, V=512
    "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 896, "vocab_size": 512,
    "max_position_embeddings": 8192, "tie_word_embeddings": False,
}


def _cli(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    code = "import sys; from meshplan.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], input=stdin, capture_output=True, text=True,
                          env=env, timeout=600)


def test_train_and_verify_ledgers_are_the_same(tmp_path):
    """`meshplan train --framework jax --json | meshplan verify --plan -` on the tiny twin: the ledger train ranks
    the plan by is the ledger verify compares XLA with, number for number."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_CONFIG))
    train = _cli(["train", "--model", str(cfg), "--hardware", "tpu-v5p", "--chips", "8", "--seq-len", "128",
                  "--global-batch", "16", "--dp", "1", "--fsdp", "4", "--tp", "2", "--pp", "1", "--cp", "1",
                  "--microbatch", "4", "--recompute", "full", "--offload", "0", "--framework", "jax", "--json"])
    assert train.returncode == 0, train.stderr[-2000:]
    ver = _cli(["verify", "--plan", "-", "--no-loss-check", "--json"], stdin=train.stdout)
    assert ver.returncode == 0, ver.stderr[-2000:]
    assert "compiling" in ver.stderr  # progress on stderr
    planned, checked = json.loads(train.stdout)["plans"][0]["ledger"], json.loads(ver.stdout)
    assert checked["ledger"] == planned
    assert checked["layout"]["fsdp"] == 4 and checked["layout"]["tp"] == 2
    mm = next(r for r in checked["rows"] if r["quantity"] == "matmul flops")
    assert abs(mm["rel_error"]) <= 0.02


TINY_MOE_CONFIG = {  # the twin verify compiles for mixtral-8x7b: L=2, D=256, N=8, K=2, H=32, F=896, E=8, k=2, V=512
    **TINY_CONFIG, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
}


def test_train_and_verify_ledgers_are_the_same_for_fsdp_x_ep(tmp_path):
    """A plan whose expert ranks sit inside the FSDP group (ep divides fsdp, not dp): verify builds it with EP carved
    out of fsdp (Layout.ep_in_fsdp) and compares XLA with the very ledger train ranked the plan by."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_MOE_CONFIG))
    train = _cli(["train", "--model", str(cfg), "--hardware", "tpu-v5p", "--chips", "8", "--seq-len", "128",
                  "--global-batch", "16", "--dp", "2", "--fsdp", "4", "--ep", "4", "--tp", "1", "--pp", "1", "--cp",
                  "1", "--microbatch", "2", "--recompute", "none", "--zero", "0", "--offload", "0", "--framework", "jax",
                  "--json"])
    assert train.returncode == 0, train.stderr[-2000:]
    ver = _cli(["verify", "--plan", "-", "--no-loss-check", "--json"], stdin=train.stdout)
    assert ver.returncode == 0, ver.stderr[-2000:]
    planned, checked = json.loads(train.stdout)["plans"][0]["ledger"], json.loads(ver.stdout)
    assert checked["ledger"] == planned
    assert (checked["layout"]["dp"], checked["layout"]["fsdp"], checked["layout"]["ep"]) == (2, 1, 4)
    assert checked["layout"]["ep_in_fsdp"] is True
    for r in checked["rows"]:
        if r["quantity"] == "matmul flops":
            assert abs(r["rel_error"]) <= 0.02, r
        elif r["quantity"].endswith(" bytes") and r["predicted"]:
            assert abs(r["rel_error"]) <= 0.05, r
        elif r["quantity"] == "memory":
            assert abs(r["rel_error"]) <= 0.15, r


def test_verify_builds_an_fsdp_x_ep_plan_of_train():
    """Issue 13: a Mixtral plan on 8 H100s with the expert ranks inside the FSDP group (fsdp 4, ep 4) is compiled
    (host offload left out and named); the top plan of the unpinned search (EP across dp and CP, which the reference
    MoE does not build) is refused with a one-line reason."""
    common = ["train", "--model", "mixtral-8x7b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len", "4096",
              "--global-batch", "64", "--json"]
    train = _cli([*common, "--fsdp", "4", "--ep", "4", "--cp", "1"])
    assert train.returncode == 0, train.stderr[-2000:]
    best = json.loads(train.stdout)["plans"][0]["config"]
    assert best["fsdp"] == 4 and best["ep"] == 4 and best["dp"] % 4
    # the loss check left on (the default): XLA:CPU cannot run this program's steps, so verify says it skipped them
    # instead of aborting in the collectives (the process died after ~70 s before)
    ver = _cli(["verify", "--plan", "-", "--json"], stdin=train.stdout)
    assert ver.returncode == 0, ver.stderr[-2000:]
    report = json.loads(ver.stdout)
    assert "all-gather over `expert`" in report["loss_check_skipped"] and report["loss_matches_unsharded"] is None
    assert "loss check skipped" in ver.stderr
    assert report["layout"]["ep_in_fsdp"] and report["layout"]["fsdp"] * report["layout"]["ep"] == 4
    mm = next(r for r in report["rows"] if r["quantity"] == "matmul flops")
    assert abs(mm["rel_error"]) <= 0.02
    # the unpinned search's top plan: since the search keeps only EP layouts the planner places (ep | dp or
    # ep | fsdp·cp under FSDP) it is one the program builds; compiled in full, the MoE all-to-alls included (under
    # gemm-last the program saves the dispatch's output as the ledger assumes, not rerunning it in the backward)
    train = _cli(common)
    assert train.returncode == 0, train.stderr[-2000:]
    top = json.loads(train.stdout)["plans"][0]["config"]
    assert top["ep"] > 1 and (top["dp"] % top["ep"] == 0 or (top["fsdp"] * top["cp"]) % top["ep"] == 0)
    ver = _cli(["verify", "--plan", "-", "--no-loss-check", "--json"], stdin=train.stdout)
    assert ver.returncode == 0, ver.stderr[-2000:]
    rows = {r["quantity"]: r for r in json.loads(ver.stdout)["rows"]}
    assert abs(rows["matmul flops"]["rel_error"]) <= 0.02 and abs(rows["all-to-all bytes"]["rel_error"]) <= 0.05
    # a layout the reference MoE does not build (EP over the tensor ranks) is refused on one line, with the reason
    train = _cli([*common, "--tp", "2", "--ep", "2", "--fsdp", "1", "--cp", "1"])
    assert train.returncode == 0, train.stderr[-2000:]
    ver = _cli(["verify", "--plan", "-", "--no-loss-check", "--json"], stdin=train.stdout)
    assert ver.returncode == 2
    err = [ln for ln in ver.stderr.splitlines() if ln.startswith("error:")]  # beside the plan's offload note
    assert len(err) == 1 and "not tp or cp" in err[0] and "must divide dp" not in err[0], ver.stderr


def test_verify_takes_the_top_plan_of_train():
    """`meshplan train ... --chips 8 --json | meshplan verify --plan -` verifies the planner's best layout."""
    train = _cli(["train", "--model", "llama3-8b", "--hardware", "tpu-v5p", "--chips", "8", "--seq-len", "4096",
                  "--global-batch", "16", "--json", "--top", "2"])
    assert train.returncode == 0, train.stderr[-2000:]
    ver = _cli(["verify", "--plan", "-", "--no-loss-check", "--json"], stdin=train.stdout)
    assert ver.returncode == 0, ver.stderr[-2000:]
    report, best = json.loads(ver.stdout), json.loads(train.stdout)["plans"][0]["config"]
    assert all(report["layout"][k] == best[k] for k in ("fsdp", "tp", "cp", "recompute"))
    assert {r["quantity"] for r in report["rows"]} >= {"matmul flops", "all-gather bytes", "memory"}


def test_verify_compiles_an_offloaded_plan_without_the_offload_and_says_so():
    """A plan with host offload (activations, optimizer state) is verified without it: XLA:CPU drops offloaded remat
    and the optimizer's host loop is not in the device program, so the program is compiled and checked against the
    ledger of exactly that program, and the report names what was left out (`not_built`), on stderr and in the JSON."""
    train = _cli(["train", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len", "4096",
                  "--global-batch", "64", "--fsdp", "8", "--offload", "0.5", "--json"])
    assert train.returncode == 0, train.stderr[-2000:]
    plan = json.loads(train.stdout)
    assert plan["plans"][0]["config"]["offload"] == 0.5
    plan["plans"][0]["config"]["offload_optimizer"] = 1  # as a plan that also keeps Adam on the host says it
    ver = _cli(["verify", "--plan", "-", "--no-loss-check", "--json"], stdin=json.dumps(plan))
    assert ver.returncode == 0, ver.stderr[-2000:]
    report = json.loads(ver.stdout)
    assert report["not_built"]["offload"] == 0.5 and report["not_built"]["offload_optimizer"] == 1
    assert "host offload" in report["not_built"]["why"] and "offload 0.5" in ver.stderr
    assert report["layout"]["offload"] == 0 and report["layout"]["fsdp"] == 8
    rows = {r["quantity"]: r for r in report["rows"]}
    assert abs(rows["matmul flops"]["rel_error"]) <= 0.02
    assert abs(rows["all-gather bytes"]["rel_error"]) <= 0.05 and abs(rows["reduce-scatter bytes"]["rel_error"]) <= 0.05


@pytest.mark.parametrize(("args", "message"), [
    (["--plan", "-"], "not a `meshplan train --json` object"),
    (["--model", "llama3-8b", "--pp", "2", "--vpp", "2"], "the interleaved pipeline needs at least pp=2 micro-batches"),
    (["--model", "llama3-8b", "--cp", "2", "--cp-impl", "ringg"], "unknown cp_impl 'ringg'"),
    ([], "verify needs --model"),
])
def test_verify_bad_input_is_one_line(args, message):
    proc = _cli(["verify", *args], stdin="not json")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error:") and message in proc.stderr


def test_verify_plan_rounds_the_cpu_batch_to_the_plans_batch_shards():
    """QA session 22: a plan with 24 batch shards failed on verify's default CPU batch of 16 ("does not divide").
    Without --global-batch, --plan takes the default rounded up to whole sequences per shard: 24."""
    train = _cli(["train", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "24", "--seq-len", "4096",
                  "--global-batch", "48", "--dp", "24", "--tp", "1", "--pp", "1", "--cp", "1", "--json"])
    assert train.returncode == 0, train.stderr[-2000:]
    ver = _cli(["verify", "--plan", "-", "--tiny", "--no-loss-check", "--json"], stdin=train.stdout)
    assert ver.returncode == 0, ver.stderr[-2000:]
    report = json.loads(ver.stdout)
    assert report["layout"]["dp"] == 24 and report["global_batch"] == 24
