"""`serve --export E` times the plan with engine E's own defaults, and `serve --from` the written launch reads the same
numbers back (session 21, QA finding: both used to time the `default` engine, so the header written into vllm.sh said
TTFT 194 ms where `--engine vllm` predicted 205 ms for the same layout)."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

ARGS = ["serve", "--model", "llama3-70b", "--hardware", "h100-sxm", "--chips", "8", "--input-len", "2000",
        "--output-len", "500", "--json"]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_export_times_the_exported_engine_and_from_reads_it_back(engine, tmp_path, capsys):
    # the launch is an HTTP server: timed with its own path (session 24), export and --from alike
    path = {"vllm": "vllm-openai", "sglang": "sglang-http"}[engine]
    code, out, _ = run_cli([*ARGS, "--engine", engine, "--frontend", path], capsys)
    assert code == 0
    pinned = json.loads(out)
    code, out, _ = run_cli([*ARGS, "--export", engine, "--out", str(tmp_path)], capsys)
    assert code == 0
    exported = json.loads(out)
    assert exported["config"] == pinned["config"]
    for key in ("ttft_s", "tpot_s", "throughput_tokens_per_s", "batch"):
        assert exported[key] == pinned[key], key
    launch = next(tmp_path.iterdir())
    code, out, _ = run_cli(["serve", "--from", str(launch), "--hardware", "h100-sxm", "--input-len", "2000",
                            "--output-len", "500", "--json"], capsys)
    assert code == 0
    yours = json.loads(out)["yours"]
    assert yours["config"]["engine"] == engine
    assert yours["ttft_s"] == pytest.approx(pinned["ttft_s"])
    assert yours["tpot_s"] == pytest.approx(pinned["tpot_s"])


def test_export_with_another_engine_is_one_error_line(tmp_path, capsys):
    code, out, err = run_cli([*ARGS, "--export", "vllm", "--engine", "sglang", "--out", str(tmp_path)], capsys)
    assert code == 2 and err.startswith("error:") and err.count("\n") == 1
    assert not list(tmp_path.iterdir())


def test_a_trtllm_serve_launch_is_not_timed_through_the_triton_ensemble(tmp_path, capsys):
    # `--export trtllm` writes a trtllm-serve launch, TensorRT-LLM's own OpenAI server: the triton-ensemble path
    # (the Triton backend's) is another server, and no measurement of trtllm-serve's path is known, so none is added
    code, out, err = run_cli([*ARGS, "--export", "trtllm", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert json.loads(out)["config"]["frontend"] is None
    code, out, _ = run_cli([*ARGS, "--export", "vllm", "--out", str(tmp_path / "v")], capsys)
    assert json.loads(out)["config"]["frontend"] == "vllm-openai"
