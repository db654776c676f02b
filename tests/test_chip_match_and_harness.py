"""Published hardware descriptions map onto catalog presets, and the accuracy harness turns every FLOP
convention of flops_conventions.md into a step time the way the sources do."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.errors import MeshplanError
from meshplan.specs.hardware import load_chip, match_chip, preset_chips

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _measurements as H  # noqa: E402  (the benchmark harness, not part of the package)


@pytest.mark.parametrize("description, preset", [
    ("A100-SXM4-80GB", "a100-80gb"),
    ("A100 (DGX A100; memory size not stated, 2020)", "a100-40gb"),
    ("A100 40GB", "a100-40gb"),
    ("H100 96GB HBM2e (SXM-class, 500W power limit)", "h100-sxm-96gb"),
    ("NVIDIA H100 80GB HBM3 SXM5", "h100-sxm"),
    ("H800 SXM5", "h800"),
    ("NVIDIA A800-SXM4-80GB", "a800"),
    ("V100-SXM3-32GB (DGX-2)", "v100-32gb"),
    ("TPU v4", "tpu-v4"),
    ("TPU v3 pod", "tpu-v3"),
    ("Cloud TPU v5p", "tpu-v5p"),
    ("TPU v5e", "tpu-v5e"),
    ("TPU v6e (Trillium)", "tpu-v6e"),
    ("h100-sxm", "h100-sxm"),
])
def test_published_descriptions_match_presets(description: str, preset: str) -> None:
    assert match_chip(description) == preset
    assert load_chip(match_chip(description)).name == preset


def test_unknown_hardware_is_a_clear_error() -> None:
    with pytest.raises(MeshplanError, match="unknown chip 'MI250X'"):
        match_chip("MI250X")


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_match_chip_never_crashes(text: str) -> None:
    try:
        assert match_chip(text) in preset_chips() or Path(text.strip()).is_file()
    except MeshplanError:
        pass


def _entry(model: dict, seq: int, batch: int, chips: int, conv: str, measured: dict) -> dict:
    return {"id": "x", "group": "x", "source": {}, "model": model,
            "hardware": {"chip": "H100", "count": chips, "peak_dense_tflops_per_chip": 989},
            "parallel": {"dp": chips}, "training": {"seq_len": seq, "global_batch_seqs": batch},
            "measured": measured, "flops_convention": conv}


LLAMA3_70B = {"name": "Llama 3 70B", "layers": 80, "d_model": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672,
              "ffn_act": "swiglu", "vocab": 128256, "seq_len": 8192}
GPT3 = {"name": "GPT-3 175B", "layers": 96, "d_model": 12288, "heads": 96, "ffn": 49152, "ffn_act": "gelu",
        "vocab": 51200, "seq_len": 2048, "tied_embeddings": True}


def test_nemo_convention_reproduces_the_published_flops_per_token() -> None:
    """flops_conventions.md: NeMo's Llama3-70B row gives 738e12 / 1533 = 4.81e11 FLOPs per token
    (6·69.5e9 + 12·80·8192·8192) and GPT3-175B gives 782e12 / 726 = 1.077e12."""
    for model, seq, per_token in ((LLAMA3_70B, 8192, 738e12 / 1533), (GPT3, 2048, 782e12 / 726)):
        flops, hw = H.convention_flops_per_step(_entry(model, seq, 1, 1, "nemo_model_flops_no_recompute", {}))
        assert not hw
        assert flops / seq == pytest.approx(per_token, rel=0.01)


MIXTRAL = {"name": "Mixtral-8x7B", "layers": 32, "d_model": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336,
           "ffn_act": "swiglu", "vocab": 32000, "seq_len": 4096,
           "moe": {"num_experts": 8, "num_experts_per_tok": 2}}


def test_maxtext_convention_counts_an_moe_by_its_active_parameters() -> None:
    """AI-Hypercomputer tpu-recipes, Mixtral 8x7B on 256 v6e: MaxText printed 302.311 TFLOP/s per chip at
    3645.203 tokens/s per chip, 82.9 GFLOP per token; 6·N_total (46.7B) would be 280 G, 6·N_active (12.9B) 77 G
    plus the attention term."""
    flops, hw = H.convention_flops_per_step(_entry(MIXTRAL, 4096, 1, 1, "maxtext_6N_plus_attention", {}))
    assert not hw
    assert flops / 4096 == pytest.approx(302.311e12 / 3645.203, rel=0.03)


def test_palm_convention_attention_term() -> None:
    """PaLM appendix B: 540B at 2048 tokens is 45.7% MFU without the 12·L·H·Q·T term and 46.2% with it."""
    palm = {"name": "PaLM 540B", "layers": 118, "d_model": 18432, "heads": 48, "kv_heads": 1, "head_dim": 256,
            "ffn": 73728, "ffn_act": "swiglu", "vocab": 256000, "seq_len": 2048, "tied_embeddings": True}
    e = _entry(palm, 2048, 1, 1, "palm_6N_plus_12LHQT", {})
    flops, _ = H.convention_flops_per_step(e)
    attention = 12 * 118 * 48 * 256 * 2048 * 2048
    assert flops / (flops - attention) == pytest.approx(46.2 / 45.7, rel=0.002)


def test_megatron_eq3_step_times_match_the_reference_derivations() -> None:
    """The reference file derives every Megatron/BLOOM step time from eq. (3); the harness's own eq. (3)
    applied to the printed TFLOP/s gives the same seconds."""
    entries = [e for e in H.load_entries() if e["flops_convention"] == "megatron_eq3_hw_with_full_recompute"
               and (e.get("derived") or {}).get("step_time_s") and not e["measured"].get("step_time_s")]
    assert entries
    for e in entries:
        flops, hw = H.convention_flops_per_step(e)
        tf = e["measured"].get("tflops_per_gpu") or e["measured"].get("tflops_per_gpu_hw")
        assert hw and flops / (tf * 1e12 * e["hardware"]["count"]) == pytest.approx(
            e["derived"]["step_time_s"], rel=0.01), e["id"]


def test_step_time_prefers_published_time_then_tokens_per_second() -> None:
    e = _entry(LLAMA3_70B, 8192, 128, 64, "nemo_model_flops_no_recompute", {"tokens_per_s_per_gpu": 1533})
    assert H.measured_step_time_s(e) == pytest.approx(128 * 8192 / (1533 * 64))
    e["measured"]["step_time_s"] = 10.0
    assert H.measured_step_time_s(e) == 10.0
    bare = _entry(LLAMA3_70B, 8192, 128, 64, "no_such_convention", {})
    with pytest.raises(ValueError, match="no step time"):
        H.measured_step_time_s(bare)


def test_moe_block_and_free_text_fields_are_read() -> None:
    model = dict(LLAMA3_70B, moe={"experts": 8, "top_k": 2, "expert_ffn": 14336}, ffn_act="SwiGLU (gated SiLU)")
    e = _entry(model, 4096, 8, 8, "unspecified", {"tokens_per_s_per_gpu": 1})
    e["training"]["recompute"] = "unspecified"
    e["parallel"] = {"dp": 8, "vpp": "interleaved", "ep": "8"}
    m = H.model_of(e)
    assert (m.n_experts, m.experts_per_token, m.d_ff, m.mlp_act) == (8, 2, 14336, "swiglu")
    pins = H.pins_of(e)
    assert pins.recompute is None and pins.vpp == 2 and pins.ep == 8


def test_maxtext_custom_offload_policy_is_full_recompute_with_inputs_on_host() -> None:
    # MaxText's custom remat policy rematerializes every tensor it does not name ('remat' is the default of each
    # checkpoint name but decoder_layer_input); offloading decoder_layer_input leaves nothing per layer in HBM
    e = _entry(LLAMA3_70B, 8192, 1, 1, "maxtext_6N_plus_attention", {"step_time_s": 1.0})
    e["training"]["recompute"] = ("MaxText custom policy: decoder_layer_input, query_proj, key_proj, value_proj "
                                  "offloaded to host memory; other activations saved")
    e["parallel"] = {"dp": 1}
    pins = H.pins_of(e)
    assert (pins.recompute, pins.offload) == ("full", 1.0)
    e["training"]["recompute"] = "full"
    assert (H.recompute_of(e), H.pins_of(e).offload) == ("full", 0.0)


def test_recompute_inferred_from_hfu_over_mfu() -> None:
    """PaLM prints MFU 46.2% and HFU 57.8% without naming its rematerialisation: a ratio of 1.25 is close to full
    recompute's 8/6; equal figures mean none."""
    e = _entry(LLAMA3_70B, 2048, 1, 1, "palm_6N_plus_12LHQT", {"mfu": 0.462, "hfu": 0.578})
    e["training"]["recompute"] = None
    assert H.recompute_of(e) == "full"
    e["measured"] = {"mfu": 0.40, "hfu": 0.40}
    assert H.recompute_of(e) == "none"
    e["measured"] = {"mfu": 0.40}
    assert H.recompute_of(e) is None


def test_accuracy_benchmark_survives_unseen_entries(monkeypatch, capsys) -> None:
    """Entries written differently from the 94 (other chip names, missing degrees, a measurement given only as
    MFU, an unknown chip) are evaluated or listed as skipped; the benchmark never stops on one."""
    import copy

    import accuracy as A

    base = {e["id"]: e for e in H.load_entries()}
    a = copy.deepcopy(base["narayanan2021_t1_145.6B"])
    a["id"], a["hardware"]["chip"] = "renamed_chip", "NVIDIA A100 80GB SXM"
    del a["parallel"]["dp"]
    b = copy.deepcopy(base["torchtitan_2412_t1_8B_FSDP"])
    b["id"], b["training"]["recompute"], b["parallel"]["vpp"] = "unstated_recompute", None, "interleaved"
    b["measured"] = {"mfu": 0.35}
    b["derived"] = {}
    c = copy.deepcopy(b)
    c["id"], c["hardware"]["chip"] = "unknown_chip", "Intel Gaudi 3"
    monkeypatch.setattr(A, "load_entries", lambda: [a, b, c])
    assert A.main(["--no-search"]) == 0
    out = capsys.readouterr().out
    assert "renamed_chip" in out and "unstated_recompute" in out
    assert "SKIPPED unknown_chip" in out and "1 of 3 entries could not be evaluated" in out


@pytest.mark.parametrize("text, gb_per_s_per_gpu, kind", [
    # Selene (Megatron SC21, Korthikanti 2022): one 200 Gb/s HDR HCA per GPU
    ("8x NVIDIA Mellanox 200 Gb/s HDR InfiniBand HCAs per node for application traffic (Selene)", 25.0, "infiniband"),
    # Jean Zay (BLOOM paper §3.1): 4 Omni-Path 100 Gb/s links shared by 8 GPUs
    ("Omni-Path (4 OPA links per node), dedicated NCCL subnet (Jean Zay)", 6.25, None),
    ("RDMA 400 Gb/s per GPU", 50.0, None),
    # AWS p4d: 400 Gb/s of EFA per 8-GPU instance; p5: 3,200 Gb/s
    ("400 Gbps EFA per node", 6.25, "ethernet"),
    ("3200 Gbps EFA per node", 50.0, "ethernet"),
    ("8x 400Gb/s NDR InfiniBand", 50.0, "infiniband"),
    ("1.6 Tb/s per node", 25.0, None),
    ("4x HDR per node", 12.5, "infiniband"),
    # a capital B is bytes: 8 NICs of 50 GB/s (= 400 Gb/s) each per 8-GPU node is 50 GB/s per GPU, not 6.25
    ("InfiniBand 8x50 GB/s per node (8x 400 Gb/s)", 50.0, "infiniband"),
    ("25 GBps per GPU", 25.0, None),
])
def test_scale_out_read_from_the_published_network(text: str, gb_per_s_per_gpu: float, kind: str | None) -> None:
    bw, k = H.scale_out_of(text, 8)
    assert bw == pytest.approx(gb_per_s_per_gpu * 1e9)
    assert k == kind


def test_unstated_network_keeps_the_preset() -> None:
    assert H.scale_out_of("", 8) == (None, None)
    assert H.scale_out_of("InfiniBand", 8) == (None, "infiniband")
    entry = {"hardware": {"chip": "A100 40GB", "count": 64, "intra_node": "8 GPUs per node, NVLink",
                          "inter_node": "400 Gbps EFA per node (AWS p4d)"}}
    chip = H.chip_of(entry)
    assert chip.links.scale_out_bandwidth_bytes_per_s == pytest.approx(6.25e9)
    assert chip.links.scale_out_kind == "ethernet"
    assert H.chip_of({"hardware": {"chip": "A100 40GB"}}).links == load_chip("a100-40gb").links


@given(st.text(max_size=80), st.integers(1, 16))
@settings(max_examples=200, deadline=None)
def test_scale_out_parser_never_crashes(text: str, gpus: int) -> None:
    bw, kind = H.scale_out_of(text, gpus)
    assert bw is None or bw > 0
    assert kind in (None, "infiniband", "roce", "ethernet")


def test_numbers_printed_as_text_or_percent_are_read() -> None:
    assert H._num({"tflops_per_gpu": "160 TFLOP/s"}, "tflops_per_gpu") == 160.0
    assert H._num({"tokens_per_s_per_gpu": "1,543"}, "tokens_per_s_per_gpu") == 1543.0
    assert H._num({"mfu": "46.2%"}, "mfu") == pytest.approx(0.462)
    assert H._num({"mfu": 46.2}, "mfu") == pytest.approx(0.462)  # a percentage printed bare
    assert H._num({"mfu": 0.462}, "mfu") == pytest.approx(0.462)
    assert H._num({"mfu": "n/a", "hfu": True}, "mfu", "hfu") is None


def _llama8b_entry(**parallel) -> dict:
    return {"id": "t", "group": "g", "source": {"title": "t", "ref": "none 2024"},
            "model": {"name": "m", "layers": 32, "d_model": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336,
                      "ffn_act": "swiglu", "vocab": 128256, "seq_len": 8192},
            "hardware": {"chip": "H100 SXM5 80GB", "count": 64}, "parallel": parallel,
            "training": {"precision": "bf16", "recompute": "none", "micro_batch": 1, "global_batch_seqs": 64,
                         "seq_len": 8192},
            "measured": {"mfu": 0.40}, "flops_convention": "unspecified"}


def test_mfu_without_a_stated_peak_uses_the_datasheet_peak() -> None:
    """6N + 12·L·H·Q·T per token (PaLM appendix B) at 40% of the H100's dense 989 TFLOP/s."""
    e = _llama8b_entry(tp=8)
    n = H.model_of(e)
    from meshplan.math.transformer import param_counts

    per_token = 6 * param_counts(n).total + 12 * 32 * 4096 * 8192
    assert H.measured_step_time_s(e) == pytest.approx(64 * 8192 * per_token / (0.40 * 989e12 * 64), rel=1e-6)


def test_a_dp_that_does_not_close_the_product_is_released_and_noted() -> None:
    e = _llama8b_entry(tp=8, pp=2, dp=64)  # 8 · 2 · 64 = 1,024 on 64 chips: dp must be 4
    pins = H.pins_of(e)
    assert pins.dp * pins.tp * pins.pp == 64 and pins.dp == 4
    assert H.harness_notes(e) == ["dp 64 -> 4 (tp·pp·cp·dp = chips)"]


def test_an_entry_with_a_zero_size_is_skipped_with_the_reason() -> None:
    e = _llama8b_entry(tp=8)
    e["model"]["heads"] = 0
    with pytest.raises(MeshplanError, match="n_heads must be a positive integer"):
        H.model_of(e)


def test_micro_batch_from_gradient_accumulation() -> None:
    e = _llama8b_entry(tp=8, pp=2)  # dp = 64 / 16 = 4
    e["training"].update(micro_batch=None, grad_accum=8)  # 64 = 4 × mb × 8 -> mb 2
    assert H.pins_of(e).microbatch == 2


def test_hfu_only_counts_the_recomputed_forward() -> None:
    """A run that prints only HFU under full recompute did 8N/6N of its model FLOPs: the same step time as an MFU
    of 3/4 of that HFU."""
    by_mfu = _llama8b_entry(tp=8)
    by_mfu["training"]["recompute"] = "full"
    by_mfu["measured"] = {"mfu": 0.45}
    by_hfu = _llama8b_entry(tp=8)
    by_hfu["training"]["recompute"] = "full"
    by_hfu["measured"] = {"hfu": 0.60}
    assert H.measured_step_time_s(by_hfu) == pytest.approx(H.measured_step_time_s(by_mfu), rel=1e-12)


@pytest.mark.parametrize(("text", "titan", "kernel"), [
    ("bf16; flash-attn 2.5, fsdp", False, "fa2"),
    ("bf16, flashattention-2", False, "fa2"),
    ("torch sdpa", False, "sdpa"),
    ("float8 linears; torch.compile", True, "sdpa"),  # torchtitan attends through SDPA
    ("te fused attention (cudnn)", False, "fused"),
    ("fa3 kernels", True, "fused"),  # a named kernel wins over the framework's default
    ("bf16 mixed precision", False, "fused"),
    ("huggingface/nanotron ultrascale playbook", False, "fa2"),
])
def test_attention_kernel_read_from_the_run(text: str, titan: bool, kernel: str) -> None:
    assert H._attention_kernel(text, titan) == kernel


@pytest.mark.parametrize(("inter", "intra", "count", "shape"), [
    ("2 slice(s) over DCN (multislice)", "v5e-256 slice: 16x16 ICI torus", 512, (16, 16)),
    ("2 slices over DCN", "v5p-128: 4x4x4 ICI torus", 128, (4, 4, 4)),
    ("DCN between 2x v5p-256", "ICI", 256, (4, 4, 8)),  # no printed shape: meshplan's slice of 128 v5p chips
    ("", "16x16 ICI torus", 256, None),  # one slice: the pod's default
    ("2 slices", "1x64 ICI torus", 128, (8, 8)),  # a printed shape the v5e pod cannot hold: the default slice
    ("single slice", "v5e-32 slice (4x8 ICI torus)", 32, None),  # a slice's name, not 32 slices of one chip
])
def test_tpu_slices_read_from_the_hardware_text(inter: str, intra: str, count: int, shape) -> None:
    chip = load_chip("tpu-v5p" if "v5p" in inter + intra else "tpu-v5e")
    e = {"group": "maxtext", "hardware": {"chip": chip.name, "count": count, "inter_node": inter,
                                          "intra_node": intra}}
    assert H.slice_shape_of(e, chip, count) == shape


@given(st.one_of(st.text(max_size=60), st.from_regex(r"\A(\d{1,3} slices?|\d{1,2} ?x ?v5p-\d{1,4})( over DCN)?\Z")),
       st.one_of(st.text(max_size=60), st.from_regex(r"\A\d{1,2}x\d{1,2}(x\d{1,2})? ICI torus\Z")),
       st.integers(1, 4096), st.sampled_from(["tpu-v5e", "tpu-v5p", "tpu-v6e", "tpu-v4"]))
@settings(max_examples=200, deadline=None)
def test_slice_reader_never_crashes_and_gives_a_valid_slice(inter: str, intra: str, count: int, name: str) -> None:
    chip = load_chip(name)
    e = {"group": "maxtext", "hardware": {"chip": name, "count": count, "inter_node": inter, "intra_node": intra}}
    shape = H.slice_shape_of(e, chip, count)
    if shape is not None:  # whatever it reads must be a slice the planner accepts for this chip count
        from meshplan.cost.topology import make_cluster

        assert make_cluster(chip, count, shape).n_chips == count


def test_harness_reads_maxtext_custom_policy_and_dropping_moe() -> None:
    # tpu-recipes mixtral_8x7b_dropped and llama3_1_70b_8192_bs2 as the data file prints them
    e = {"training": {"recompute": "MaxText custom policy: decoder_layer_input, out_proj, query_proj, key_proj, "
                                   "value_proj offloaded to host memory; other activations saved"}}
    assert H.kept_projections_of(e) == ("query_proj", "key_proj", "value_proj", "out_proj")
    assert H.kept_projections_of({"training": {"recompute": "full"}}) == ()
    notes = "maxtext pure fsdp: ici_fsdp_parallelism -1; megablox false, sparse_matmul false, capacity_factor 1.25"
    assert H._capacity_factor(notes) == 1.25
    assert H._capacity_factor("capacity_factor 1.25 with megablox") == 0.0  # sparse kernels: dropless path


def test_llama3_causal_convention_halves_the_palm_attention_term() -> None:
    """The Llama 3 rows' convention (session 14): 6N + 6·L·H·Q·T a token, PaLM's form with causal attention. At 131K
    tokens on Llama 3 405B (126 layers, 128 heads of 128) the attention term is 6·126·128·128·131072 = 1.62e12 a
    token beside 6N = 2.44e12, against 3.25e12 non-causal: the step a 380 TFLOPs/GPU figure means is 0.714x as long."""
    llama405 = {"name": "Llama 3 405B", "layers": 126, "d_model": 16384, "heads": 128, "kv_heads": 8, "head_dim": 128,
                "ffn": 53248, "ffn_act": "swiglu", "vocab": 128256, "seq_len": 131072}
    causal, _ = H.convention_flops_per_step(_entry(llama405, 131072, 1, 1, "llama3_6N_plus_6LHQT_causal", {}))
    palm, _ = H.convention_flops_per_step(_entry(llama405, 131072, 1, 1, "palm_6N_plus_12LHQT", {}))
    attention = 12 * 126 * 128 * 128 * 131072 * 131072
    assert palm - causal == pytest.approx(attention / 2, rel=1e-12)
    six_n = palm - attention
    assert six_n / 131072 == pytest.approx(6 * 405.9e9, rel=0.01)
    assert causal / palm == pytest.approx((2.435e12 + 1.623e12) / (2.435e12 + 3.246e12), rel=0.005)


def test_tpu_v3_and_v4_follow_the_datasheet():
    """Session 16: TPU v3's peak is the datasheet's 123 TFLOP/s (the book's table rounds it to 1.4e14), derived here
    from the chip's parts (Jouppi et al. CACM 2020, 'A Domain-Specific Supercomputer for Training Deep Neural
    Networks': 2 TensorCores of 2 MXUs of 128x128 multiply-accumulators at 940 MHz); v3 and v4 hold 32 GiB of HBM
    (Google Cloud TPU v3 and v4 docs), not 32e9 B."""
    v3, v4 = load_chip("tpu-v3"), load_chip("tpu-v4")
    assert v3.peak("bf16") == pytest.approx(2 * 2 * 128 * 128 * 2 * 940e6, rel=2e-3)
    assert v3.hbm_bytes == pytest.approx(32 * 2**30, rel=1e-3)
    assert v4.hbm_bytes == pytest.approx(32 * 2**30, rel=1e-3)
