"""Sharded matmuls (book ch.3 §4.2) and collective matmuls (book ch.10; Wang et al., ASPLOS 2023).

Operands are written like `B:data,D:tensor` (dim name, then the mesh axes sharding it, joined by `+`); the
contracting dim is the one name both operands share. The four cases of the book:
  1. no contracting dim sharded: local matmul, no communication;
  2. one operand sharded on it: AllGather that operand, or multiply the local slices and AllReduce /
     ReduceScatter the partial output (cheaper when the output is smaller than the gathered input);
  3. both sharded on it by the same axes: local matmul gives partial sums, then AllReduce / ReduceScatter;
  4. both operands shard a non-contracting dim on the same axis: invalid; AllGather one of them first.
Local compute is `roofline.matmul` at the chip's peak: time = max(T_math, T_mem).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from meshplan.cost import roofline as rf
from meshplan.cost.collectives import CollectiveCost, collective, placement_cost
from meshplan.cost.efficiency import Efficiency, default_efficiency
from meshplan.cost.topology import MeshMapping
from meshplan.errors import MeshplanError
from meshplan.math.transformer import dtype_bytes

Dim = tuple[str, tuple[str, ...]]  # (dim name, mesh axes sharding it)
Operand = tuple[Dim, ...]


def parse_operand(text: str) -> Operand:
    """`B:data,D:tensor+fsdp,F` -> (('B', ('data',)), ('D', ('tensor', 'fsdp')), ('F', ()))."""
    dims: list[Dim] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, _, axes = part.partition(":")
        name = name.strip()
        if not name.isidentifier():
            raise MeshplanError(f"bad dimension name '{name}' in operand '{text}'")
        dims.append((name, tuple(a.strip() for a in axes.split("+") if a.strip())))
    if not dims:
        raise MeshplanError(f"operand '{text}' has no dimensions (write e.g. B:data,D:tensor)")
    return tuple(dims)


def _subscript(axes: tuple[str, ...]) -> str:
    """Mesh axes of one dimension: the book's B_XY where every axis is one letter, else B_{data,tensor} (session 23,
    QA finding: B_datatensor read as one axis)."""
    if not axes:
        return ""
    if len(axes) == 1 or all(len(a) == 1 for a in axes):
        return "_" + "".join(axes)
    return "_{" + ",".join(axes) + "}"


def format_operand(op: Operand) -> str:
    """The book's notation: A[B_data, D] for (('B', ('data',)), ('D', ()))."""
    return "[" + ", ".join(n + _subscript(tuple(a)) for n, a in op) + "]"


@dataclass(frozen=True)
class CommStep:
    kind: str
    axes: tuple[str, ...]
    nbytes: float  # V: the full array of one group
    purpose: str
    cost: CollectiveCost

    def as_dict(self) -> dict:
        return {"kind": self.kind, "axes": list(self.axes), "nbytes": self.nbytes, "purpose": self.purpose,
                **{k: v for k, v in self.cost.as_dict().items() if k not in ("kind",)}}


@dataclass(frozen=True)
class ShardedMatmul:
    case: int  # book ch.3 §4.2 case number
    strategy: str
    lhs: str
    rhs: str
    out: str
    local_shape: tuple[float, float, float]  # (rows, contracting, cols) of the local matmul
    steps: tuple[CommStep, ...]
    compute_s: float
    comm_s: float
    time_overlapped_s: float  # max(compute, comm): perfect overlap (e.g. a collective matmul)
    time_sequential_s: float  # compute + comm: no overlap
    alternatives: tuple[tuple[str, float], ...] = field(default=())  # (strategy, overlapped time)
    comm_bytes_per_chip: float = 0.0  # bytes each chip sends, summed over the steps
    comm_bytes_all_chips: float = 0.0  # the same over every chip of the mesh (book ch.3: totals across devices)
    replication: tuple[tuple[str, int], ...] = field(default=())  # (operand, copies of each element)

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("steps", "alternatives")}
        d["local_shape"] = list(self.local_shape)
        d["collectives"] = [s.as_dict() for s in self.steps]
        d["alternatives"] = [{"strategy": s, "time_overlapped_s": t} for s, t in self.alternatives]
        d["replication"] = dict(self.replication)
        return d


def mesh_size(mapping: MeshMapping) -> int:
    return math.prod(mapping.axes.values())


def replication_factor(op: Operand | str, mapping: MeshMapping) -> int:
    """Copies of each element of an array across the mesh (book ch.3 Q1): the mesh size over the product of
    the axes sharding it. A[I_X, J] on {X: 4, Y: 8, Z: 2}: 64 / 4 = 16 (replicated over Y and Z)."""
    op = parse_operand(op) if isinstance(op, str) else tuple(op)
    for a in _axes_of(op):
        if a not in mapping.axes:
            raise MeshplanError(f"axis '{a}' is not in the mesh (axes: {', '.join(mapping.axes)})")
    return mesh_size(mapping) // math.prod(mapping.axes[a] for a in _axes_of(op))


def bytes_all_chips(op: Operand | str, sizes: dict[str, int], mapping: MeshMapping, dtype: str = "bf16") -> float:
    """Bytes an array takes summed over every chip (book ch.3 pop quiz: int8[128, 2048] sharded over X, Y
    and replicated over Z=2 takes 128 x 2048 x 2 = 512 KiB in all): global bytes x replication factor."""
    op = parse_operand(op) if isinstance(op, str) else tuple(op)
    return dtype_bytes(dtype) * math.prod(sizes[n] for n, _ in op) * replication_factor(op, mapping)


@dataclass
class _Plan:
    """A candidate: operand shardings after resharding, the comm steps so far, the reduce axes."""

    lhs: list[list]
    rhs: list[list]
    steps: list[tuple[str, tuple[str, ...], float, str]]
    reduce: tuple[str, ...] = ()
    label: str = ""


def _axes_of(op: Operand) -> list[str]:
    return [a for _, axes in op for a in axes]


def _validate(lhs: Operand, rhs: Operand, sizes: dict[str, int], mapping: MeshMapping) -> str:
    for which, op in (("lhs", lhs), ("rhs", rhs)):
        names = [n for n, _ in op]
        if len(set(names)) != len(names):
            raise MeshplanError(f"{which} {format_operand(op)} repeats a dimension")
        axes = _axes_of(op)
        if len(set(axes)) != len(axes):
            raise MeshplanError(f"{which} {format_operand(op)} uses a mesh axis twice (book ch.3: at most once per array)")
        for a in axes:
            if a not in mapping.axes:
                raise MeshplanError(f"axis '{a}' is not in the mesh (axes: {', '.join(mapping.axes)})")
        for n, ax in op:
            if n not in sizes:
                raise MeshplanError(f"no size for dimension '{n}' (give --sizes {n}=...)")
            shards = math.prod(mapping.axes[a] for a in ax)
            if sizes[n] <= 0 or sizes[n] % shards:
                raise MeshplanError(f"dimension {n}={sizes[n]} does not divide into {shards} shards")
    unused = sorted(set(sizes) - {n for n, _ in lhs} - {n for n, _ in rhs})
    if unused:  # a size for no operand dimension is a typo, not something to ignore
        raise MeshplanError(f"--sizes names {', '.join(unused)}, which neither operand has "
                            f"(lhs {format_operand(lhs)}, rhs {format_operand(rhs)})")
    common = [n for n, _ in lhs if n in dict(rhs)]
    if len(common) != 1:
        raise MeshplanError(f"the operands must share exactly one contracting dimension, found {common or 'none'}")
    return common[0]


def _bytes(op: list[list], sizes: dict[str, int], mapping: MeshMapping, wb: float) -> float:
    """Local bytes of an operand on one chip."""
    return wb * math.prod(sizes[n] / math.prod(mapping.axes[a] for a in ax) for n, ax in op)


def _gather(plan_op: list[list], dim: str, axes: tuple[str, ...], sizes, mapping, wb) -> float:
    """Remove `axes` from `dim`; return V, the group's gathered array = local bytes x group size."""
    local = _bytes(plan_op, sizes, mapping, wb)
    for d in plan_op:
        if d[0] == dim:
            d[1] = tuple(a for a in d[1] if a not in axes)
    return local * math.prod(mapping.axes[a] for a in axes)


def _fix_case4(plan: _Plan, J: str, sizes, mapping, wb) -> bool:
    """Both operands shard a non-contracting dim on the same axis: AllGather the smaller one first."""
    found = False
    for a in set(_axes_of(_op(plan.lhs, J, False))) & set(_axes_of(_op(plan.rhs, J, False))):
        found = True
        small = min((plan.lhs, plan.rhs), key=lambda o: _bytes(o, sizes, mapping, wb))
        dim = next(d[0] for d in small if a in d[1])
        V = _gather(small, dim, (a,), sizes, mapping, wb)
        plan.steps.append(("allgather", (a,), V, f"case 4: AllGather {dim} over {a} first"))
    return found


def _op(op: list[list], J: str, contracting: bool) -> Operand:
    return tuple((d[0], tuple(d[1])) for d in op if (d[0] == J) == contracting)


def _j_axes(op: list[list], J: str) -> tuple[str, ...]:
    return next(tuple(d[1]) for d in op if d[0] == J)


def _candidates(base: _Plan, J: str, sizes, mapping, wb) -> list[_Plan]:
    ja, jb = _j_axes(base.lhs, J), _j_axes(base.rhs, J)
    only_a = tuple(a for a in ja if a not in jb)
    only_b = tuple(b for b in jb if b not in ja)
    common = tuple(a for a in ja if a in jb)
    gather = _copy(base, "AllGather the contracting dim, then local matmul")
    for side, extra in ((gather.lhs, only_a), (gather.rhs, only_b)):
        if extra:
            V = _gather(side, J, extra, sizes, mapping, wb)
            gather.steps.append(("allgather", extra, V, f"AllGather {J} over {'+'.join(extra)}"))
    gather.reduce = common
    if not (only_a or only_b) and common:
        gather.label = "local matmul on the shards, then reduce the partial sums"
    out = [gather]
    for extra, other in ((only_a, base.rhs), (only_b, base.lhs)):
        if extra and not (only_a and only_b) and not set(extra) & set(_axes_of(_op(other, J, False))):
            part = _copy(base, "multiply local slices, then reduce the partial output")
            side = part.rhs if other is base.rhs else part.lhs
            next(d for d in side if d[0] == J)[1] = tuple(_j_axes(side, J)) + extra  # free local slice
            part.reduce = common + extra
            out.append(part)
    return out


def _copy(plan: _Plan, label: str) -> _Plan:
    return _Plan([[n, tuple(a)] for n, a in plan.lhs], [[n, tuple(a)] for n, a in plan.rhs], list(plan.steps),
                 plan.reduce, label)


def _finish(plan: _Plan, J: str, sizes, mapping, wb, output: str) -> tuple[list, Operand]:
    """Add the output reduction; return the steps and the output sharding."""
    out = list(_op(plan.lhs, J, False) + _op(plan.rhs, J, False))
    steps = list(plan.steps)
    if plan.reduce:
        V = wb * math.prod(sizes[n] / math.prod(mapping.axes[a] for a in ax) for n, ax in out)
        kind = "reducescatter" if output == "sharded" else "allreduce"
        steps.append((kind, plan.reduce, V, f"{'ReduceScatter' if output == 'sharded' else 'AllReduce'} "
                                          f"the partial sums over {'+'.join(plan.reduce)}"))
        if output == "sharded":
            i = max(range(len(out)), key=lambda k: sizes[out[k][0]] / math.prod(mapping.axes[a] for a in out[k][1]))
            out[i] = (out[i][0], out[i][1] + plan.reduce)
    return steps, tuple(out)


def _local_dims(plan: _Plan, J: str, sizes, mapping) -> tuple[float, float, float]:
    def loc(op: Operand) -> float:
        return math.prod(sizes[n] / math.prod(mapping.axes[a] for a in ax) for n, ax in op)
    j = dict(_op(plan.lhs, J, True))[J]
    return loc(_op(plan.lhs, J, False)), sizes[J] / math.prod(mapping.axes[a] for a in j), loc(_op(plan.rhs, J, False))


def _evaluate(plan, J, sizes, mapping, wb, output, dtype, ideal, case, lhs, rhs, eff) -> ShardedMatmul:
    steps, out = _finish(plan, J, sizes, mapping, wb, output)
    shape = _local_dims(plan, J, sizes, mapping)
    op, chip = rf.matmul(*shape, lhs_dtype=dtype, rhs_dtype=dtype), mapping.cluster.chip
    # the book's roofline floor (ideal), else the same realistic GEMM time `meshplan roofline` prints (the kernel's
    # shape-dependent efficiency and launch), as the collectives beside it are realistic
    compute = rf.roofline(op, chip).t_lower_s if ideal else rf.realistic_time_s(op, chip, eff)
    comm = tuple(CommStep(k, ax, V, why, collective(k, V, mapping, ax, ideal=ideal)) for k, ax, V, why in steps)
    t_comm = sum(s.cost.time_s for s in comm)
    label = plan.label if comm else "local matmul, no communication"
    per_chip = sum(s.cost.bytes_per_chip for s in comm)
    copies = tuple((format_operand(o), replication_factor(o, mapping)) for o in (lhs, rhs, out))
    return ShardedMatmul(case, label, format_operand(lhs), format_operand(rhs), format_operand(out), shape, comm,
                         compute, t_comm, max(compute, t_comm), compute + t_comm, (), per_chip,
                         per_chip * mesh_size(mapping), copies)


def _case(lhs: Operand, rhs: Operand, J: str, case4: bool) -> int:
    ja, jb = dict(lhs)[J], dict(rhs)[J]
    if case4:
        return 4
    if not ja and not jb:
        return 1
    return 3 if ja and jb and set(ja) == set(jb) else 2


def sharded_matmul(lhs: Operand | str, rhs: Operand | str, sizes: dict[str, int], mapping: MeshMapping, *,
                   dtype: str = "bf16", output: str = "replicated", ideal: bool = False,
                   eff: Efficiency | None = None) -> ShardedMatmul:
    """The cheapest way (book ch.3 §4.2) to multiply two sharded operands on `mapping`.

    `output`: 'replicated' reduces partial sums with AllReduce, 'sharded' with ReduceScatter (scattered
    over the largest output dim). Every candidate's time is in `alternatives`. `ideal`: the book's floors (peak FLOPs,
    ideal links); else realistic, with `eff` (default: the chip's default efficiencies)."""
    lhs = parse_operand(lhs) if isinstance(lhs, str) else tuple(lhs)
    rhs = parse_operand(rhs) if isinstance(rhs, str) else tuple(rhs)
    if output not in ("replicated", "sharded"):
        raise MeshplanError(f"output must be 'replicated' or 'sharded', got '{output}'")
    J = _validate(lhs, rhs, sizes, mapping)
    wb = dtype_bytes(dtype)
    base = _Plan([[n, a] for n, a in lhs], [[n, a] for n, a in rhs], [])
    case4 = _fix_case4(base, J, sizes, mapping, wb)
    case = _case(lhs, rhs, J, case4)
    eff = eff or default_efficiency(mapping.cluster.chip)
    results = [_evaluate(p, J, sizes, mapping, wb, output, dtype, ideal, case, lhs, rhs, eff)
               for p in _candidates(base, J, sizes, mapping, wb)]
    results.sort(key=lambda r: (r.time_overlapped_s, r.comm_s))
    alts = tuple((r.strategy, r.time_overlapped_s) for r in results)
    best = results[0]
    return ShardedMatmul(**{**{k: getattr(best, k) for k in best.__dataclass_fields__}, "alternatives": alts})


# ---------------------------------------------------------------- collective matmul


@dataclass(frozen=True)
class CollectiveMatmul:
    """A collective split into ring-permute steps, each overlapped with a partial matmul (book ch.10)."""

    kind: str  # the collective it replaces: allgather | reducescatter
    steps: int
    step_comm_s: float
    step_compute_s: float
    compute_s: float
    time_s: float
    exposed_comm_s: float
    unfused_time_s: float  # the plain collective then the matmul, sequentially
    hidden: bool  # True when every permute step hides behind its partial matmul

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def collective_matmul_time(kind: str, nbytes: float, compute_s: float, mapping: MeshMapping,
                           axes: Sequence[str], *, bidirectional: bool = True,
                           ideal: bool = False) -> CollectiveMatmul:
    """Decompose an AllGather (or ReduceScatter) of `nbytes` over `axes`, feeding (fed by) a matmul of
    `compute_s`, into ring permutes (Wang et al. 2023; book ch.10). Each chip starts on its own shard;
    every step moves one shard per direction (two on a bidirectional torus ring) while the matmul on the
    shard(s) in hand runs: T = c + sum over steps of max(shards x c, t_permute), c = compute/N, up to
    k shards per step (k = 2 on a bidirectional torus ring, else 1). Hidden when T = compute."""
    if kind not in ("allgather", "reducescatter"):
        raise MeshplanError(f"a collective matmul replaces an allgather or reducescatter, not '{kind}'")
    if compute_s < 0:
        raise MeshplanError(f"compute time must be non-negative, got {compute_s}")
    p = mapping.group(axes)
    plain = collective(kind, nbytes, mapping, axes, ideal=ideal)
    n = p.size
    if n == 1:
        return CollectiveMatmul(kind, 0, 0.0, compute_s, compute_s, compute_s, 0.0, compute_s, True)
    k = 2 if bidirectional and p.cluster.is_torus and p.n_domains == 1 else 1
    full, rest = divmod(n - 1, k)  # steps carrying k shards, and a last one carrying fewer
    t_step = placement_cost("permute", nbytes / n, p, ideal).time_s
    c = compute_s / n
    total = c + full * max(k * c, t_step) + (max(rest * c, t_step) if rest else 0.0)
    exposed = max(total - compute_s, 0.0)
    return CollectiveMatmul(kind, full + (1 if rest else 0), t_step, k * c, compute_s, total, exposed,
                            compute_s + plain.time_s, exposed <= 1e-9 * max(compute_s, 1e-30))
