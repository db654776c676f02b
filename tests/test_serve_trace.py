"""Replaying a benchmark's own request lengths (issue #14, session 13): a length trace drives the simulator request by
request, and a published "Mean ITL" (every inter-token gap pooled) is told apart from a per-request mean TPOT.
Expected values come from the published totals of the sample, from the trace itself, or from an identity derived in
the comments (pooled gaps are the per-request TPOTs weighted by each request's gap count)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshplan.cost.efficiency import default_efficiency
from meshplan.errors import MeshplanError
from meshplan.infer.config import ServeConfig, Workload
from meshplan.infer.simulate import SimSpec, _Replica, load_length_trace, make_requests, simulate
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

ROOT = Path(__file__).resolve().parents[1]
SHAREGPT = ROOT / "benchmarks" / "data" / "traces" / "sharegpt_vllm_seed0_llama31_500.json"
NEW_SERVING = ROOT / "benchmarks" / "data" / "serving_measurements_new.yaml"
H100 = load_chip("h100-sxm")
EFF = default_efficiency(H100)
M8 = load_model("llama3.1-8b")


def test_sharegpt_trace_matches_the_published_sample_totals():
    # github.com/modular/modular benchmark/README.md 'Token Stats' of vLLM's 500-prompt ShareGPT sample (seed 0,
    # Llama 3.1 tokenizer): 100,895 input tokens, max input 933, max output 806, max input + output 1,570
    trace = load_length_trace(SHAREGPT)
    assert len(trace) == 500
    assert sum(i for i, _ in trace) == 100_895
    assert max(i for i, _ in trace) == 933 and max(o for _, o in trace) == 806
    assert max(i + o for i, o in trace) == 1570
    assert trace[:3] == ((13, 120), (25, 770), (27, 233))  # the first rows of the source CSV, in order


def test_rows_with_a_trace_state_its_means():
    rows = [e for e in yaml.safe_load(NEW_SERVING.read_text())["measurements"] if e.get("length_trace")]
    # 202/214 rows, H100 and H200: 70B at QPS 2, 8 and INF; 8B at QPS 2, 4, 8, 16, 32 and INF (4, 16, 32 from session 16);
    # session 18: SGLang v0.3.0's ShareGPT rows (8B on A100, 70B on 4 x H100: RPS 4, 8 and offline)
    assert len(rows) == 24
    for e in rows:
        trace = load_length_trace(NEW_SERVING.parent / e["length_trace"])
        assert e["input_len"] == round(sum(i for i, _ in trace) / len(trace))  # 100,895 / 500 = 201.8
        assert e["output_len"] == round(sum(o for _, o in trace) / len(trace))  # 106,959 / 500 = 213.9


def test_make_requests_replays_the_trace_in_order_and_cycles():
    trace = ((5, 7), (300, 2), (40, 90))
    reqs = make_requests(SimSpec(rate=float("inf"), n_requests=7, lengths=trace), Workload(100, 30))
    assert [(r.inp, r.out) for r in reqs] == [*trace, *trace, trace[0]]
    with pytest.raises(MeshplanError, match="does not combine"):
        make_requests(SimSpec(rate=1.0, n_requests=3, input_dist="exponential", lengths=trace), Workload(100, 30))
    with pytest.raises(MeshplanError, match="output tokens to simulate"):
        make_requests(SimSpec(rate=1.0, n_requests=3, lengths=((1, 8_000_000),)), Workload(100, 30))


def _sim(trace, rate=float("inf"), batch=8, w=Workload(200, 60)):
    cfg = ServeConfig(engine="trtllm")
    spec = SimSpec(rate=rate, n_requests=len(trace), lengths=tuple(trace))
    return simulate(M8, H100, 1, cfg, EFF, w, batch, spec)


def test_pooled_itl_weighs_tokens_not_requests():
    # With every request of one length the pooled gaps and the per-request TPOTs have one mean (each request has the
    # same number of gaps). Otherwise the pooled mean is sum_r (out_r - 1) tpot_r / sum_r (out_r - 1): each request
    # weighs by its gap count, while the TPOT mean weighs the requests alike.
    even = _sim([(200, 30)] * 4)
    assert even["itl_s"]["mean"] == pytest.approx(even["tpot_s"]["mean"], rel=1e-9)
    # two slots: the 3-token request ends, the 7000-token prompt takes its slot and its prefill step lands in one gap
    # of the 40-token request (39 gaps), not in the short one's (2 gaps)
    # (a workload of 7000 + 60 tokens sizes two slots' cache at 14,120 tokens: the slots, not the cache, limit here)
    trace, big = ((8, 3), (8, 40), (7000, 5)), Workload(7000, 60)
    reqs = make_requests(SimSpec(rate=float("inf"), n_requests=3, lengths=trace), big)
    _Replica(M8, H100, ServeConfig(engine="trtllm"), EFF, 2).run(reqs)
    tpots = [(r.finish - r.first_token) / (r.out - 1) for r in reqs]
    pooled = sum((r.out - 1) * t for r, t in zip(reqs, tpots, strict=True)) / sum(r.out - 1 for r in reqs)
    mixed = _sim(trace, batch=2, w=big)
    assert mixed["itl_s"]["mean"] == pytest.approx(pooled, rel=1e-9)
    assert mixed["tpot_s"]["mean"] == pytest.approx(sum(tpots) / 3, rel=1e-9)
    assert mixed["input_dist"] == "trace"
    assert mixed["itl_s"]["mean"] > 1.1 * mixed["tpot_s"]["mean"]


def test_requests_of_a_trace_fill_the_cache_in_tokens():
    # TensorRT-LLM reserves a request's whole input + output at admission (GUARANTEED_NO_EVICT). 4 slots sized for the
    # workload's 200 + 60 tokens are a cache of 4 x 260 = 1,040 tokens: two requests of 500 + 20 = 520 tokens fill it,
    # so 4 of them run two at a time (the 3rd starts when one of the first two ends), where 4 short ones run at once
    cfg = ServeConfig(engine="trtllm")
    long = make_requests(SimSpec(rate=float("inf"), n_requests=4, lengths=((500, 20),)), Workload(200, 60))
    _Replica(M8, H100, cfg, EFF, 4, kv_tokens=4 * 260).run(long)
    first, third = sorted(r.first_token for r in long)[0], sorted(r.first_token for r in long)[2]
    assert third > min(r.finish for r in long) - 1e-12 > first
    short = make_requests(SimSpec(rate=float("inf"), n_requests=4, lengths=((100, 20),)), Workload(200, 60))
    _Replica(M8, H100, cfg, EFF, 4, kv_tokens=4 * 260).run(short)
    assert len({r.first_token for r in short}) == 1  # all four prefilled in the first step
    # simulate() applies the cache when the lengths vary: a 2,000-token request and short ones on 4 slots of 260
    mixed = _sim([(2000, 20), (100, 20), (100, 20), (100, 20)], batch=4)
    slots_only = make_requests(SimSpec(rate=float("inf"), n_requests=4, lengths=((2000, 20), (100, 20), (100, 20),
                                                                                (100, 20))), Workload(200, 60))
    _Replica(M8, H100, cfg, EFF, 4).run(slots_only)
    assert mixed["ttft_s"]["mean"] > sum(r.first_token - r.arrival for r in slots_only) / 4


def test_a_closed_batch_of_a_trace_lasts_as_long_as_its_longest_request():
    # 8 requests at once on 8 slots: the span is set by the longest output, so a trace with one 200-token request and
    # seven 2-token ones delivers far fewer tokens per second than eight requests at the mean length (27 tokens)
    tail = _sim([(100, 200)] + [(100, 2)] * 7)
    mean = _sim([(100, 27)] * 8)
    assert tail["throughput_tokens_per_s"] < 0.5 * mean["throughput_tokens_per_s"]


@pytest.mark.parametrize(("body", "suffix", "message"), [
    ('{"input_lens": [1, 2], "output_lens": [3]}', ".json", "lists of one length"),
    ('{"inputs": [1]}', ".json", "input_lens"),
    ('{"input_lens": [0], "output_lens": [3]}', ".json", "input length"),
    ("input,output\n5,6\n7\n", ".csv", "line 3"),
    ("5,6\n7,-1\n", ".csv", "output length"),
    ("", ".csv", "requests in"),
    ("5,\u00b2\n", ".csv", "line 1"),  # a superscript two: a digit to str.isdigit, not to int()
    ("[" * 100_000, ".json", "JSON object"),
])
def test_bad_traces_are_one_line_errors(tmp_path, body, suffix, message):
    p = tmp_path / f"t{suffix}"
    p.write_text(body)
    with pytest.raises(MeshplanError, match=message):
        load_length_trace(p)


def test_csv_trace_with_header(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("num_prefill_tokens,num_decode_tokens\n13,120\n25,770\n")
    assert load_length_trace(p) == ((13, 120), (25, 770))


def _cli(*args: str) -> subprocess.CompletedProcess:
    code = "import sys; from meshplan.cli import main; main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          check=False)


def test_cli_length_trace(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"input_lens": [100, 300], "output_lens": [20, 60]}))
    r = _cli("serve", "--model", "llama3.1-8b", "--hardware", "h100-sxm", "--chips", "1", "--simulate", "--rate",
             "inf", "--requests", "4", "--length-trace", str(p), "--json")
    assert r.returncode == 0, r.stderr[-1500:]
    out = json.loads(r.stdout)
    assert out["input_len"] == 200 and out["output_len"] == 40  # the trace's means, as --input-len/--output-len
    assert out["simulation"]["input_dist"] == "trace" and "itl_s" in out["simulation"]
    bad = _cli("serve", "--model", "llama3.1-8b", "--hardware", "h100-sxm", "--chips", "1", "--length-trace", str(p))
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --length-trace goes with --simulate"
    missing = _cli("serve", "--model", "llama3.1-8b", "--hardware", "h100-sxm", "--chips", "1", "--simulate",
                   "--rate", "1", "--length-trace", str(tmp_path / "none.json"))
    assert missing.returncode == 2 and missing.stderr.startswith("error: cannot read length trace")
    assert len(missing.stderr.strip().splitlines()) == 1


_LEN = st.one_of(st.integers(min_value=-5, max_value=2**60), st.floats(allow_nan=True), st.text(max_size=5),
                 st.none(), st.booleans())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(
    st.binary(max_size=300).map(lambda b: (".csv", b)),
    st.binary(max_size=300).map(lambda b: (".json", b)),
    st.fixed_dictionaries({"input_lens": st.lists(_LEN, max_size=6), "output_lens": st.lists(_LEN, max_size=6)})
    .map(lambda d: (".json", json.dumps(d).encode())),
    st.lists(st.tuples(_LEN, _LEN), max_size=6).map(
        lambda rows: (".csv", "\n".join(f"{a},{b}" for a, b in rows).encode()))))
def test_any_trace_file_loads_or_is_one_meshplan_error(tmp_path, data):
    suffix, body = data
    p = tmp_path / f"t{suffix}"
    p.write_bytes(body)
    try:
        trace = load_length_trace(p)
    except MeshplanError as exc:
        assert "\n" not in str(exc)
        return
    assert trace and all(isinstance(i, int) and isinstance(o, int) and i >= 1 and o >= 1 for i, o in trace)
