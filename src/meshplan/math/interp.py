"""Interpolation on measured curves (collective efficiency by message size, kernel rates by parallel work)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def log_interp(pts: Sequence[Sequence[float]], x: float) -> float:
    """y at `x` on measured [x, y] points sorted by x: linear in log(x) between neighbours, clamped outside."""
    (x0, y0), (x1, y1) = pts[0], pts[-1]
    if x <= x0:
        return float(y0)
    if x >= x1:
        return float(y1)
    for (xa, ya), (xb, yb) in zip(pts, pts[1:], strict=False):
        if xa <= x <= xb:
            return float(ya + math.log(x / xa) / math.log(xb / xa) * (yb - ya))
    return float(y1)
