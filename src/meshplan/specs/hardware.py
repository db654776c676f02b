"""Chips: peak FLOP/s per dtype, HBM, host link, fast domain (ICI torus or NVLink/NVSwitch), scale-out.

Loaded from `data/hardware/*.yaml` (one file per chip, every number with its source) or from a user's YAML
of the same schema. Units are SI on load: bytes, bytes/s, FLOP/s, seconds, dollars per chip-hour.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from meshplan.errors import MeshplanError, unknown_name_error
from meshplan.specs._load import DATA_DIR, FieldReader, find_spec, read_mapping
from meshplan.validate import hardware_rule

HARDWARE_DIR = DATA_DIR / "hardware"
DTYPES = ("bf16", "fp16", "fp8", "int8", "int4", "fp32")
# A chip's fast network (links.fast_domain) -> its link type (the efficiency curve's key) and its name in tables.
FAST_LINKS = {"ici_torus": "ici", "nvswitch": "nvlink", "pcie": "pcie", "xgmi": "xgmi"}
FAST_LABELS = {"ici_torus": "ICI", "nvswitch": "NVLink", "pcie": "PCIe", "xgmi": "Infinity Fabric"}

# Datasheets quote fp16 tensor throughput equal to bf16 on every chip in the catalog.
_DTYPE_ALIASES = {"fp16": "bf16", "float16": "bf16", "bfloat16": "bf16", "float8": "fp8", "e4m3": "fp8"}


@dataclass(frozen=True)
class Links:
    """The chip's networks. `fast_domain` is 'ici_torus' (TPU), or a GPU node's own fabric: 'nvswitch' (an NVLink
    domain behind NVSwitches), 'pcie' (GPUs without NVLink, talking over the node's PCIe switches: L40S, H100 PCIe)
    or 'xgmi' (AMD Instinct: every GPU of the node wired to every other by its own Infinity Fabric link).

    Bandwidths are one direction per chip (egress); the book's bidirectional W_ici is 2x the per-link value.
    For the GPU fabrics `nvlink_bandwidth_bytes_per_s` holds the GPU's whole egress over its node fabric and
    `nvlink_domain_size` the GPUs sharing it, whatever the fabric (the YAML names them per fabric); on 'xgmi'
    `peer_link_bandwidth_bytes_per_s` is one link's, so a group of k GPUs reaches only k-1 of its links.
    """

    fast_domain: str
    scale_out_bandwidth_bytes_per_s: float
    scale_out_kind: str
    sharp: bool
    fast_hop_latency_s: float
    scale_out_hop_latency_s: float
    # fixed start-up cost of one collective op on the fast domain, on top of its hops (TPU ICI: an XLA collective's
    # own synchronisation, measured; 0 where the hop latency already holds it)
    collective_op_latency_s: float = 0.0
    # GPU (nvswitch)
    nvlink_bandwidth_bytes_per_s: float = 0.0
    nvlink_domain_size: int = 1
    # TPU (ici_torus)
    ici_links_per_chip: int = 0
    ici_bandwidth_per_link_bytes_per_s: float = 0.0
    torus_dims: int = 0
    max_slice_shape: tuple[int, ...] = ()
    wraparound: str = "none"
    chips_per_host: int = 8
    # GPU (xgmi): one direct link per peer; 0 on switched fabrics (nvswitch, pcie)
    peer_link_bandwidth_bytes_per_s: float = 0.0

    @property
    def is_torus(self) -> bool:
        return self.fast_domain == "ici_torus"

    @property
    def fast_link(self) -> str:
        """The fast network's link type, the key of its efficiency curve (collective_efficiency.yaml links)."""
        return FAST_LINKS[self.fast_domain]

    @property
    def fast_label(self) -> str:
        """The fast network as a person names it (tables, errors)."""
        return FAST_LABELS[self.fast_domain]

    def group_bandwidth_bytes_per_s(self, members: int) -> float:
        """One GPU's egress toward `members` - 1 peers of its node fabric. A switched fabric (NVSwitch, a PCIe
        switch) gives the GPU's whole egress to any group; a full mesh (xgmi: AMD Instinct platform, one Infinity
        Fabric link per peer pair) only the links to the peers in the group: (members - 1) x one link, so TP 2 on
        MI300X gets one 64 GB/s link of seven (AMD Instinct MI300X platform: 8 GPUs fully connected)."""
        if self.peer_link_bandwidth_bytes_per_s > 0:
            return min(self.nvlink_bandwidth_bytes_per_s, max(members - 1, 1) * self.peer_link_bandwidth_bytes_per_s)
        return self.nvlink_bandwidth_bytes_per_s

    @property
    def fast_domain_size(self) -> int:
        """Chips reachable over the fast network: a full TPU pod or one NVLink domain."""
        if self.is_torus:
            n = 1
            for s in self.max_slice_shape:
                n *= s
            return n
        return self.nvlink_domain_size

    @property
    def fast_bandwidth_bytes_per_s(self) -> float:
        """One-way egress of one chip over its fast network (all ICI links, or NVLink)."""
        if self.is_torus:
            return self.ici_links_per_chip * self.ici_bandwidth_per_link_bytes_per_s
        return self.nvlink_bandwidth_bytes_per_s

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["max_slice_shape"] = list(self.max_slice_shape)
        d.pop("peer_link_bandwidth_bytes_per_s")
        if self.is_torus:
            for k in ("nvlink_bandwidth_bytes_per_s", "nvlink_domain_size"):
                d.pop(k)
        else:
            for k in ("ici_links_per_chip", "ici_bandwidth_per_link_bytes_per_s", "torus_dims",
                      "max_slice_shape", "wraparound"):
                d.pop(k)
            # the fabric's own YAML names (chip_from_mapping reads them back)
            if self.fast_domain == "pcie":
                d["pcie_bandwidth_bytes_per_s"] = d.pop("nvlink_bandwidth_bytes_per_s")
                d["pcie_domain_size"] = d.pop("nvlink_domain_size")
            elif self.fast_domain == "xgmi":
                d.pop("nvlink_bandwidth_bytes_per_s")
                d["xgmi_link_bandwidth_bytes_per_s"] = self.peer_link_bandwidth_bytes_per_s
                d["xgmi_domain_size"] = d.pop("nvlink_domain_size")
        return d


@dataclass(frozen=True)
class Chip:
    """One accelerator. `peak_flops_per_s` holds dense peaks only, keyed by dtype."""

    name: str
    kind: str  # "gpu" | "tpu"
    description: str
    peak_flops_per_s: dict[str, float]
    hbm_bytes: float
    hbm_bandwidth_bytes_per_s: float
    host_bandwidth_bytes_per_s: float
    links: Links
    price_per_chip_hour: float
    host_memory_bytes: float = 0.0
    # the host's DRAM bandwidth per chip (the node's sockets' peak / chips per node): times the CPU Adam step of
    # optimizer offload (ZeRO-Offload); 0 = no figure (optimizer offload is then not searched)
    host_memory_bandwidth_bytes_per_s: float = 0.0
    # what the driver exposes (nvidia-smi memory.total): marketed "80 GB" HBM is 80 GiB less ECC/driver reserve;
    # 0 = same as hbm_bytes. Fit decisions use it; the marketed capacity stays for reports and the book's sums.
    hbm_usable_bytes: float = 0.0
    # the kind of price (provider, on-demand list or assumed, region, date): printed beside every $ figure, since
    # prices from different bases do not compare
    price_basis: str = "catalog price"
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    # on-chip memories (book ch.2 VMEM, ch.12 SMEM/L2/registers/TMEM): keys in ON_CHIP_KEYS; optional
    on_chip_memory: dict[str, float] = field(default_factory=dict, compare=False)
    # scale-out fabric of the vendor's reference cluster (book ch.12 SuperPod): keys in SUPERPOD_KEYS; optional
    superpod: dict[str, float] = field(default_factory=dict, compare=False)

    @property
    def usable_hbm_bytes(self) -> float:
        return self.hbm_usable_bytes or self.hbm_bytes

    def peak(self, dtype: str = "bf16") -> float:
        """Dense peak FLOP/s (or OP/s) for `dtype`; an error if the chip has no such unit."""
        key = _DTYPE_ALIASES.get(dtype, dtype)
        if key == "int4" and "int4" not in self.peak_flops_per_s:
            raise MeshplanError(f"{self.name} has no int4 matmul unit; int4 weights compute in bf16 or int8")
        if key not in self.peak_flops_per_s:
            have = ", ".join(sorted(self.peak_flops_per_s))
            raise MeshplanError(f"{self.name} has no dense {dtype} peak in its spec (has: {have})")
        return self.peak_flops_per_s[key]

    def critical_intensity(self, dtype: str = "bf16") -> float:
        """C / W_hbm in FLOPs per byte (book ch.1): above it a kernel is compute-bound."""
        return self.peak(dtype) / self.hbm_bandwidth_bytes_per_s

    def with_overrides(self, **changes: Any) -> Chip:
        return replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        peaks = {d: self.peak_flops_per_s.get(d) for d in ("bf16", "fp8", "int8")}
        peaks.update({d: v for d, v in self.peak_flops_per_s.items() if d not in peaks})
        return {
            "name": self.name,
            "kind": self.kind,
            "description": self.description,
            "peak_flops_per_s": peaks,
            "hbm_bytes": self.hbm_bytes,
            "hbm_usable_bytes": self.usable_hbm_bytes,
            "hbm_bandwidth_bytes_per_s": self.hbm_bandwidth_bytes_per_s,
            "host_bandwidth_bytes_per_s": self.host_bandwidth_bytes_per_s,
            "links": self.links.as_dict(),
            "price_per_chip_hour": self.price_per_chip_hour,
            "on_chip_memory": dict(self.on_chip_memory),
            "superpod": dict(self.superpod),
            "price_basis": self.price_basis,
            "sources": dict(self.sources),
        }


ON_CHIP_KEYS = ("sm_count", "registers_bytes_per_sm", "smem_bytes_per_sm", "tmem_bytes_per_sm", "l2_bytes",
                "l2_bandwidth_bytes_per_s", "vmem_bytes", "vmem_bandwidth_bytes_per_s", "vregs_bytes")
SUPERPOD_KEYS = ("nodes_per_su", "su_count", "leaf_switches_per_su", "spine_switches", "nvswitches_per_node",
                 "switch_ports", "port_bandwidth_bytes_per_s")


def _optional_numbers(r: FieldReader, data: dict[str, Any], section: str, keys: tuple[str, ...]) -> dict[str, float]:
    node = data.get(section)
    if node is None:
        return {}
    if not isinstance(node, dict):
        raise MeshplanError(f"{r.origin}: field '{section}' must be a mapping")
    for k in node:
        if k not in keys:
            raise MeshplanError(f"{r.origin}: field '{section}.{k}' is not known (known: {', '.join(keys)})")
    return {k: r.number(f"{section}.{k}") for k in keys if k in node}


def chip_from_mapping(data: dict[str, Any], origin: str) -> Chip:
    """Validate a hardware mapping; every problem names its field."""
    r = FieldReader(data, origin, rules=hardware_rule)
    name = r.string("name")
    kind = r.string("kind", choices=("gpu", "tpu"))
    peaks_node = data.get("peak_flops_per_s")
    if not isinstance(peaks_node, dict) or not peaks_node:
        raise MeshplanError(f"{origin}: missing field 'peak_flops_per_s' (a mapping of dtype to dense FLOP/s)")
    peaks: dict[str, float] = {}
    for dtype in peaks_node:
        if dtype not in DTYPES:
            raise MeshplanError(f"{origin}: field 'peak_flops_per_s.{dtype}' is not a known dtype ({', '.join(DTYPES)})")
        peaks[dtype] = r.number(f"peak_flops_per_s.{dtype}")
    if "bf16" not in peaks:
        raise MeshplanError(f"{origin}: missing field 'peak_flops_per_s.bf16'")
    top = {k: r.number(k) for k in ("hbm_bytes", "hbm_bandwidth_bytes_per_s", "host_bandwidth_bytes_per_s")}
    fast = r.string("links.fast_domain", choices=tuple(FAST_LINKS))
    common = dict(
        fast_domain=fast,
        scale_out_bandwidth_bytes_per_s=r.number("links.scale_out_bandwidth_bytes_per_s"),
        scale_out_kind=r.string("links.scale_out_kind", choices=("dcn", "infiniband", "roce", "ethernet")),
        sharp=r.boolean("links.sharp"),
        fast_hop_latency_s=r.number("links.fast_hop_latency_s"),
        scale_out_hop_latency_s=r.number("links.scale_out_hop_latency_s"),
        collective_op_latency_s=r.number("links.collective_op_latency_s", required=False, default=0.0,
                                         positive=False),
    )
    if fast == "ici_torus":
        links = Links(
            **common,
            ici_links_per_chip=r.integer("links.ici_links_per_chip"),
            ici_bandwidth_per_link_bytes_per_s=r.number("links.ici_bandwidth_per_link_bytes_per_s"),
            torus_dims=r.integer("links.torus_dims"),
            max_slice_shape=r.int_list("links.max_slice_shape"),
            wraparound=r.string("links.wraparound", choices=("full_axis", "cube_multiple", "none")),
            chips_per_host=r.integer("links.chips_per_host"),
        )
        if len(links.max_slice_shape) != links.torus_dims:
            raise MeshplanError(f"{origin}: field 'links.max_slice_shape' must have torus_dims={links.torus_dims} entries")
    else:  # a GPU node fabric: the YAML names its egress and the GPUs sharing it after the fabric
        if fast == "xgmi":
            peer, size = r.number("links.xgmi_link_bandwidth_bytes_per_s"), r.integer("links.xgmi_domain_size")
            egress = peer * max(size - 1, 1)  # every peer over its own link at once
        else:
            key = "pcie" if fast == "pcie" else "nvlink"
            peer = 0.0
            egress, size = r.number(f"links.{key}_bandwidth_bytes_per_s"), r.integer(f"links.{key}_domain_size")
        links = Links(
            **common,
            nvlink_bandwidth_bytes_per_s=egress,
            nvlink_domain_size=size,
            chips_per_host=r.integer("links.chips_per_host", required=False, default=8),
            peer_link_bandwidth_bytes_per_s=peer,
        )
    return Chip(
        name=name,
        kind=kind,
        description=r.string("description", required=False, default=name),
        peak_flops_per_s=peaks,
        **top,
        host_memory_bytes=r.number("host_memory_bytes", required=False, default=0.0, positive=False),
        host_memory_bandwidth_bytes_per_s=r.number("host_memory_bandwidth_bytes_per_s", required=False, default=0.0,
                                                   positive=False),
        hbm_usable_bytes=r.number("hbm_usable_bytes", required=False, default=0.0, positive=False),
        links=links,
        price_per_chip_hour=r.number("price_per_chip_hour"),
        on_chip_memory=_optional_numbers(r, data, "on_chip_memory", ON_CHIP_KEYS),
        superpod=_optional_numbers(r, data, "superpod", SUPERPOD_KEYS),
        price_basis=r.string("price_basis", required=False, default="catalog price"),
        sources=r.sources,
    )


def preset_chips() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


@lru_cache(maxsize=64)
def _load_path(path: str) -> Chip:
    p = Path(path)
    return chip_from_mapping(read_mapping(p, "hardware"), f"hardware file '{p.name}'")


def load_chip(name_or_path: str) -> Chip:
    """A preset name (`h100-sxm`) or a path to a YAML file of the same schema."""
    p = find_spec(name_or_path, "hardware", HARDWARE_DIR, ".yaml", preset_chips, "hardware file")
    return _load_path(str(p.resolve()))


# Marketing names in published papers -> catalog presets, most specific first. Each rule is (words that must all
# appear in the lower-cased description with spaces, dashes and underscores removed, preset).
_DESCRIPTION_RULES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("gb300",), "gb300-nvl72"),  # before b300: "GB300" contains it
    (("b300",), "b300"),
    (("gb200",), "gb200-nvl72"),
    (("b200",), "b200"),
    (("gh200",), "gh200"),  # before h200: "GH200" contains it
    (("h200",), "h200"),
    (("h800",), "h800"),
    (("h100", "pcie"), "h100-pcie"),  # before hbm2e: the PCIe card is HBM2e too
    (("h100", "96gb"), "h100-sxm-96gb"),
    (("h100", "hbm2e"), "h100-sxm-96gb"),
    (("h100", "500w"), "h100-sxm-96gb"),
    (("h100",), "h100-sxm"),
    (("a800",), "a800"),
    (("a100", "40gb"), "a100-40gb"),
    (("a100", "2020"), "a100-40gb"),  # the 2020 DGX A100 shipped with 40 GB parts
    (("a100",), "a100-80gb"),
    (("v100",), "v100-32gb"),
    (("l40s",), "l40s"),
    (("mi325x",), "mi325x"),
    (("mi300x",), "mi300x"),
    (("v6e",), "tpu-v6e"),
    (("trillium",), "tpu-v6e"),
    (("v5p",), "tpu-v5p"),
    (("v5e",), "tpu-v5e"),
    (("v5lite",), "tpu-v5e"),
    (("tpuv4",), "tpu-v4"),
    (("v4p",), "tpu-v4"),
    (("tpuv3",), "tpu-v3"),
)


def match_chip(description: str) -> str:
    """The catalog preset a published hardware description names ("A100-SXM4-80GB", "TPU v4", "H100 80GB HBM3").

    A preset name or path is returned unchanged; otherwise the first rule whose words all appear wins. Raises a
    MeshplanError naming the presets when nothing matches."""
    text = description.strip()
    if text in preset_chips() or Path(text).is_file():
        return text
    squashed = "".join(ch for ch in text.lower() if ch not in " -_")
    for words, preset in _DESCRIPTION_RULES:
        if all(w in squashed for w in words):
            return preset
    raise unknown_name_error("chip", text, preset_chips())


def price_label(chip: Chip) -> str:
    """`$11.06/chip-hour, GCP on-demand list price, us-central1, 2025`: the basis of every $ figure."""
    return f"${chip.price_per_chip_hour:g}/chip-hour, {chip.price_basis}"


def with_price(chip: Chip, price_per_chip_hour: float | None) -> Chip:
    """The chip at the user's `--price` (dollars per chip-hour), labelled as such; unchanged when None."""
    if price_per_chip_hour is None:
        return chip
    return chip.with_overrides(price_per_chip_hour=float(price_per_chip_hour), price_basis="--price override")
