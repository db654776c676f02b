"""Export to and import from the frameworks people run (issue 16): round trips, refused features, real files.

No framework's own config loader installs on a CPU machine without PyTorch's CUDA wheels (torchtitan, Megatron-Core,
vLLM, SGLang, TensorRT-LLM) or MaxText's TPU stack, so the exported keys are checked against each framework's
documented key list in src/meshplan/export/data/ (every list names the source file and commit it was read from).
"""

from __future__ import annotations

import json
import shlex
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest
import yaml
from conftest import run_cli

from meshplan.cost.efficiency import default_efficiency
from meshplan.errors import MeshplanError
from meshplan.export import PRESET, export_train, train_module
from meshplan.export.common import PlanToExport, framework_keys
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import ParallelConfig
from meshplan.train.costmodel import Options
from meshplan.train.frameworks import framework_options
from meshplan.train.planner import plan
from meshplan.train.space import Pins, Problem

DATA = Path(__file__).parent / "data" / "frameworks"


def _plan(fw: str, model: str, hw: str, chips: int, seq: int, gb: int, slice_shape=None, opts: dict | None = None,
          **degrees) -> PlanToExport:
    """One fully pinned layout planned with the framework's behaviour, ready to export."""
    chip = load_chip(hw)
    problem = Problem(load_model(model), chip, chips, seq, gb, slice_shape)
    o = framework_options(PRESET[fw], Options(), opts or {})
    cfg = ParallelConfig(**degrees)
    pins = Pins(**{f.name: getattr(cfg, f.name) for f in fields(ParallelConfig)})
    pr = plan(problem, pins, default_efficiency(chip), o, top=1).plans[0]
    assert ParallelConfig(**pr["config"]) == cfg
    return PlanToExport(problem, cfg, o, pr, "meshplan train (test)", model)


# one layout per framework, using the features it expresses: TP with overlap, interleaved pipelines, CP, FP8,
# ZeRO/FSDP, recompute
CASES = {
    "torchtitan": dict(fw="torchtitan", model="llama3-8b", hw="h100-sxm", chips=64, seq=8192, gb=32,
                       opts=dict(tp_overlap=True, selective_flavor="op"),
                       dp=2, fsdp=2, tp=4, pp=2, vpp=2, cp=2, microbatch=1, recompute="selective"),
    "megatron": dict(fw="megatron", model="llama3-70b", hw="h100-sxm", chips=64, seq=8192, gb=64,
                     opts=dict(tp_overlap=True), dp=2, tp=4, pp=4, vpp=5, cp=2, microbatch=1, recompute="full",
                     zero=1),
    "nemo": dict(fw="nemo", model="llama3-70b", hw="h100-sxm", chips=64, seq=8192, gb=64,
                 dp=4, tp=8, pp=2, vpp=2, microbatch=1, recompute="selective", zero=1),
    "maxtext": dict(fw="maxtext", model="llama3-8b", hw="tpu-v5p", chips=256, seq=8192, gb=256,
                    slice_shape=(4, 4, 8), dp=2, fsdp=64, tp=2, microbatch=1, recompute="full"),
    "deepspeed": dict(fw="deepspeed", model="llama3-8b", hw="h100-sxm", chips=16, seq=4096, gb=64,
                      dp=16, microbatch=2, recompute="full", zero=2),
}


def _roundtrip(case: dict):
    pe = _plan(**case)
    name, text = export_train(case["fw"], pe)
    job = train_module(case["fw"]).load(text, pe.problem.chips)
    job.finish(pe.problem.model)
    return pe, name, text, job


@pytest.mark.parametrize("fw", sorted(CASES))
def test_round_trip_gives_the_same_plan_and_prediction(fw):
    pe, _, _, job = _roundtrip(CASES[fw])
    p = pe.problem
    assert job.chips == p.chips and job.global_batch == p.global_batch
    assert job.seq_len in (p.seq_len, None)  # a DeepSpeed config does not state it
    assert ParallelConfig(**{f.name: getattr(job.pins, f.name) for f in fields(ParallelConfig)}) == pe.config
    opts = job.resolved_options(Options())
    again = plan(p, job.pins, default_efficiency(p.chip), opts, top=1).plans[0]
    assert again["config"] == pe.prediction["config"]
    assert again["step_time_s"] == pe.prediction["step_time_s"]
    assert again["memory_bytes_per_chip"] == pe.prediction["memory_bytes_per_chip"]


def _keys_torchtitan(text):
    def flat(d, pre=""):
        for k, v in d.items():
            yield from flat(v, f"{pre}{k}.") if isinstance(v, dict) else [pre + k]
    return set(flat(tomllib.loads(text)))


def _keys_megatron(text):
    argv = shlex.split(text.replace("\\\n", " "), comments=True)
    return {a for a in argv[argv.index("pretrain_gpt.py") + 1:] if a.startswith("--")}


def _keys_nemo(text):
    def flat(d, pre=""):
        for k, v in d.items():
            yield from flat(v, f"{pre}{k}.") if isinstance(v, dict) else [pre + k]
    return set(flat(yaml.safe_load(text)))


def _keys_maxtext(text):
    return set(yaml.safe_load(text))


def _keys_deepspeed(text):
    doc = json.loads(text)
    doc.pop("_meshplan")
    return {f"{k}.{kk}" for k, v in doc.items() if isinstance(v, dict) for kk in v} | \
        {k for k, v in doc.items() if not isinstance(v, dict)}


@pytest.mark.parametrize("fw", sorted(CASES))
def test_every_exported_key_is_one_the_framework_documents(fw):
    _, _, text, _ = _roundtrip(CASES[fw])
    keys = globals()[f"_keys_{fw}"](text)
    assert keys and keys <= framework_keys(fw), keys - framework_keys(fw)


def test_exported_files_state_version_command_and_prediction():
    pe, _, text, _ = _roundtrip(CASES["torchtitan"])
    assert "meshplan 0.1.0" in text and "command: meshplan train (test)" in text
    assert f"{pe.prediction['step_time_s']:.6g} s" in text and f"MFU {pe.prediction['mfu']:.1%}" in text


def test_torchtitan_file_reads_as_torchtitan_means_it():
    # pipeline_parallel_microbatch_size is the micro-batch; the local batch is global / data-parallel ranks
    # (torchtitan job_config.py docstrings); 32 sequences / (2 x 2) = 8 local
    _, _, text, _ = _roundtrip(CASES["torchtitan"])
    doc = tomllib.loads(text)
    assert doc["training"]["local_batch_size"] == 8 and doc["parallelism"]["pipeline_parallel_microbatch_size"] == 1
    assert doc["parallelism"]["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert doc["parallelism"]["enable_async_tensor_parallel"] is True and doc["compile"]["enable"] is True
    assert doc["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}


def test_maxtext_file_splits_the_mesh_over_slices():
    # 256 chips in slices of 4x4x8 = 128: 2 slices; the outermost axis (data, 2) crosses DCN
    _, _, text, job = _roundtrip(CASES["maxtext"])
    doc = yaml.safe_load(text)
    assert doc["num_slices"] == 2 and doc["dcn_data_parallelism"] == 2 and doc["ici_data_parallelism"] == 1
    assert doc["ici_fsdp_parallelism"] == 64 and doc["ici_tensor_parallelism"] == 2
    # micro-batch 1 on each of 2 x 64 = 128 data ranks is 128 sequences a micro-step: 2 accumulation steps; MaxText
    # counts every device, so per_device_batch_size = 256 / (256 devices x 2 steps) = 0.5
    assert doc["per_device_batch_size"] == 0.5 and doc["gradient_accumulation_steps"] == 2
    assert doc["remat_policy"] == "full" and job.slices == 2


def test_maxtext_file_carries_the_splash_block_grid():
    # the maxtext preset's 512 x 512 blocks (base.yml) are written out and read back; a file's own sa_block_q /
    # sa_block_kv (tpu-recipes Llama3.1-70B: 2048) set the forward grid, the unset dKV pair keeps base.yml's 512
    case = dict(CASES["maxtext"], opts={"attention_block_fwd": (2048, 1024)})
    pe, _, text, job = _roundtrip(case)
    doc = yaml.safe_load(text)
    assert (doc["sa_block_q"], doc["sa_block_kv"], doc["sa_block_q_dkv"], doc["sa_block_kv_dkv"]) == (2048, 1024, 512, 512)
    opts = job.resolved_options(Options())
    assert (opts.attention_block_fwd, opts.attention_block_bwd) == ((2048, 1024), (512, 512))
    read = train_module("maxtext").load("sa_block_q: 2048\nsa_block_kv: 2048\nici_fsdp_parallelism: 8\n", 8)
    assert read.options["attention_block_fwd"] == (2048, 2048) and "attention_block_bwd" not in read.options
    assert "sa_block_q" not in read.unmodelled_keys
    with pytest.raises(MeshplanError, match="sa_block_kv must be an integer"):
        train_module("maxtext").load("sa_block_kv: 0\nici_fsdp_parallelism: 8\n", 8)


# benchmarks/xla_flags_library.py at AI-Hypercomputer/maxtext@e591f30cbbf217ed67ef71263ec0538239f9c3b8, copied by
# hand: ENABLE_SPARSECORE_OFFLOADING_FOR_ALL_REDUCE = (its three flags) + ENABLE_SPARSECORE_OFFLOADING_BASE_FLAGS
# (four), each string starting with a space as the module writes them; MaxText passes the concatenation as
# LIBTPU_INIT_ARGS='{xla_flags}' (benchmarks/maxtext_xpk_runner.py)
MAXTEXT_SC_ALL_REDUCE = (
    " --xla_tpu_enable_async_collective_fusion_fuse_all_reduce=false"
    " --xla_tpu_enable_sparse_core_collective_offload_all_reduce=true"
    " --xla_tpu_enable_all_reduce_offload_tracing=true"
) + (
    " --xla_tpu_use_tc_device_shape_on_sc=true"
    " --xla_sc_enable_instruction_fusion=false"
    " --xla_sc_disjoint_spmem=false"
    " --xla_sc_disable_megacore_partitioning=true"
)
V6E = dict(fw="maxtext", model="llama3-8b", hw="tpu-v6e", chips=8, seq=8192, gb=32, fsdp=8, microbatch=1,
           recompute="full")


def _libtpu_args(text: str) -> list[str]:
    """The LIBTPU_INIT_ARGS values the file's comment lines assign."""
    return [w.split("=", 1)[1] for line in text.splitlines() if line.startswith("#")
            for w in shlex.split(line[1:]) if w.startswith("LIBTPU_INIT_ARGS=")]


def test_maxtext_file_carries_the_sparsecore_reduce_flags_and_the_iota_embedding():
    # a v6e plan that assumes the SparseCore gradient reduction and MaxText's one-hot embedding: the file sets
    # use_iota_embed (base.yml: false by default) and launches with MaxText's own flag group, and reads back to both
    pe, _, text, job = _roundtrip(dict(V6E, opts={"sparsecore_reduce": True, "iota_embedding": True}))
    doc = yaml.safe_load(text)
    assert doc["use_iota_embed"] is True and set(doc) <= framework_keys("maxtext")
    assert _libtpu_args(text) == [MAXTEXT_SC_ALL_REDUCE.strip()]
    assert "python3 -m maxtext.trainers.pre_train.train FILE" in text
    assert job.options["sparsecore_reduce"] is True and job.options["iota_embedding"] is True
    assert "use_iota_embed" not in job.unmodelled_keys
    opts = job.resolved_options(Options())
    assert opts.sparsecore_reduce and opts.iota_embedding
    again = plan(pe.problem, job.pins, default_efficiency(pe.problem.chip), opts, top=1).plans[0]
    assert again["step_time_s"] == pe.prediction["step_time_s"]
    # without them: no flags, no key, and the file reads back to neither
    pe0, _, text0, job0 = _roundtrip(V6E)
    assert _libtpu_args(text0) == [] and "use_iota_embed" not in yaml.safe_load(text0)
    assert not job0.resolved_options(Options()).sparsecore_reduce
    assert not job0.resolved_options(Options()).iota_embedding
    # the SparseCore merge is TensorCore time saved (costmodel._tpu_reduction_s), so the two plans differ
    assert pe0.prediction["step_time_s"] != pe.prediction["step_time_s"]


def test_maxtext_loader_reads_libtpu_init_args_and_use_iota_embed_from_a_hand_written_file():
    load = train_module("maxtext").load
    base = "ici_fsdp_parallelism: 8\n"
    on = load('# export LIBTPU_INIT_ARGS="--xla_tpu_scoped_vmem_limit_kib=98304' + MAXTEXT_SC_ALL_REDUCE + '"\n'
              + base + "use_iota_embed: false\n", 8)
    assert on.options["sparsecore_reduce"] is True and on.options["iota_embedding"] is False
    off = load("# LIBTPU_INIT_ARGS='--xla_tpu_enable_sparse_core_collective_offload_all_reduce=false'\n" + base, 8)
    assert off.options["sparsecore_reduce"] is False
    other = load("# LIBTPU_INIT_ARGS='--xla_tpu_scoped_vmem_limit_kib=98304'\n" + base, 8)
    assert "sparsecore_reduce" not in other.options and "iota_embedding" not in other.options
    with pytest.raises(MeshplanError, match="use_iota_embed must be true or false"):
        load(base + "use_iota_embed: 1\n", 8)
    with pytest.raises(MeshplanError, match="cannot read the LIBTPU_INIT_ARGS line"):
        load("# LIBTPU_INIT_ARGS='--a\n" + base, 8)


def test_cli_exports_and_reads_back_the_tpu_options_and_refuses_them_on_gpus(capsys, tmp_path):
    args = ["train", "--model", "llama3-8b", "--hardware", "tpu-v6e", "--chips", "8", "--seq-len", "8192",
            "--global-batch", "32", "--top", "1"]
    code, out, err = run_cli(args + ["--sparsecore-reduce", "--iota-embedding", "--export", "maxtext", "--out",
                                     str(tmp_path)], capsys)
    assert code == 0, err
    said = " ".join(out.split())
    assert "gradient reductions merged on the SparseCores" in said
    assert "embedding as a one-hot matmul (MaxText use_iota_embed)" in said
    text = (tmp_path / "maxtext.yml").read_text()
    assert _libtpu_args(text) == [MAXTEXT_SC_ALL_REDUCE.strip()] and yaml.safe_load(text)["use_iota_embed"] is True
    code, out, err = run_cli(["train", "--from", str(tmp_path / "maxtext.yml"), "--hardware", "tpu-v6e", "--model",
                              "llama3-8b"], capsys)
    said = " ".join(out.split())
    assert code == 0 and "merged on the SparseCores" in said and "embedding as a one-hot matmul" in said, err
    code, out, _ = run_cli(args, capsys)
    said = " ".join(out.split())
    assert code == 0 and "merged on the TensorCore" in said and "embedding by gather" in said
    code, _, err = run_cli(["train", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len",
                            "8192", "--global-batch", "32", "--iota-embedding"], capsys)
    assert code == 2 and "error: --iota-embedding needs a TPU (h100-sxm is a GPU)" in err


# ---- refused features: one test per feature a framework cannot express -------------------------------------

REFUSED = [
    ("torchtitan", dict(dp=8, tp=8, microbatch=1, recompute="none", zero=1), {}, "ZeRO stage"),
    ("torchtitan", dict(fsdp=8, tp=8, microbatch=1, recompute="none", offload=1.0), {}, "activation offload"),
    ("torchtitan", dict(fsdp=64, microbatch=1, recompute="gemm-last"), {}, "recompute policy"),
    ("torchtitan", dict(fsdp=64, microbatch=1, recompute="selective"), {"selective_flavor": "attention"},
     "selective recompute saves"),
    ("torchtitan", dict(fsdp=32, cp=2, microbatch=1, recompute="none"), {"cp_impl": "ring"}, "context-parallel"),
    ("torchtitan", dict(fsdp=8, tp=8, microbatch=1, recompute="none"), {"sequence_parallel": False},
     "sequence parallelism"),
    ("megatron", dict(dp=8, tp=8, microbatch=1, recompute="none", zero=2), {}, "ZeRO stage"),
    ("megatron", dict(dp=8, tp=8, microbatch=1, recompute="gemm-last", zero=1), {}, "recompute policy"),
    ("megatron", dict(dp=8, tp=8, microbatch=1, recompute="none", offload=1.0), {}, "activation offload"),
    ("megatron", dict(dp=8, tp=2, cp=4, microbatch=1, recompute="full"), {"cp_impl": "torch"}, "context-parallel"),
    ("megatron", dict(dp=8, pp=8, microbatch=1, recompute="none"), {"pp_schedule": "zb1p"}, "pipeline schedule"),
    ("megatron", dict(fsdp=8, tp=8, microbatch=1, recompute="none", dp=1), {"attention_kernel": "sdpa"},
     "attention kernel"),
    ("maxtext", dict(fsdp=64, microbatch=1, recompute="none"), {}, "recompute policy"),
    ("maxtext", dict(dp=64, microbatch=1, recompute="full", zero=1), {}, "ZeRO stage"),
    ("maxtext", dict(fsdp=64, microbatch=1, recompute="full"), {"tp_overlap": False, "dp_overlap": True},
     "DP gradient reduction"),
    ("deepspeed", dict(dp=8, tp=8, microbatch=1, recompute="none", zero=1), {}, "tensor parallelism"),
    ("deepspeed", dict(dp=64, microbatch=1, recompute="selective", zero=1), {}, "recompute policy"),
    ("nemo", dict(dp=8, tp=8, microbatch=1, recompute="none", zero=2), {}, "ZeRO stage"),
]


@pytest.mark.parametrize("fw,degrees,opts,words", REFUSED, ids=[f"{r[0]}-{r[3]}" for r in REFUSED])
def test_a_feature_the_framework_cannot_express_is_refused(fw, degrees, opts, words):
    sp = opts.pop("sequence_parallel", True)
    hw, chips = ("tpu-v5p", 64) if fw == "maxtext" else ("h100-sxm", 64)
    pe = _plan(fw, "llama3-8b", hw, chips, 4096, 64, opts=opts, sequence_parallel=sp, **degrees)
    with pytest.raises(MeshplanError, match=f"{fw} cannot express this plan: .*{words}"):
        export_train(fw, pe)


def test_a_gpu_framework_refuses_a_tpu_plan():
    pe = _plan("maxtext", "llama3-8b", "tpu-v5p", 64, 4096, 64, fsdp=64, microbatch=1, recompute="full")
    with pytest.raises(MeshplanError, match="megatron cannot express this plan: it runs on GPUs"):
        export_train("megatron", pe)


def test_refusal_through_the_cli_is_one_error_line(capsys, tmp_path):
    code, out, err = run_cli(["train", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "64", "--seq-len",
                              "4096", "--global-batch", "64", "--zero", "2", "--dp", "64", "--export", "torchtitan",
                              "--out", str(tmp_path), "--rank", "1"], capsys)
    assert code == 2 and err.startswith("error: torchtitan cannot express this plan") and err.count("\n") == 1
    assert not list(tmp_path.iterdir())


def test_cli_export_then_from_round_trips(capsys, tmp_path):
    base = ["--hardware", "h100-sxm", "--top", "2"]
    code, out, err = run_cli(["train", "--model", "llama3-8b", "--chips", "16", "--seq-len", "4096",
                              "--global-batch", "32", "--export", "megatron", "--out", str(tmp_path), "--json", *base],
                             capsys)
    assert code == 0, err
    best = json.loads(out)["plans"]
    written = (tmp_path / "megatron.sh").read_text()
    code, out, err = run_cli(["train", "--from", str(tmp_path / "megatron.sh"), "--model", "llama3-8b", "--json",
                              *base], capsys)
    assert code == 0, err
    r = json.loads(out)
    # the file's header names the layout and the step time it was exported with; reading it back gives both
    assert f"plan: {ParallelConfig(**r['yours']['config']).describe()} on 16" in written
    assert f"({r['yours']['step_time_s']:.6g} s)" in written and best
    assert r["unknown_keys"] == [] and r["framework"] == "megatron"


# ---- import of real published files ---------------------------------------------------------------------------


def test_published_torchtitan_llama3_8b_toml(capsys):
    # torchtitan's own llama3_8b.toml ("a preset for 64 A100 GPUs"): FSDP over all ranks (-1), local batch 1 at 8192
    # tokens, per-op selective AC, no torch.compile
    code, out, err = run_cli(["train", "--from", str(DATA / "torchtitan_llama3_8b.toml"), "--hardware", "a100-80gb",
                              "--chips", "64", "--json", "--top", "2"], capsys)
    assert code == 0, err
    r = json.loads(out)
    y = r["yours"]["config"]
    assert (y["fsdp"], y["dp"], y["tp"], y["microbatch"], y["recompute"]) == (64, 1, 1, 1, "selective")
    assert (r["model"], r["seq_len"], r["global_batch"]) == ("llama3-8b", 8192, 64)
    assert "optimizer.lr" in r["unmodelled_keys"] and r["unknown_keys"] == []
    assert len(r["alternatives"]) == 2 and r["differences"]


def test_published_torchtitan_without_compile_runs_eager():
    from meshplan.export import torchtitan

    job = torchtitan.load((DATA / "torchtitan_llama3_8b.toml").read_text(), 64)
    o = job.resolved_options(Options())
    assert (o.fused_elementwise, o.fused_loss, o.selective_flavor, o.cp_impl) == (False, False, "op", "torch")


def test_unknown_keys_are_listed_not_ignored():
    from meshplan.export import torchtitan

    text = (DATA / "torchtitan_llama3_8b.toml").read_text().replace("seq_len = 8192", "seq_len = 8192\nseqlen = 9")
    job = torchtitan.load(text, 64)
    assert job.unknown_keys == ["training.seqlen"]
    offload = torchtitan.load(text.replace("[training]", "[training]\nenable_cpu_offload = true"), 64)
    assert any("enable_cpu_offload = True" in n and "not modelled" in n for n in offload.notes)


def test_published_maxtext_gpu_llama3_8b_yml():
    # MaxText's gpu/models/llama3_8b.yml: 12 sequences per device, 8192 tokens, remat minimal_with_context
    from meshplan.export import maxtext

    job = maxtext.load((DATA / "maxtext_gpu_llama3_8b.yml").read_text(), 8)
    assert (job.model, job.seq_len, job.chips, job.global_batch) == ("llama3-8b", 8192, 8, 96)  # 12 x 8 devices
    assert (job.pins.fsdp, job.pins.microbatch, job.pins.recompute) == (8, 12, "gemm-last")
    assert "dataset_type" in job.unmodelled_keys


def test_a_gpu_maxtext_file_on_a_tpu_is_an_error(capsys):
    code, _, err = run_cli(["train", "--from", str(DATA / "maxtext_gpu_llama3_8b.yml"), "--hardware", "tpu-v5p",
                            "--chips", "8"], capsys)
    assert code == 2 and "is for GPUs but --hardware tpu-v5p is a tpu" in err


def test_a_file_no_framework_wrote_is_an_error(capsys, tmp_path):
    bad = tmp_path / "job.toml"
    bad.write_text("[parallelism\n")
    code, _, err = run_cli(["train", "--from", str(bad), "--hardware", "h100-sxm"], capsys)
    assert code == 2 and err.startswith("error: not a TOML file")
    other = tmp_path / "job.txt"
    other.write_text("hello")
    code, _, err = run_cli(["train", "--from", str(other), "--hardware", "h100-sxm"], capsys)
    assert code == 2 and err.startswith("error: cannot tell which framework")


def test_a_nemo_run_serialised_recipe_reads_through_its_targets():
    from meshplan.export import nemo

    text = """
trainer:
  _target_: nemo.lightning.Trainer
  num_nodes: 2
  devices: 8
  strategy:
    _target_: nemo.lightning.MegatronStrategy
    tensor_model_parallel_size: 4
    sequence_parallel: true
data:
  _target_: nemo.collections.llm.gpt.data.mock.MockDataModule
  seq_length: 8192
  global_batch_size: 64
  micro_batch_size: 1
"""
    job = nemo.load(text)
    # 2 nodes x 8 GPUs = 16 chips; 16 / tp 4 = 4 data-parallel replicas
    assert (job.chips, job.pins.tp, job.pins.dp, job.seq_len, job.global_batch) == (16, 4, 4, 8192, 64)
    assert job.unknown_keys == [] and job.pins.sequence_parallel


def test_megatron_model_shape_must_match_model(capsys, tmp_path):
    _, _, text, _ = _roundtrip(CASES["megatron"])
    f = tmp_path / "args.sh"
    f.write_text(text)
    code, _, err = run_cli(["train", "--from", str(f), "--hardware", "h100-sxm", "--model", "llama3-8b"], capsys)
    assert code == 2 and "model shape does not match --model" in err


# ---- serving ---------------------------------------------------------------------------------------------------

SERVE = ["--model", "llama3-70b", "--hardware", "h100-sxm", "--chips", "16", "--input-len", "2000",
         "--output-len", "500"]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_serve_export_then_from_round_trips(engine, capsys, tmp_path):
    code, out, err = run_cli(["serve", *SERVE, "--quant", "fp8", "--kv-quant", "fp8", "--json", "--export", engine,
                              "--out", str(tmp_path)], capsys)
    assert code == 0, err
    planned = json.loads(out)
    f = tmp_path / f"{engine}.sh"
    argv = shlex.split(f.read_text().replace("\\\n", " "), comments=True)
    assert {a for a in argv if a.startswith("--")} <= framework_keys(engine)
    code, out, err = run_cli(["serve", "--from", str(f), "--hardware", "h100-sxm", "--input-len", "2000",
                              "--output-len", "500", "--json"], capsys)
    assert code == 0, err
    r = json.loads(out)
    assert r["yours"]["config"] == planned["config"] and r["yours"]["batch"] == planned["batch"]
    assert r["yours"]["tpot_s"] == planned["tpot_s"] and r["yours"]["ttft_s"] == planned["ttft_s"]


def test_a_local_model_folder_round_trips(capsys, tmp_path):
    from meshplan.specs.model import MODELS_DIR

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text((MODELS_DIR / "llama3-8b.json").read_text())
    code, _, err = run_cli(["serve", "--model", str(folder / "config.json"), "--hardware", "h100-sxm", "--chips", "2",
                            "--input-len", "500", "--output-len", "100", "--export", "vllm", "--out", str(tmp_path)],
                           capsys)
    assert code == 0, err
    assert f"vllm serve {folder} " in (tmp_path / "vllm.sh").read_text().replace("\\\n", "")
    code, out, err = run_cli(["serve", "--from", str(tmp_path / "vllm.sh"), "--hardware", "h100-sxm", "--input-len",
                              "500", "--output-len", "100", "--json"], capsys)
    assert code == 0, err


def test_serve_disaggregated_export_writes_both_pools(capsys, tmp_path):
    code, _, err = run_cli(["serve", *SERVE, "--disaggregate", "--export", "sglang", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert "--disaggregation-mode prefill" in (tmp_path / "sglang_prefill.sh").read_text()
    assert "--disaggregation-mode decode" in (tmp_path / "sglang_decode.sh").read_text()


@pytest.mark.parametrize("engine,flags,words", [
    ("vllm", ["--kv-quant", "int8"], "int8 KV cache"),
    ("sglang", ["--kv-quant", "int8"], "int8 KV cache"),
    ("vllm", ["--quant", "int4"], "int4 weights"),
    ("trtllm", ["--quant", "fp8"], "fp8 weights"),
    ("trtllm", ["--disaggregate"], "disaggregated pools"),
])
def test_serve_refuses_what_the_engine_cannot_express(engine, flags, words, capsys, tmp_path):
    code, _, err = run_cli(["serve", *SERVE, *flags, "--export", engine, "--out", str(tmp_path)], capsys)
    # refused by the exporter, or already by the engine preset --export implies (session 21: an int8 KV cache)
    assert code == 2 and err.startswith(f"error: {engine} ") and words in err and err.count("\n") == 1


def test_vllm_expert_parallel_spans_every_tp_rank(capsys, tmp_path):
    code, _, err = run_cli(["serve", "--model", "mixtral-8x7b", "--hardware", "h100-sxm", "--chips", "8",
                            "--input-len", "1000", "--output-len", "200", "--tp", "8", "--ep", "2", "--export", "vllm",
                            "--out", str(tmp_path)], capsys)
    assert code == 2 and "expert parallelism 2 inside tp 8" in err


def test_trtllm_writes_launch_and_extra_options(capsys, tmp_path):
    code, _, err = run_cli(["serve", *SERVE, "--kv-quant", "fp8", "--export", "trtllm", "--out", str(tmp_path)],
                           capsys)
    assert code == 0, err
    extra = yaml.safe_load((tmp_path / "trtllm_extra.yml").read_text())
    # the plan was timed as TensorRT-LLM runs by default, prompts whole (serving.yaml engine_chunked_prefill): the
    # launch says so (session 22 QA: it wrote chunking on beside a plan timed without it)
    assert extra == {"kv_cache_config": {"dtype": "fp8"}, "enable_chunked_prefill": False}
    assert "--extra_llm_api_options trtllm_extra.yml" in (tmp_path / "trtllm.sh").read_text()


def test_trtllm_launch_keeps_the_timed_chunking_and_sizes_the_batch_per_micro_batch(capsys, tmp_path):
    # trtllm-bench's TensorRT flow chunks prompts (harness_trtllm_bench): the launch turns chunking on
    code, _, err = run_cli(["serve", *SERVE, "--engine", "trtllm@0.17", "--harness", "trtllm-bench", "--export",
                            "trtllm", "--out", str(tmp_path / "a")], capsys)
    assert code == 0, err
    assert yaml.safe_load((tmp_path / "a" / "trtllm_extra.yml").read_text())["enable_chunked_prefill"] is True
    # pp 2: max_batch_size holds per micro-batch, half the replica's batch (rounded up)
    code, out, err = run_cli(["serve", "--model", "llama3.1-70b", "--hardware", "h200", "--chips", "8", "--tp", "4",
                              "--pp", "2", "--input-len", "1024", "--output-len", "1024", "--export", "trtllm",
                              "--out", str(tmp_path / "b"), "--json"], capsys)
    assert code == 0, err
    batch = json.loads(out[out.index("{"):])["batch"]
    assert f"--max_batch_size {-(-batch // 2)} " in (tmp_path / "b" / "trtllm.sh").read_text()


# ---- bad files: an error line, never a traceback ----------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_LOADERS = ["torchtitan", "megatron", "nemo", "maxtext", "deepspeed"]


@settings(max_examples=60, deadline=None)
@given(fw=st.sampled_from(_LOADERS), text=st.text(max_size=200), chips=st.one_of(st.none(), st.integers(-2, 64)))
def test_any_text_is_read_or_refused_cleanly(fw, text, chips):
    try:
        train_module(fw).load(text, chips)
    except MeshplanError:
        pass


_DEGREE = st.one_of(st.integers(-3, 9), st.sampled_from(["x", 1.5, True, None]))


@settings(max_examples=60, deadline=None)
@given(tp=_DEGREE, pp=_DEGREE, shard=_DEGREE, mb=_DEGREE, seq=_DEGREE)
def test_odd_values_in_a_torchtitan_file_are_errors_not_crashes(tp, pp, shard, mb, seq):
    def v(x):
        return "true" if x is True else '"x"' if x in ("x", None) else repr(x)

    text = (f"[parallelism]\ntensor_parallel_degree = {v(tp)}\npipeline_parallel_degree = {v(pp)}\n"
            f"data_parallel_shard_degree = {v(shard)}\npipeline_parallel_microbatch_size = {v(mb)}\n"
            f"[training]\nseq_len = {v(seq)}\nlocal_batch_size = {v(mb)}\n")
    try:
        train_module("torchtitan").load(text, 8)
    except MeshplanError:
        pass


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=200))
def test_any_server_command_is_read_or_refused_cleanly(text):
    from meshplan.export.serving import load_engine

    for prefix in ("vllm serve m ", "python -m sglang.launch_server "):
        try:
            load_engine(prefix + text)
        except MeshplanError:
            pass


_FIELDS = {
    "maxtext": ["ici_fsdp_parallelism", "ici_tensor_parallelism", "dcn_data_parallelism", "num_slices",
                "per_device_batch_size", "gradient_accumulation_steps", "max_target_length", "ici_pipeline_parallelism",
                "num_pipeline_microbatches", "remat_policy", "quantization", "model_name", "base_emb_dim"],
    "nemo": ["trainer.num_nodes", "trainer.devices", "trainer.strategy.tensor_model_parallel_size",
             "data.micro_batch_size", "data.global_batch_size", "model.config.recompute_granularity",
             "trainer.strategy.virtual_pipeline_model_parallel_size", "data.seq_length"],
    "deepspeed": ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                  "zero_optimization.stage", "activation_checkpointing.cpu_checkpointing"],
}
_VALUE = st.one_of(st.integers(-3, 300), st.sampled_from(["x", "full", 1.5, 0.5, True, None, [], {}]))


@settings(max_examples=150, deadline=None)
@given(fw=st.sampled_from(sorted(_FIELDS)), data=st.data(), chips=st.one_of(st.none(), st.integers(1, 64)))
def test_odd_values_in_yaml_and_json_files_are_errors_not_crashes(fw, data, chips):
    keys = data.draw(st.lists(st.sampled_from(_FIELDS[fw]), unique=True, max_size=8))
    doc: dict = {}
    for k in keys:
        d = doc
        *parents, leaf = k.split(".")
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = data.draw(_VALUE)
    text = json.dumps(doc) if fw == "deepspeed" else yaml.safe_dump(doc)
    try:
        job = train_module(fw).load(text, chips)
        job.finish(load_model("llama3-8b"))
    except MeshplanError:
        pass


def test_from_does_not_combine_with_outputs_it_would_ignore(capsys, tmp_path):
    f = DATA / "torchtitan_llama3_8b.toml"
    code, _, err = run_cli(["train", "--from", str(f), "--hardware", "h100-sxm", "--chips", "64", "--html",
                            str(tmp_path / "p.html")], capsys)
    assert code == 2 and "does not combine" in err


def test_deepspeed_writes_and_reads_model_state_offload():
    # ZeRO-Offload (offload_optimizer, any stage) and ZeRO-Infinity (offload_param, stage 3) to the host CPU: the
    # file's zero_optimization says both, and reading it back gives the same plan and prediction (QA session 22: the
    # exporter refused them)
    case = dict(fw="deepspeed", model="llama3-8b", hw="h100-sxm", chips=16, seq=4096, gb=64, fsdp=16, microbatch=2,
                recompute="full", offload_optimizer=1, offload_params=1)
    pe, _, text, job = _roundtrip(case)
    z = json.loads(text)["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"]["device"] == "cpu" and z["offload_param"]["device"] == "cpu"
    assert (job.pins.offload_optimizer, job.pins.offload_params) == (1, 1) and not job.unknown_keys
    again = plan(pe.problem, job.pins, default_efficiency(pe.problem.chip), job.resolved_options(Options()),
                 top=1).plans[0]
    assert again["step_time_s"] == pe.prediction["step_time_s"]


def test_deepspeed_refuses_what_it_cannot_offload():
    # offload_param needs stage 3: weight offload under ZeRO-2 has no DeepSpeed key
    pe = _plan("deepspeed", "llama3-8b", "h100-sxm", 16, 4096, 64, dp=16, microbatch=2, recompute="full", zero=2,
               offload_params=1)
    with pytest.raises(MeshplanError, match="offload_param is valid only with ZeRO stage 3"):
        export_train("deepspeed", pe)
    # an NVMe offload is read as an error, not silently as the host's
    doc = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2,
           "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
    with pytest.raises(MeshplanError, match="host \\(cpu\\) offload only"):
        train_module("deepspeed").load(json.dumps(doc), 32)
