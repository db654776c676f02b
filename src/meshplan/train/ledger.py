"""The ledger: per device per step, every quantity the training cost model costs (DESIGN.md "One ledger").

FLOPs by kind (`flops/matmul`, `flops/attention`, `flops/other`; hardware FLOPs, recompute included), bytes of
every collective by kind and mesh axes (`all_gather/tensor`, `reduce_scatter/fsdp+context`, `all_to_all/expert`,
`permute/stage`, ...), HBM bytes moved (`hbm`) and memory by category (`memory/params`, ...). Each entry is a
numpy array over the layouts being evaluated; the cost model turns the bytes and FLOPs into seconds.

Byte convention (docs/verify.md; the same as `measure/hlo.py` and `meshplan collective`): one collective
counts the full array X that one device holds on the wide side of it: an all-gather its result, a
reduce-scatter its operand (the unreduced array), an all-reduce, all-to-all and collective-permute their
operand. An all-gather of an array of N bytes over k devices counts N on every device (each sends N(k−1)/k).
Mesh axes are the JAX mesh's names (`measure/layout.py` MESH_AXES), outermost first, size-1 axes left out.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# mesh axis names, outermost first (measure/layout.py MESH_AXES; kept here so the planner imports no JAX code)
AXIS_ORDER = ("data", "fsdp", "expert", "context", "tensor", "stage")
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "permute")
HLO_KIND = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "all_reduce": "all-reduce",
            "all_to_all": "all-to-all", "permute": "collective-permute"}
FLOP_KINDS = ("matmul", "attention", "other")
MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "temp", "total")
HOST_KINDS = ("device_to_host", "host_to_device", "memory")


class Ledger(dict):
    """key → array over layouts (or a scalar broadcast over them); `add` accumulates. `collectives` False: the
    collectives' bytes by mesh axes are not kept (a search ranks by step time and memory, which the cost model
    derives from its own terms; the plans it reports are evaluated again with a full ledger)."""

    collectives: bool = True

    def add(self, key: str, value: Any) -> None:
        self[key] = self.get(key, 0.0) + value

    def flops(self, kind: str, value: Any) -> None:
        self.add(f"flops/{kind}", value)

    def collective(self, kind: str, axes: list[tuple[str, Any]], nbytes: Any) -> None:
        """Add `nbytes` (per device per step, array over layouts) of `kind` over the axes [(name, size)]; each
        layout's key names only its axes of size > 1 (a group of one moves nothing)."""
        assert kind in KINDS, kind
        if not self.collectives:
            return
        names = [a for a, _ in axes]
        sizes = np.broadcast_arrays(*[np.asarray(s, float) for _, s in axes], np.asarray(nbytes, float))
        nbytes = sizes[-1]
        present = np.zeros(nbytes.shape, np.int64)
        for i, s in enumerate(sizes[:-1]):
            present |= (s > 1).astype(np.int64) << i
        for pattern in np.unique(present):
            if pattern == 0:
                continue
            label = "+".join(n for i, n in enumerate(names) if pattern >> i & 1)
            self.add(f"{kind}/{label}", np.where(present == pattern, nbytes, 0.0))

    def collective_keys(self) -> list[str]:
        return [k for k in self if k.split("/")[0] in KINDS]

    def plan(self, i: int) -> dict[str, Any]:
        """The DESIGN.md `ledger` object of layout i: flops, collective_bytes, hbm_bytes, memory_bytes (zero
        collectives left out)."""
        def at(v: Any) -> float:
            a = np.asarray(v, float)
            return float(a if a.ndim == 0 else a.reshape(-1)[i])

        coll = {k: at(self[k]) for k in sorted(self.collective_keys(), key=_order) if at(self[k]) > 0}
        return {"flops": {k: at(self.get(f"flops/{k}", 0.0)) for k in FLOP_KINDS},
                "collective_bytes": coll,
                "hbm_bytes": at(self.get("hbm", 0.0)),
                "memory_bytes": {k: at(self.get(f"memory/{k}", 0.0)) for k in MEMORY_KINDS},
                # over the host link (offload: activations, optimizer state, weights), and what the host holds
                "host_bytes": {k: at(self.get(f"host/{k}", 0.0)) for k in HOST_KINDS}}


def _order(key: str) -> tuple:
    kind, axes = key.split("/", 1)
    return KINDS.index(kind), [AXIS_ORDER.index(a) if a in AXIS_ORDER else 99 for a in axes.split("+")]


def collective_totals(ledger: dict[str, Any]) -> dict[str, float]:
    """A plan ledger's collective bytes summed per HLO kind (`all-gather`, ...), every kind present."""
    out = {HLO_KIND[k]: 0.0 for k in KINDS}
    for key, v in ledger["collective_bytes"].items():
        out[HLO_KIND[key.split("/")[0]]] += v
    return out
