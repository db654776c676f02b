"""A layout: how one training step is split over a mesh (STYLE.md §3: a plan is a rules table plus a
mesh shape). Pure Python; importing this module does not import JAX.

Mesh axes (book ch.5 names in brackets): `data` [X, pure data parallel], `fsdp` [ZeRO-3 / FSDP], `expert`
[EP; also a batch axis outside the experts], `context` [CP], `tensor` [Megatron TP, with sequence
parallelism], `stage` [PP]. Devices = dp·fsdp·ep·cp·tp·pp.

`microbatch` is the planner's: sequences per micro-batch per batch shard (dp·fsdp·ep), so a step runs
n_micro = B / (dp·fsdp·ep·microbatch) micro-batches (train/costmodel.py `n_micro`); 0 means one micro-batch of
the whole per-shard batch. `zero` 1/2 shard the AdamW state (and, for 2, the accumulated gradients) over
`data`; `zero` 3 is FSDP over the data ranks (`resolved()` moves dp into fsdp). `cp_impl` picks the CP form:
"allgather" (K/V all-gathered over `context`) or "ring" (K/V blocks passed round the ring by
collective-permute). `ep_in_fsdp` carves the expert ranks out of the FSDP group instead of the replicas (torchtitan's
FSDP+EP: ep = dp_shard_in_ep): the dense weights' `embed` dim is sharded over `fsdp` and `expert` together, the
experts' (`expert_embed`) over `fsdp` alone (dp_shard_mod_ep), so a plan's fsdp is the mesh's fsdp·ep.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from meshplan.errors import MeshplanError
from meshplan.math.transformer import RECOMPUTE_POLICIES

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor", "stage")
_AXIS_OF = {"data": "dp", "fsdp": "fsdp", "expert": "ep", "context": "cp", "tensor": "tp", "stage": "pp"}

# Logical dims of weights and activations. Weights use the bare names; activations the `act_` ones, so
# that FSDP shards a weight's embed dim without sharding the activations' embed dim.
WEIGHT_DIMS = ("embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "expert", "expert_embed", "layers")
CP_IMPLS = ("allgather", "ring")
CAPACITY_FACTOR = 1.0  # MoE expert slots per routed token (GShard); 1.0 drops overflow
ACTIVATION_DIMS = ("batch", "seq", "seq_sp", "act_embed", "act_heads", "act_kv_heads", "act_mlp", "act_vocab")


@dataclass(frozen=True)
class Layout:
    """Degrees of each parallelism and the per-device execution policy (book ch.5 notation)."""

    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    pp: int = 1
    microbatch: int = 0
    recompute: str = "none"
    sequence_parallel: bool = True
    zero: int = 0
    offload: float = 0.0
    vpp: int = 1
    cp_impl: str = "allgather"
    ep_in_fsdp: bool = False

    def __post_init__(self) -> None:
        for f in ("dp", "fsdp", "tp", "cp", "ep", "pp", "microbatch", "vpp"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if f == "microbatch" else 1):
                raise MeshplanError(f"layout: {f} must be a positive integer, got {v!r}")
        if self.cp_impl not in CP_IMPLS:
            raise MeshplanError(f"layout: unknown cp_impl '{self.cp_impl}' (known: {', '.join(CP_IMPLS)})")
        if self.recompute not in RECOMPUTE_POLICIES:
            raise MeshplanError(f"layout: unknown recompute policy '{self.recompute}' "
                                f"(known: {', '.join(RECOMPUTE_POLICIES)})")
        if self.zero not in (0, 1, 2, 3):
            raise MeshplanError(f"layout: zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if not isinstance(self.ep_in_fsdp, bool):
            raise MeshplanError(f"layout: ep_in_fsdp must be true or false, got {self.ep_in_fsdp!r}")

    @property
    def devices(self) -> int:
        return self.dp * self.fsdp * self.ep * self.cp * self.tp * self.pp

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Mesh axis → size, in MESH_AXES order (size-1 axes included, so every rule resolves)."""
        return {axis: getattr(self, _AXIS_OF[axis]) for axis in MESH_AXES}

    @property
    def batch_shards(self) -> int:
        """Ways the batch is split: every axis but context, tensor and stage carries different sequences."""
        return self.dp * self.fsdp * self.ep

    def n_micro(self, global_batch: int) -> int:
        """Micro-batches per step: B / (batch shards · microbatch); 1 when microbatch is 0 (whole batch)."""
        if not self.microbatch:
            return 1
        return max(1, global_batch // (self.batch_shards * self.microbatch))

    def resolved(self) -> Layout:
        """The layout the program builds: ZeRO-3 over the data ranks is FSDP (the data ranks join `fsdp`)."""
        if self.zero != 3:
            return self
        return replace(self, fsdp=self.fsdp * self.dp, dp=1, zero=0)

    @property
    def zero_axes(self) -> tuple[str, ...]:
        """Mesh axes ZeRO-1/2 shard the optimizer (and ZeRO-2 the gradients) over: the gradient replicas, `data`, the
        expert ranks (replicas of the dense weights; an expert weight, already split over `expert`, is sharded over
        the others only) and, without FSDP, `context` (CP ranks hold the same weights: Megatron's distributed
        optimizer shards over the data-parallel-with-context group; the ledger's `replicas` and `_replica_axes`,
        train/costmodel.py)."""
        fsdp = self.fsdp > 1 or (self.ep_in_fsdp and self.ep > 1)  # `expert` is then in the FSDP group
        return tuple(a for a, n in (("data", self.dp), ("expert", 1 if self.ep_in_fsdp else self.ep),
                                    ("context", 1 if fsdp else self.cp)) if n > 1)

    @property
    def sp(self) -> bool:
        """Sequence parallelism is in effect (it only means something with tp > 1)."""
        return self.sequence_parallel and self.tp > 1

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_config(cls, obj: Any, devices: int | None = None) -> Layout:
        """Read a planner config duck-typed (attributes dp, fsdp, tp, pp, vpp, cp, ep, microbatch, recompute, zero,
        offload, cp_impl). Where the planner counts EP inside the data-parallel ranks (dp·fsdp·tp·cp·pp =
        devices), `ep` is carved out of them here, because this mesh gives experts their own axis: out of dp where
        ep divides it (the planner's `_carved`, Megatron-Core's expert ranks), else out of fsdp where ep divides that
        (`ep_in_fsdp`: the planner's `ep_fsdp`, torchtitan's dp_shard_in_ep); an EP group across both is refused."""
        names = {f.name for f in fields(cls)}
        kw = {n: getattr(obj, n) for n in names if getattr(obj, n, None) is not None}
        if isinstance(obj, dict):
            kw = {n: obj[n] for n in names if obj.get(n) is not None}
        layout = cls(**kw)
        ep = layout.ep
        if devices and ep > 1 and layout.devices != devices and layout.devices // ep == devices:
            if layout.dp % ep == 0:
                layout = cls(**{**kw, "dp": layout.dp // ep})
            elif layout.fsdp % ep == 0:
                layout = cls(**{**kw, "fsdp": layout.fsdp // ep, "ep_in_fsdp": True})
            else:
                raise MeshplanError(
                    f"layout: the plan's ep={ep} cannot be built: the mesh carves the expert axis out of the replicas "
                    f"(ep | dp) or out of the FSDP group (ep | fsdp), and ep divides neither dp={layout.dp} nor "
                    f"fsdp={layout.fsdp} (the planner counts the expert ranks inside tp·cp·dp·fsdp = "
                    f"{layout.tp * layout.cp * layout.dp * layout.fsdp})"
                    + ("; nor does the reference MoE build tp or cp" if layout.tp * layout.cp > 1 else ""))
        return layout


def logical_rules(layout: Layout) -> dict[str, tuple[str, ...]]:
    """The rules table: logical dim name → mesh axes it is sharded over (empty tuple: replicated).

    FSDP shards weights on `embed`; TP shards heads, KV heads (when K divides by tp), MLP width and vocab;
    the batch goes over every data-like axis; the sequence over `context`, and, between blocks under
    sequence parallelism, over `context` and `tensor` (Korthikanti et al. 2022 §4.2.2)."""

    def on(axis: str) -> tuple[str, ...]:
        return (axis,) if layout.mesh_shape[axis] > 1 else ()

    batch = on("data") + on("fsdp") + on("expert")
    tensor = on("tensor")
    return {
        "batch": batch,
        "seq": on("context"),
        "seq_sp": on("context") + (tensor if layout.sequence_parallel else ()),
        "act_embed": (),
        "act_heads": tensor,
        "act_kv_heads": tensor,
        "act_mlp": tensor,
        "act_vocab": tensor,
        "embed": on("fsdp") + (on("expert") if layout.ep_in_fsdp else ()),
        "expert_embed": on("fsdp"),
        "heads": tensor,
        "kv_heads": tensor,
        "head_dim": (),
        "mlp": tensor,
        "vocab": tensor,
        "expert": on("expert"),
        "layers": on("stage"),
    }


def describe(layout: Layout) -> str:
    """`dp=2 fsdp=4 tp=1 ...` with only the axes in use, e.g. for table titles."""
    parts = [f"{k}={v}" for k, v in (("dp", layout.dp), ("fsdp", layout.fsdp), ("tp", layout.tp),
                                    ("cp", layout.cp), ("ep", layout.ep), ("pp", layout.pp)) if v > 1]
    parts += ["ep in fsdp"] if layout.ep_in_fsdp and layout.ep > 1 else []
    parts += [f"zero={layout.zero}"] if layout.zero else []
    parts += [f"mb={layout.microbatch}"] if layout.microbatch else []
    parts += ["cp=ring"] if layout.cp > 1 and layout.cp_impl == "ring" else []
    sp = " +SP" if layout.sp else ""
    return (" ".join(parts) or "single device") + sp + f", recompute={layout.recompute}"


def moe_capacity(model: Any, seq_len: int) -> int:
    """Slots per expert per sequence: capacity factor × T·k/E (GShard; one routing group per sequence, so the
    routing does not depend on the layout and the sharded loss equals the unsharded one)."""
    return max(1, math.ceil(CAPACITY_FACTOR * seq_len * model.experts_per_token / model.n_experts))
