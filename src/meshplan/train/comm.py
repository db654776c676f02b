"""Collective times for arrays of layouts.

The planner asks `cost.collectives.group_collective` once per distinct (kind, group size, stride) and
models each as latency + bytes × seconds-per-byte (the α-β model; Hockney 1994), which is exact for the
bandwidth term of every ring/tree algorithm there and keeps the search vectorised.
"""

from __future__ import annotations

import numpy as np

from meshplan.cost.collectives import group_collective
from meshplan.cost.topology import make_cluster
from meshplan.errors import MeshplanError
from meshplan.specs.hardware import Chip

_REF_BYTES = 1.0e9


class CommModel:
    """Vectorised collective times on one cluster."""

    def __init__(self, chip: Chip, chips: int, slice_shape: tuple[int, ...] | None = None):
        self.cluster = make_cluster(chip, chips, slice_shape)
        self._coef: dict[tuple[str, int, int], tuple[float, float]] = {}

    def _alpha_beta(self, kind: str, size: int, stride: int) -> tuple[float, float]:
        key = (kind, size, stride)
        if key not in self._coef:
            try:
                c = group_collective(kind, _REF_BYTES, self.cluster, size, stride)
                self._coef[key] = (c.latency_time_s, c.bandwidth_time_s / _REF_BYTES)
            except MeshplanError:  # the group does not map onto the topology: the layout is infeasible
                self._coef[key] = (np.inf, np.inf)
        return self._coef[key]

    def time(self, kind: str, nbytes: np.ndarray, size: np.ndarray, stride: np.ndarray) -> np.ndarray:
        """Seconds for `kind` over groups of `size` chips `stride` apart moving `nbytes` (full array)."""
        nbytes, size, stride = np.broadcast_arrays(np.asarray(nbytes, float), np.asarray(size), np.asarray(stride))
        # one key per (size, stride) pair: 1-D unique is far faster than unique over rows
        key = size.ravel().astype(np.int64) * (1 << 32) + stride.ravel().astype(np.int64)
        uniq, inv = np.unique(key, return_inverse=True)
        alpha = np.zeros(len(uniq))
        beta = np.zeros(len(uniq))
        for i, k in enumerate(uniq):
            g, s = int(k >> 32), int(k & 0xFFFFFFFF)
            if g > 1:
                alpha[i], beta[i] = self._alpha_beta(kind, g, s)
        out = alpha[inv] + nbytes.ravel() * beta[inv]
        return np.where(size.ravel() > 1, out, 0.0).reshape(nbytes.shape)
