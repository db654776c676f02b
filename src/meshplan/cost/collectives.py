"""Collective costs on real topologies: AllGather, ReduceScatter, AllReduce, AllToAll, permute.

V (`nbytes`) is the full (gathered) array of ONE group (AllToAll: the whole array exchanged; permute: the
bytes each chip sends). Each cost has a bandwidth term (per network level, the slowest level binds as the
levels pipeline) and a latency term (hops x per-hop latency); total = max(latency, bandwidth) as in the
book's latest edition (ch.3 §latency), except permute / point-to-point where they add (book ch.2 Q5).
`ideal=True` gives the book's formulas exactly; otherwise each level's bandwidth is scaled by the measured
efficiency in data/collective_efficiency.yaml.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import yaml

from meshplan.cost.topology import Cluster, GroupPlacement, MeshMapping, Span, place_group
from meshplan.errors import MeshplanError
from meshplan.math.interp import log_interp

KINDS = ("allgather", "reducescatter", "allreduce", "alltoall", "permute")
_EFF_FILE = Path(__file__).parent / "data" / "collective_efficiency.yaml"


@dataclass(frozen=True)
class CollectiveCost:
    kind: str
    time_s: float
    bytes_per_chip: float  # bytes each chip sends
    algorithm: str
    regime: str  # "bandwidth" | "latency"
    bandwidth_time_s: float
    latency_time_s: float
    group_size: int
    link: str  # "ici", "nvlink", "infiniband", "dcn", "nvlink+infiniband", ...
    levels: tuple[tuple[str, float], ...] = field(default=())  # bandwidth time per network level

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "levels"}
        d["levels"] = dict(self.levels)
        return d


# ---------------------------------------------------------------- efficiency catalog


@lru_cache(maxsize=1)
def _catalog() -> dict:
    return yaml.safe_load(_EFF_FILE.read_text())


def _curve(link: str, chip: str | None) -> dict | None:
    """The catalog entry of `link`: the curve of the chip's generation where `generations` lists the chip by its
    catalog name (NVLink: A100's NVLink 3, Hopper's NVLink 4), else the link's generic curve."""
    entry = _catalog()["links"].get(link)
    if entry is None or chip is None:
        return entry
    return next((g for g in entry.get("generations", ()) if chip in g["chips"]), entry)


def efficiency(link: str, nbytes: float, chip: str | None = None, group: int | None = None) -> float:
    """Achieved fraction of peak bandwidth on `link` for a V-byte collective (log-interpolated curve) on
    `chip` (a catalog name; None or an unlisted chip: the link's generic curve). A curve measured by group size
    (`by_group`: [GPUs, fraction], log-interpolated and clamped; PCIe, where the node's host bridges, not the cards'
    links, bind as more GPUs share them) is read at `group` GPUs (None: its largest group)."""
    entry = _curve(link, chip)
    if entry is None:
        return 1.0
    by_group = entry.get("by_group")
    if by_group:
        return log_interp(by_group, float(group if group else by_group[-1][0]))
    pts = entry.get("points")
    if not pts or nbytes <= 0:
        return float(entry["value"])
    return log_interp(pts, nbytes)


def ep_dispatch_scale_out_efficiency(backend: str, nodes: float) -> float | None:
    """Achieved fraction of the per-GPU scale-out line rate in the network leg of a deduplicating MoE dispatcher
    (`backend`: "hybridep" or "deepep") whose EP group spans `nodes` nodes: the measured points of
    data/collective_efficiency.yaml `ep_dispatch_scale_out`, log-interpolated in nodes and clamped outside. None for
    a backend without measured points."""
    entry = _catalog().get("ep_dispatch_scale_out", {}).get(backend)
    if entry is None:
        return None
    return log_interp(entry["points"], nodes)


def sharp_speedup(ideal: bool) -> float:
    """AllReduce speed-up from in-network reduction: 2x in theory (B/W vs 2B/W), ~1.3x measured (ch.12)."""
    return 2.0 if ideal else float(_catalog()["sharp"]["allreduce_speedup"]["value"])


def tpu_reduction_hbm_passes() -> float:
    """HBM accesses per element a TPU reduce-scatter or all-reduce makes its TensorCore do for each element it merges
    (data/collective_efficiency.yaml `tpu_reduction`: read the local partial, read the received chunk, write the sum)."""
    return float(_catalog()["tpu_reduction"]["hbm_passes_per_element"]["value"])


def tpu_reduction_s(nbytes, n, hbm_bytes_per_s: float):
    """TensorCore seconds of the merges of a TPU reduce-scatter (or an all-reduce, whose reduce-scatter half merges)
    of an `nbytes` array per rank over `n` ranks: each rank merges (n - 1)/n of the array's elements, each merge an
    HBM-bound pass of tpu_reduction_hbm_passes() accesses at `hbm_bytes_per_s` (data/collective_efficiency.yaml
    `tpu_reduction`). The ring's DMAs do not do it; the chip's vector unit does, in series with the layer's work unless
    offloaded (training: Options.sparsecore_reduce). Scalars or numpy arrays; 0 for a group of one."""
    n = np.asarray(n, float)
    frac = np.where(n > 1, (n - 1) / np.maximum(n, 1.0), 0.0)
    return tpu_reduction_hbm_passes() * np.asarray(nbytes, float) * frac / hbm_bytes_per_s


def leaf_degree_nodes(domain_size: int) -> int:
    """Nodes under one leaf level of the fat tree (DGX SuperPOD SU: 32 nodes; NVL72: 8 racks)."""
    key = "leaf_degree_nodes_nvl72" if domain_size >= 72 else "leaf_degree_nodes"
    return int(_catalog()["fat_tree"][key]["value"])


# ---------------------------------------------------------------- levels


@dataclass(frozen=True)
class Level:
    """One network level of a group: AllGather bandwidth time of V over it, and its latency."""

    name: str
    link: str
    bandwidth_time_s: float
    latency_time_s: float


def _eff(link: str, nbytes: float, ideal: bool, chip: str | None = None, group: int | None = None) -> float:
    return 1.0 if ideal else efficiency(link, nbytes, chip, group)


def _torus_axis_bw(s: Span, w1: float) -> float:
    """AllGather bandwidth of one torus axis (book ch.3 §4.3): a ring with wraparound gives T = V/W_bidir,
    W_bidir = 2 x one-way link; without, T = V(X-1)/(X W_oneway). A strided span shares links `step` ways."""
    if s.wrap:
        return 2.0 * w1 / s.step
    return w1 * s.length / ((s.length - 1) * s.step)


def _hops(s: Span) -> float:
    """Ring hops along one axis: X/2 with wraparound, X-1 without (book ch.3 §latency)."""
    return (s.length / 2 if s.wrap else s.length - 1) * s.step


def _torus_levels(p: GroupPlacement, V: float, ideal: bool) -> list[Level]:
    links, out = p.cluster.links, []
    spans = [s for s in p.spans if s.length > 1]
    if spans:
        # several torus axes at once divide the bandwidth term by the number of axes (book ch.3 §4.3)
        bw = sum(_torus_axis_bw(s, links.ici_bandwidth_per_link_bytes_per_s) for s in spans)
        lat = sum(_hops(s) for s in spans) * links.fast_hop_latency_s
        out.append(Level("ici", "ici", V / (bw * _eff("ici", V, ideal)), lat))
    if p.n_domains > 1:
        out.append(_scale_out_ring(p, V, ideal, "dcn"))
    return out


def _scale_out_ring(p: GroupPlacement, V: float, ideal: bool, name: str) -> Level:
    """Ring across M domains, each chip on its own NIC/DCN share (book ch.5 §DCN, ch.12 rail-aligned):
    T = V (M-1) / (M k W_chip), k = group members per domain."""
    M, k, links = p.n_domains, p.fast_members, p.cluster.links
    w = k * links.scale_out_bandwidth_bytes_per_s * _eff(links.scale_out_kind, V, ideal)
    return Level(name, links.scale_out_kind, V * (M - 1) / (M * w), (M - 1) * links.scale_out_hop_latency_s)


def _gpu_levels(p: GroupPlacement, V: float, ideal: bool, in_network: bool = False) -> list[Level]:
    """Book ch.12 §collectives (precise): T = V max_i (D_i - 1) / (D_i W_i) over NVLink, leaf and spine.
    `in_network` (SHARP, book ch.12 §in-network reductions): each GPU sends V to the switch, which reduces and
    sends V back, so a level costs V / W_i with no (D_i - 1)/D_i factor."""
    links, out = p.cluster.links, []
    k, M = p.fast_members, p.n_domains

    def frac(d: int) -> float:
        return 1.0 if in_network else (d - 1) / d

    if k > 1:  # the node fabric: NVLink, PCIe or Infinity Fabric (a full mesh gives k - 1 links: Links docs)
        w = links.group_bandwidth_bytes_per_s(k) * _eff(links.fast_link, V, ideal, p.cluster.chip_name, k)
        out.append(Level(links.fast_link, links.fast_link, V * frac(k) / w, (k - 1) * links.fast_hop_latency_s))
    if M > 1:
        sp = p.cluster.chip.superpod  # the chip's SuperPod spec where it has one (book ch.12), else the catalog
        L = int(sp["nodes_per_su"]) if sp.get("nodes_per_su") else leaf_degree_nodes(p.cluster.domain_size)
        w_nic = k * links.scale_out_bandwidth_bytes_per_s * _eff(links.scale_out_kind, V, ideal)
        d_leaf, d_spine = min(M, L), math.ceil(M / L)
        lat = (M - 1) * links.scale_out_hop_latency_s
        out.append(Level("leaf", links.scale_out_kind, V * frac(d_leaf) / w_nic, lat))
        if d_spine > 1:  # spine children are whole leaf groups at full bisection: L x node egress
            out.append(Level("spine", links.scale_out_kind, V * frac(d_spine) / (L * w_nic), 0.0))
    return out


def network_levels(p: GroupPlacement, nbytes: float, *, ideal: bool = False, in_network: bool = False) -> list[Level]:
    """AllGather of `nbytes` over the group, level by level (the slowest bandwidth level binds);
    `in_network`: the switch-reduced (SHARP) form of the GPU levels."""
    if p.cluster.is_torus:
        return _torus_levels(p, nbytes, ideal)
    return _gpu_levels(p, nbytes, ideal, in_network)


def level_bandwidths(p: GroupPlacement) -> dict[str, float]:
    """Effective AllGather bandwidth per level, V / T_level (book ch.12: node 514 GB/s, leaf 413 GB/s)."""
    return {lv.name: 1.0 / lv.bandwidth_time_s for lv in network_levels(p, 1.0, ideal=True) if lv.bandwidth_time_s}


# ---------------------------------------------------------------- costs


def _result(kind: str, p: GroupPlacement, sent: float, algo: str, bw: float, lat: float,
            levels: Sequence[Level] = (), additive: bool = False) -> CollectiveCost:
    total = bw + lat if additive else max(bw, lat)
    regime = "latency" if lat > bw else "bandwidth"
    return CollectiveCost(kind, total, sent, algo, regime, bw, lat, p.size, p.link,
                          tuple((lv.name, lv.bandwidth_time_s) for lv in levels))


def _algo_name(p: GroupPlacement, base: str) -> str:
    if p.cluster.is_torus:
        axes = [s for s in p.spans if s.length > 1]
        wrap = "bidirectional ring (wraparound)" if axes and all(s.wrap for s in axes) else "ring"
        parts = [f"{wrap} over {len(axes)} torus axis(es)"] if axes else []
        parts += [f"DCN ring across {p.n_domains} slices"] if p.n_domains > 1 else []
    else:
        parts = [f"{p.cluster.links.fast_label} {base} ({p.fast_members} GPUs)"] if p.fast_members > 1 else []
        parts += [f"rail-aligned {p.cluster.scale_out_link} ring ({p.n_domains} nodes)"] if p.n_domains > 1 else []
    return ("hierarchical: " if len(parts) > 1 else "") + " + ".join(parts)


def _op_latency(p: GroupPlacement, ideal: bool) -> float:
    """The fixed start-up cost of one collective op on the group's fast domain, once per op whatever its hops
    (hardware YAML links.collective_op_latency_s: measured on TPU ICI, where a lone one-hop ppermute of a few KiB takes
    ~5-6 us against the book's ~1 us per hop). 0 in the book's own formulas (`ideal`)."""
    return 0.0 if ideal else p.cluster.links.collective_op_latency_s


def _gather(kind: str, p: GroupPlacement, V: float, ideal: bool) -> CollectiveCost:
    """AllGather = ReduceScatter (transposes, book ch.3): each chip sends V (n-1)/n."""
    levels = network_levels(p, V, ideal=ideal)
    bw = max(lv.bandwidth_time_s for lv in levels)
    lat = sum(lv.latency_time_s for lv in levels) + _op_latency(p, ideal)
    return _result(kind, p, V * (p.size - 1) / p.size, _algo_name(p, "ring"), bw, lat, levels)


def _allreduce(p: GroupPlacement, V: float, ideal: bool, sharp: bool) -> CollectiveCost:
    """AllReduce = ReduceScatter + AllGather (2x, book ch.3 §4.2). With SHARP the switch reduces: ideally
    T = V / W per level (book ch.12 §in-network reductions: B/W, no (N-1)/N factor, so 1.75x faster than the
    ring on 8 GPUs, not 2x); measured only ~1.3x faster than the ring, which the realistic cost uses."""
    ag = _gather("allgather", p, V, ideal)
    if sharp and ideal and not p.cluster.is_torus:
        lv = network_levels(p, V, ideal=True, in_network=True)
        levels = tuple((x.name, x.bandwidth_time_s) for x in lv)
        bw = max(t for _, t in levels)
    else:
        f = sharp_speedup(ideal) if sharp else 1.0
        bw = 2 * ag.bandwidth_time_s / f
        levels = tuple((n, 2 * t / f) for n, t in ag.levels)
        if sharp and not p.cluster.is_torus:
            # the measured speed-up over the ring never beats the in-network floor, V / W per level (book ch.12):
            # with few ranks the ring itself sends about V, and 2(N-1)/N V / 1.3 would go below it (session 21, QA
            # finding: 1 GiB over two nodes' 50 GB/s NICs in 18.4 ms, under the 21.5 ms floor). The floor is the
            # book's ideal one: no measured in-network efficiency is layered on the measured ring speed-up
            floor = {x.name: x.bandwidth_time_s for x in network_levels(p, V, ideal=True, in_network=True)}
            levels = tuple((n, max(lt, floor.get(n, 0.0))) for n, lt in levels)
            bw = max(bw, *floor.values()) if floor else bw
    t_op = _op_latency(p, ideal)  # one op: its start-up once, its hops twice (reduce-scatter, then all-gather)
    lat = (ag.latency_time_s - t_op) * (1 if sharp else 2) + t_op
    algo = "SHARP in-network reduction" if sharp else "reduce-scatter + all-gather: " + ag.algorithm
    if not p.cluster.is_torus and p.n_domains > 2:
        # NCCL's double binary tree across nodes: 2 log2(M) network hops up and down instead of the ring's 2(M - 1),
        # at the ring's bandwidth for large messages ("Massively Scale Your Deep Learning Training with NCCL 2.4",
        # NVIDIA blog 2019: logarithmic latency, full bandwidth); NCCL runs whichever its model times faster
        # (src/graph/tuning.cc). Session 23, QA finding: 1 GB over 2,048 nodes read latency-bound at 10 ms.
        links = p.cluster.links
        tree = t_op + 2 * ((p.fast_members - 1) * links.fast_hop_latency_s
                           + math.ceil(math.log2(p.n_domains)) * links.scale_out_hop_latency_s)
        if tree < lat:  # SHARP's reduction runs up and down the switches' aggregation tree: no longer than this
            lat = tree
            algo = algo if sharp else (f"{links.fast_label} chain ({p.fast_members} GPUs) + double binary tree "
                                       f"({p.n_domains} nodes)")
    sent = V if sharp else 2 * ag.bytes_per_chip  # SHARP: egress V(N-1)/N + V/N per GPU (book ch.12)
    return CollectiveCost("allreduce", max(bw, lat), sent, algo, "latency" if lat > bw else "bandwidth",
                          bw, lat, p.size, p.link, levels)


def _alltoall_torus(p: GroupPlacement, V: float, ideal: bool) -> tuple[float, float]:
    """Book ch.3 §4.3 (latest): ND AllToAll T = V max(axis) / (4 N W_bidir); without wraparound the
    bisection halves (W_oneway). Across M slices each chip sends V (M-1) / (M N) over DCN."""
    links, N, M = p.cluster.links, p.size, p.n_domains
    w1 = links.ici_bandwidth_per_link_bytes_per_s * _eff("ici", V, ideal)
    bw = 0.0
    for s in (s for s in p.spans if s.length > 1):
        w = 2 * w1 if s.wrap else w1
        bw = max(bw, (V / M) * s.length * s.step / (4 * p.fast_members * w))
    lat = sum(_hops(s) for s in p.spans if s.length > 1) * links.fast_hop_latency_s
    if M > 1:
        w_dcn = links.scale_out_bandwidth_bytes_per_s * _eff(links.scale_out_kind, V, ideal)
        bw = max(bw, V * (M - 1) / (M * N * w_dcn))
        lat += links.scale_out_hop_latency_s
    return bw, lat


def _alltoall_gpu(p: GroupPlacement, V: float, ideal: bool) -> tuple[float, float]:
    """Book ch.12: in node T = V (N-1) / (W N^2); across M nodes T = V (M-1) / (M^2 W_node), W_node = k NICs.
    In general each GPU holds V/(kM) and sends 1/(kM) of it to every peer."""
    links, k, M = p.cluster.links, p.fast_members, p.n_domains
    w_gpu = links.group_bandwidth_bytes_per_s(k) * _eff(links.fast_link, V, ideal, p.cluster.chip_name, k)
    w_nic = links.scale_out_bandwidth_bytes_per_s * _eff(links.scale_out_kind, V, ideal)
    t_node = V * (k - 1) / (k * k * M * M * w_gpu)
    t_out = V * (M - 1) / (M * M * k * w_nic)
    lat = (links.fast_hop_latency_s if k > 1 else 0.0) + (links.scale_out_hop_latency_s if M > 1 else 0.0)
    return max(t_node, t_out), lat


def _alltoall(p: GroupPlacement, V: float, ideal: bool) -> CollectiveCost:
    bw, lat = (_alltoall_torus if p.cluster.is_torus else _alltoall_gpu)(p, V, ideal)
    lat += _op_latency(p, ideal)
    sent = V / p.size * (p.size - 1) / p.size  # each chip holds V/N and keeps 1/N of it
    return _result("alltoall", p, sent, "direct all-to-all (bisection-bound)", bw, lat)


def ragged_destinations(k: int, n: int) -> float:
    """Expected distinct devices a token routed to `k` of `n` devices' experts lands on (uniform routing):
    n (1 - ((n-1)/n)^k); 1 for k = 1 and -> min(k, n) (book ch.12 §other collectives: a ragged top-k
    AllToAll costs min(k/N, 1) of an AllGather of the activations, i.e. up to k x a dense AllToAll)."""
    if k < 1 or n < 1:
        raise MeshplanError(f"top-k and group size must be at least 1, got k={k}, n={n}")
    return n * (1.0 - ((n - 1) / n) ** k)


def ragged_alltoall(nbytes: float, mapping: MeshMapping, axes: Sequence[str], k: int, *,
                    ideal: bool = False) -> CollectiveCost:
    """MoE dispatch (or combine) of `nbytes` of token activations over `axes` when each token goes to its
    top-`k` experts spread over the group (book ch.12 §other collectives, ragged AllToAll): a dense
    AllToAll sends each token to one device; here each token is copied to `ragged_destinations(k, N)`
    devices, so the bandwidth term and bytes sent scale by that factor (latency unchanged). In one 8-GPU
    node: V (N-1)/(W N^2) x N (1 - ((N-1)/N)^k)."""
    dense = collective("alltoall", nbytes, mapping, axes, ideal=ideal)
    if dense.group_size <= 1 or nbytes == 0:
        return dense
    f = ragged_destinations(k, dense.group_size)
    bw = dense.bandwidth_time_s * f
    return CollectiveCost("alltoall", max(bw, dense.latency_time_s), dense.bytes_per_chip * f,
                          f"ragged top-{k} all-to-all ({f:.2f} destinations per token)",
                          "latency" if dense.latency_time_s > bw else "bandwidth", bw, dense.latency_time_s,
                          dense.group_size, dense.link)


def _permute(p: GroupPlacement, nbytes: float, ideal: bool) -> CollectiveCost:
    """Ring shift by one: bytes / one-way link bandwidth + hop latency (book ch.2 Q5, ch.3 collective matmul).
    Members at a domain boundary send over the scale-out link, which then binds."""
    links = p.cluster.links
    if p.n_domains > 1:
        w = links.scale_out_bandwidth_bytes_per_s * _eff(links.scale_out_kind, nbytes, ideal)
        return _result("permute", p, nbytes, f"ring shift over {p.cluster.scale_out_link}", nbytes / w,
                       links.scale_out_hop_latency_s, additive=True)
    if not p.cluster.is_torus:  # to one neighbour: a full mesh's single link to it (Links.group_bandwidth_bytes_per_s)
        w = links.group_bandwidth_bytes_per_s(2) * _eff(links.fast_link, nbytes, ideal, p.cluster.chip_name, 2)
        return _result("permute", p, nbytes, f"ring shift over {links.fast_label}", nbytes / w,
                       links.fast_hop_latency_s, additive=True)
    s = next(s for s in p.spans if s.length > 1)  # shift along the innermost axis
    w = links.ici_bandwidth_per_link_bytes_per_s * _eff("ici", nbytes, ideal)
    hops = s.step if s.wrap else (s.length - 1) * s.step  # without wraparound the last chip sends the long way
    return _result("permute", p, nbytes, "ring shift over ICI", nbytes * s.step / w,
                   hops * links.fast_hop_latency_s + _op_latency(p, ideal), additive=True)


def _zero(kind: str, p: GroupPlacement) -> CollectiveCost:
    return CollectiveCost(kind, 0.0, 0.0, "none (group of 1)", "bandwidth", 0.0, 0.0, p.size, "none")


@lru_cache(maxsize=65536)
def placement_cost(kind: str, nbytes: float, p: GroupPlacement, ideal: bool = False,
                   sharp: bool | None = None) -> CollectiveCost:
    """The cost of one collective over a placed group (cached)."""
    _check(kind, nbytes)
    if p.size == 1 or nbytes == 0:
        return _zero(kind, p)
    if kind in ("allgather", "reducescatter"):
        return _gather(kind, p, float(nbytes), ideal)
    if kind == "allreduce":
        if sharp and not p.cluster.links.sharp:
            # the fabric reduces nothing itself (TPU ICI and DCN, pre-Hopper NVSwitch, RoCE: the chip's spec, links.sharp)
            raise MeshplanError(f"{p.cluster.chip.name} has no in-network reduction (SHARP) in its spec (drop --sharp)")
        use_sharp = p.cluster.links.sharp if sharp is None else sharp
        return _allreduce(p, float(nbytes), ideal, use_sharp)
    if kind == "alltoall":
        return _alltoall(p, float(nbytes), ideal)
    return _permute(p, float(nbytes), ideal)


def _check(kind: str, nbytes: float) -> None:
    if kind not in KINDS:
        raise MeshplanError(f"unknown collective '{kind}' (known: {', '.join(KINDS)})")
    if not isinstance(nbytes, numbers.Real) or isinstance(nbytes, bool) or math.isnan(nbytes) or nbytes < 0:
        raise MeshplanError(f"byte count must be a non-negative number, got {nbytes}")
    if math.isinf(nbytes):
        raise MeshplanError("byte count must be finite")


def group_collective(kind: str, nbytes: float, cluster: Cluster, size: int, stride: int = 1, *,
                     ideal: bool = False, sharp: bool | None = None) -> CollectiveCost:
    """A collective over `size` chips spaced `stride` apart. `sharp=None` uses the chip's catalog flag."""
    _check(kind, nbytes)
    return placement_cost(kind, nbytes, place_group(cluster, size, stride), ideal, sharp)


def collective(kind: str, nbytes: float, mapping: MeshMapping, axes: Sequence[str], *, ideal: bool = False,
               sharp: bool | None = None) -> CollectiveCost:
    """A collective over the named mesh axes (the other axes index independent groups running at once)."""
    _check(kind, nbytes)
    return placement_cost(kind, nbytes, mapping.group(axes), ideal, sharp)


def point_to_point(cluster: Cluster, nbytes: float, src: Sequence[int], dst: Sequence[int], *,
                   ideal: bool = True) -> CollectiveCost:
    """Send `nbytes` between two chips of one TPU slice (coordinates): bytes split over the usable ports
    (one per axis that differs) + hops x per-hop latency, added (book ch.2 Q5, latest edition)."""
    if not cluster.is_torus:
        raise MeshplanError("point_to_point takes torus coordinates; use permute for GPUs")
    _check("permute", nbytes)
    shape, links = cluster.slice_shape, cluster.links
    if len(src) != len(shape) or len(dst) != len(shape):
        raise MeshplanError(f"coordinates need {len(shape)} entries for slice {list(shape)}")
    dist = [_axis_distance(a, b, s, w) for a, b, s, w in zip(src, dst, shape, cluster.wraparound, strict=True)]
    ports = max(sum(1 for d in dist if d), 1)
    w = links.ici_bandwidth_per_link_bytes_per_s * _eff("ici", nbytes, ideal)
    p = place_group(cluster, 1, 1)
    return _result("permute", p, nbytes, f"point-to-point over {ports} port(s)", nbytes / (ports * w),
                   sum(dist) * links.fast_hop_latency_s, additive=True)


def _axis_distance(a: int, b: int, size: int, wrap: bool) -> int:
    if not (0 <= a < size and 0 <= b < size):
        raise MeshplanError(f"coordinate out of range for an axis of {size}")
    d = abs(a - b)
    return min(d, size - d) if wrap else d
