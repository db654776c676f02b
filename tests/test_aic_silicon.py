"""The external serving check on aiconfigurator's silicon sample (benchmarks/aic_silicon.py, session 25): the import
keeps exactly the rows its rules name and maps each field as stated, the committed subset says each row's split as
benchmarks/_split.py's rule gives it, and every kept row plans at its published layout."""

from __future__ import annotations

import csv
import statistics
import sys
from pathlib import Path

import pytest
from conftest import split_by_rule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _split  # noqa: E402  (benchmark helpers, not part of the package)
import aic_silicon  # noqa: E402
import serving_accuracy  # noqa: E402

ENTRIES = aic_silicon.load()

UPSTREAM_HEADER = ("id,silicon_data_source,backend,backend_version,model_path,system,precision,mode,isl,osl,"
                   "gemm_quant_mode,moe_quant_mode,batch_size,tp_size,pp_size,attention_dp_size,moe_tp_size,"
                   "moe_ep_size,silicon_ttft_ms,silicon_tpot_ms")


def _upstream(tmp_path: Path, rows: list[str]) -> Path:
    p = tmp_path / "silicon_sample.csv"
    p.write_text("\n".join([UPSTREAM_HEADER, *rows]) + "\n")
    return p


def test_the_import_keeps_the_rows_its_rules_name_and_maps_them(tmp_path: Path) -> None:
    up = _upstream(tmp_path, [
        # kept: agg, h200_sxm, a preset model, fp8, one stage
        "r1,src=a; silicon_concurrency=8,vllm,0.12.0,meta-llama/Llama-3.1-70B,h200_sxm,fp8,agg,1024,8192,fp8,fp8,8.0,4.0,1.0,,,,150.5,9.25",
        # kept: no precision -> the checkpoint's bf16; no release -> 'unversioned'
        "r2,src=b; silicon_concurrency=16,sglang,,Qwen/Qwen3-32B,h100_sxm,,agg,2048,128,,,16.0,2.0,1.0,,,,300.0,20.0",
        # kept (session 33): a B200 in fp8
        "r4,src=d,trtllm,1.0,meta-llama/Llama-3.1-70B,b200_sxm,fp8,agg,1024,1024,fp8,fp8,8.0,4.0,1.0,,,,1.0,1.0",
        # dropped: disaggregated, a model without a preset, two pipeline stages, fp4 weights, fp4 on Blackwell even
        # for gpt-oss (FP4 tensor cores), a batch_size that is not the stated client count
        "r3,src=c,trtllm,1.0,meta-llama/Llama-3.1-70B,h200_sxm,fp8,disagg,1024,1024,fp8,fp8,8.0,4.0,1.0,,,,1.0,1.0",
        "r8,src=h,trtllm,1.0,openai/gpt-oss-120b,b200_sxm,fp4,agg,1024,1024,,,8.0,1.0,1.0,,1,1,1.0,1.0",
        "r9,src=i; silicon_concurrency=16,trtllm,1.0,meta-llama/Llama-3.1-70B,h200_sxm,fp8,agg,1024,1024,fp8,fp8,8.0,4.0,1.0,,,,1.0,1.0",
        "r5,src=e,vllm,0.18.0,MiniMaxAI/MiniMax-M2.5,h200_sxm,fp8,agg,1024,1024,fp8,fp8,8.0,4.0,1.0,,,,1.0,1.0",
        "r6,src=f,vllm,0.12.0,meta-llama/Llama-3.1-70B,h200_sxm,fp8,agg,1024,1024,fp8,fp8,8.0,4.0,2.0,,,,1.0,1.0",
        "r7,src=g,vllm,0.12.0,meta-llama/Llama-3.1-8B-Instruct,h200_sxm,fp4,agg,1024,1024,,,8.0,1.0,1.0,,,,1.0,1.0",
    ])
    rows = aic_silicon.select(up)
    assert [r["upstream_id"] for r in rows] == ["r1", "r2", "r4"]
    a, b, c = rows
    assert (c["hardware"], c["weight_dtype"], c["source_key"]) == ("b200", "fp8",
                                                                   "aic-silicon-2026-04:b200_sxm/trtllm/1.0/llama3.1-70b")
    assert a["source_key"] == "aic-silicon-2026-04:h200_sxm/vllm/0.12.0/llama3.1-70b"
    assert (a["hardware"], a["weight_dtype"], a["tp"], a["concurrency"]) == ("h200", "fp8", 4, 8)
    assert (a["input_len"], a["output_len"], a["ttft_ms"], a["tpot_ms"]) == (1024, 8192, 150.5, 9.25)
    assert b["source_key"] == "aic-silicon-2026-04:h100_sxm/sglang/unversioned/qwen3-32b"
    assert (b["hardware"], b["weight_dtype"], b["engine"]) == ("h100-sxm", "bf16", "sglang")
    # the split by the rule, computed apart from _split.py (conftest.split_by_rule)
    assert [r["split"] for r in rows] == [split_by_rule(r["source_key"]) for r in rows]
    # written and read back: a closed loop of the row's clients, the engine's own server path, KV by the stated rule
    out = tmp_path / "subset.csv"
    aic_silicon.write_subset(rows, out)
    ea, eb, _ = aic_silicon.load(out)
    assert (ea["regime"], ea["batch"], ea["chips"], ea["frontend"], ea["kv_dtype"]) == ("fixed_batch", 8, 4,
                                                                                       "vllm-openai", None)
    assert serving_accuracy.mode(ea) == "continuous" and "concurrency 8" in ea["source"]["where"]
    assert ea["measured"] == {"output_tokens_per_s": None, "tpot_s": pytest.approx(9.25e-3),
                              "ttft_s": pytest.approx(0.1505)}
    assert eb["frontend"] == "sglang-http"


def test_a_subset_whose_split_disagrees_with_the_rule_is_refused(tmp_path: Path) -> None:
    lines = aic_silicon.SUBSET.read_text().splitlines()
    header_end = next(i for i, line in enumerate(lines) if line.startswith("id,"))
    row = next(csv.DictReader(lines[header_end:]))
    row["split"] = "tuning" if row["split"] == "validation" else "validation"
    bad = tmp_path / "bad.csv"
    with bad.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=aic_silicon.FIELDS)
        w.writeheader()
        w.writerow(row)
    with pytest.raises(ValueError, match="not the rule's"):
        aic_silicon.load(bad)


def test_the_committed_subset_is_split_by_source_and_uses_both_halves() -> None:
    halves: dict[str, set[str]] = {}
    for e in ENTRIES:
        assert e["split"] == _split.split_of(e["source"]["key"])
        halves.setdefault(e["source"]["key"], set()).add(e["split"])
    assert all(len(h) == 1 for h in halves.values())
    assert {e["split"] for e in ENTRIES} == set(_split.SPLITS)
    assert len({e["id"] for e in ENTRIES}) == len(ENTRIES)


def test_every_row_plans_and_vllm_decode_on_h200_meets_its_measurement() -> None:
    """Every kept row plans at its published layout. The tuning campaign of Llama 3.1 70B FP8 served by vLLM on H200
    (TP 1-8, 4-64 clients, 1k/8k lengths) is meshplan's closed form against 60 independent measurements: its median
    TPOT error was 4.6% when the sample was imported (session 25); the bound holds it within 15%."""
    rows = serving_accuracy.run(entries=ENTRIES)["rows"]
    assert [r["id"] for r in rows if "skipped" in r] == []
    key = "aic-silicon-2026-04:h200_sxm/vllm/unversioned/llama3.1-70b"
    errs = [r["error"]["tpot_s"] for r in rows if r["source_key"] == key]
    assert len(errs) == 60
    assert statistics.median(abs(e) for e in errs) < 0.15


def test_tuning_only_hides_the_external_checks_validation_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """serving_accuracy.py --tuning-only loads the external check through _split._visible, as it loads issue #14's
    rows: no validation row is even loaded."""
    monkeypatch.setenv(_split.TUNING_ONLY_ENV, "1")
    seen = _split._visible(aic_silicon.load())
    assert seen and {e["split"] for e in seen} == {"tuning"}
    assert len(seen) == sum(e["split"] == "tuning" for e in ENTRIES)


def test_campaign_rows_list_the_tuning_rows_of_a_campaign_and_never_a_validation_row(
        capsys: pytest.CaptureFixture[str]) -> None:
    """serving_accuracy.py --campaign TEXT lists a campaign's tuning rows one by one (for looking into its misses on
    the half constants are chosen on): each row's predicted and measured TPOT and TTFT as run() gives them, and no
    row of a validation campaign even when the text matches it."""
    tuning = [e for e in ENTRIES if e["source"]["key"].endswith("h200_sxm/trtllm/unversioned/deepseek-v3")]
    assert tuning and {e["split"] for e in tuning} == {"tuning"}
    validation = [e for e in ENTRIES if e["split"] == "validation"][:3]
    entries = tuning + validation
    res = serving_accuracy.run(entries=entries)
    shown = serving_accuracy.print_campaign_rows(res["rows"], entries, "")  # "" matches every campaign
    out = capsys.readouterr().out
    assert shown == len(tuning)
    lines = [ln for ln in out.splitlines() if ln.startswith("| h200_sxm/trtllm/unversioned/deepseek-v3")]
    assert len(lines) == len(tuning)
    for e in validation:  # no validation row's campaign or measurement is printed
        assert e["source"]["key"].split(":", 1)[-1] not in out
    r = next(r for r in res["rows"] if r["id"] == tuning[0]["id"])
    e = tuning[0]
    want = (f"| {e['tp']} | {e['input_len']} | {e['output_len']} | {e['batch']} | {r['predicted']['tpot_s'] * 1e3:.2f} "
            f"| {r['measured']['tpot_s'] * 1e3:.2f} |")
    assert any(want in ln for ln in lines)
