"""Predicted vs measured training throughput for every run in training_measurements.yaml.

Each run is evaluated at exactly its published layout (every published degree pinned; what the source
omits is chosen by meshplan). Compared like with like (flops_conventions.md): step time, tokens/s per chip
(no FLOP convention needed). Also runs meshplan's own search at the same chips, batch and sequence length
and checks it finds a layout at least as good as the published one under meshplan's own model.

    python benchmarks/accuracy.py [--group NAME] [--no-search] [--no-new]

After the reference set, the same evaluation runs over the new published runs of issue #14
(data/training_measurements_new.yaml), reported per frozen half (validation / tuning, split by source:
_split.py) and per family. Sign convention, as everywhere in this script: error = predicted step time / measured
step time - 1, so a NEGATIVE error is a prediction FASTER than the measured run (optimistic).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace

from _measurements import (
    _source_key,
    harness_notes,
    load_entries,
    measured_memory_bytes,
    measured_step_time_s,
    options_of,
    pins_of,
    problem_of,
)
from _split import SPLITS, error_stats, format_stats_row, load_new_training

from meshplan.cost.efficiency import default_efficiency
from meshplan.errors import MeshplanError
from meshplan.train.planner import plan
from meshplan.train.space import Pins

GPU_D_HALF = 256.0  # efficiency.yaml matmul_half_dim for `gpu` (Ampere/Hopper tiles)


def evaluate_entry(e: dict, search: bool = True, d_half_gpu: float | None = None) -> dict:
    prob, pins, opts = problem_of(e), pins_of(e), options_of(e)
    eff = default_efficiency(prob.chip)
    if d_half_gpu is not None and prob.chip.kind == "gpu" and eff.matmul_half_dim == GPU_D_HALF:
        eff = replace(eff, matmul_half_dim=d_half_gpu)  # sensitivity study of the one shape constant
    row = {"id": e["id"], "group": e["group"], "measured_step_s": measured_step_time_s(e)}
    best, fits, note = _plan_published(prob, pins, eff, opts)
    row.update(pred_step_s=best["step_time_s"], fits=fits, layout=_short(best["config"]),
               bottleneck=best["bottleneck"], mfu=best["mfu"], note=note)
    row["pred_mem_bytes"] = best["memory_bytes_per_chip"]["total"]
    row["params_note"] = "; ".join(n for n in (_params_note(e, prob), *harness_notes(e)) if n)
    row["measured_mem_bytes"] = measured_memory_bytes(e)
    row["rel_err"] = row["pred_step_s"] / row["measured_step_s"] - 1
    tokens = prob.global_batch * prob.seq_len
    row["measured_tok_s_chip"] = tokens / row["measured_step_s"] / prob.chips
    row["pred_tok_s_chip"] = tokens / row["pred_step_s"] / prob.chips
    if search:
        free = Pins(sequence_parallel=pins.sequence_parallel, offload=0.0, offload_optimizer=0, offload_params=0)
        try:
            own = plan(prob, free, eff, opts, top=1).plans[0]
            row["search_step_s"] = own["step_time_s"]
            row["search_layout"] = _short(own["config"])
        except MeshplanError:
            row["search_step_s"] = float("nan")
    return row


def _params_note(e: dict, prob) -> str:
    """Where the source prints a parameter count that meshplan's reading of the architecture misses by more
    than 10% (an attention or MoE variant the schema cannot express), say so next to the row."""
    from meshplan.math.transformer import param_counts

    pc = param_counts(prob.model)
    notes = []
    for key, ours in (("params_b", pc.total), ("active_params_b", pc.active)):
        published = (e.get("model") or {}).get(key)
        if isinstance(published, (int, float)) and published > 0 and abs(ours / (published * 1e9) - 1) > 0.10:
            notes.append(f"{key} {ours / 1e9:.0f}B vs published {published:g}B")
    return "; ".join(notes)


def _plan_published(prob, pins: Pins, eff, opts) -> tuple[dict, bool, str]:
    """The published layout's plan, whether it fits meshplan's memory model, and what had to give.

    A layout that does not fit is still timed (without the memory limit). Where a printed degree breaks one
    of meshplan's divisibility rules (a micro-batch that does not divide the per-replica batch, virtual
    stages that do not divide the layers), that degree is released for meshplan to choose, and the row
    says so."""
    try:
        return plan(prob, pins, eff, opts, top=1).plans[0], True, ""
    except MeshplanError as exc:
        first = str(exc)
    try:
        return plan(prob, pins, eff, _no_memory_limit(opts), top=1).plans[0], False, "does not fit"
    except MeshplanError:
        pass
    for freed in (("microbatch",), ("microbatch", "vpp"), ("microbatch", "vpp", "zero"),
                  ("microbatch", "vpp", "zero", "recompute")):
        try:
            relaxed = replace(pins, **dict.fromkeys(freed))
            best = plan(prob, relaxed, eff, _no_memory_limit(opts), top=1).plans[0]
            return best, bool(best["fits"]), f"released {'/'.join(freed)}: {first[:60]}"
        except MeshplanError:
            continue
    raise MeshplanError(first)


def _no_memory_limit(opts):
    return replace(opts, headroom=-1e6)


def _short(c: dict) -> str:
    keys = ("dp", "fsdp", "tp", "pp", "vpp", "cp", "ep")
    s = " ".join(f"{k}{c[k]}" for k in keys if c[k] > 1)
    return f"{s} mb{c['microbatch']} {c['recompute']}" + (f" z{c['zero']}" if c["zero"] else "")


def summarize(rows: list[dict]) -> None:
    groups = sorted({r["group"] for r in rows})
    print(f"\n{'group':34s} {'n':>3s} {'median |err|':>13s} {'worst |err|':>12s} {'within 25%':>11s}")
    for g in groups + ["ALL"]:
        errs = [abs(r["rel_err"]) for r in rows if g == "ALL" or r["group"] == g]
        within = sum(e <= 0.25 for e in errs)
        print(f"{g:34s} {len(errs):3d} {statistics.median(errs):13.1%} {max(errs):12.1%} {within:>7d}/{len(errs)}")


def memory_table(rows: list[dict]) -> None:
    """Predicted memory per chip against the peak the source reports, where it reports one."""
    with_mem = [r for r in rows if r.get("measured_mem_bytes")]
    if not with_mem:
        return
    gib = 2**30
    print(f"\n{'id':46s} {'meas GiB':>9s} {'pred GiB':>9s} {'err':>7s}")
    for r in with_mem:
        err = r["pred_mem_bytes"] / r["measured_mem_bytes"] - 1
        r["mem_rel_err"] = err
        print(f"{r['id'][:46]:46s} {r['measured_mem_bytes'] / gib:9.1f} {r['pred_mem_bytes'] / gib:9.1f} {err:+7.1%}")
    errs = sorted(abs(r["mem_rel_err"]) for r in with_mem)
    print(f"memory: {len(errs)} runs, median |err| {statistics.median(errs):.1%}, worst {errs[-1]:.1%}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group")
    ap.add_argument("--no-search", action="store_true")
    ap.add_argument("--no-new", action="store_true", help="skip the new runs of issue #14 (reference set only)")
    ap.add_argument("--d-half-gpu", type=float, help="replace the Ampere/Hopper GEMM tile constant (sensitivity)")
    ap.add_argument("--tuning-only", action="store_true",
                    help="load only the tuning half of the new data (for choosing constants without seeing validation)")
    args = ap.parse_args(argv)
    if args.tuning_only:
        os.environ["MESHPLAN_TUNING_ONLY"] = "1"  # read by _split's loaders
    everything = load_entries()
    entries = [e for e in everything if not args.group or e.get("group") == args.group]
    if not entries:
        known = sorted({str(e.get("group")) for e in everything})
        ap.error(f"no run in group {args.group!r}; the groups are: {', '.join(known)}")
    t0 = time.perf_counter()
    rows, skipped = [], []
    for e in entries:
        try:
            rows.append(evaluate_entry(e, search=not args.no_search, d_half_gpu=args.d_half_gpu))
        except Exception as exc:  # an entry meshplan cannot read or place is reported, never silently dropped
            why = f"the entry has no {exc} field" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
            skipped.append((e.get("id", "?"), why))
    print(f"{'id':46s} {'meas s':>8s} {'pred s':>8s} {'err':>7s} {'tok/s/chip m/p':>15s} {'fit':>4s}  "
          f"{'search s':>8s}  layout / bottleneck")
    for r in rows:
        srch = r.get("search_step_s", float("nan"))
        flag = "" if not (srch == srch) or not r["fits"] or srch <= r["pred_step_s"] * 1.0001 else " SEARCH-WORSE"
        print(f"{r['id'][:46]:46s} {r['measured_step_s']:8.3f} {r['pred_step_s']:8.3f} {r['rel_err']:+7.1%} "
              f"{r['measured_tok_s_chip']:7.0f}/{r['pred_tok_s_chip']:<7.0f} {'y' if r['fits'] else 'N':>4s}  "
              f"{srch:8.3f}  {r['layout']} / {r['bottleneck']}{flag}"
              + (f"  [{r['note']}]" if r.get("note", "").startswith("released") else "")
              + (f"  [{r['params_note']}]" if r.get("params_note") else ""))
    summarize(rows)
    memory_table(rows)
    for ident, why in skipped:
        print(f"SKIPPED {ident}: {why[:160]}")
    if skipped:
        print(f"{len(skipped)} of {len(entries)} entries could not be evaluated (listed above)")
    print(f"\n{len(rows)} runs in {time.perf_counter() - t0:.1f} s")
    if not args.no_new and not args.group:
        ref = error_stats([r["rel_err"] for r in rows])
        new_data_report(ref, len(skipped), d_half_gpu=args.d_half_gpu)
    return 0


def evaluate_all(entries: list[dict], d_half_gpu: float | None = None) -> tuple[list[dict], list[tuple[dict, str]]]:
    """Rows for every entry meshplan can plan at its published layout, and (entry, reason) for the others."""
    rows, unplannable = [], []
    for e in entries:
        try:
            row = evaluate_entry(e, search=False, d_half_gpu=d_half_gpu)
            row["split"], row["families"] = e.get("split"), e.get("families") or []
            row["source_key"] = _source_key(e)
            rows.append(row)
        except Exception as exc:  # reported with its reason, never dropped
            unplannable.append((e, f"{type(exc).__name__}: {exc}"))
    return rows, unplannable


SOURCE_FLAGS = ("known_regression",)


def source_flagged(entries: list[dict]) -> tuple[list[dict], list[dict]]:
    """(entries in the statistics, entries their source marks as not the software's normal performance: `source_flag`
    of a known kind, training_measurements_new.yaml header). An unknown kind is an error, not a silent exclusion."""
    kept, flagged = [], []
    for e in entries:
        flag = e.get("source_flag")
        if flag is None:
            kept.append(e)
        elif flag.get("kind") in SOURCE_FLAGS and flag.get("text"):
            flagged.append(e)
        else:
            raise ValueError(f"{e.get('id')}: source_flag needs a kind of {SOURCE_FLAGS} and the source's text")
    return kept, flagged


def new_data_report(ref: dict, ref_unplannable: int, d_half_gpu: float | None = None) -> dict:
    """Issue #14's tables: the reference set and each half of the new runs (median |err|, p90, signed median,
    within 25%, unplannable, predicted-faster count), then each half per family and per source; then every new row; then the rows
    their source flags (source_flagged), apart and outside every statistic."""
    entries, flagged = source_flagged(load_new_training())
    rows, unplannable = evaluate_all(entries, d_half_gpu)
    head = ("| set | n planned | median abs err | p90 abs err | signed median | within 25% | unplannable | "
            "predicted faster | layout does not fit |")
    print("\n## Issue #14: new published runs (step-time error = predicted / measured - 1; negative = predicted faster)")
    print(head)
    print("|" + "---|" * 9)
    print(format_stats_row("reference (shared/reference)", ref, ref_unplannable) + " - | - |")
    report = {"reference": ref}
    for half in SPLITS:
        hr = [r for r in rows if r["split"] == half]
        s = error_stats([r["rel_err"] for r in hr])
        un = sum(e.get("split") == half for e, _ in unplannable)
        faster = sum(r["rel_err"] < 0 for r in hr)
        nofit = sum(not r["fits"] for r in hr)
        report[half] = dict(s, unplannable=un, faster=faster, no_fit=nofit)
        print(format_stats_row(f"new: {half}", s, un) + f" {faster}/{len(hr)} | {nofit} |")
    print("\n| half / family | n planned | median abs err | p90 abs err | signed median | within 25% | unplannable |")
    print("|" + "---|" * 7)
    fams = sorted({f for e in entries for f in e.get("families") or []})
    for half in SPLITS:
        for fam in fams:
            hr = [r for r in rows if r["split"] == half and fam in r["families"]]
            un = sum(e.get("split") == half and fam in (e.get("families") or []) for e, _ in unplannable)
            if hr or un:
                print(format_stats_row(f"{half} / {fam}", error_stats([r["rel_err"] for r in hr]), un))
    # per source (the split's unit: one publication table), so a family's figure can be traced to the tables behind it
    print("\n| half / source | n planned | median abs err | p90 abs err | signed median | within 25% | unplannable |")
    print("|" + "---|" * 7)
    for half in SPLITS:
        for src in sorted({_source_key(e) for e in entries if e.get("split") == half}):
            hr = [r for r in rows if r["split"] == half and r["source_key"] == src]
            un = sum(e.get("split") == half and _source_key(e) == src for e, _ in unplannable)
            print(format_stats_row(f"{half} / {src}", error_stats([r["rel_err"] for r in hr]), un))
    print(f"\n{'id':52s} {'split':10s} {'meas s':>8s} {'pred s':>8s} {'err':>7s} {'fit':>4s}  layout / bottleneck")
    for r in rows:
        print(f"{r['id'][:52]:52s} {r['split']:10s} {r['measured_step_s']:8.3f} {r['pred_step_s']:8.3f} "
              f"{r['rel_err']:+7.1%} {'y' if r['fits'] else 'N':>4s}  {r['layout']} / {r['bottleneck']}"
              + (f"  [{r['note']}]" if r.get("note") else ""))
    for e, why in unplannable:
        print(f"UNPLANNABLE {e['id']} ({e.get('split')}): {why[:150]}")
    if flagged:
        frows, funplannable = evaluate_all(flagged, d_half_gpu)
        print(f"\n{len(flagged)} row(s) flagged by their source, outside every statistic above:")
        for r in frows:
            e = next(x for x in flagged if x["id"] == r["id"])
            print(f"FLAGGED {r['id']} ({r['split']}): measured {r['measured_step_s']:.3f} s, predicted "
                  f"{r['pred_step_s']:.3f} s ({r['rel_err']:+.1%}); {e['source_flag']['kind']}: "
                  f"{' '.join(e['source_flag']['text'].split())}")
        for e, why in funplannable:
            print(f"FLAGGED {e['id']} ({e.get('split')}), unplannable: {why[:150]}")
    report["source_flagged"] = [e["id"] for e in flagged]
    return report


if __name__ == "__main__":
    sys.exit(main())
