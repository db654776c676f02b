"""Read an optimized HLO module's text: every collective (kind, bytes, group, mesh axes) and every dot's FLOPs.

Pure Python and numpy (no JAX): it parses `compiled.as_text()`. Bytes follow the `meshplan collective`
convention: the full (gathered, unreduced) array size X per device, so an all-gather counts its result, a
reduce-scatter its operand (result × group size), an all-reduce / all-to-all / collective-permute their
operand. `wire_bytes` adds what a ring sends per device: X(n−1)/n, 2X(n−1)/n for all-reduce, X for a permute.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, replace

import numpy as np

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
DTYPE_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "s32": 4, "u32": 4, "s16": 2, "u16": 2,
               "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 0.5, "u4": 0.5}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+) = ")
_ARRAY = re.compile(r"(?P<dt>[a-z]+\d*(?:e\dm\d\w*)?)\[(?P<dims>[\d,]*)\]")


@dataclass(frozen=True)
class Collective:
    """One collective instruction of the per-device program."""

    kind: str  # one of COLLECTIVES (async -start/-done folded into the kind)
    name: str
    dtype: str
    bytes: float  # full array size X per device
    group_size: int
    axes: tuple[str, ...]  # mesh axes its groups span
    op_name: str  # the JAX op it came from (metadata)
    note: str = ""  # e.g. "all-reduce+dynamic-slice": a reduce-scatter the CPU pipeline left unfused

    @property
    def wire_bytes(self) -> float:
        n = self.group_size
        if self.kind == "collective-permute":
            return self.bytes
        factor = 2.0 if self.kind == "all-reduce" else 1.0
        return factor * self.bytes * (n - 1) / max(n, 1)


def _split_instr(line: str) -> tuple[str, str, str, str] | None:
    """(name, shape text, opcode, rest) of one instruction line, or None."""
    m = _INSTR.match(line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):  # tuple shape: find the matching parenthesis
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                shape, rest = rest[: i + 1], rest[i + 1:]
                break
    else:
        shape, _, rest = rest.partition(" ")
    op = re.match(r"\s*([a-z][\w\-]*)\(", rest)
    if not op:
        return None
    return m.group("name"), shape, op.group(1), rest[op.end():]


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """[(dtype, dims)] of every array in a shape text (a tuple gives several)."""
    out = []
    for m in _ARRAY.finditer(shape):
        if m.group("dt") in DTYPE_BYTES:
            out.append((m.group("dt"), tuple(int(d) for d in m.group("dims").split(",") if d)))
    return out


def shape_bytes(shape: str) -> float:
    return float(sum(DTYPE_BYTES[dt] * math.prod(dims) for dt, dims in arrays(shape)))


# --- replica groups ------------------------------------------------------------------------------

def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _mesh_groups(text: str) -> np.ndarray | None:
    """`mesh['axis_0'=2,'axis_1'=4] {'axis_1'}` with optional `device_ids=([2,4]T(1,0))`."""
    m = re.search(r"mesh\[(?P<axes>[^\]]*)\](?:, device_ids=\((?P<ids>[^)]*\)?)\))? \{(?P<sel>[^}]*)\}", text)
    if not m:
        return None
    axes = re.findall(r"'([^']+)'=(\d+)", m.group("axes"))
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    ids = np.arange(math.prod(sizes))
    if m.group("ids"):
        it = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", m.group("ids"))
        if it:
            ids = _iota(_ints(it.group(1)), _ints(it.group(2)) if it.group(2) else None).reshape(-1)
    grid = ids.reshape(sizes)
    sel = [names.index(s) for s in re.findall(r"'([^']+)'", m.group("sel")) if s in names]
    rest = [i for i in range(len(names)) if i not in sel]
    size = math.prod(sizes[i] for i in sel) if sel else 1
    return grid.transpose(rest + sel).reshape(-1, size)


def replica_groups(rest: str, n_devices: int) -> np.ndarray:
    """Device-id groups [n_groups, group_size] from an instruction's attributes (all HLO spellings)."""
    mg = _mesh_groups(rest)
    if mg is not None:
        return mg
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if m:
        ids = _iota(_ints(m.group(3)), _ints(m.group(4)) if m.group(4) else None)
        return ids.reshape(int(m.group(1)), int(m.group(2)))
    m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", rest)
    if m:
        groups = [_ints(g) for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
        if groups and all(len(g) == len(groups[0]) for g in groups) and groups[0]:
            return np.array(groups)
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", rest)
    if m:
        return np.array([_ints(p) for p in re.findall(r"\{([\d,]+)\}?", m.group(1) + "}")])
    return np.arange(n_devices).reshape(1, -1)  # replica_groups={} : everyone


def group_axes(groups: np.ndarray, coords: dict[int, tuple[int, ...]], axis_names: tuple[str, ...]) -> tuple[str, ...]:
    """Mesh axes along which the members of the groups differ."""
    varying: set[int] = set()
    for g in groups:
        cs = np.array([coords[int(d)] for d in g if int(d) in coords])
        if len(cs) > 1:
            varying |= {i for i in range(cs.shape[1]) if len(set(cs[:, i])) > 1}
    return tuple(axis_names[i] for i in sorted(varying))


# --- the module ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Instr:
    name: str
    shape: str
    op: str
    operands: tuple[str, ...]
    rest: str
    computation: str


def parse_module(hlo_text: str) -> dict[str, Instr]:
    """name → instruction, for every computation (HLO names are unique within a module)."""
    instrs: dict[str, Instr] = {}
    comp = ""
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%([\w.\-]+) \(", line)
        if head:
            comp = head.group(1)
            continue
        parts = _split_instr(line)
        if parts:
            name, shape, op, rest = parts
            operands = tuple(re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0]))
            instrs[name] = Instr(name, shape, op, operands, rest, comp)
    return instrs


def trip_counts(instrs: dict[str, Instr]) -> dict[str, float]:
    """computation → how many times it runs per step: a while loop's body (and what it calls) runs its
    `known_trip_count` times (XLA's backend_config, e.g. a `lax.scan` over micro-batches), nested loops
    multiply; every other computation once. The HLO text lists each instruction once, so per-step bytes and
    FLOPs are the instruction's times its computation's count."""
    calls: dict[str, list[tuple[str, float]]] = {}
    for ins in instrs.values():
        n = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.rest) if ins.op == "while" else None
        for attr, callee in re.findall(r"\b(calls|to_apply|body|condition|branch_computations)=%([\w.\-]+)", ins.rest):
            calls.setdefault(ins.computation, []).append((callee, float(n.group(1)) if n and attr == "body" else 1.0))
    count: dict[str, float] = {}

    def visit(comp: str, k: float) -> None:
        if count.get(comp, 0.0) >= k:
            return
        count[comp] = k
        for callee, n in calls.get(comp, []):
            visit(callee, k * n)

    called = {c for cs in calls.values() for c, _ in cs}
    for comp in {i.computation for i in instrs.values()} - called:
        visit(comp, 1.0)
    return count


def _users(instrs: dict[str, Instr]) -> dict[str, list[Instr]]:
    users: dict[str, list[Instr]] = {}
    for ins in instrs.values():
        for o in ins.operands:
            users.setdefault(o, []).append(ins)
    return users


def _slices_only(value: str, nbytes: float, n: int, instrs: dict[str, Instr], users: dict[str, list[Instr]]) -> bool:
    """Every use of `value` is a dynamic-slice to 1/n of it (directly, or of the matching parameter inside a
    fusion): an all-reduce used only so is a reduce-scatter."""
    us = users.get(value, [])
    if not us:
        return False
    for u in us:
        if u.op == "fusion":
            called = re.search(r"calls=%([\w.\-]+)", u.rest)
            params = [i for i in instrs.values() if called and i.computation == called.group(1)
                      and i.op == "parameter"]
            idx = [k for k, o in enumerate(u.operands) if o == value]
            inner = [p.name for p in params if int(re.match(r"\s*(\d+)", p.rest).group(1)) in idx]
            if not inner or not all(_slices_only(p, nbytes, n, instrs, users) for p in inner):
                return False
        elif u.op != "dynamic-slice" or abs(shape_bytes(u.shape) * n - nbytes) > 0.5:
            return False
    return True


def _scattered_bytes(ins: Instr, n: int, instrs: dict[str, Instr], users: dict[str, list[Instr]],
                     only: list[int] | None = None) -> float:
    """Bytes of an all-reduce's results that are only ever dynamic-sliced to 1/n (see `_slices_only`); `only`: of
    these tuple indices."""
    arrs = arrays(ins.shape)
    if not ins.shape.startswith("("):
        b = shape_bytes(ins.shape)
        return b if _slices_only(ins.name, b, n, instrs, users) else 0.0
    total = 0.0
    for u in users.get(ins.name, []):
        idx = re.search(r"index=(\d+)", u.rest)
        if only is not None and (not idx or int(idx.group(1)) not in only):
            continue
        if u.op == "get-tuple-element" and idx and int(idx.group(1)) < len(arrs):
            dt, dims = arrs[int(idx.group(1))]
            b = DTYPE_BYTES[dt] * math.prod(dims)
            total += b if _slices_only(u.name, b, n, instrs, users) else 0.0
    return total


def _kind(op: str) -> str | None:
    base = op.removesuffix("-start")
    return base if base in COLLECTIVES and not op.endswith("-done") else None


def _collective_bytes(kind: str, op: str, shape: str, group: int) -> tuple[str, float]:
    arrs = arrays(shape)
    if op.endswith("-start") and len(arrs) > 1:
        # async start returns (operands..., results..., context): take the results (the larger half for
        # an all-gather, the first array for the others)
        sizes = [DTYPE_BYTES[dt] * math.prod(d) for dt, d in arrs if d]
        total = max(sizes) if kind == "all-gather" else sizes[0]
    else:
        total = sum(DTYPE_BYTES[dt] * math.prod(d) for dt, d in arrs)
    if kind == "reduce-scatter":
        total *= group
    return (arrs[0][0] if arrs else "?"), float(total)


def _folded_all_reduces(instrs: dict[str, Instr], users: dict[str, list[Instr]]) -> dict[str, tuple[str, list[int]]]:
    """all-reduce A → (the all-reduce B it feeds, B's operand indices that read A): B reduces A's results again
    (directly, or each through a get-tuple-element of a tuple all-reduce) and nothing else reads them, so each
    such array is reduced once over the union of both groups. The GSPMD partitioner emits these chains for a dot
    whose contracted dims are sharded over two mesh axes (batch over `data`, sequence over `context`), and XLA's
    GPU and TPU pipelines fold them right after partitioning, before any combiner (AllReduceFolder,
    xla/hlo/transforms/simplifiers/all_reduce_folder.cc, first in gpu_compiler.cc's "collective-optimizations"
    pipeline); the CPU pipeline does not, and its all-reduce combiner may then put them in tuples with others.
    Not folded: a B whose results are only dynamic-sliced to 1/n (`_scattered_bytes`), i.e. a reduce-scatter that
    the partitioner wrote as all-reduce + slice (under a layer scan, where a layer's gradient is sliced into the
    stacked gradient); the unrolled program has the reduce-scatter there, after A."""
    out: dict[str, tuple[str, list[int]]] = {}
    for b in instrs.values():
        if b.op != "all-reduce":
            continue
        n = replica_groups(b.rest, 0).shape[1] if "replica_groups" in b.rest else 0
        if n > 1 and _scattered_bytes(b, n, instrs, users) >= shape_bytes(b.shape) - 0.5:
            continue
        srcs: dict[str, list[int]] = {}
        for i, o in enumerate(b.operands):
            src = instrs.get(o)
            if src is not None and src.op == "get-tuple-element":
                src = instrs.get(src.operands[0]) if src.operands else None
            if src is not None and src.op == "all-reduce" and src.name != b.name:
                srcs.setdefault(src.name, []).append(i)
        for a_name, idx in srcs.items():
            readers = users.get(a_name, [])
            if len(idx) == len(arrays(instrs[a_name].shape)) and all(
                    u.name == b.name or (u.op == "get-tuple-element"
                                         and [x.name for x in users.get(u.name, [])] == [b.name]) for u in readers):
                out[a_name] = (b.name, idx)
    return out


@dataclass(frozen=True)
class Module:
    """An HLO module parsed once: its instructions (`parse_module`) and the runs per step of each computation
    (`trip_counts`), which `parse_collectives` and `dot_flops` both read."""

    instrs: dict[str, Instr]
    runs: dict[str, float]


def _split_scatters(ins: Instr, rec: Collective, coords: dict[int, tuple[int, ...]], axis_names: tuple[str, ...],
                    instrs: dict[str, Instr], users: dict[str, list[Instr]], runs: float) -> list[Collective]:
    """An all-reduce over axes G whose results are only dynamic-sliced to 1/n, n the size of a proper subset S of G's
    axes (the only one of that size): a reduce-scatter over S and an all-reduce of the shard over the rest, as XLA's
    GPU pipeline rewrites it (AllReduceSplitter, xla/service/gpu/transforms/all_reduce_splitter.h, then
    ReduceScatterCreator); the CPU pipeline leaves the pair (verify FSDP×EP: the dense gradients' partial sums over
    fsdp+expert sliced to the `fsdp` shard, or data+expert to the `expert` shard under Layout.ep_in_fsdp)."""
    size = {a: 1 + max(c[i] for c in coords.values()) for i, a in enumerate(axis_names)}
    axes = rec.axes
    subsets: dict[int, list[tuple[str, ...]]] = {}
    for k in range(1, len(axes)):
        for sub in itertools.combinations(axes, k):
            subsets.setdefault(math.prod(size[a] for a in sub), []).append(sub)
    out = []
    for n, subs in sorted(subsets.items(), reverse=True):
        if len(subs) != 1 or rec.group_size % n or n == rec.group_size:
            continue
        scat = _scattered_bytes(ins, n, instrs, users) * runs
        if not scat or scat > rec.bytes:
            continue
        rest = tuple(a for a in axes if a not in subs[0])
        out.append(replace(rec, kind="reduce-scatter", bytes=scat, group_size=n, axes=subs[0],
                           note="all-reduce+dynamic-slice, split"))
        out.append(replace(rec, bytes=scat / n, group_size=rec.group_size // n, axes=rest,
                           note="all-reduce of a reduce-scatter's shard, split"))
        break
    return out


def read_module(hlo_text: str) -> Module:
    """Parse an optimized HLO module's text (`compiled.as_text()`) once."""
    instrs = parse_module(hlo_text)
    return Module(instrs, trip_counts(instrs))


def _as_module(hlo: Module | str) -> Module:
    return hlo if isinstance(hlo, Module) else read_module(hlo)


def parse_collectives(hlo: Module | str, coords: dict[int, tuple[int, ...]], axis_names: tuple[str, ...],
                      fold_reduce_scatter: bool = True) -> list[Collective]:
    """Every collective in the module (`hlo`: its text, or the `read_module` of it). `coords`: device id → mesh coordinates of that device.

    With `fold_reduce_scatter`, an all-reduce whose results are only dynamic-sliced to 1/n per device is
    reported as a reduce-scatter with note "all-reduce+dynamic-slice": the GSPMD partitioner emits that pair
    and XLA's GPU/TPU pipelines fuse it into a reduce-scatter (ReduceScatterCreator); the CPU pipeline does
    not, so the CPU program moves twice the bytes a real reduce-scatter would. Likewise an all-reduce of an
    all-reduce's results is reported as one all-reduce over both groups' axes, note "all-reduce+all-reduce"
    (AllReduceFolder, see `_folded_all_reduces`)."""
    module = _as_module(hlo)
    instrs, runs = module.instrs, module.runs
    users = _users(instrs) if fold_reduce_scatter else {}
    folded = _folded_all_reduces(instrs, users) if fold_reduce_scatter else {}
    out = []
    for ins in instrs.values():
        kind = _kind(ins.op)
        if not kind or ins.name in folded:
            continue
        groups = replica_groups(ins.rest, len(coords))
        gsize = 2 if kind == "collective-permute" else groups.shape[1]
        dtype, nbytes = _collective_bytes(kind, ins.op, ins.shape, gsize)
        meta = re.search(r'op_name="([^"]*)"', ins.rest)
        axes = group_axes(groups, coords, axis_names)
        nbytes *= runs.get(ins.computation, 1.0)
        rec = Collective(kind, ins.name, dtype, nbytes, gsize, axes, meta.group(1) if meta else "")
        for a_name, (b_name, idx) in folded.items():
            if b_name != ins.name:
                continue
            # the arrays that an all-reduce already reduced: one all-reduce over the axes of both groups
            first = replica_groups(instrs[a_name].rest, len(coords))
            inner = set(group_axes(first, coords, axis_names))
            arrs = arrays(ins.shape)
            part = float(sum(DTYPE_BYTES[arrs[i][0]] * math.prod(arrs[i][1]) for i in idx)) * runs.get(ins.computation, 1)
            both = replace(rec, group_size=gsize * first.shape[1], note="all-reduce+all-reduce",
                           axes=tuple(a for a in axis_names if a in inner or a in axes))
            # the folded all-reduce's results only sliced to 1/(both groups): a reduce-scatter over both (ZeRO's
            # shard over data+context; ReduceScatterCreator after AllReduceFolder)
            scat = _scattered_bytes(ins, both.group_size, instrs, users, idx) * runs.get(ins.computation, 1.0)
            if scat:
                out.append(replace(both, kind="reduce-scatter", bytes=scat, note="all-reduce+all-reduce+dynamic-slice"))
            if part - scat > 0:
                out.append(replace(both, bytes=part - scat))
            rec = replace(rec, bytes=rec.bytes - part)
        scattered = (_scattered_bytes(ins, gsize, instrs, users) * runs.get(ins.computation, 1.0)
                     if kind == "all-reduce" and fold_reduce_scatter else 0)
        if scattered and scattered <= rec.bytes:
            out.append(replace(rec, kind="reduce-scatter", bytes=scattered, note="all-reduce+dynamic-slice"))
            rec = replace(rec, bytes=rec.bytes - scattered)
        if kind == "all-reduce" and fold_reduce_scatter and rec.bytes > 0:
            split = _split_scatters(ins, rec, coords, axis_names, instrs, users, runs.get(ins.computation, 1.0))
            out += split
            # what the reduce-scatter took out of the all-reduce (the shard's all-reduce is its own record)
            rec = replace(rec, bytes=rec.bytes - sum(c.bytes for c in split if c.kind == "reduce-scatter"))
        if rec.bytes > 0:
            out.append(rec)
    return out


# XLA's GPU GEMM library calls (the dot rewritten to a cuBLAS / cuBLASLt custom call; its result is a tuple of the
# product and a workspace): the contraction is in the call's backend_config (gemm_backend_config.dot_dimension_numbers)
GEMM_CUSTOM_CALLS = ('"__cublas$gemm"', '"__cublas$lt$matmul"', '"__cublas$lt$matmul$f8"')


def is_gemm_call(ins: Instr) -> bool:
    """Whether an instruction is one of XLA's GPU GEMM library calls (GEMM_CUSTOM_CALLS)."""
    return ins.op == "custom-call" and any(f"custom_call_target={t}" in ins.rest for t in GEMM_CUSTOM_CALLS)


def dot_flops(hlo: Module | str) -> float:
    """2 × (result elements) × (contracted size) summed over every dot, fused or not (a Triton GEMM fusion's dot
    too), and every cuBLAS GEMM custom call of a GPU module, times the runs of its computation (`trip_counts`: a
    dot in a loop body counts once per iteration) (book ch.4). `hlo`: the module's text, or the `read_module` of
    it."""
    module = _as_module(hlo)
    instrs, runs = module.instrs, module.runs
    total = 0.0
    for ins in instrs.values():
        if not ins.operands:
            continue
        if ins.op == "dot":
            cdims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.rest)
            dims = _ints(cdims.group(1)) if cdims else []
        elif is_gemm_call(ins):
            cdims = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.rest)
            dims = [int(x) for x in re.findall(r"\d+", cdims.group(1))] if cdims else []
        else:
            continue
        lhs = instrs.get(ins.operands[0])
        lhs_dims = arrays(lhs.shape if lhs else "")
        out = arrays(ins.shape)
        if not lhs_dims or not out:
            continue
        contracted = math.prod(lhs_dims[0][1][i] for i in dims)
        total += 2.0 * math.prod(out[0][1]) * contracted * runs.get(ins.computation, 1.0)
    return total
