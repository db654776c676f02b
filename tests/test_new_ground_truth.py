"""The new published ground truth of issue #14 (benchmarks/data/*_new.yaml): every entry has a source and a split,
the split is by source (no source in both halves, and each entry's split is the one benchmarks/_split.py's rule
gives its source key), and every entry reads into a plannable problem, or is a known-unplannable case with the
reason meshplan gives (the issue asks for this list to reach zero; a fixed case makes this test fail until the
list is updated)."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _split  # noqa: E402  (benchmark helpers, not part of the package)
import accuracy  # noqa: E402
import serving_accuracy  # noqa: E402

from meshplan.cost.efficiency import default_efficiency  # noqa: E402
from meshplan.errors import MeshplanError  # noqa: E402
from meshplan.infer.config import ServeConfig, Workload  # noqa: E402
from meshplan.infer.memory import max_batch_per_replica  # noqa: E402
from meshplan.infer.simulate import SimSpec, load_length_trace, simulate  # noqa: E402
from meshplan.specs.hardware import load_chip  # noqa: E402
from meshplan.specs.model import load_model  # noqa: E402

TRAINING = _split.load_new_training()
SERVING = _split.load_new_serving()

# Published layouts meshplan cannot place today, with the reason it gives (issue #14: "every published layout in
# your data can be planned" is the goal; these are what is left). Fixed: GB200 NVL72 jobs on 256 GPUs (4 racks x 64
# GPUs), Megatron-Core's MoE parallel folding (EP 32 > DP 16 with TP 2) and PP 32 x VP 3 = 96 virtual stages for 94
# layers (embedding and loss stages); tests/test_placement.py plans each of them by hand.
KNOWN_UNPLANNABLE: dict[str, set[str]] = {}


# Published layouts meshplan plans but whose memory model says they do not fit (timed without the memory limit): none.
# The five Llama 3 70B FP8-CS runs on GB200 (Megatron-FSDP over 64, micro-batch 2, 40 of 80 layers' activations
# offloaded, no recompute) plan 177.1 GiB: they failed against the 186 GB marketed capacity, and fit since
# gb200-nvl72.yaml carries the driver's total, 189,471 MiB = 185.0 GiB (hbm_usable_bytes, nvidia-smi printout).
# The MaxText runs on TPU v6e (Llama 3.1 8B/70B, 8192-token sequences of a 128k vocabulary) fit since XLA's
# loss holds one fp32 logits buffer and its peak is not added to the layer gradients' (costmodel._xla_activations),
# v6e gives XLA 31.25 GiB, and the 70B on 32 chips stores its weights and Adam moments in bf16 (weight_dtype).
# The Llama 3 405B paper's 8K rows (Table 4: TP 8, PP 16, V = 8, micro-batch 1, "we could pre-train Llama 3 on
# sequences of 8K tokens without activation checkpointing", S3.3.2) fit since session 14 reads them as gemm-last: no
# GEMM run twice, and only the GEMM outputs and the layer input saved, which is what Chu et al. ISCA 2025 §6.3 says Meta's
# custom autograd operators did ("save tensor checkpoints during forward ... to eliminate activation recomputation and
# avoid increasing PP or TP to fit the training into the memory"). Under PyTorch autograd's saved set ("none") they
# needed 106 and 88 GiB per 80 GB GPU. The reading was chosen after seeing them not fit, and the data file says so.
# OPT-175B on 992 A100 80GB (TP 8, FSDP kept gathered through the backward, read as ZeRO-2; 8 sequences per rank, full
# recompute) fits since its row says `training.distribute_saved_activations` (metaseq's
# --distribute-checkpointed-activations, Options.distribute_saved_activations): each checkpointed layer input is split
# over the 8 TP ranks, 8 x 2048 x 12288 x 2 B x 96 layers = 38.7 GB per GPU whole, 4.8 GB split, beside
# 175e9 / 8 x 2 B = 43.8 GB of fp16 weights.
KNOWN_DOES_NOT_FIT: set[str] = set()


def _known_reason(entry_id: str) -> str | None:
    return next((why for why, ids in KNOWN_UNPLANNABLE.items() if entry_id in ids), None)


def test_at_least_sixty_new_runs_of_each_kind() -> None:
    assert len(TRAINING) >= 60 and len(SERVING) >= 60


@pytest.mark.parametrize("entries", [TRAINING, SERVING], ids=["training", "serving"])
def test_every_entry_has_a_source_and_its_sources_split(entries: list[dict]) -> None:
    for e in entries:
        src = e["source"]
        assert src.get("key") and (src.get("ref") or src.get("url")) and src.get("where"), e["id"]
        assert e["split"] in _split.SPLITS, e["id"]
        assert e["split"] == _split.split_of(src["key"]), e["id"]
        assert e.get("families"), e["id"]


@pytest.mark.parametrize("entries", [TRAINING, SERVING], ids=["training", "serving"])
def test_split_is_by_source_and_both_halves_are_used(entries: list[dict]) -> None:
    halves = defaultdict(set)
    for e in entries:
        halves[e["source"]["key"]].add(e["split"])
    assert all(len(h) == 1 for h in halves.values())
    assert {e["split"] for e in entries} == set(_split.SPLITS)


def test_ids_are_unique() -> None:
    ids = [e["id"] for e in TRAINING + SERVING]
    assert len(ids) == len(set(ids))


def test_split_rule_is_the_stated_hash() -> None:
    # sha256("megatron-bridge-perf:deepseek-v3") starts 0790a48c: even -> validation;
    # sha256("megatron-bridge-perf:gpt-oss-120b") starts 46bafedf: odd -> tuning
    assert _split.split_of("megatron-bridge-perf:deepseek-v3") == "validation"
    assert _split.split_of("megatron-bridge-perf:gpt-oss-120b") == "tuning"


@pytest.mark.parametrize("entry", TRAINING, ids=lambda e: e["id"])
def test_training_entry_plans_at_its_published_layout(entry: dict) -> None:
    why = _known_reason(entry["id"])
    if why is None:
        row = accuracy.evaluate_entry(entry, search=False)
        assert row["pred_step_s"] > 0 and row["measured_step_s"] > 0
        assert "released" not in row.get("note", ""), row["note"]  # every published degree was kept
        assert row["fits"] == (entry["id"] not in KNOWN_DOES_NOT_FIT)
    else:
        with pytest.raises(MeshplanError, match=why):
            accuracy.evaluate_entry(entry, search=False)


def test_finite_load_serving_rows_name_a_batch() -> None:
    # a row at a finite request rate is compared at its in-flight batch (Little's law, >= 1); an unset batch would
    # put it at meshplan's maximum-throughput point instead
    for e in SERVING:
        if e["regime"] == "server_qps":
            assert isinstance(e["batch"], int) and e["batch"] >= 1, e["id"]


def test_serving_entries_all_plan() -> None:
    rows = serving_accuracy.run(entries=SERVING)["rows"]
    assert [r["id"] for r in rows if "skipped" in r] == []
    assert all(r["predicted"]["output_tokens_per_s"] > 0 for r in rows)


def test_tuning_only_loads_no_validation_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--tuning-only` (both accuracy scripts) sets MESHPLAN_TUNING_ONLY=1: the loaders then return exactly the
    tuning entries of the full files, so the validation half is never on screen while constants are chosen."""
    monkeypatch.setenv(_split.TUNING_ONLY_ENV, "1")
    for loaded, full in ((_split.load_new_training(), TRAINING), (_split.load_new_serving(), SERVING)):
        assert [e["id"] for e in loaded] == [e["id"] for e in full if e["split"] == "tuning"]
        assert 0 < len(loaded) < len(full)


def test_a_published_median_is_compared_with_the_simulated_median() -> None:
    """SGLang's bench_serving prints medians (its 'Median TTFT' is np.median of the requests' TTFTs, its 'Median ITL'
    np.median of every request's gaps pooled): a row with `statistic: median` is compared with the simulation's p50 of
    the same quantity, a row without it with the mean. Checked against simulate() run directly on the row's inputs."""
    row = next(e for e in SERVING if e.get("statistic") == "median" and e["regime"] == "server_qps")
    row = {**row, "arrivals": {**row["arrivals"], "requests": 200}}  # fewer requests: the same rule, a quicker test
    m, chip = load_model(row["model"]), load_chip(row["hardware"])
    eff = default_efficiency(chip)
    cfg = ServeConfig(tp=row["tp"], engine=row["engine"], overlap_scheduling=row.get("async_scheduling"),
                      frontend=row.get("frontend"))  # the server path the row names (sglang-http)
    w = Workload(row["input_len"], row["output_len"])
    trace = load_length_trace(serving_accuracy.DATA / row["length_trace"])
    sim = simulate(m, chip, row["chips"], cfg, eff, w, max_batch_per_replica(m, chip, cfg, eff, w),
                   SimSpec(rate=float(row["arrivals"]["rate"]), n_requests=200, lengths=trace))
    got = serving_accuracy.predict(row, serving_accuracy._assumptions())
    assert got["ttft_s"] == sim["ttft_s"]["p50"] and got["tpot_s"] == sim["itl_s"]["p50"]
    assert sim["ttft_s"]["p50"] != sim["ttft_s"]["mean"]  # the two statistics differ on this row
    mean_row = {k: v for k, v in row.items() if k != "statistic"}
    got_mean = serving_accuracy.predict(mean_row, serving_accuracy._assumptions())
    assert got_mean["ttft_s"] == sim["ttft_s"]["mean"] and got_mean["tpot_s"] == sim["itl_s"]["mean"]


def test_a_random_dataset_sample_reproduces_the_published_token_totals() -> None:
    """A row whose requests came from a benchmark's random dataset (`length_sample`) is simulated on the sample that
    benchmark drew. sglang.bench_serving prints the sample's total input and output tokens; drawing it again with the
    benchmark's rule and seed must give exactly those published totals (the jsonl's total_input_tokens and
    total_output_tokens, copied into each row's published_totals)."""
    rows = [e for e in SERVING if e.get("length_sample")]
    assert len(rows) >= 14
    for e in rows:
        spec = e["length_sample"]
        lens = serving_accuracy.sample_lengths(spec, int(e["arrivals"]["requests"]))
        assert sum(i for i, _ in lens) == spec["published_totals"]["input"], e["id"]
        assert sum(o for _, o in lens) == spec["published_totals"]["output"], e["id"]
        assert all(1 <= i <= spec["random_input_len"] and 0 <= o <= spec["random_output_len"] for i, o in lens)


def test_a_sampled_row_is_simulated_on_its_own_sample() -> None:
    """predict() on a `length_sample` row equals simulate() run directly on the drawn lengths (0-token outputs as 1)."""
    row = next(e for e in SERVING if e.get("length_sample") and e["regime"] == "server_qps")
    row = {**row, "arrivals": {**row["arrivals"], "requests": 150}}  # fewer requests: the same rule, a quicker test
    m, chip = load_model(row["model"]), load_chip(row["hardware"])
    eff = default_efficiency(chip)
    cfg = ServeConfig(tp=row["tp"], engine=row["engine"], frontend=row.get("frontend"))
    w = Workload(row["input_len"], row["output_len"])
    lens = tuple((i, max(o, 1)) for i, o in serving_accuracy.sample_lengths(row["length_sample"], 150))
    sim = simulate(m, chip, row["chips"], cfg, eff, w, max_batch_per_replica(m, chip, cfg, eff, w),
                   SimSpec(rate=float(row["arrivals"]["rate"]), n_requests=150, lengths=lens))
    got = serving_accuracy.predict(row, serving_accuracy._assumptions())
    assert got["ttft_s"] == sim["ttft_s"]["p50"] and got["tpot_s"] == sim["itl_s"]["p50"]
    fixed = {k: v for k, v in row.items() if k != "length_sample"}  # at the means instead: a different answer
    assert serving_accuracy.predict(fixed, serving_accuracy._assumptions())["ttft_s"] != got["ttft_s"]


def test_an_unknown_sample_generator_is_refused() -> None:
    with pytest.raises(MeshplanError, match="unknown length_sample generator"):
        serving_accuracy.sample_lengths({"generator": "vllm_random", "seed": 0, "random_input_len": 8,
                                         "random_output_len": 8, "random_range_ratio": 0.0}, 4)


def test_a_row_its_source_flags_is_reported_apart_and_an_unknown_flag_is_refused() -> None:
    """Session 29: a row whose source footnotes a known performance regression stays out of the statistics
    (accuracy.source_flagged); an unknown flag kind, or one without the source's text, is an error, never a silent
    exclusion."""
    plain = {"id": "a"}
    flagged = {"id": "b", "source_flag": {"kind": "known_regression", "text": "footnote: known issue"}}
    assert accuracy.source_flagged([plain, flagged]) == ([plain], [flagged])
    for bad in ({"kind": "looks_wrong", "text": "x"}, {"kind": "known_regression"}):
        with pytest.raises(ValueError, match="source_flag"):
            accuracy.source_flagged([{"id": "c", "source_flag": bad}])


def test_every_flagged_row_quotes_the_footnote_that_flags_it() -> None:
    """Each flagged row's quoted table row carries the footnote marker its flag text quotes: the flag comes from the
    published row, not from the row's error."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "training_measurements_new.yaml"
    entries = yaml.safe_load(path.read_text())
    flagged = accuracy.source_flagged(entries)[1]
    assert [e["id"] for e in flagged] == ["mbridge_26p06p01_gpt-oss-120b_gb200_64_mxfp8",
                                          "mbridge_26p06p01_gpt-oss-120b_gb300_64_mxfp8"]  # the same footnote (s33)
    for e in flagged:
        marker = e["source_flag"]["text"].split("[^", 1)[1].split("]", 1)[0]
        assert f"[^{marker}]" in e["source"]["row"]
