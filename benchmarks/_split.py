"""The frozen split of the new ground truth (issue #14): half of the new published runs, chosen BY SOURCE, is held
out as validation and never used to choose a constant; the other half ("tuning") is where new constants may be
chosen.

Rule (fixed before any prediction was compared with these data): an entry's split is decided by its
`source.key` (one publication table, e.g. 'megatron-bridge-perf:qwen3-235b-a22b'): the SHA-256 of the key, read
as hex; if its first 8 hex digits are an even number the source is `validation`, otherwise `tuning`. The rule
looks at the key alone, so adding a source never moves another, and every row of one source lands in one half.
Each entry also carries the resulting `split:` field, so the data file says it on its own; tests check the two
agree.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import math
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import yaml

DATA = Path(__file__).resolve().parent / "data"
NEW_TRAINING = DATA / "training_measurements_new.yaml"
NEW_SERVING = DATA / "serving_measurements_new.yaml"
SPLITS = ("validation", "tuning")


def split_of(source_key: str) -> str:
    """'validation' or 'tuning' for a source key (the rule in the module docstring)."""
    return "validation" if int(hashlib.sha256(source_key.encode()).hexdigest()[:8], 16) % 2 == 0 else "tuning"


# Set by --tuning-only (both accuracy scripts): the validation half is not even loaded, so that whoever chooses a
# constant sees only the tuning half's rows and aggregates (issue #14: "a split you do not fit on").
TUNING_ONLY_ENV = "MESHPLAN_TUNING_ONLY"


def _visible(entries: list[dict]) -> list[dict]:
    if os.environ.get(TUNING_ONLY_ENV) == "1":
        return [e for e in entries if e.get("split") == "tuning"]
    return entries


def load_new_training() -> list[dict]:
    entries = yaml.safe_load(NEW_TRAINING.read_text()) or []
    for e in entries:
        e.setdefault("group", "ungrouped")
    return _visible(entries)


def load_new_serving() -> list[dict]:
    return _visible(yaml.safe_load(NEW_SERVING.read_text())["measurements"])


def error_stats(errs: list[float]) -> dict:
    """Median |error|, 90th percentile of |error| (nearest rank), signed median, and the count within 25%.
    Errors are predicted / measured - 1 of the quantity compared (see each script for its sign convention)."""
    if not errs:
        return {"n": 0, "median_abs": None, "p90_abs": None, "signed_median": None, "within_25": 0}
    a = sorted(abs(x) for x in errs)
    rank = max(math.ceil(0.9 * len(a)), 1)  # nearest-rank 90th percentile
    return {"n": len(errs), "median_abs": statistics.median(a), "p90_abs": a[rank - 1],
            "signed_median": statistics.median(errs), "within_25": sum(x <= 0.25 for x in a)}


def format_stats_row(label: str, s: dict, unplannable: int | None = None) -> str:
    """One markdown table row: label | n | median |err| | p90 |err| | signed median | within 25% [| unplannable]."""
    def pct(v: float | None, signed: bool = False) -> str:
        return "-" if v is None else (f"{v * 100:+.1f}%" if signed else f"{v * 100:.1f}%")
    un = "" if unplannable is None else f" {unplannable} |"
    return (f"| {label} | {s['n']} | {pct(s['median_abs'])} | {pct(s['p90_abs'])} | {pct(s['signed_median'], True)} | "
            f"{s['within_25']}/{s['n']} |{un}")


# The external checks' subsets (aic_silicon.py, nim_dli.py): a CSV of closed-loop runs, each row carrying its source
# key and split, written and read the same way.
def repeat_id(seen: dict[str, int], rid: str) -> str:
    """A configuration measured again keeps each measurement: the first as `rid`, then `rid`_r2, _r3, ..."""
    seen[rid] = seen.get(rid, 0) + 1
    return rid if seen[rid] == 1 else f"{rid}_r{seen[rid]}"


def write_subset_csv(path: Path, header: str, fields: tuple[str, ...], rows: list[dict]) -> None:
    """A subset's `#` comment header (its source and how each column maps from it), then its rows."""
    with path.open("w", newline="") as f:
        f.write(header)
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def read_subset_csv(path: Path) -> list[dict]:
    """A subset's rows (its `#` comment lines skipped); a row whose split is not the rule's for its source key is
    refused."""
    with path.open() as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    for r in rows:
        if r["split"] != split_of(r["source_key"]):
            raise ValueError(f"{r['id']}: split {r['split']} is not the rule's for {r['source_key']}")
    return rows


def closed_loop_entry(r: dict, *, families: list[str], source: dict, engine: str, measured: dict, notes: str,
                      **extra) -> dict:
    """A subset row as a serving_measurements_new.yaml entry (serving_accuracy.predict reads it unchanged): one engine
    over the row's tp GPUs, a closed loop of its `concurrency` clients at its fixed lengths, KV dtype unstated;
    `extra` adds the source's own keys (ep, frontend, benchmark_requests, ...)."""
    tp = int(r["tp"])
    return {"id": r["id"], "split": r["split"], "families": families, "source": source, "model": r["model"],
            "hardware": r["hardware"], "chips": tp, "tp": tp, "pp": 1, "weight_dtype": r["weight_dtype"],
            "kv_dtype": None, "input_len": int(r["input_len"]), "output_len": int(r["output_len"]),
            "batch": int(r["concurrency"]), "regime": "fixed_batch", "engine": engine, **extra, "measured": measured,
            "notes": notes}



def import_main(argv: list[str] | None, doc: str, upstream_help: str, select: Callable[[Path], list[dict]],
                write_subset: Callable[[list[dict]], None], subset: Path) -> int:
    """An external check's importer command (aic_silicon.py, nim_dli.py): `--upstream FILE`, the rows its rules keep
    (`select`) written to its committed subset (`write_subset`, to `subset`)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--upstream", type=Path, required=True, help=upstream_help)
    rows = select(ap.parse_args(argv).upstream)
    write_subset(rows)
    print(f"{len(rows)} rows -> {subset}")
    return 0
