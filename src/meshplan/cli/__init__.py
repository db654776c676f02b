"""meshplan's command line: `meshplan model|hardware|roofline|collective|matmul|train|serve|verify|...`."""

from meshplan.cli import commands  # noqa: E402,F401  (registers the commands)
from meshplan.cli.app import app, main

__all__ = ["app", "main"]
