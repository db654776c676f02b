"""Imports every command module so each registers its commands on the one app."""

from meshplan.cli import basic  # noqa: F401
from meshplan.cli import train  # noqa: F401
from meshplan.cli import net  # noqa: F401
