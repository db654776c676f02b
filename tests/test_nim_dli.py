"""The second external serving check (benchmarks/nim_dli.py, session 31): NIM sizing-course GenAI-Perf sweeps. The
import keeps the rows its rules name and maps each field as stated (units: ns -> ms), the committed subset says each
row's split as benchmarks/_split.py's rule gives it, and every kept row plans at its published layout."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import split_by_rule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _split  # noqa: E402  (benchmark helpers, not part of the package)
import nim_dli  # noqa: E402
import serving_accuracy  # noqa: E402

HEADER = ("task_inputs-model,task_inputs-execution_type,task_inputs-GPU,task_inputs-n_gpus,task_inputs-precision,"
          "request_throughput-unit,request_throughput-avg,request_latency-unit,request_latency-avg,request_latency-p95,"
          "time_to_first_token-unit,time_to_first_token-avg,time_to_first_token-p95,inter_token_latency-unit,"
          "inter_token_latency-avg,inter_token_latency-p95,output_token_throughput-unit,output_token_throughput-avg,"
          "output_token_throughput_per_request-unit,output_token_throughput_per_request-avg,"
          "output_token_throughput_per_request-p95,num_output_token-unit,num_output_token-avg,num_output_token-p95,"
          "num_input_token-unit,num_input_token-avg,num_input_token-p95,input_config-model,input_config-backend,"
          "input_config-extra_inputs-max_tokens,input_config-stability_percentage,input_config-concurrency,"
          "input_config-synthetic_input_tokens_mean,input_config-synthetic_input_tokens_stddev,"
          "input_config-output_tokens_mean")


def _row(model: str, gpu: str, n: int, prec: str, ttft_ns: float, itl_ns: float, tok_s: float, out_avg: float,
         in_avg: float, c: int, isl: int, osl: int, exec_type: str = "NIM_TRT-LLM") -> str:
    return (f"{model},{exec_type},{gpu},{n},{prec},requests/sec,1.0,ns,1.0,1.0,ns,{ttft_ns},{ttft_ns},ns,{itl_ns},"
            f"{itl_ns},tokens/sec,{tok_s},tokens/sec,1.0,1.0,tokens,{out_avg},{osl},tokens,{in_avg},{isl},{model},"
            f"tensorrtllm,{osl},999,{c},{isl},0,{osl}")


def test_the_import_keeps_the_rows_its_rules_name_and_maps_them(tmp_path: Path) -> None:
    up = tmp_path / "nim.csv"
    up.write_text("\n".join([
        HEADER,
        # kept: 70B on 4 H100s in fp8, 25 clients, 2000/200: 1.5 s TTFT and 20 ms ITL in ns
        _row("meta-llama3-70b-instruct", "H100_80GB_HBM3", 4, "fp8", 1.5e9, 2.0e7, 1234.5, 200.0, 1999.7, 25, 2000,
             200),
        # kept: fp16 weights are bf16's bytes; 8B on one A100
        _row("meta-llama3-8b-instruct", "A100-SXM4-80GB", 1, "fp16", 2.1e7, 8.3e6, 119.8, 999.5, 199.4, 1, 200, 1000),
        # dropped: the output fell 5% short of the asked length; another backend; a model without a preset
        _row("meta-llama3-8b-instruct", "A100-SXM4-80GB", 1, "fp16", 2.1e7, 8.3e6, 119.8, 950.0, 199.4, 1, 200, 1000),
        _row("meta-llama3-8b-instruct", "A100-SXM4-80GB", 1, "fp16", 2.1e7, 8.3e6, 119.8, 1000, 200, 1, 200, 1000,
             exec_type="vLLM"),
        _row("mistral-7b-instruct", "A100-SXM4-80GB", 1, "fp16", 2.1e7, 8.3e6, 119.8, 1000, 200, 1, 200, 1000),
    ]) + "\n")
    rows = nim_dli.select(up)
    assert [r["upstream_row"] for r in rows] == [2, 3]
    a, b = rows
    assert a["source_key"] == "nim-dli-sizing:h100_80gb_hbm3/nim_trt-llm/llama3-70b"
    assert (a["hardware"], a["weight_dtype"], a["tp"], a["concurrency"]) == ("h100-sxm", "fp8", 4, 25)
    assert (a["ttft_ms"], a["itl_ms"], a["output_tokens_per_s"]) == (1500.0, 20.0, 1234.5)
    assert (b["hardware"], b["weight_dtype"], b["model"]) == ("a100-80gb", "bf16", "llama3-8b")
    # the split by the rule, computed apart from _split.py (conftest.split_by_rule)
    assert [r["split"] for r in rows] == [split_by_rule(r["source_key"]) for r in rows]
    out = tmp_path / "subset.csv"
    nim_dli.write_subset(rows, out)
    ea, _ = nim_dli.load(out)
    assert (ea["regime"], ea["batch"], ea["chips"], ea["engine"], ea["kv_dtype"]) == ("fixed_batch", 25, 4,
                                                                                     "trtllm@0.17", None)
    assert serving_accuracy.mode(ea) == "continuous"
    assert ea["measured"] == {"output_tokens_per_s": 1234.5, "tpot_s": pytest.approx(0.02), "ttft_s": pytest.approx(1.5)}


def test_a_subset_whose_split_disagrees_with_the_rule_is_refused(tmp_path: Path) -> None:
    text = nim_dli.SUBSET.read_text()
    bad = tmp_path / "bad.csv"
    bad.write_text(text.replace(",validation,", ",tuning,", 1) if ",validation," in text else
                   text.replace(",tuning,", ",validation,", 1))
    with pytest.raises(ValueError, match="not the rule's"):
        nim_dli.load(bad)


def test_the_committed_subset_reads_in_its_stated_units_and_plans() -> None:
    """All 787 upstream rows are kept; each is one split by its campaign; no measurement breaks physics in the units
    stated (a mean ITL or TTFT under 1 ms would be a unit slip: ns read as us, a thousand times too short); every row
    plans at its published layout."""
    entries = nim_dli.load()
    assert len(entries) == 787 and len({e["id"] for e in entries}) == 787
    for e in entries:
        assert e["split"] == _split.split_of(e["source"]["key"])
        m = e["measured"]
        assert 1e-3 < m["tpot_s"] < 1.0 and m["ttft_s"] > 1e-3 and m["output_tokens_per_s"] > 0
        # c clients at one token per ITL each cannot exceed c / ITL output tokens/s
        assert m["output_tokens_per_s"] <= e["batch"] / m["tpot_s"] * 1.05
    sample = [e for e in entries if e["batch"] in (1, 250)]
    rows = serving_accuracy.run(entries=sample)["rows"]
    assert [r["id"] for r in rows if "skipped" in r] == []


def test_tuning_only_hides_the_validation_campaigns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_split.TUNING_ONLY_ENV, "1")
    seen = _split._visible(nim_dli.load())
    assert seen and {e["split"] for e in seen} == {"tuning"}


def test_print_between_places_each_row_against_the_two_regimes(capsys: pytest.CaptureFixture) -> None:
    def row(spread: float, grouped: float, measured: float) -> dict:
        return {"id": "x", "split": "tuning", "source_key": "k:c", "error": {},
                "predicted": {"spread_ttft_s": spread, "ttft_s": grouped}, "measured": {"ttft_s": measured}}

    rows = [row(0.1, 0.3, 0.05), row(0.1, 0.3, 0.2), row(0.1, 0.3, 0.3), row(0.1, 0.3, 0.5), row(0.3, 0.1, 0.2),
            {"id": "y", "split": "tuning", "source_key": "k:c", "error": {},  # a row priced spread: not placed
             "predicted": {"spread_ttft_s": None, "ttft_s": 0.1}, "measured": {"ttft_s": 0.2}}]
    got = serving_accuracy.print_between(rows)
    assert got[("tuning", "all")] == [1, 3, 1] == got[("tuning", "k:c")]
    assert "| tuning / c | 5 | 1 | 3 | 1 |" in capsys.readouterr().out


def test_nims_tuning_loops_sit_nearer_the_grouped_rounds() -> None:
    """The physics chosen on this tuning campaign (session 32): TensorRT-LLM takes whole prompts, so a fixed-length
    closed loop keeps its rounds in phase. Against the published GenAI-Perf TTFTs, the grouped form is the nearer of
    the two regimes (log distance) in most rows it prices."""
    import math

    entries = [e for e in nim_dli.load() if e["split"] == "tuning"]
    rows = [r for r in serving_accuracy.run(entries=entries)["rows"]
            if "error" in r and r["predicted"].get("spread_ttft_s") is not None]
    assert len(rows) >= 100
    nearer = sum(abs(math.log(r["measured"]["ttft_s"] / r["predicted"]["ttft_s"]))
                 < abs(math.log(r["measured"]["ttft_s"] / r["predicted"]["spread_ttft_s"])) for r in rows)
    assert nearer >= 0.8 * len(rows)


def test_the_importers_command_writes_what_its_rules_keep(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    written: list[list[dict]] = []
    code = _split.import_main(["--upstream", str(tmp_path / "up.csv")], "Importer.\nmore", "the file",
                              lambda p: [{"from": p.name}], written.append, tmp_path / "subset.csv")
    assert code == 0 and written == [[{"from": "up.csv"}]]
    assert capsys.readouterr().out == f"1 rows -> {tmp_path / 'subset.csv'}\n"
    with pytest.raises(SystemExit):
        _split.import_main([], "Importer.", "the file", lambda p: [], written.append, tmp_path / "subset.csv")
