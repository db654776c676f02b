"""Imports every command module so each registers its commands on the one app."""

from meshplan.cli import (
    basic,  # noqa: F401
    calibrate,  # noqa: F401
    net,  # noqa: F401
    serve,  # noqa: F401
    train,  # noqa: F401
    verify,  # noqa: F401
    web,  # noqa: F401
)
