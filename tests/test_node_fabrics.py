"""GPU node fabrics beyond NVSwitch: PCIe-only nodes (L40S, H100 PCIe) and AMD's fully connected Infinity Fabric
(MI300X, MI325X). Expected values are hand calculations from the fabric's link figures (book ch.12 ring formulas)."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import run_cli

from meshplan.cost.collectives import efficiency, group_collective
from meshplan.cost.topology import make_cluster
from meshplan.errors import MeshplanError
from meshplan.infer.config import ServeConfig
from meshplan.infer.step import _allreduce_s, custom_allreduce_fabric
from meshplan.specs.hardware import HARDWARE_DIR, chip_from_mapping, load_chip, match_chip


def _variant(links: dict) -> dict:
    """h100-sxm's YAML with its node fabric replaced by `links` (the rest of the links section kept)."""
    data = yaml.safe_load((HARDWARE_DIR / "h100-sxm.yaml").read_text())
    for k in ("nvlink_bandwidth_bytes_per_s", "nvlink_domain_size"):
        data["links"].pop(k)
    data["links"].update(links)
    data["links"]["sharp"] = {"value": False, "source": "no in-network reduction on this fabric"}
    return data


PCIE = chip_from_mapping(_variant({"fast_domain": "pcie", "pcie_bandwidth_bytes_per_s": {"value": 32e9, "source": "t"},
                                   "pcie_domain_size": {"value": 8, "source": "t"}}), "pcie test chip")
XGMI = chip_from_mapping(_variant({"fast_domain": "xgmi",
                                   "xgmi_link_bandwidth_bytes_per_s": {"value": 64e9, "source": "t"},
                                   "xgmi_domain_size": {"value": 8, "source": "t"}}), "xgmi test chip")
V = 1e9


def _ideal(kind: str, chip, size: int) -> float:
    return group_collective(kind, V, make_cluster(chip, 8), size, ideal=True).bandwidth_time_s


def test_pcie_node_is_a_switched_domain_at_the_pcie_rate():
    # ring all-gather in one node: V (k-1) / (k W) = 1e9 x 7/8 / 32e9 = 27.34 ms; all-reduce twice that
    assert _ideal("allgather", PCIE, 8) == pytest.approx(V * 7 / 8 / 32e9, rel=1e-12)
    assert _ideal("allreduce", PCIE, 8) == pytest.approx(2 * V * 7 / 8 / 32e9, rel=1e-12)
    # a switch gives any group the GPU's whole egress: 2 GPUs, V/2 / 32e9
    assert _ideal("allgather", PCIE, 2) == pytest.approx(V / 2 / 32e9, rel=1e-12)
    c = group_collective("allreduce", V, make_cluster(PCIE, 8), 8)
    assert c.link == "pcie" and "PCIe" in c.algorithm


def test_xgmi_full_mesh_gives_a_group_only_its_own_links():
    # 7 peer links x 64 GB/s = 448 GB/s for the whole node; k GPUs use k-1 of them
    assert XGMI.links.nvlink_bandwidth_bytes_per_s == pytest.approx(448e9)
    for k, w in ((2, 64e9), (4, 192e9), (8, 448e9)):
        assert XGMI.links.group_bandwidth_bytes_per_s(k) == pytest.approx(w)
        assert _ideal("allgather", XGMI, k) == pytest.approx(V * (k - 1) / k / w, rel=1e-12)
    # TP 2 on a full mesh moves one link's worth: 7x slower than the same bytes over a 448 GB/s switch port
    switched = _ideal("allgather", chip_from_mapping(_variant({
        "fast_domain": "nvswitch", "nvlink_bandwidth_bytes_per_s": {"value": 448e9, "source": "t"},
        "nvlink_domain_size": {"value": 8, "source": "t"}}), "switched test chip"), 2)
    assert _ideal("allgather", XGMI, 2) / switched == pytest.approx(7.0, rel=1e-12)
    # a shift to one neighbour crosses one link
    p = group_collective("permute", V, make_cluster(XGMI, 8), 8, ideal=True)
    assert p.bandwidth_time_s == pytest.approx(V / 64e9, rel=1e-12) and p.link == "xgmi"


def test_fabric_yaml_keys_and_errors(tmp_path, capsys):
    d = XGMI.links.as_dict()
    assert d["fast_domain"] == "xgmi" and d["xgmi_link_bandwidth_bytes_per_s"] == 64e9 and d["xgmi_domain_size"] == 8
    assert "nvlink_bandwidth_bytes_per_s" not in d
    d = PCIE.links.as_dict()
    assert d["pcie_bandwidth_bytes_per_s"] == 32e9 and d["pcie_domain_size"] == 8
    bad = _variant({"fast_domain": "pcie", "pcie_domain_size": {"value": 8, "source": "t"}})
    p = tmp_path / "chip.yaml"
    p.write_text(yaml.safe_dump(bad))
    code, _, err = run_cli(["hardware", str(p)], capsys)
    assert code == 2 and err.count("\n") == 1 and "pcie_bandwidth_bytes_per_s" in err
    bad = _variant({"fast_domain": "xgmi", "xgmi_link_bandwidth_bytes_per_s": {"value": 64e9, "source": "t"},
                    "xgmi_domain_size": {"value": 1, "source": "t"}})
    with pytest.raises(MeshplanError, match="xgmi_domain_size"):
        chip_from_mapping(bad, "t")


def test_custom_allreduce_on_pcie_only_in_pairs():
    # vLLM: no custom all-reduce on more than two PCIe-only GPUs -> NCCL (the collectives model) from TP 4 up
    assert custom_allreduce_fabric(PCIE, 2) and not custom_allreduce_fabric(PCIE, 4)
    assert custom_allreduce_fabric(XGMI, 8) and custom_allreduce_fabric(load_chip("h100-sxm"), 8)
    nbytes = 64 * 8192 * 2  # a 64-sequence decode step's activations of a d_model 8192 layer
    cfg4, cfg2 = ServeConfig(tp=4), ServeConfig(tp=2)
    ring = group_collective("allreduce", nbytes, make_cluster(PCIE, 4), 4).time_s
    assert _allreduce_s(PCIE, cfg4, nbytes, 4) == pytest.approx(ring, rel=1e-12)
    # in a pair: one synchronisation + the peer's buffer over PCIe at the fabric's rate, or two-shot, the faster
    from meshplan.infer.config import serving_constant
    lat = serving_constant("custom_allreduce_latency_s", PCIE)
    w = 32e9 * efficiency("pcie", nbytes, PCIE.name, 2)
    assert _allreduce_s(PCIE, cfg2, nbytes, 2) == pytest.approx(min(lat + nbytes / w, 2 * lat + nbytes / w), rel=1e-12)


def test_hardware_json_names_the_fabric(capsys):
    code, out, _ = run_cli(["hardware", "h100-sxm", "--json"], capsys)
    assert code == 0 and json.loads(out)["links"]["fast_domain"] == "nvswitch"


# ---------------------------------------------------------------- the presets on these fabrics

NEW = ("l40s", "h100-pcie", "mi300x", "mi325x", "gh200", "b300", "gb300-nvl72")


@pytest.mark.parametrize(("text", "preset"), [
    ("NVIDIA L40S", "l40s"), ("NVIDIA H100 PCIe 80GB", "h100-pcie"), ("AMD Instinct MI300X", "mi300x"),
    ("MI325X", "mi325x"), ("NVIDIA GH200 144GB HBM3e", "gh200"), ("NVIDIA H200", "h200"),
    ("H100 80GB HBM3", "h100-sxm"), ("H100 SXM5 96GB HBM2e", "h100-sxm-96gb"), ("NVIDIA B300 SXM6 AC", "b300"),
    ("GB300 NVL72", "gb300-nvl72"), ("NVIDIA B200", "b200"), ("GB200 NVL72", "gb200-nvl72")])
def test_published_descriptions_name_the_presets(text, preset):
    assert match_chip(text) == preset


def test_preset_fabrics():
    mi = load_chip("mi300x").links
    assert (mi.fast_domain, mi.peer_link_bandwidth_bytes_per_s, mi.nvlink_domain_size) == ("xgmi", 64e9, 8)
    assert mi.nvlink_bandwidth_bytes_per_s == pytest.approx(7 * 64e9)  # 448 GB/s (stas00/ml-engineering network)
    for name, w in (("l40s", 32e9), ("h100-pcie", 64e9)):  # x16 Gen4 / Gen5: 64 / 128 GB/s bidirectional
        links = load_chip(name).links
        assert links.fast_domain == "pcie" and links.nvlink_bandwidth_bytes_per_s == w and not links.sharp
    assert load_chip("gh200").links.nvlink_domain_size == 1
    # rccl-tests on 8 MI300X: 316.6 GB/s busbw at 8 GiB -> the fabric curve returns that bus bandwidth
    assert 448e9 * efficiency("xgmi", 8 * 2**30, "mi300x") == pytest.approx(316.6e9, rel=2e-3)
    # nccl#1639: 28 GB/s busbw on 8 PCIe Gen5 GPUs, 35 on 4 (63 GB/s per direction)
    assert 63e9 * efficiency("pcie", 2**30, "h100-pcie") == pytest.approx(28e9, rel=0.02)
    assert 63e9 * efficiency("pcie", 2**30, "h100-pcie", 4) == pytest.approx(35e9, rel=0.02)
    # aiconfigurator's nccl-tests on L40S nodes, all_reduce of 512 MiB (half): 26.700 / 156.034 / 649.471 ms on 2 / 4 /
    # 8 GPUs; bus bandwidth 2 (g-1)/g x 2^29 B / t, against 32 GB/s x the curve the preset reads at g GPUs
    for g, t_ms in ((2, 26.700), (4, 156.034), (8, 649.471)):
        busbw = 2 * (g - 1) / g * 2**29 / (t_ms * 1e-3)
        assert 32e9 * efficiency("pcie", 2**29, "l40s", g) == pytest.approx(busbw, rel=0.01)
    # the ring in one L40S node then takes what nccl-tests took (bandwidth-bound: 2 (g-1)/g V / busbw)
    l40s = load_chip("l40s")
    c = group_collective("allreduce", 2**29, make_cluster(l40s, 8), 8)
    assert c.bandwidth_time_s == pytest.approx(0.649471, rel=0.01)


def test_matmul_fractions_follow_the_measured_ceilings():
    """stas00/ml-engineering MAMF BF16: MI300X 668.4 / 1300, MI325X 784.9 / 1300, GH200 828.6 / 989, H100 SXM
    794.5 / 989; each chip's fraction is h100-sxm's 0.75 scaled by its ceiling ratio to H100's."""
    from meshplan.cost.efficiency import default_efficiency

    h100 = 794.5 / 989
    for name, ratio in (("mi300x", 668.4 / 1300), ("mi325x", 784.9 / 1300), ("gh200", 828.6 / 989)):
        eff = default_efficiency(load_chip(name))
        assert eff.matmul_peak_fraction == pytest.approx(0.75 * ratio / h100, abs=6e-4)


def test_one_shot_allreduce_on_a_full_mesh_does_not_grow_with_tp():
    """One-shot: each GPU reads every peer's buffer over that peer's own link, (g-1) buffers over g-1 links, one
    link's time whatever g: 6 us + 524,288 B / (64 GB/s x 0.707) = 17.59 us. The two-shot form (2 x 6 us + 2 x
    nbytes / (g x link)) only gets faster with g, so the kernel never slows as TP grows; behind a switch the one-shot
    pulls g-1 buffers through one port and does."""
    mi, h = load_chip("mi300x"), load_chip("h100-sxm")
    nbytes = 32 * 8192 * 2
    t = {g: _allreduce_s(mi, ServeConfig(tp=g), nbytes, g) for g in (2, 4, 8)}
    assert t[2] == pytest.approx(6e-6 + nbytes / (64e9 * 0.707), rel=1e-9)
    assert t[8] == pytest.approx(2 * 6e-6 + 2 * nbytes / (8 * 64e9 * 0.707), rel=1e-9)  # two-shot wins at 8
    assert t[8] <= t[4] <= t[2]
    th = {g: _allreduce_s(h, ServeConfig(tp=g), nbytes, g) for g in (2, 8)}
    assert th[8] > th[2]


def test_l40s_decode_reads_its_weights_at_gddr6_speed():
    """Llama 3.1 8B at batch 1 on one L40S: at least the weights over 864 GB/s (16.06e9 B -> 18.6 ms), and the
    model's kernel and HBM-efficiency terms keep it within 1.6x of that bound."""
    from meshplan.cost.efficiency import default_efficiency
    from meshplan.infer.step import decode_step
    from meshplan.specs.model import load_model

    m, chip = load_model("llama3.1-8b"), load_chip("l40s")
    bound = 8.03e9 * 2 / 864e9  # Llama 3.1 8B: 8.03B parameters (its model card), bf16
    t = decode_step(m, chip, ServeConfig(), default_efficiency(chip), 1, 1000).time_s
    assert bound < t < 1.6 * bound


@pytest.mark.parametrize("name", NEW)
def test_every_new_preset_plans_training_and_serving(name, capsys):
    code, out, err = run_cli(["serve", "--model", "llama3.1-8b", "--hardware", name, "--chips", "2",
                              "--input-len", "1000", "--output-len", "200", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["tpot_s"] > 0
    code, out, err = run_cli(["train", "--model", "llama3-8b", "--hardware", name, "--chips", "16", "--seq-len", "4096",
                              "--global-batch", "64", "--json"], capsys)
    assert code == 0, err
    code, out, _ = run_cli(["hardware", name], capsys)
    assert code == 0 and name in out


def test_blackwell_ultra_takes_blackwell_kernel_rates():
    """B300 runs the GEMM fractions read from TransformerEngine's B300 timings (b200's, whose source already reads B300
    as B200) at its own peaks, memory and NICs; GB200's lower MAMF-derived figure belongs to the GB200 part."""
    from meshplan.cost.efficiency import default_efficiency
    from meshplan.measure.cluster import chip_for_device_kind

    b = default_efficiency(load_chip("b200"))
    a = default_efficiency(load_chip("b300"))
    assert (a.matmul_peak_fraction, a.fp8_peak_fraction) == (b.matmul_peak_fraction, b.fp8_peak_fraction)
    assert default_efficiency(load_chip("gb200-nvl72")).matmul_peak_fraction < b.matmul_peak_fraction
    assert load_chip("gb300-nvl72").usable_hbm_bytes == pytest.approx(298500227072, rel=1e-3)  # NVIDIA nvml-mock profile
    b300 = load_chip("b300")
    assert b300.hbm_bytes == 288e9 and b300.links.scale_out_bandwidth_bytes_per_s == 100e9  # 8x ConnectX-8 800G
    assert chip_for_device_kind("NVIDIA GB300") == "gb300-nvl72" and chip_for_device_kind("NVIDIA B300 SXM6 AC") == "b300"
    assert chip_for_device_kind("NVIDIA GH200 480GB") is None  # the 96 GB part


def test_l40s_gemm_fractions_are_the_measured_medians():
    """efficiency.yaml's L40S GEMM fractions re-derived from the measured table they cite (TensorRT-LLM's GEMMs on
    L40S, benchmarks/data/aic_l40s_gemm.csv): the median over the shapes of measured FLOP/s over the peak times the
    model's own shape penalty, min(m/(m + 128), d/(d + 256)), d = min(n, k)."""
    import csv
    import statistics
    from pathlib import Path

    from meshplan.cost.efficiency import default_efficiency

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "aic_l40s_gemm.csv"
    rows = list(csv.DictReader(line for line in path.read_text().splitlines() if not line.startswith("#")))
    peak = {"bfloat16": 362.05e12, "fp8": 733e12}  # NVIDIA L40S datasheet, dense
    implied: dict[str, list[float]] = {"bfloat16": [], "fp8": []}
    for r in rows:
        m, n, k, t = int(r["m"]), int(r["n"]), int(r["k"]), float(r["latency_ms"]) * 1e-3
        d = min(n, k)
        implied[r["dtype"]].append(2 * m * n * k / t / (peak[r["dtype"]] * min(m / (m + 128), d / (d + 256))))
    eff = default_efficiency(load_chip("l40s"))
    assert len(implied["bfloat16"]) == len(implied["fp8"]) == 4459
    assert eff.matmul_peak_fraction == pytest.approx(statistics.median(implied["bfloat16"]), abs=6e-4)
    assert eff.fp8_peak_fraction == pytest.approx(statistics.median(implied["fp8"]), abs=6e-4)


def test_gb300_gemm_rates_are_gb200s_times_the_measured_speedup():
    """GB300's GEMM fractions: GB200's times the median per-shape speed of GB300 over GB200 in NVIDIA's tables of the
    same TensorRT-LLM GEMMs on both (benchmarks/data/aic_gb300_gb200_gemm.csv, 64 shapes per format), both parts at the
    same 2.5 PF BF16 / 5 PF FP8 datasheet peaks."""
    import csv
    import statistics
    from pathlib import Path

    from meshplan.cost.efficiency import default_efficiency

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "aic_gb300_gb200_gemm.csv"
    rows = list(csv.DictReader(line for line in path.read_text().splitlines() if not line.startswith("#")))
    t = {(r["system"], r["dtype"], r["m"], r["n"], r["k"]): float(r["latency_ms"]) for r in rows}
    speed = {dt: statistics.median(t[("gb200", dt, m, n, k)] / t[("gb300", dt, m, n, k)]
                                   for (s, d, m, n, k) in t if s == "gb300" and d == dt) for dt in ("bfloat16", "fp8")}
    gb200, gb300 = (default_efficiency(load_chip(n)) for n in ("gb200-nvl72", "gb300-nvl72"))
    assert load_chip("gb300-nvl72").peak("bf16") == load_chip("gb200-nvl72").peak("bf16")
    assert gb300.matmul_peak_fraction == pytest.approx(gb200.matmul_peak_fraction * speed["bfloat16"], abs=6e-4)
    assert gb300.fp8_peak_fraction == pytest.approx(gb200.fp8_peak_fraction * speed["fp8"], abs=6e-4)


def test_gb300_forward_attention_is_gb200s_times_the_measured_speedup():
    """GB300's attention fractions are cuDNN's measured 8K causal rates (tests/test_attention_tiles.py); their forward
    ratio to GB200's, 0.742 / 0.630 = 1.178, agrees within 3% with the median speed of GB300 over GB200 in NVIDIA's
    other tables, TensorRT-LLM's context attention (benchmarks/data/aic_gb300_gb200_context_attention.csv: 1.204),
    and the backward gains less (1,435 / 1,332 = 1.077 TFLOP/s in the cuDNN tables): the doubled exponential rate
    speeds the forward's softmax more than the backward's five GEMMs per tile."""
    import csv
    import statistics
    from pathlib import Path

    from meshplan.cost.efficiency import default_efficiency

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "aic_gb300_gb200_context_attention.csv"
    rows = list(csv.DictReader(line for line in path.read_text().splitlines() if not line.startswith("#")))
    speed = statistics.median(float(r["gb200_ms"]) / float(r["gb300_ms"]) for r in rows)
    gb200, gb300 = (default_efficiency(load_chip(n)) for n in ("gb200-nvl72", "gb300-nvl72"))
    assert len(rows) == 1356 and speed == pytest.approx(1.204, abs=5e-4)
    assert gb300.attention_fwd_fraction / gb200.attention_fwd_fraction == pytest.approx(speed, rel=0.03)
    assert gb300.attention_bwd_fraction / gb200.attention_bwd_fraction == pytest.approx(1435 / 1332, abs=2e-3)


