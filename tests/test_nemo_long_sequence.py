"""NeMo's long-sequence tables (docs/source/performance/performance_long_sequence.md @ 19fadb67b0) as training rows
(issue #14, the long-context family): TFLOPS/GPU only, turned into step times under NeMo's own model-FLOPs formula.
The step times are checked against that formula written out by hand (nemo/utils/flops_formulas.py `llama2`/`llama3`
before #14424: per token L·h²·(12 + 12·g/a + 18·F/h + 12·s/h + 6·V/(L·h)), attention non-causal), the layouts against
the table's own columns. No prediction is compared here."""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _measurements as H  # noqa: E402  (the benchmark harness, not part of the package)

DATA = ROOT / "benchmarks" / "data"


@lru_cache(maxsize=1)
def _rows() -> list[dict]:
    rows = yaml.safe_load((DATA / "training_measurements_new.yaml").read_text())
    return [e for e in rows if e["id"].startswith("nemo_longseq_")]


def _nemo_flops_per_token(m: dict, seq: int) -> float:
    """NeMo's llama2/llama3 model FLOPs per token (the formula as the NeMo source writes it, not meshplan's)."""
    L, h, a, g, F, V = m["layers"], m["d_model"], m["heads"], m["kv_heads"], m["ffn"], m["vocab"]
    return L * h * h * (12 + 12 * g / a + 18 * F / h + 12 * seq / h + 6 * V / (L * h))


def test_both_tables_are_entered_whole() -> None:
    keys = {e["source"]["key"]: 0 for e in _rows()}
    for e in _rows():
        keys[e["source"]["key"]] += 1
    assert keys == {"nemo-long-sequence-24.03:llama2-7b": 9, "nemo-long-sequence-25.04:llama3-8b": 8}


@pytest.mark.parametrize("ident", [e["id"] for e in _rows()])
def test_step_time_is_nemo_formula_over_tflops(ident: str) -> None:
    e = next(r for r in _rows() if r["id"] == ident)
    seq, gbs, gpus = e["training"]["seq_len"], e["training"]["global_batch_seqs"], e["hardware"]["count"]
    by_hand = gbs * seq * _nemo_flops_per_token(e["model"], seq) / (e["measured"]["model_tflops_per_gpu"] * 1e12 * gpus)
    assert H.measured_step_time_s(e) == pytest.approx(by_hand, rel=2e-3)


def test_llama2_7b_4k_row_by_hand() -> None:
    # 32 x 4096^2 x (12 + 12 + 18 x 11008/4096 + 12 + 6 x 32000/(32 x 4096)) = 46.09 GFLOP a token; 1,024 x 4,096
    # tokens at 768 TFLOP/s on each of 4 GPUs: 62.9 s
    e = next(r for r in _rows() if r["id"] == "nemo_longseq_h100_llama2_7b_4k_4gpu")
    assert H.measured_step_time_s(e) == pytest.approx(1024 * 4096 * 46.09e9 / (768e12 * 4), rel=1e-3)


@pytest.mark.parametrize("ident", [e["id"] for e in _rows()])
def test_layout_fills_the_gpus_and_splits_the_batch(ident: str) -> None:
    e = next(r for r in _rows() if r["id"] == ident)
    p = e["parallel"]
    assert p["tp"] * p["pp"] * p["dp"] * p["cp"] == e["hardware"]["count"]
    assert e["training"]["global_batch_seqs"] % p["dp"] == 0  # 4 sequences at 1024K: DP 4 at most
    assert ("long_context_cp" in e["families"]) == (p["cp"] > 1)


def test_the_b200_table_keeps_its_printed_dp() -> None:
    # the table's last row: SeqLen 1024K, '# of GPUs' 1024, batch 4, TP 4 PP 1 DP 4 CP 16: 256 GPUs hold the layout
    e = next(r for r in _rows() if r["id"] == "nemo_longseq_b200_llama3_8b_1024k_256gpu")
    assert (e["parallel"]["dp"], e["hardware"]["count"]) == (4, 256)
    assert "GPUs 1024" in e["source"]["row"]


def test_nemo_1x_container_runs_the_2407_preset() -> None:
    # NeMo 24.03 is NeMo 1.x: the nemo@24.07 preset's fp32 gradient reduction and blocking pipeline sends, and
    # Transformer Engine's delayed scaling (the row's own field); NeMo 25.04 (NeMo 2.0): the current preset's bf16
    # reduction
    old = next(r for r in _rows() if "24.03" in r["source"]["key"])
    new = next(r for r in _rows() if "25.04" in r["source"]["key"])
    o_old, o_new = H.options_of(dict(old)), H.options_of(dict(new))
    assert (o_old.grad_reduce_bytes, o_old.pp_overlap, o_old.fp8_recipe) == (4.0, False, "delayed")
    assert o_new.grad_reduce_bytes == 2.0
    assert H.pins_of(old).microbatch == 1
