"""One error type for bad input. The CLI prints it as one `error:` line and exits with code 2."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class MeshplanError(ValueError):
    """A user-facing error: bad input, an unknown name, a layout that cannot work."""


class InfeasibleError(MeshplanError):
    """A layout or configuration that cannot run (does not fit, does not divide)."""


def close_matches(name: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """The closest known names to `name` (difflib ratio), best first."""
    choices = list(choices)
    lowered = {c.lower(): c for c in choices}
    hits = difflib.get_close_matches(name.lower(), list(lowered), n=n, cutoff=0.4)
    # A name that contains the query (e.g. "70b" in "llama3-70b") is also a good suggestion.
    hits += [c for c in lowered if name.lower() in c and c not in hits]
    return [lowered[h] for h in hits[:n]]


def unknown_name_error(kind: str, name: str, choices: Iterable[str]) -> MeshplanError:
    """`unknown model 'llama3-7b' (did you mean: llama3-8b, llama3-70b?)`."""
    choices = sorted(choices)
    near = close_matches(name, choices)
    hint = f" (did you mean: {', '.join(near)}?)" if near else f" (known: {', '.join(choices)})"
    return MeshplanError(f"unknown {kind} '{name}'{hint}")
