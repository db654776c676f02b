"""`meshplan collective` and `meshplan matmul`: collectives on a real topology and sharded matmuls."""

from __future__ import annotations

import math
import re
from typing import Annotated

import typer
from rich.table import Table

from meshplan.cli.app import app, console, fail, parse_mesh, print_json
from meshplan.cost.collectives import KINDS, ragged_alltoall
from meshplan.cost.collectives import collective as collective_cost
from meshplan.cost.sharded_matmul import collective_matmul_time, mesh_size, sharded_matmul
from meshplan.cost.topology import MeshMapping, make_cluster, map_mesh
from meshplan.specs.hardware import load_chip
from meshplan.units import fmt_bytes, fmt_time
from meshplan.validate import DIM, NBYTES

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")]
HardwareOpt = Annotated[str, typer.Option("--hardware", "-h", help="Chip preset or YAML path.")]
ChipsOpt = Annotated[int, typer.Option("--chips", "-n", help="Number of chips.")]
MeshOpt = Annotated[str, typer.Option("--mesh", help="Logical mesh, e.g. data=8,tensor=4.")]
OrderOpt = Annotated[str | None, typer.Option("--order", help="Mesh axes innermost (fastest links) first.")]
SliceOpt = Annotated[str | None, typer.Option("--slice", help="TPU slice shape, e.g. 16x16 (GPU: GPUs per node).")]
IdealOpt = Annotated[bool, typer.Option("--ideal", help="Also the book's ideal answer (peak bandwidth, no efficiency), "
                                                       "beside meshplan's realistic one; --json key 'book_ideal'.")]

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> float:
    """`1e9`, `512MB`, `1GiB`, `4096` -> bytes (decimal KB/MB/GB, binary KiB/MiB/GiB); must be positive."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text or "")
    if not m or m.group(2).lower() not in _UNITS:
        fail(f"bad byte count '{text}' (write e.g. 1e9, 512MB, 1GiB)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(value) or value <= 0:
        fail(f"byte count must be positive, got '{text}'")
    return NBYTES.check(value, "byte count")


def _check_negative(text: str) -> None:
    if text.strip().startswith("-"):
        fail(f"byte count must be positive, got '{text}'")


def parse_sizes(text: str) -> dict[str, int]:
    """`B=8192,D=8192,F=28672` -> {'B': 8192, ...}."""
    sizes: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, eq, val = part.partition("=")
        try:
            n = float(val) if eq else 0.0
        except ValueError:
            n = 0.0
        if n <= 0 or not name.strip().isidentifier():
            fail(f"bad size '{part}' in '{text}' (write e.g. B=8192,D=8192,F=28672 with positive integers)")
        if name.strip() in sizes:
            fail(f"size {name.strip()} is given twice in '{text}'")
        sizes[name.strip()] = DIM.check(n, f"size {name.strip()}")
    return sizes


def parse_slice_shape(text: str | None) -> tuple[int, ...] | None:
    """'16x16' / '4x4x8' (a TPU slice) or '8' (GPUs per NVLink domain); None when not given."""
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        fail(f"bad slice shape '{text}' (write e.g. 16x16 or 4x4x8)")


def build_mapping(hardware: str, chips: int, mesh: str, order: str | None, slice_shape: str | None) -> MeshMapping:
    chip = load_chip(hardware)
    cluster = make_cluster(chip, chips, parse_slice_shape(slice_shape))
    axes_order = [a.strip() for a in order.split(",") if a.strip()] if order else None
    return map_mesh(cluster, parse_mesh(mesh), axes_order)


def _axes(text: str) -> list[str]:
    axes = [a.strip() for a in text.split(",") if a.strip()]
    if not axes:
        fail("--axes is empty: name one or more mesh axes, e.g. --axes tensor")
    return axes


def _print_mapping(mapping: MeshMapping) -> None:
    console.print(f"[bold]cluster[/bold]: {mapping.cluster.describe()}", highlight=False)
    for a in mapping.order:
        console.print(f"  {a}={mapping.axes[a]} -> {mapping.group([a]).describe()}", highlight=False)


@app.command()
def collective(
    kind: Annotated[str, typer.Argument(help=f"One of: {', '.join(KINDS)}.")],
    hardware_name: HardwareOpt,
    chips: ChipsOpt,
    mesh: MeshOpt,
    axes: Annotated[str, typer.Option("--axes", help="Mesh axes the collective runs over, e.g. tensor or data,fsdp.")],
    nbytes: Annotated[str, typer.Option("--bytes", help="Full (gathered) array per group: 1e9, 512MB, 1GiB; for permute, the bytes each chip sends to its neighbour.")],
    order: OrderOpt = None,
    slice_shape: SliceOpt = None,
    topk: Annotated[int | None, typer.Option("--topk", help="alltoall only: MoE dispatch where each token goes to "
                                                            "its top-k experts (ragged all-to-all, book ch.12).")]
    = None,
    sharp: Annotated[bool | None, typer.Option("--sharp/--no-sharp", help="allreduce: in-network reduction "
                                                                          "(default: the chip's spec).")] = None,
    ideal: IdealOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Time of one collective over mesh axes on a real topology (book ch.2, 3, 12)."""
    if kind not in KINDS:
        fail(f"unknown collective '{kind}' (known: {', '.join(KINDS)})")
    if topk is not None and (kind != "alltoall" or topk < 1):
        fail("--topk takes a positive expert count and only applies to alltoall")
    if sharp is not None and kind != "allreduce":
        fail("--sharp/--no-sharp choose how an allreduce reduces; it does not apply to " + kind)
    _check_negative(nbytes)
    V = parse_bytes(nbytes)
    mapping = build_mapping(hardware_name, chips, mesh, order, slice_shape)
    ax = _axes(axes)

    def cost_of(book: bool):
        if topk is not None:
            return ragged_alltoall(V, mapping, ax, topk, ideal=book)
        return collective_cost(kind, V, mapping, ax, ideal=book, sharp=sharp)

    cost = cost_of(False)
    book = cost_of(True) if ideal else None
    if json_out:
        out = {**cost.as_dict(), "nbytes": V, "axes": ax, "group": mapping.group(ax).describe(),
               "mapping": mapping.as_dict(), "ideal": ideal,
               # every group of the mesh runs it at once (book ch.3: totals across devices)
               "bytes_all_chips": cost.bytes_per_chip * mesh_size(mapping)}
        if book:
            out["book_ideal"] = book.as_dict()
        print_json(out)
        return
    _print_mapping(mapping)
    console.print(f"[bold]{kind}[/bold] of {fmt_bytes(V)} over {','.join(ax)} ({cost.group_size} chips, "
                  f"{mapping.group(ax).describe()})", highlight=False)
    t = Table(show_header=bool(book))
    t.add_column("quantity")
    t.add_column("meshplan (realistic)")
    if book:
        t.add_column("book (ideal)")
    levels = dict(book.levels) if book else {}
    for k, f in (("time", lambda c: fmt_time(c.time_s)), ("bandwidth term", lambda c: fmt_time(c.bandwidth_time_s)),
                 ("latency term", lambda c: fmt_time(c.latency_time_s)), ("regime", lambda c: c.regime),
                 ("bytes sent per chip", lambda c: fmt_bytes(c.bytes_per_chip)),
                 (f"bytes sent, all {mesh_size(mapping)} chips", lambda c: fmt_bytes(c.bytes_per_chip * mesh_size(mapping))),
                 ("algorithm", lambda c: c.algorithm),
                 ("link", lambda c: c.link)):
        t.add_row(k, f(cost), *([f(book)] if book else []))
    for n, s in cost.levels:
        t.add_row(f"level {n}", fmt_time(s), *([fmt_time(levels.get(n, 0.0))] if book else []))
    console.print(t)


@app.command()
def matmul(
    hardware_name: HardwareOpt,
    chips: ChipsOpt,
    mesh: MeshOpt,
    lhs: Annotated[str, typer.Option("--lhs", help="Left operand dims and shardings, e.g. B:data,D:tensor.")],
    rhs: Annotated[str, typer.Option("--rhs", help="Right operand, e.g. D:tensor,F (shared name = contracting).")],
    sizes: Annotated[str, typer.Option("--sizes", help="Dim sizes, e.g. B=8192,D=8192,F=28672.")],
    dtype: Annotated[str, typer.Option("--dtype", help="bf16, fp8, int8.")] = "bf16",
    output: Annotated[str, typer.Option("--output", help="replicated (AllReduce) or sharded (ReduceScatter).")]
    = "replicated",
    order: OrderOpt = None,
    slice_shape: SliceOpt = None,
    ideal: IdealOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Sharded matmul (book ch.3): the strategy, its collectives and time with and without overlap."""
    mapping = build_mapping(hardware_name, chips, mesh, order, slice_shape)

    def solve(book: bool):
        r = sharded_matmul(lhs, rhs, parse_sizes(sizes), mapping, dtype=dtype, output=output, ideal=book)
        fused = [collective_matmul_time(s.kind, s.nbytes, r.compute_s, mapping, s.axes, ideal=book)
                 for s in r.steps if s.kind in ("allgather", "reducescatter") and len(r.steps) == 1]
        return r, fused

    r, fused = solve(False)
    book = solve(True) if ideal else None
    if json_out:
        out = {**r.as_dict(), "collective_matmul": fused[0].as_dict() if fused else None,
               "mapping": mapping.as_dict()}
        if book:
            out["book_ideal"] = {**book[0].as_dict(), "collective_matmul": book[1][0].as_dict() if book[1] else None}
        print_json(out)
        return
    _print_mapping(mapping)
    console.print(f"[bold]{r.lhs} · {r.rhs} -> {r.out}[/bold]  (book ch.3 case {r.case})", highlight=False)
    console.print(f"strategy: {r.strategy}", highlight=False)
    for s in r.steps:
        console.print(f"  {s.purpose}: {s.kind} of {fmt_bytes(s.nbytes)} over {'+'.join(s.axes)} -> "
                      f"{fmt_time(s.cost.time_s)} ({s.cost.regime}-bound, {s.cost.link})", highlight=False)
    console.print(f"local matmul {' x '.join(f'{d:g}' for d in r.local_shape)}: {fmt_time(r.compute_s)}; "
                  f"comm {fmt_time(r.comm_s)}; time with overlap {fmt_time(r.time_overlapped_s)}, "
                  f"without {fmt_time(r.time_sequential_s)}", highlight=False)
    if fused:
        f = fused[0]
        console.print(f"collective matmul ({f.steps} permute steps): {fmt_time(f.time_s)}, exposed comm "
                      f"{fmt_time(f.exposed_comm_s)} ({'hidden' if f.hidden else 'not hidden'})", highlight=False)
    for name, t in r.alternatives[1:]:
        console.print(f"[dim]alternative: {name}: {fmt_time(t)}[/dim]", highlight=False)
    console.print(f"communication: {fmt_bytes(r.comm_bytes_per_chip)} sent per chip, "
                  f"{fmt_bytes(r.comm_bytes_all_chips)} across all {mesh_size(mapping)} chips (book ch.3)", highlight=False)
    console.print("replication (copies of each element, book ch.3): "
                  + ", ".join(f"{op} x{n}" for op, n in r.replication), highlight=False)
    if book:
        b, bf = book
        console.print(f"[bold]book (ideal)[/bold]: comm {fmt_time(b.comm_s)}; time with overlap "
                      f"{fmt_time(b.time_overlapped_s)}, without {fmt_time(b.time_sequential_s)}"
                      + (f"; collective matmul {fmt_time(bf[0].time_s)}" if bf else ""), highlight=False)
