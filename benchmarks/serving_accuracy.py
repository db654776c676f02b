"""Predicted vs published measured serving results (benchmarks/data/serving_measurements.yaml).

Physics, not fitted rows: every entry runs through meshplan's default efficiencies and serving constants;
gaps in an entry (unstated KV dtype, variable lengths) are filled by the fixed rules in
benchmarks/data/serving_assumptions.yaml, the same for every entry.

    python benchmarks/serving_accuracy.py [--file F.yaml] [--json] [--no-new]

After the published set, the new measurements of issue #14 (data/serving_measurements_new.yaml) are reported per
frozen half (validation / tuning, split by source: _split.py) and per family. Sign convention, as in the rest of
this script: error = (predicted - measured) / measured of the quantity itself, so for output tokens/s a POSITIVE
error is an optimistic prediction (faster than measured), and for TPOT and TTFT a NEGATIVE error is optimistic.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np
import yaml

from meshplan.cost.efficiency import default_efficiency
from meshplan.errors import MeshplanError
from meshplan.infer.config import KV_DTYPES, ServeConfig, Workload, check_layout, engine_token_budget
from meshplan.infer.frontier import best_point, frontier
from meshplan.infer.harness import harness_settings
from meshplan.infer.memory import max_batch_per_replica
from meshplan.infer.metrics import evaluate
from meshplan.infer.simulate import SimSpec, load_length_trace, simulate
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

DATA = Path(__file__).parent / "data"


def _assumptions() -> dict:
    return yaml.safe_load((DATA / "serving_assumptions.yaml").read_text())


def _text(e: dict) -> str:
    return json.dumps(e.get("source", "")) + " " + str(e.get("notes", ""))


def lengths(e: dict, rules: dict) -> tuple[int, int, str]:
    """(input_len, output_len, how) following the documented rules."""
    i, o = e.get("input_len"), e.get("output_len")
    if i and o:
        return int(i), int(o), "given"
    if o and not i:
        return int(o), int(o), "input=output"
    for name, d in rules["dataset_mean_lengths"].items():
        if name in _text(e).lower():
            return int(d["input"]), int(d["output"]), f"{name} means"
    raise MeshplanError("no lengths and no known dataset")


def kv_dtype(e: dict) -> str:
    if e.get("kv_dtype"):
        return e["kv_dtype"]
    w = e["weight_dtype"]
    return w if w in KV_DTYPES else "bf16"


def mode(e: dict) -> str:
    if e["regime"] != "fixed_batch":
        return "continuous"
    where = json.dumps(e.get("source", "")).lower()  # the quoted table/row, not the free-text notes
    return "continuous" if "concurren" in where else "static"


def source_harness(e: dict, rules: dict) -> str | None:
    """The harness the row's source ran (serving_assumptions.yaml harness_by_source, by source key), or None."""
    return (rules.get("harness_by_source") or {}).get("sources", {}).get(source_key(e).split(":", 1)[0])


def source_key(e: dict) -> str:
    """The entry's source key (its `source.key`; '' where the source is a plain reference)."""
    return str(e["source"].get("key", "")) if isinstance(e.get("source"), dict) else ""


def _setup(e: dict, rules: dict):
    """The row's model, chip, layout (with the harness's limits where its source ran one), efficiencies, workload,
    the lengths' note and meshplan's largest batch per replica: what predict() and implied_batch() time."""
    # a config under benchmarks/data (models/qwen3-235b-a22b.json) or a preset name
    m, chip = load_model(str(DATA / e["model"]) if e["model"].endswith(".json") else e["model"]), load_chip(e["hardware"])
    eff = default_efficiency(chip)
    # the engine's step token budget: the one the source's server command sets, else the engine's default
    budget = e.get("max_num_batched_tokens") or engine_token_budget(e.get("engine") or "default", chip)
    # attention data parallel where the source's own command turns it on (its engine flag, like async_scheduling);
    # its EP degree, where unstated, by serving_assumptions.yaml missing_ep_attention_dp (ep = tp)
    adp = bool(e.get("attention_dp"))
    ep = e.get("ep") or (e["tp"] if adp else 1)
    cfg = ServeConfig(tp=e["tp"], pp=e.get("pp") or 1, ep=ep, attention_dp=adp, weight_dtype=e["weight_dtype"],
                      kv_dtype=kv_dtype(e),
                      max_num_batched_tokens=budget, engine=e.get("engine") or "default",
                      overlap_scheduling=e.get("async_scheduling"),  # the source's server flag, else the engine's
                      frontend=e.get("frontend"),  # the server path the source names (config.frontend_first_token_s)
                      dense_kv_cache=e.get("dense_kv_cache"))  # the source's fixed cache length (JetStream)
    check_layout(m, chip, e["chips"], cfg)
    I, O, how = lengths(e, rules)
    w = Workload(I, O)
    harness = source_harness(e, rules)
    if harness and not e.get("max_num_batched_tokens"):
        cfg = harness_settings(harness, m, chip, cfg, w).apply(cfg, chip)  # the limits the harness set for the run
    mb = max_batch_per_replica(m, chip, cfg, eff, w)
    if mb < 1:
        raise MeshplanError("model does not fit")
    return m, chip, cfg, eff, w, how, mb


def predict(e: dict, rules: dict) -> dict:
    m, chip, cfg, eff, w, how, mb = _setup(e, rules)
    md = mode(e)
    if e.get("arrivals"):  # the benchmark's own arrival process, replayed by the simulator
        return _simulated(e, m, chip, cfg, eff, w, mb, how)
    if e.get("batch") and md == "continuous" and e["regime"] == "fixed_batch":
        # a 'concurrency' source is a closed loop of that many clients (mode above): the engine holds at most mb
        # sequences per replica, the other clients wait for a slot (metrics.admission_queue_wait_s)
        # a benchmark of a stated request count (benchmark_requests) starts its clients together: the mean TTFT
        # counts that first round apart (metrics.benchmark_mean_ttft_s); unstated, the steady state alone
        p = evaluate(m, chip, e["chips"], cfg, eff, w, mb, md, clients=int(e["batch"]),
                     requests=e.get("benchmark_requests"))
    elif e.get("batch"):
        p = evaluate(m, chip, e["chips"], cfg, eff, w, min(int(e["batch"]), mb), md)
    else:
        p = best_point(frontier(m, chip, e["chips"], cfg, eff, w, md))
    return {"output_tokens_per_s": p.throughput_tokens_per_s, "tpot_s": p.tpot_s, "ttft_s": p.ttft_s,
            "spread_ttft_s": p.spread_ttft_s,  # in phase (metrics.in_phase_ttft_s): the steady state's, the other bound
            "batch": p.batch, "max_batch": mb, "mode": md, "lengths": how, "kv_dtype": cfg.kv_dtype,
            "max_num_batched_tokens": cfg.max_num_batched_tokens}


def implied_batch(e: dict, rules: dict, predicted_batch: int) -> dict | None:
    """For an offline max-throughput row (no batch, no arrivals in the source): the batch at which meshplan's own step
    times give the measured output tok/s, beside the batch its prediction ran (`predicted_batch`, the capacity-bound
    best point). A diagnostic that splits a throughput error in two: were the step time right, the run held this
    many sequences. None where the row is not such a row; `implied` None where even the largest batch meshplan
    admits falls short of the measurement (its step times are slower than the run's at every batch it can hold)."""
    meas = (e.get("measured") or {}).get("output_tokens_per_s")
    if not meas or e.get("batch") or e.get("arrivals") or e.get("regime") != "offline_max_throughput":
        return None
    m, chip, cfg, eff, w, _, mb = _setup(e, rules)
    md = mode(e)

    def tok_s(b: int) -> float:
        return evaluate(m, chip, e["chips"], cfg, eff, w, b, md).throughput_tokens_per_s

    out = {"predicted_batch": predicted_batch, "max_batch": mb, "implied": None}
    if tok_s(mb) < meas:
        return out
    lo, hi = 0, mb  # throughput rises with the batch up to capacity: bisect for the first batch that reaches meas
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if tok_s(mid) < meas else (lo, mid)
    out["implied"] = hi
    return out


def print_implied_batch(rows: list[dict], entries: list[dict], rules: dict) -> dict:
    """Per half and source, the offline max-throughput rows' implied batch (implied_batch) over the batch meshplan's
    prediction ran: near 1 where the error lies in the step time at that batch, well below 1 where the run held
    fewer sequences than meshplan's capacity (or its steps at large batch are slower than meshplan's), 'above' where
    meshplan's steps are slower than the run's at any batch it admits."""
    from _split import SPLITS

    by_id = {e["id"]: e for e in entries}
    got: dict[tuple[str, str], list[float | None]] = {}
    for r in rows:
        if "error" not in r:
            continue
        ib = implied_batch(by_id[r["id"]], rules, r["predicted"]["batch"])
        if ib is not None:
            ratio = None if ib["implied"] is None else ib["implied"] / ib["predicted_batch"]
            got.setdefault((r.get("split"), r["source_key"]), []).append(ratio)
    print("\n| half / source: offline max-throughput rows | n | implied batch / predicted batch, median | range | "
          "above capacity |")
    print("|" + "---|" * 5)
    out = {}
    for h in SPLITS:
        for (half, key), ratios in sorted(got.items()):
            if half != h:
                continue
            vals = sorted(x for x in ratios if x is not None)
            median = statistics.median(vals) if vals else None
            rng = f"{vals[0]:.2f}-{vals[-1]:.2f}" if vals else "-"
            above = sum(x is None for x in ratios)
            out[(h, key)] = {"n": len(ratios), "median": median, "above": above}
            print(f"| {h} / {key} | {len(ratios)} | {'-' if median is None else f'{median:.2f}'} | {rng} | {above} |")
    return out


SAMPLE_GENERATORS = ("sglang_random", "sgl_jax_random")


def sample_lengths(spec: dict, n: int) -> list[tuple[int, int]]:
    """(input, output) tokens of the `n` requests a benchmark's random dataset draws, as its own code draws them.
    sglang_random: sglang.bench_serving --dataset-name random (sample_random_requests): numpy's global legacy generator
    seeded with --seed (np.random.seed), then input_lens = randint(max(int(I * r), 1), I + 1, n) and output_lens =
    randint(int(O * r), O + 1, n), r = --random-range-ratio. sgl_jax_random: SGLang-JAX's copy (python/sgl_jax/
    bench_serving.py compute_random_lens @ b4621162), which floors both draws at 1: randint(max(int(L * r), 1), L + 1, n).
    numpy's legacy RandomState stream is frozen across versions (NEP 19), so the draw is the benchmark's. Outputs may
    be 0 under sglang_random; the simulation runs such a request as 1 token."""
    if spec.get("generator") not in SAMPLE_GENERATORS:
        raise MeshplanError(f"unknown length_sample generator {spec.get('generator')!r} (known: {', '.join(SAMPLE_GENERATORS)})")
    I, O, r = int(spec["random_input_len"]), int(spec["random_output_len"]), float(spec["random_range_ratio"])
    rng = np.random.RandomState(int(spec["seed"]))
    ins = rng.randint(max(int(I * r), 1), I + 1, size=n)
    outs = rng.randint(max(int(O * r), 1) if spec["generator"] == "sgl_jax_random" else int(O * r), O + 1, size=n)
    return [(int(i), int(o)) for i, o in zip(ins, outs, strict=True)]


def _simulated(e: dict, m, chip, cfg: ServeConfig, eff, w: Workload, mb: int, how: str) -> dict:
    """Mean TTFT and TPOT (the published means) and output tokens/s of the simulated benchmark: `arrivals` gives
    its request count, rate (requests/s, 'inf' = all at t = 0) and closed-loop concurrency, from the source."""
    a = e["arrivals"]
    # a dataset's sample replays its own requests' lengths where the data names the sample (length_trace), or draws
    # them as the benchmark's own generator does (length_sample)
    if e.get("length_trace"):
        trace = load_length_trace(DATA / e["length_trace"])
    elif e.get("length_sample"):
        trace = tuple((i, max(o, 1)) for i, o in sample_lengths(e["length_sample"], int(a["requests"])))
    else:
        trace = ()
    spec = SimSpec(rate=float(a.get("rate", "inf")), n_requests=int(a["requests"]), concurrency=a.get("concurrency"),
                   lengths=trace)
    limit = min(mb, int(a["max_num_seqs"])) if a.get("max_num_seqs") else mb
    sim = simulate(m, chip, e["chips"], cfg, eff, w, limit, spec, kv_batch=mb)  # the cache is memory's, not the cap's
    # a published mean ITL pools every gap between two tokens (tpot_measure: pooled_itl); a mean TPOT weighs requests;
    # a published median (`statistic: median`, SGLang bench_serving's 'Median TTFT' / 'Median ITL': np.median of the
    # requests' TTFTs and of every request's pooled gaps) is compared with the simulation's own p50
    stat = "p50" if e.get("statistic") == "median" else "mean"
    tpot = sim["itl_s"][stat] if e.get("tpot_measure") == "pooled_itl" else sim["tpot_s"][stat]
    return {"output_tokens_per_s": sim["throughput_tokens_per_s"], "tpot_s": tpot,
            "ttft_s": sim["ttft_s"][stat], "batch": limit, "max_batch": mb, "mode": "simulated", "lengths": how,
            "kv_dtype": cfg.kv_dtype}


def _rel(pred: float, meas: float | None) -> float | None:
    return None if meas in (None, 0) else (pred - meas) / meas


def run(path: Path | None = None, entries: list[dict] | None = None) -> dict:
    rules = _assumptions()
    rows = []
    for e in entries if entries is not None else yaml.safe_load(path.read_text())["measurements"]:
        try:
            pred = predict(e, rules)
        except MeshplanError as exc:
            rows.append({"id": e["id"], "skipped": str(exc), "split": e.get("split"), "families": e.get("families") or [],
                         "source_key": source_key(e)})
            continue
        meas = e["measured"]
        rows.append({"id": e["id"], "predicted": pred, "measured": meas, "split": e.get("split"),
                     "families": e.get("families") or [], "source_key": source_key(e),
                     "error": {k: _rel(pred[k], meas.get(k)) for k in ("output_tokens_per_s", "tpot_s", "ttft_s")}})
    return {"rows": rows, "summary": _summary(rows)}


def _summary(rows: list[dict]) -> dict:
    out = {}
    for k in ("output_tokens_per_s", "tpot_s", "ttft_s"):
        errs = [abs(r["error"][k]) for r in rows if "error" in r and r["error"][k] is not None]
        out[k] = {"n": len(errs), "median_abs_rel_error": statistics.median(errs) if errs else None,
                  "worst_abs_rel_error": max(errs) if errs else None}
    return out


def _fmt(v: float | None, scale: float = 1.0, spec: str = ".1f") -> str:
    return "-" if v is None else format(v * scale, spec)


def print_report(res: dict) -> None:
    w = max([48] + [len(r["id"]) for r in res["rows"]])  # every id whole (the new rows' ids run to 59 characters)
    print(f"{'id':{w}s} {'mode':5s} {'B':>5s} {'tok/s pred':>10s} {'meas':>9s} {'err':>6s} "
          f"{'TPOT ms':>8s} {'meas':>7s} {'err':>6s} {'TTFT s':>7s} {'meas':>6s}")
    for r in res["rows"]:
        if "skipped" in r:
            print(f"{r['id']:{w}s} skipped: {r['skipped']}")
            continue
        p, m, e = r["predicted"], r["measured"], r["error"]
        print(f"{r['id']:{w}s} {p['mode'][:5]:5s} {p['batch']:5d} {p['output_tokens_per_s']:10.0f} "
              f"{_fmt(m.get('output_tokens_per_s'), 1, '.0f'):>9s} {_fmt(e['output_tokens_per_s'], 100, '+.0f'):>5s}% "
              f"{p['tpot_s'] * 1e3:8.1f} {_fmt(m.get('tpot_s'), 1e3):>7s} {_fmt(e['tpot_s'], 100, '+.0f'):>5s}% "
              f"{p['ttft_s']:7.3f} {_fmt(m.get('ttft_s'), 1, '.3f'):>6s}")
    for k, s in res["summary"].items():
        print(f"{k:22s} n={s['n']:2d}  median |error| {_fmt(s['median_abs_rel_error'], 100)}%  "
              f"worst {_fmt(s['worst_abs_rel_error'], 100)}%")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", type=Path, default=DATA / "serving_measurements.yaml")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-new", action="store_true", help="skip the new measurements of issue #14")
    ap.add_argument("--no-aic", action="store_true",
                    help="skip the external check on aiconfigurator's silicon sample (aic_silicon.py)")
    ap.add_argument("--no-nim", action="store_true",
                    help="skip the external check on the NIM sizing-course sweeps (nim_dli.py)")
    ap.add_argument("--no-tpu", action="store_true",
                    help="skip the external check on the TPU engines' sweep (tpu_engines.py)")
    ap.add_argument("--tuning-only", action="store_true",
                    help="load only the tuning half of the new data (for choosing constants without seeing validation)")
    ap.add_argument("--implied-batch", action="store_true",
                    help="also print, per half and source, the batch at which meshplan's step times give each offline "
                         "max-throughput row's measured tok/s over the batch its prediction ran (implied_batch)")
    ap.add_argument("--campaign", metavar="TEXT",
                    help="also list, row by row, the external check's tuning rows whose campaign (source key) contains "
                         "TEXT: lengths, clients, TP, predicted and measured TPOT and TTFT; implies --tuning-only, so "
                         "no validation row is shown")
    args = ap.parse_args(argv)
    if args.campaign:
        args.tuning_only = True
    if args.tuning_only:
        os.environ["MESHPLAN_TUNING_ONLY"] = "1"  # read by _split's loaders
    res = run(args.file)
    if not args.no_new and args.file == DATA / "serving_measurements.yaml":
        from _split import load_new_serving  # sibling helper, imported here so the module loads on its own (tests)

        new_entries = load_new_serving()
        res["new"] = run(entries=new_entries)
    external: dict[str, list[dict]] = {}  # the external checks' entries, by name (EXTERNAL_CHECKS)
    if args.file == DATA / "serving_measurements.yaml":
        from _split import _visible

        for name, (module, _) in EXTERNAL_CHECKS.items():
            if not getattr(args, f"no_{name}"):
                external[name] = _visible(importlib.import_module(module).load())
                res[name] = run(entries=external[name])
    if args.json:
        json.dump(res, sys.stdout, indent=2)
        print()
    else:
        print_report(res)
        if "new" in res:
            print("\n## Issue #14: new published serving measurements")
            print_report(res["new"])
            print_halves(res, res["new"]["rows"])
            if args.implied_batch:
                print_implied_batch(res["new"]["rows"], new_entries, _assumptions())
        for name, entries in external.items():
            print_external(res[name]["rows"], EXTERNAL_CHECKS[name][1])
            if args.campaign:
                print_campaign_rows(res[name]["rows"], entries, args.campaign)
    return 0


# The external checks: closed-loop sweeps at fixed lengths from benchmark databases or datasets that do not quote every
# engine flag as serving_measurements_new.yaml's entries do, reported apart from issue #14's tables, by half and by
# measurement campaign (source key): name -> (the sibling module whose load() gives the entries, the table's title)
EXTERNAL_CHECKS = {
    "aic": ("aic_silicon", "aiconfigurator silicon sample (closed loop, fixed lengths; aic_silicon.py)"),
    "nim": ("nim_dli", "NIM sizing-course sweeps, TensorRT-LLM backend (closed loop, fixed lengths; nim_dli.py)"),
    "tpu": ("tpu_engines", "SGLang-JAX and vLLM on TPU v6e-4, Qwen3 8B / 32B (closed loop, fixed lengths; tpu_engines.py)"),
}


def print_campaign_rows(rows: list[dict], entries: list[dict], text: str) -> int:
    """The external check's tuning rows whose campaign (source key) contains `text`, one line each, for looking into
    a campaign's misses on the half constants are chosen on; validation rows are never listed. Returns the count."""
    setup = {e["id"]: e for e in entries if e.get("split") == "tuning"}
    picked = sorted((r for r in rows if r["id"] in setup and text in r["source_key"]),
                    key=lambda r: (r["source_key"], setup[r["id"]]["tp"], setup[r["id"]]["input_len"],
                                   setup[r["id"]]["output_len"], setup[r["id"]]["batch"]))
    print(f"\n## External check, tuning rows of campaigns matching {text!r}: {len(picked)}")
    print("| campaign | TP | input | output | clients | TPOT ms pred | meas | err | TTFT ms pred | meas | err |")
    print("|" + "---|" * 11)
    for r in picked:
        e = setup[r["id"]]
        head = f"| {r['source_key'].split(':', 1)[-1]} | {e['tp']} | {e['input_len']} | {e['output_len']} | {e['batch']} |"
        if "skipped" in r:
            print(f"{head} unplannable: {r['skipped']} |")
            continue
        p, m, err = r["predicted"], r["measured"], r["error"]
        print(f"{head} {p['tpot_s'] * 1e3:.2f} | {m['tpot_s'] * 1e3:.2f} | {err['tpot_s'] * 100:+.1f}% | "
              f"{p['ttft_s'] * 1e3:.1f} | {m['ttft_s'] * 1e3:.1f} | {err['ttft_s'] * 100:+.1f}% |")
    return len(picked)


QUANTITIES = (("output_tokens_per_s", "output tok/s", 1), ("tpot_s", "TPOT/ITL", -1), ("ttft_s", "TTFT", -1))


def print_halves(res: dict, rows: list[dict]) -> dict:
    """Issue #14's tables: per quantity, the published set and each half of the new data (median |err|, p90, signed
    median, within 25%, unplannable, optimistic count), then per half and family, then per half and source."""
    from _split import SPLITS, error_stats, format_stats_row

    ref_rows = res["rows"]
    out = {}
    print("\nerror = (predicted - measured) / measured; optimistic = tok/s over-predicted or TPOT/TTFT under-predicted")
    print("| quantity / set | n | median abs err | p90 abs err | signed median | within 25% | unplannable | optimistic |")
    print("|" + "---|" * 8)
    for key, label, sign in QUANTITIES:
        sets = [("published (serving_measurements.yaml)", ref_rows)] + [
            (f"new: {h}", [r for r in rows if r.get("split") == h]) for h in SPLITS]
        for name, rs in sets:
            errs = [r["error"][key] for r in rs if "error" in r and r["error"][key] is not None]
            st = error_stats(errs)
            un = sum("skipped" in r for r in rs)
            opt = sum(sign * x > 0 for x in errs)
            out[f"{key}/{name}"] = dict(st, unplannable=un, optimistic=opt)
            print(format_stats_row(f"{label} / {name}", st, un) + f" {opt}/{len(errs)} |")
    # per family, then per source (the split's unit: one publication table), so a family's figure can be traced to the
    # tables behind it
    for title, groups_of in (("family", lambda r: r.get("families") or []), ("source", lambda r: [r["source_key"]])):
        print(f"\n| half / {title} / quantity | n | median abs err | p90 abs err | signed median | within 25% | "
              "unplannable |")
        print("|" + "---|" * 7)
        for h in SPLITS:
            for g in sorted({g for r in rows if r.get("split") == h for g in groups_of(r)}):
                rs = [r for r in rows if r.get("split") == h and g in groups_of(r)]
                for key, label, _ in QUANTITIES:
                    errs = [r["error"][key] for r in rs if "error" in r and r["error"][key] is not None]
                    if errs:
                        print(format_stats_row(f"{h} / {g} / {label}", error_stats(errs),
                                               sum("skipped" in r for r in rs)))
    for r in rows:
        if "skipped" in r:
            print(f"UNPLANNABLE {r['id']} ({r.get('split')}): {r['skipped']}")
    return out


def print_external(rows: list[dict], title: str) -> dict:
    """An external check (EXTERNAL_CHECKS), per half and per measurement campaign (its source key), each quantity the
    source measured, apart from issue #14's tables: its rows come from a benchmark database or dataset that does not
    record every engine flag or the benchmark client's settings, which every entry of serving_measurements_new.yaml
    quotes from its source."""
    from _split import SPLITS, error_stats, format_stats_row

    print(f"\n## External check: {title}")
    print("| half / campaign / quantity | n | median abs err | p90 abs err | signed median | within 25% | unplannable |")
    print("|" + "---|" * 7)
    out = {}
    keys = sorted({r["source_key"] for r in rows})
    for h in SPLITS:
        for label_key in ["all"] + keys:
            rs = [r for r in rows if r.get("split") == h and label_key in ("all", r["source_key"])]
            for key, label, _ in QUANTITIES:
                errs = [r["error"][key] for r in rs if "error" in r and r["error"][key] is not None]
                if errs:
                    name = label_key.split(":", 1)[-1]
                    st = error_stats(errs)
                    out[f"{h}/{name}/{key}"] = st
                    print(format_stats_row(f"{h} / {name} / {label}", st, sum("skipped" in r for r in rs)))
    print_between(rows)
    return out


def print_between(rows: list[dict]) -> dict:
    """Where a closed loop was priced in phase (metrics.in_phase_ttft_s), where the measured TTFT lies against the two
    regimes, per half and campaign: below the spread steady state, between it and the in-phase rounds, or above both.
    Returns the counts by (half, campaign)."""
    from _split import SPLITS

    two = [r for r in rows if "error" in r and r["predicted"].get("spread_ttft_s") is not None
           and r["measured"].get("ttft_s") is not None]
    if not two:
        return {}
    print("\n| half / campaign: TTFT of the rows priced in phase | n | below both | between | above both |")
    print("|" + "---|" * 5)
    out = {}
    for h in SPLITS:
        for key in ["all"] + sorted({r["source_key"] for r in two}):
            rs = [r for r in two if r.get("split") == h and key in ("all", r["source_key"])]
            if not rs:
                continue
            counts = [0, 0, 0]
            for r in rs:
                lo, hi = sorted((r["predicted"]["spread_ttft_s"], r["predicted"]["ttft_s"]))
                m = r["measured"]["ttft_s"]
                counts[0 if m < lo else 2 if m > hi else 1] += 1
            out[(h, key)] = counts
            print(f"| {h} / {key.split(':', 1)[-1]} | {len(rs)} | {counts[0]} | {counts[1]} | {counts[2]} |")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
