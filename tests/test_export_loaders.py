"""Exported files read by the frameworks' own config loaders, where the framework is installed.

CI does not install them: torchtitan, Megatron-LM, vLLM and SGLang all pull PyTorch (its CUDA wheels from the
registries, several GB), so these tests skip there; test_export.py checks the same files against each framework's
documented keys instead. Where the framework is importable they run as written. They were run (and pass) in a
separate virtual environment with the PyTorch 2.13 CPU wheel and: torchtitan 0.2.2 (`pip install --no-deps
torchtitan==0.2.2 tyro tokenizers`; the last release that reads TOML job files, and its loader rejects unknown
keys), Megatron-LM's own source at tag core_v0.15.0 on PYTHONPATH (+ six, regex), SGLang 0.5.23 (`--no-deps` plus
the few modules server_args imports), DeepSpeed's own source at deepspeedai/DeepSpeed@edaa7221 on PYTHONPATH (+ py-cpuinfo,
hjson, einops, msgpack). The vLLM test has not been run (its wheel carries CUDA kernels).
"""

from __future__ import annotations

import shlex
import sys

import pytest
from test_export import CASES, _roundtrip

from meshplan.export.serving import ServePlan, export_engine


def test_torchtitan_config_manager_reads_the_exported_toml(tmp_path):
    manager = pytest.importorskip("torchtitan.config.manager")
    pe, name, text, _ = _roundtrip(CASES["torchtitan"])
    f = tmp_path / name
    f.write_text(text)
    try:
        cfg = manager.ConfigManager().parse_args(["--job.config_file", str(f)])
    except SystemExit:
        pytest.skip("this torchtitan reads Python config registries, not TOML job files")
    c = pe.config
    par = cfg.parallelism
    assert (par.data_parallel_replicate_degree, par.data_parallel_shard_degree, par.tensor_parallel_degree,
            par.pipeline_parallel_degree, par.context_parallel_degree) == (c.dp, c.fsdp, c.tp, c.pp, c.cp)
    assert par.pipeline_parallel_schedule == "Interleaved1F1B" and par.enable_async_tensor_parallel
    assert (cfg.training.seq_len, cfg.training.global_batch_size) == (pe.problem.seq_len, pe.problem.global_batch)
    assert cfg.activation_checkpoint.mode == "selective" and cfg.compile.enable


def test_megatron_argument_parser_reads_the_exported_arguments(monkeypatch):
    arguments = pytest.importorskip("megatron.training.arguments")
    pe, _, text, _ = _roundtrip(CASES["megatron"])
    argv = shlex.split(text.replace("\\\n", " "), comments=True)
    monkeypatch.setattr(sys, "argv", argv[argv.index("pretrain_gpt.py"):])
    args = arguments.parse_args()
    c = pe.config
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size) == \
        (c.tp, c.pp, c.cp)
    assert args.sequence_parallel and args.use_distributed_optimizer and args.tp_comm_overlap
    assert (args.micro_batch_size, args.global_batch_size) == (c.microbatch, pe.problem.global_batch)


def _serve_argv(engine: str) -> list[str]:
    out = {"config": {"tp": 4, "pp": 2, "ep": 1, "replicas": 2, "weight_dtype": "fp8", "kv_dtype": "fp8"},
           "batch": 64, "input_len": 2000, "output_len": 500, "model": "llama3-70b", "chips": 16,
           "hardware": "h100-sxm", "ttft_s": 0.1, "tpot_s": 0.05, "throughput_tokens_per_s": 1.0,
           "memory_bytes_per_chip": {"total": 1.0}}
    text = export_engine(engine, ServePlan(out, "meta-llama/Meta-Llama-3-70B", "meshplan serve", "continuous", 8192))
    return shlex.split(next(iter(text.values())).replace("\\\n", " "), comments=True)


def test_vllm_engine_args_parse_the_exported_command():
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        from vllm.utils import FlexibleArgumentParser
    argv = _serve_argv("vllm")
    parser = arg_utils.EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", argv[2], *argv[3:]])
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size) == (4, 2, 2)
    assert (args.max_num_seqs, args.kv_cache_dtype, args.quantization) == (64, "fp8", "fp8")


def test_sglang_server_args_parse_the_exported_command():
    server_args = pytest.importorskip("sglang.srt.server_args")
    import argparse

    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    args = parser.parse_args(_serve_argv("sglang")[3:])
    assert (args.tp_size, args.pp_size, args.dp_size, args.max_running_requests) == (4, 2, 2, 64)
    assert (args.kv_cache_dtype, args.quantization, args.chunked_prefill_size) == ("fp8_e4m3", "fp8", 8192)


def test_deepspeed_config_reads_the_exported_json(tmp_path, monkeypatch):
    config = pytest.importorskip("deepspeed.runtime.config")
    # no process group here: rank 0, and the data-parallel world size from the mpu hook below
    monkeypatch.setattr(config.dist, "get_rank", lambda *a, **k: 0)
    pe, name, text, _ = _roundtrip(CASES["deepspeed"])
    f = tmp_path / name
    f.write_text(text)

    class DataParallel:  # the mpu hook DeepSpeedConfig asks for the data-parallel world size
        def get_data_parallel_world_size(self):
            return pe.config.dp * pe.config.fsdp

    ds = config.DeepSpeedConfig(str(f), mpu=DataParallel())
    assert (ds.train_batch_size, ds.train_micro_batch_size_per_gpu) == (pe.problem.global_batch, pe.config.microbatch)
    assert ds.zero_optimization_stage == pe.config.zero and ds.bfloat16_config.enabled
    assert ds.zero_config.overlap_comm and ds.gradient_accumulation_steps == 2  # 64 = 2 x 2 x 16 ranks
