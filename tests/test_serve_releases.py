"""Versioned serving-engine presets (issue #14 item 4): `engine@release` is an older release whose defaults differ
from the current preset's (serving.yaml engine_releases); every other default is the preset's."""

from __future__ import annotations

import pytest
from conftest import run_cli

from meshplan.cost.efficiency import default_efficiency
from meshplan.errors import MeshplanError
from meshplan.infer import config as C
from meshplan.infer.config import ServeConfig, Workload, check_layout, engine_token_budget, schedules_ahead
from meshplan.infer.simulate import SimSpec, simulate
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

M8, H100 = load_model("llama3.1-8b"), load_chip("h100-sxm")
EFF = default_efficiency(H100)


def test_every_release_names_a_preset_and_overrides_known_keys_with_a_source():
    table = C._table()
    assert {"sglang@0.3", "trtllm@0.17", "vllm@0.14"} <= set(C.engine_releases())
    for name, overrides in table["engine_releases"].items():
        assert C.base_engine(name) in C.ENGINES and name.count("@") == 1
        assert overrides
        for key, by_chip in overrides.items():
            assert key.startswith("engine_") and key in table, (name, key)
            for entry in by_chip.values():
                # a value, or a measured curve (engine_decode_attention_kv_rate: [units, bytes/s] points), or one
                # fraction per experts' format (engine_grouped_matmul_peak_fraction)
                formats = set(entry) - {"source"}
                if key == "engine_grouped_matmul_peak_fraction":
                    assert formats and formats <= set(C.EXPERT_GEMM_FORMATS)
                    assert all(set(entry[f]) == {"fraction", "rows_half", "half_dim"}
                               and 0.0 < entry[f]["fraction"] <= 1.0 and entry[f]["rows_half"] >= 0
                               and entry[f]["half_dim"] >= 0 for f in formats)
                else:
                    assert formats in ({"value"}, {"points"})
                assert "source" in entry and len(entry["source"]) > 40


def test_sglang_0_3_runs_serially_and_keeps_every_other_sglang_default():
    # SGLang v0.4 introduced the overlap scheduler (LMSYS blog, 2024-12-04); v0.3 schedules each step after the last
    now, old = ServeConfig(engine="sglang"), ServeConfig(engine="sglang@0.3")
    assert schedules_ahead(now, H100) and not schedules_ahead(old, H100)
    assert engine_token_budget("sglang@0.3", H100) == engine_token_budget("sglang", H100) == 8192
    for fn in (C.chunked_prefill, C.fused_add_norm, C.custom_allreduce, C.kv_on_demand, C.first_token_decode_step):
        assert fn(old, H100) == fn(now, H100), fn.__name__
    assert C.kv_cache_free_fraction(old, H100) == C.kv_cache_free_fraction(now, H100)
    # a layout's own flag still wins over the release's default
    assert schedules_ahead(ServeConfig(engine="sglang@0.3", overlap_scheduling=True), H100)


def test_trtllm_0_17_is_the_serial_cpp_executor_and_trtllm_the_pytorch_backend():
    # TensorRT-LLM's PyTorch backend overlaps (docs/source/features/overlap-scheduler.md: 'Enabled by default'); the
    # C++ executor of the TensorRT engine path (the v0.14 and v0.17 tables) runs each step after the last
    assert schedules_ahead(ServeConfig(engine="trtllm"), H100)
    assert not schedules_ahead(ServeConfig(engine="trtllm@0.17"), H100)
    assert engine_token_budget("trtllm@0.17", H100) == engine_token_budget("trtllm", H100)
    for fn in (C.chunked_prefill, C.fused_add_norm, C.custom_allreduce, C.kv_on_demand):
        assert fn(ServeConfig(engine="trtllm@0.17"), H100) == fn(ServeConfig(engine="trtllm"), H100), fn.__name__


def test_a_release_simulates_as_its_preset_with_that_default_changed():
    w = Workload(1000, 200)
    spec = SimSpec(rate=6.0, n_requests=120, seed=3)
    old = simulate(M8, H100, 1, ServeConfig(engine="sglang@0.3"), EFF, w, 64, spec)
    flag = simulate(M8, H100, 1, ServeConfig(engine="sglang", overlap_scheduling=False), EFF, w, 64, spec)
    now = simulate(M8, H100, 1, ServeConfig(engine="sglang"), EFF, w, 64, spec)
    assert old["ttft_s"] == flag["ttft_s"] and old["itl_s"] == flag["itl_s"]
    # one step ahead, a request that arrives during step n is first scheduled into step n+2: later first tokens
    assert now["ttft_s"]["mean"] > old["ttft_s"]["mean"]


def test_an_unknown_release_is_one_clear_error(capsys):
    with pytest.raises(MeshplanError, match="unknown engine 'sglang@9'"):
        check_layout(M8, H100, 1, ServeConfig(engine="sglang@9"))
    code, out, err = run_cli(["serve", "-m", "llama3.1-8b", "--hardware", "h100-sxm", "--chips", "1", "--input-len",
                              "100", "--output-len", "10", "--engine", "vllm@0.1"], capsys)
    assert code == 2
    assert (out + err).strip().splitlines() == [
        "error: --engine must be one of default, vllm, sglang, trtllm, lmdeploy, sglang@0.3, trtllm@0.17, vllm@0.14, "
            "got 'vllm@0.1'"]
