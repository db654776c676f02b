"""Shared fixtures: the reference data beside the project (../shared/reference) and the CLI runner."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import yaml

# The reference files live beside the project root (…/shared/reference); a copy inside the project
# (tests/reference) is used when present, so a standalone clone can run the tests too.
_CANDIDATES = [Path(__file__).resolve().parents[1].parent / "shared" / "reference",
               Path(__file__).resolve().parent / "reference"]
if os.environ.get("MESHPLAN_REFERENCE_DIR"):
    _CANDIDATES.insert(0, Path(os.environ["MESHPLAN_REFERENCE_DIR"]))
REF_DIR = next((p for p in _CANDIDATES if (p / "scaling_book_problems.yaml").is_file()), None)


def load_reference(name: str):
    if REF_DIR is None:
        pytest.skip("shared/reference is not beside the project (set MESHPLAN_REFERENCE_DIR)")
    return yaml.safe_load((REF_DIR / name).read_text())


def book_problems() -> dict[str, dict]:
    """id -> problem from scaling_book_problems.yaml (empty when the file is absent)."""
    if REF_DIR is None:
        return {}
    data = yaml.safe_load((REF_DIR / "scaling_book_problems.yaml").read_text())
    return {p["id"]: p for p in data["problems"]}


def answer(problem: dict, name: str) -> dict:
    """The named answer entry of a problem."""
    for a in problem["answers"]:
        if a["name"] == name:
            return a
    raise KeyError(f"{problem['id']} has no answer '{name}'")


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    """Run the real entry point; returns (exit code, stdout, stderr)."""
    from meshplan.cli.app import main

    with pytest.raises(SystemExit) as exc:
        main(args)
    out = capsys.readouterr()
    return int(exc.value.code or 0), out.out, out.err


def split_by_rule(source_key: str) -> str:
    """issue #14's frozen split, computed here apart from benchmarks/_split.py: the first 8 hex digits of the source
    key's SHA-256, even -> validation, odd -> tuning."""
    return "validation" if int(hashlib.sha256(source_key.encode()).hexdigest()[:8], 16) % 2 == 0 else "tuning"

