"""Collective times for arrays of layouts.

The planner asks `cost.collectives.group_collective` once per distinct (kind, group size, stride) and
models each as latency + bytes × seconds-per-byte (the α-β model; Hockney 1994), which is exact for the
bandwidth term of every ring/tree algorithm there and keeps the search vectorised.
"""

from __future__ import annotations

import numpy as np

from meshplan.cost.collectives import group_collective
from meshplan.cost.topology import make_cluster
from meshplan.specs.hardware import Chip

_REF_BYTES = 1.0e9


class CommModel:
    """Vectorised collective times on one cluster."""

    def __init__(self, chip: Chip, chips: int):
        self.cluster = make_cluster(chip, chips)
        self._coef: dict[tuple[str, int, int], tuple[float, float]] = {}

    def _alpha_beta(self, kind: str, size: int, stride: int) -> tuple[float, float]:
        key = (kind, size, stride)
        if key not in self._coef:
            c = group_collective(kind, _REF_BYTES, self.cluster, size, stride)
            self._coef[key] = (c.latency_time_s, c.bandwidth_time_s / _REF_BYTES)
        return self._coef[key]

    def time(self, kind: str, nbytes: np.ndarray, size: np.ndarray, stride: np.ndarray) -> np.ndarray:
        """Seconds for `kind` over groups of `size` chips `stride` apart moving `nbytes` (full array)."""
        nbytes, size, stride = np.broadcast_arrays(np.asarray(nbytes, float), np.asarray(size), np.asarray(stride))
        out = np.zeros(nbytes.shape)
        pairs = np.stack([size.ravel(), stride.ravel()], axis=1)
        uniq, inv = np.unique(pairs, axis=0, return_inverse=True)
        alpha = np.zeros(len(uniq))
        beta = np.zeros(len(uniq))
        for i, (g, s) in enumerate(uniq):
            if g > 1:
                alpha[i], beta[i] = self._alpha_beta(kind, int(g), int(s))
        inv = inv.ravel()
        out = alpha[inv] + nbytes.ravel() * beta[inv]
        return np.where(size.ravel() > 1, out, 0.0).reshape(nbytes.shape)
