"""The JAX program's flash attention core (`jaxmodel.blockwise_attention_core`, issue 13 item 6): FlashAttention-2's
blockwise forward and backward (Dao 2023, Algorithms 1 and 2) against the materialised core on one device, and its
dot FLOPs in XLA's HLO against a hand count. One subprocess (JAX starts with its own flags there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")
pytestmark = pytest.mark.jax

_SCRIPT = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from meshplan.measure import jaxmodel as jm
from meshplan.measure.hlo import dot_flops
rng = np.random.default_rng(0)
B, T, N, K, H = 2, 128, 8, 2, 16
q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
k, v = (jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32) for _ in range(2))
w = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
pos = jnp.arange(T)
order = jnp.asarray(jm.load_balanced_order(T, 2))  # CP's token order; device 0's queries are the first half
out = {}
for name, qs, pq, pk, causal in (("natural", slice(None), pos, pos, True), ("cp_order", slice(0, T // 2), order[:T // 2], order, False)):
    qq, kk, vv = (x[:, order] if name == "cp_order" else x for x in (q, k, v))
    qq = qq[:, qs]
    ww = w[:, : qq.shape[1]]
    def flash(a, b, c):
        return jnp.sum(jm.blockwise_attention_core(a, b, c, pq, pk, causal_order=causal) * ww)
    def ref(a, b, c):
        return jnp.sum(jm.attention_core(a, b, c, pq, pk) * ww)
    o1 = jm.blockwise_attention_core(qq, kk, vv, pq, pk, causal_order=causal)
    o2 = jm.attention_core(qq, kk, vv, pq, pk)
    g1, g2 = (jax.grad(f, argnums=(0, 1, 2))(qq, kk, vv) for f in (flash, ref))
    out[name] = {"out": float(jnp.max(jnp.abs(o1 - o2))),
                 "grads": [float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(g1, g2)]}
# the forward and the backward compiled apart, as the layer scan runs them (one program would let XLA merge the
# backward's QKᵀ recompute with the forward's)
qg = jnp.transpose(q.reshape(B, T, K, N // K, H), (0, 2, 3, 1, 4))
fwd = jax.jit(lambda a, b, c: jm._flash_fwd(a, b, c, pos, pos, True))
o, res = fwd(qg, k, v)
bwd = jax.jit(lambda res, do: jm._flash_bwd(True, res, do)[:3])
out["fwd_flops"] = dot_flops(fwd.lower(qg, k, v).compile().as_text())
out["bwd_flops"] = dot_flops(bwd.lower(res, o).compile().as_text())
print("JSON" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def flash() -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("JSON"))[4:])


@pytest.mark.parametrize("order", ["natural", "cp_order"])
def test_flash_core_equals_materialised_attention(flash, order):
    """Same output and same q, k, v gradients as softmax over the full masked score matrix (fp32), in natural
    token order (blocks above the diagonal skipped) and in CP's load-balanced order (masked by position only)."""
    assert flash[order]["out"] < 1e-5
    assert max(flash[order]["grads"]) < 1e-5


def test_flash_core_dot_flops_by_hand(flash):
    """8 blocks of 16 tokens, blocks above the diagonal skipped: per (sequence, query head) the forward computes
    Σ_j (128 − 16 j)·16 = 16·16·(8+7+…+1) = 9216 (query, key) pairs (9/16 of 128²), each 2·H FLOPs for QKᵀ and
    2·H for AV: B·N·9216·4·H = 2·8·9216·64 = 9437184. The backward recomputes QKᵀ and runs dV = PᵀdO, dP = dO Vᵀ,
    dQ = dS K, dK = dSᵀ Q: five such matmuls against two, 2.5 × (compiled apart from the forward; FlashAttention-2 §3.1.2; efficiency.yaml
    attention_bwd_flops_ratio)."""
    assert flash["fwd_flops"] == 2 * 8 * 9216 * 4 * 16
    assert flash["bwd_flops"] == 2.5 * flash["fwd_flops"]


def test_verify_refuses_an_unknown_attention_core(capsys):
    from conftest import run_cli

    code, _, err = run_cli(["verify", "--model", "llama3-8b", "--attention", "bogus"], capsys)
    assert code == 2 and err.startswith("error: --attention must be materialized or flash")


FLASH_FSDP_REFUSAL = ("--attention flash with FSDP runs into a deadlock of XLA's CPU collectives when the steps are "
                      "run; add --no-loss-check to compare the compiled program only")


@pytest.mark.parametrize("layout", [["--fsdp", "8"], ["--dp", "8", "--zero", "3"]])
def test_verify_refuses_running_flash_under_fsdp(capsys, layout):
    """The measured deadlock (docs/verify.md) is refused with one line before anything compiles or runs (ZeRO-3 is
    FSDP over the data ranks)."""
    from conftest import run_cli

    code, _, err = run_cli(["verify", "--model", "llama3-8b", "--devices", "8", *layout, "--attention", "flash"],
                           capsys)
    assert code == 2 and err.strip() == f"error: {FLASH_FSDP_REFUSAL}"


class _Ledger(Exception):
    """Raised by the stub of plan_ledger: run_verify went past its refusals."""


def test_run_verify_refuses_running_flash_under_fsdp(monkeypatch):
    """Library callers get the same refusal from `run_verify`, decided on the attention core the program compiles
    (`program_attention`): flash under FSDP when the steps are run. Compile-only (no loss model) and CP layouts,
    which compile the materialised core, go on (to the ledger, stubbed here: nothing compiles)."""
    from dataclasses import replace

    from meshplan.errors import MeshplanError
    from meshplan.measure import verify as mv
    from meshplan.measure.layout import Layout
    from meshplan.specs.model import load_model

    def stub(*a, **k):
        raise _Ledger

    monkeypatch.setattr(mv, "plan_ledger", stub)
    m = mv.tiny_model(load_model("llama3-8b"))
    flash = replace(mv.program_options(), flash_attention=True)
    for layout in (Layout(fsdp=8), Layout(dp=8, zero=3)):
        with pytest.raises(MeshplanError) as exc:
            mv.run_verify(m, layout, 128, 16, loss_model=m, options=flash)
        assert str(exc.value) == FLASH_FSDP_REFUSAL
    for layout, loss, options in ((Layout(fsdp=8), None, flash), (Layout(fsdp=4, cp=2), m, flash),
                                  (Layout(fsdp=8), m, mv.program_options())):
        with pytest.raises(_Ledger):
            mv.run_verify(m, layout, 128, 16, loss_model=loss, options=options)
