"""Physical topologies and how a logical mesh sits on them (book ch.2 §topology, ch.3, ch.12 §networking).

A `Cluster` is a catalog chip times a chip count, arranged as fast domains joined by a scale-out network:
  * TPU: ICI slices, each a 1D/2D/3D torus (`slice_shape`), joined over DCN. Wraparound per book ch.2:
    v5e/v6e wrap an axis only at its full pod length (16); v4/v5p wrap all axes when every axis is a
    multiple of the 4x4x4 cube; sub-cube slices have none.
  * GPU: NVLink/NVSwitch domains (8 GPUs, 72 on NVL72) joined by a rail-aligned fat tree (one NIC per GPU); a
    job that is not a whole number of domains uses the same share of each (256 GB200s: 4 racks x 64).

Chips are numbered linearly: the first slice axis varies fastest, then the other slice axes, then the
slice (or node) index. A communication group is `size` chips spaced `stride` apart in that order; a
`MeshMapping` gives each logical mesh axis its stride (innermost axis stride 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from meshplan.errors import InfeasibleError, MeshplanError
from meshplan.math.integers import divisors
from meshplan.specs.hardware import Chip, Links

# Mesh-axis names by how much they communicate (most first); used to put heavy axes on fast links.
_AXIS_RANKS = (
    (0, ("tensor", "tp", "mp", "model", "expert", "ep", "context", "cp", "seq", "sequence", "sp")),
    (1, ("fsdp", "zero", "shard")),
    (3, ("data", "dp", "replica", "batch", "ddp")),
    (4, ("pipeline", "pp", "stage", "pipe")),
)
_UNKNOWN_RANK = 2


@dataclass(frozen=True)
class Span:
    """A group's extent along one physical dimension: `length` members, `step` chips apart."""

    dim: int
    length: int
    step: int
    wrap: bool


@dataclass(frozen=True)
class Cluster:
    """`n_chips` of `chip`: `n_slices` fast domains of shape `slice_shape` (TPU torus or NVLink domain)."""

    chip: Chip = field(compare=False)
    n_chips: int
    slice_shape: tuple[int, ...] = ()
    wrap_override: tuple[bool, ...] | None = None
    n_slices: int = field(init=False, default=1)
    wraparound: tuple[bool, ...] = field(init=False, default=())
    links: Links = field(init=False, default=None)  # type: ignore[assignment]
    chip_name: str = field(init=False, default="")

    def __post_init__(self) -> None:
        if not isinstance(self.n_chips, int) or self.n_chips <= 0:
            raise MeshplanError(f"chip count must be a positive integer, got {self.n_chips}")
        links = self.chip.links
        shape = tuple(self.slice_shape) or _default_shape(links, self.n_chips)
        shape = _check_shape(links, self.n_chips, shape)
        object.__setattr__(self, "slice_shape", shape)
        object.__setattr__(self, "n_slices", self.n_chips // math.prod(shape))
        object.__setattr__(self, "wraparound", _wraparound(links, shape, self.wrap_override))
        object.__setattr__(self, "links", links)
        object.__setattr__(self, "chip_name", self.chip.name)

    @property
    def is_torus(self) -> bool:
        return self.links.is_torus

    @property
    def domain_size(self) -> int:
        """Chips per fast domain used here (one ICI slice, or the GPUs used per NVLink domain)."""
        return math.prod(self.slice_shape)

    @property
    def n_domains(self) -> int:
        return self.n_slices

    @property
    def dims(self) -> tuple[int, ...]:
        """Physical dimensions in linear chip order: slice axes, then the scale-out index."""
        return (*self.slice_shape, self.n_slices)

    @property
    def fast_link(self) -> str:
        return self.links.fast_link  # ici, nvlink, pcie or xgmi

    @property
    def scale_out_link(self) -> str:
        return self.links.scale_out_kind

    @property
    def node_egress_bytes_per_s(self) -> float:
        """Scale-out egress of one fast domain (book ch.12 'node egress'): chips x per-chip NIC/DCN share."""
        return self.domain_size * self.links.scale_out_bandwidth_bytes_per_s

    @property
    def domain_fast_bandwidth_bytes_per_s(self) -> float:
        """Total one-way fast-network egress of one domain (book ch.12: 8 x 450 GB/s = 3.6 TB/s per H100 node)."""
        return self.domain_size * self.links.fast_bandwidth_bytes_per_s

    def describe(self) -> str:
        if self.is_torus:
            wr = [str(s) for s, w in zip(self.slice_shape, self.wraparound, strict=True) if w]
            wrap = f"wraparound on axes of {'/'.join(wr)}" if wr else "no wraparound"
            base = f"{self.n_chips} x {self.chip_name}: {self.n_slices} slice(s) of {_shape(self.slice_shape)} ({wrap})"
            return base + (" joined over DCN" if self.n_slices > 1 else "")
        per = f"{self.domain_size} GPUs per {self.links.fast_label} domain"
        return f"{self.n_chips} x {self.chip_name}: {self.n_slices} node(s), {per}, {self.scale_out_link} between nodes"


def _shape(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape))


def default_slice_shape(chip: Chip, n: int) -> tuple[int, ...]:
    """The slice (TPU) or NVLink domain (GPU) meshplan assumes for `n` chips in one fast domain."""
    return _default_shape(chip.links, n)


def _default_shape(links: Links, n: int) -> tuple[int, ...]:
    if not links.is_torus:
        return (_gpu_domain_share(links, n),)
    return _default_torus(n, tuple(links.max_slice_shape), links.wraparound == "cube_multiple")


@lru_cache(maxsize=1024)
def _default_torus(n: int, max_shape: tuple[int, ...], cubes: bool) -> tuple[int, ...]:
    """The largest slice that divides n and fits the pod, as balanced as possible (smallest axis first);
    on v4/v5p a shape made of whole 4x4x4 cubes (which wraps around) is preferred."""
    for d in sorted(divisors(n), reverse=True):
        best = _balanced_fit(d, max_shape, cubes)
        if best:
            return best
    return (1,) * len(max_shape)


def _gpu_domain_share(links: Links, n: int) -> int:
    """GPUs a job of `n` uses in each NVLink domain. The whole domain when `n` is a multiple of it (or smaller);
    a rack-scale domain of several hosts (NVL72: 18 trays of 4) may be used in part, the same whole trays in
    every rack: the largest divisor of `n` made of whole hosts that fits one domain. A job of 256 GB200s runs as
    4 racks x 64 GPUs: NVIDIA's Slurm block-scheduling guidance gives large GB200 NVL72 training jobs (128+
    GPUs) a segment of 16 compute trays = 64 GPUs per rack ("Unlock exascale performance on NVIDIA GB200 NVL72
    with Slurm topology-aware job scheduling", NVIDIA technical blog, 2025). An 8-GPU server is used whole.
    Any other count (12 or 24 H100s, a pipeline of 11) spans gcd(n, D) GPUs per domain: a group crossing domains
    is paced by its slowest (scale-out) hop either way, so a deployment that runs is costed, not refused (#18)."""
    domain, host = links.nvlink_domain_size, links.chips_per_host
    if n <= domain or n % domain == 0:
        return min(n, domain)
    if domain > host:
        shares = [d for d in divisors(n) if d <= domain and d % host == 0]
        if shares:
            return max(shares)
    return math.gcd(n, domain)


def _factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    if k == 1:
        return [(n,)]
    return [(d, *rest) for d in divisors(n) for rest in _factorizations(n // d, k - 1)]


def _balanced_fit(n: int, max_shape: tuple[int, ...], cubes: bool) -> tuple[int, ...] | None:
    fits = [f for f in _factorizations(n, len(max_shape)) if all(a <= b for a, b in zip(f, max_shape, strict=True))]
    return min(fits, key=lambda f: (cubes and any(a % 4 for a in f), max(f), -min(f), f)) if fits else None


def _check_shape(links: Links, n: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    if any(not isinstance(s, int) or s <= 0 for s in shape):
        raise MeshplanError(f"slice shape {list(shape)} must be positive integers")
    if not links.is_torus:
        return _check_gpu_domain(links, n, shape)
    if n % math.prod(shape):
        raise InfeasibleError(f"slice shape {_shape(shape)} ({math.prod(shape)} chips) does not divide {n} chips")
    if len(shape) > links.torus_dims:
        raise MeshplanError(f"slice shape {_shape(shape)} has more axes than the {links.torus_dims}D torus")
    shape = shape + (1,) * (links.torus_dims - len(shape))
    if any(a > b for a, b in zip(sorted(shape), sorted(links.max_slice_shape), strict=True)):
        raise InfeasibleError(f"slice shape {_shape(shape)} does not fit the pod {_shape(links.max_slice_shape)}")
    return shape


def _check_gpu_domain(links: Links, n: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) != 1 or shape[0] > links.nvlink_domain_size:
        raise MeshplanError(f"GPU slice shape must be one number <= the NVLink domain size "
                            f"{links.nvlink_domain_size}, got {_shape(shape)}")
    if n % shape[0]:
        raise InfeasibleError(f"{n} GPUs is not a whole number of {shape[0]}-GPU NVLink domains")
    return shape


def _wraparound(links: Links, shape: tuple[int, ...], override: tuple[bool, ...] | None) -> tuple[bool, ...]:
    """Book ch.2 topology rules; an explicit override (a what-if) wins."""
    if not links.is_torus:
        return (False,) * len(shape)
    if override is not None:
        if len(override) != len(shape):
            raise MeshplanError(f"wraparound needs one flag per slice axis ({len(shape)}), got {len(override)}")
        return tuple(bool(w) and s > 2 for w, s in zip(override, shape, strict=True))
    if links.wraparound == "full_axis":  # v5e/v6e: only an axis at full pod length (16) wraps
        return tuple(s == max(links.max_slice_shape) for s in shape)
    if links.wraparound == "cube_multiple":  # v4/v5p: any multiple of a full 4x4x4 cube wraps on all axes
        cube = all(s % 4 == 0 for s in shape)
        return tuple(cube for _ in shape)
    return (False,) * len(shape)


def make_cluster(chip: Chip, n_chips: int, slice_shape: tuple[int, ...] | None = None,
                 wraparound: bool | Sequence[bool] | None = None) -> Cluster:
    """`n_chips` of `chip`. TPU: `slice_shape` is one ICI slice (default: the largest balanced slice that
    fits the pod and divides n_chips); slices join over DCN. GPU: `slice_shape=(k,)` uses k GPUs per
    NVLink domain (default: full domains). `wraparound` overrides the book's rule (what-if studies)."""
    shape = tuple(slice_shape) if slice_shape else ()
    if isinstance(wraparound, bool):
        ndim = len(shape) or max(chip.links.torus_dims, 1)
        wraparound = (wraparound,) * ndim
    return Cluster(chip, n_chips, shape, tuple(wraparound) if wraparound is not None else None)


@dataclass(frozen=True)
class GroupPlacement:
    """How one communication group sits on the hardware."""

    size: int
    stride: int
    cluster: Cluster
    spans: tuple[Span, ...]  # fast-network spans: torus axes (TPU) or the NVLink domain (GPU)
    n_domains: int  # slices / nodes the group spans (1 = inside one fast domain)

    @property
    def fast_members(self) -> int:
        """Group members inside one fast domain (ICI slice or NVLink node)."""
        return math.prod(s.length for s in self.spans)

    @property
    def n_axes(self) -> int:
        return len(self.spans)

    @property
    def wraparound(self) -> bool:
        return bool(self.spans) and all(s.wrap for s in self.spans)

    @property
    def link(self) -> str:
        parts = ([self.cluster.fast_link] if self.spans else []) + (
            [self.cluster.scale_out_link] if self.n_domains > 1 else [])
        return "+".join(parts) or "none"

    def describe(self) -> str:
        if self.size == 1:
            return "local (group of 1)"
        parts = [self._fast_text()] if self.spans else []
        if self.n_domains > 1:
            unit = "slices" if self.cluster.is_torus else "nodes"
            parts.append(f"{_LINK_NAMES.get(self.cluster.scale_out_link, self.cluster.scale_out_link)} "
                         f"({self.n_domains} {unit})")
        return " + ".join(parts)

    def _fast_text(self) -> str:
        if not self.cluster.is_torus:
            where = "within a node" if self.n_domains == 1 else f"{self.fast_members} GPUs per node"
            return f"{self.cluster.links.fast_label} ({where})"
        axes = []
        for s in self.spans:
            full = self.cluster.slice_shape[s.dim]
            wrap = "wraparound" if s.wrap else "no wraparound"
            step = f", stride {s.step}" if s.step > 1 else ""
            axes.append(f"axis {s.dim} ({s.length} of {full}{step}, {wrap})")
        return "ICI " + ", ".join(axes)


_LINK_NAMES = {"infiniband": "InfiniBand", "dcn": "DCN", "roce": "RoCE", "ethernet": "Ethernet"}


def _spans_of(dims: tuple[int, ...], size: int, stride: int) -> list[tuple[int, int, int]]:
    """Split one strided group over the physical dims: (dim, length, step) per dim it spans."""
    out: list[tuple[int, int, int]] = []
    r, n = stride, size
    for d, s in enumerate(dims):
        if n == 1:
            break
        if r >= s:
            if r % s:
                raise InfeasibleError(f"stride {stride} does not line up with a physical axis of {s}")
            r //= s
            continue
        if s % r:
            raise InfeasibleError(f"stride {r} does not divide a physical axis of {s}")
        m = min(n, s // r)
        if n % m or s % (m * r):
            raise InfeasibleError(f"a group of {size} (stride {stride}) does not tile a physical axis of {s}")
        out.append((d, m, r))
        n, r = n // m, 1
    if n > 1:
        raise InfeasibleError(f"a group of {size} chips with stride {stride} exceeds the cluster")
    return out


@lru_cache(maxsize=8192)
def _place(cluster: Cluster, factors: tuple[tuple[int, int], ...]) -> GroupPlacement:
    merged: dict[int, list[int]] = {}
    for size, stride in factors:
        for d, m, r in _spans_of(cluster.dims, size, stride):
            length, step = merged.get(d, [1, r])
            merged[d] = [length * m, min(step, r)]
    last = len(cluster.dims) - 1
    spans = tuple(Span(d, m, r, _wraps(cluster, d, m, r)) for d, (m, r) in sorted(merged.items()) if d != last)
    size = math.prod(s for s, _ in factors)
    stride = min((st for _, st in factors), default=1)
    return GroupPlacement(size, stride, cluster, spans, merged.get(last, [1, 1])[0])


def _wraps(cluster: Cluster, d: int, length: int, step: int) -> bool:
    return cluster.wraparound[d] and length * step == cluster.slice_shape[d]


def place_group(cluster: Cluster, size: int, stride: int) -> GroupPlacement:
    """`size` chips spaced `stride` apart in the linear chip order; MeshplanError if it cannot map."""
    for name, v in (("group size", size), ("stride", stride)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise MeshplanError(f"{name} must be a positive integer, got {v}")
    if size * stride > cluster.n_chips:
        raise InfeasibleError(f"a group of {size} chips with stride {stride} needs {size * stride} chips; "
                            f"the cluster has {cluster.n_chips}")
    return _place(cluster, ((size, stride),)) if size > 1 else _place(cluster, ())


@dataclass(frozen=True)
class MeshMapping:
    """A logical mesh (ordered named axes) mapped onto a cluster; `order` is innermost first."""

    cluster: Cluster
    axes: dict[str, int]
    order: tuple[str, ...]
    strides: dict[str, int]

    def __hash__(self) -> int:
        return hash((self.cluster, tuple(self.axes.items()), self.order))

    def group(self, axes: Sequence[str]) -> GroupPlacement:
        """The communication group that spans the named mesh axes (all other axes fixed)."""
        if isinstance(axes, str):
            axes = [axes]
        for a in axes:
            if a not in self.axes:
                raise MeshplanError(f"axis '{a}' is not in the mesh (axes: {', '.join(self.axes)})")
        if len(set(axes)) != len(axes):
            raise MeshplanError(f"axis listed twice in {list(axes)}")
        return _place(self.cluster, _merge_factors(sorted((self.strides[a], self.axes[a]) for a in axes)))

    def describe(self) -> str:
        """e.g. 'tensor=8 -> NVLink (within a node); data=64 -> InfiniBand (64 nodes)'."""
        return "; ".join(f"{a}={self.axes[a]} -> {self.group([a]).describe()}" for a in self.order)

    def as_dict(self) -> dict:
        return {"cluster": self.cluster.describe(), "order_innermost_first": list(self.order),
                "axes": {a: {"size": self.axes[a], "stride": self.strides[a],
                             "placement": self.group([a]).describe()} for a in self.order}}


def _merge_factors(by_stride: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Merge (stride, size) pairs that tile contiguously into one (size, stride) factor; drop size 1."""
    out: list[list[int]] = []
    for stride, size in by_stride:
        if size == 1:
            continue
        if out and out[-1][1] * out[-1][0] == stride:
            out[-1][0] *= size
        else:
            out.append([size, stride])
    return tuple((s, st) for s, st in out)


def axis_rank(name: str) -> int:
    """0 = heaviest communicator (tensor/expert/context) ... 4 = pipeline; unknown names rank 2."""
    low = name.lower()
    for rank, names in _AXIS_RANKS:
        if low in names or any(low.startswith(n) for n in names if len(n) > 3):
            return rank
    return _UNKNOWN_RANK


def default_order(mesh: dict[str, int]) -> tuple[str, ...]:
    """Innermost first: by rank; among equal ranks the later-listed axis is inner (row-major, like JAX)."""
    names = list(mesh)
    return tuple(sorted(names, key=lambda a: (axis_rank(a), -names.index(a))))


def map_mesh(cluster: Cluster, mesh: dict[str, int], order: Sequence[str] | None = None) -> MeshMapping:
    """Map a logical mesh onto `cluster`: heavy axes innermost (fastest links) unless `order` is given."""
    _check_mesh(cluster, mesh)
    order = tuple(order) if order is not None else default_order(mesh)
    if sorted(order) != sorted(mesh):
        raise MeshplanError(f"order {list(order)} must list each mesh axis ({', '.join(mesh)}) exactly once")
    strides, s = {}, 1
    for a in order:
        strides[a] = s
        s *= mesh[a]
    mapping = MeshMapping(cluster, dict(mesh), order, strides)
    for a in order:
        try:
            mapping.group([a])
        except MeshplanError as exc:
            raise MeshplanError(f"mesh axis {a}={mesh[a]} cannot map onto {cluster.describe()}: {exc}") from None
    return mapping


def _check_mesh(cluster: Cluster, mesh: dict[str, int]) -> None:
    if not mesh:
        raise MeshplanError("mesh is empty: give axes as name=size, e.g. data=8,tensor=4")
    for a, n in mesh.items():
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise MeshplanError(f"mesh axis '{a}' must have a positive integer size, got {n}")
    total = math.prod(mesh.values())
    if total != cluster.n_chips:
        text = ",".join(f"{a}={n}" for a, n in mesh.items())
        raise MeshplanError(f"mesh {text} has {total} devices but the cluster has {cluster.n_chips} chips")
