"""Session 7 flags and inputs under hostile values (issue #18's contract): one `error:` line and exit 2, or a plan.

Covered: `train` --moe-dispatcher, --moe-force-balance, --cuda-graph, --pp-overlap, --pp-head-in-split,
--weight-dtype, --fp8-recipe, --framework NAME@VERSION; `serve` --engine, --concurrency, --max-num-batched-tokens,
--from; `verify` --plan FILE|-, --rank, --attention, --framework (their checks only: `run_verify` is replaced by a
stub, so nothing compiles); `calibrate --show`; `Options(...)`. Hypothesis draws the values; every property says
which values must be accepted, so a check that refused everything would fail as surely as one that let bad input by.
"""

from __future__ import annotations

import io
import json
import math
import sys

import pytest
from conftest import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshplan.errors import MeshplanError
from meshplan.train.costmodel import ATTENTION_KERNELS, CUDA_GRAPH_SCOPES, MOE_DISPATCHERS, Options, fp8_recipes
from meshplan.train.space import PP_SCHEDULES

FAST = settings(max_examples=12, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# small searches: a dense and a MoE model whose plans take well under a second
DENSE = ["train", "-m", "llama3.2-1b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len", "2048",
         "--global-batch", "16", "--top", "1", "--json"]
MOE = ["train", "-m", "qwen3-30b-a3b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len", "2048",
       "--global-batch", "16", "--top", "1", "--json"]
SERVE = ["serve", "-m", "llama3.2-1b", "--hardware", "h100-sxm", "--chips", "1", "--input-len", "256",
         "--output-len", "32", "--json"]

# hostile words: empty, case, separators, a 300-character name, NUL, unicode, a path, a number
ODD_WORDS = st.one_of(st.sampled_from(["", " ", "ALLTOALL", "none,attn", "attn,", ",", "a" * 300, "nul\x00x",
                                       "\u00e9", "../x", "1", "nan", "@", "megatron@", "nemo@24.07@1"]),
                      st.text(max_size=12))


def one_error(code: int, err: str, needle: str = "") -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), (code, err)
    assert needle in lines[0], lines[0]
    return lines[0]


# --- train: word-valued flags ---------------------------------------------------------------------------------

WORD_FLAGS = {  # flag -> (base command where the flag applies, the words it accepts)
    "--moe-dispatcher": (MOE, MOE_DISPATCHERS),
    "--weight-dtype": (DENSE, ("bf16", "fp32")),
    "--fp8-recipe": (DENSE + ["--dtype", "fp8"], tuple(fp8_recipes())),
    "--pp-schedule": (DENSE, PP_SCHEDULES),
    "--attention-kernel": (DENSE, ATTENTION_KERNELS),
    "--cuda-graph": (DENSE, ("none",) + CUDA_GRAPH_SCOPES + ("attn,mlp", "moe_router,moe_preprocess")),
}


@FAST
@given(st.sampled_from(sorted(WORD_FLAGS)), st.one_of(ODD_WORDS, st.sampled_from(
    [w for _, words in WORD_FLAGS.values() for w in words])))
def test_train_word_flags_accept_exactly_their_words(capsys, flag, word):
    base, words = WORD_FLAGS[flag]
    code, out, err = run_cli(base + [f"{flag}={word}"], capsys)
    if word in words:
        assert code == 0, err
        assert json.loads(out)["plans"]
    else:
        one_error(code, err, flag)


@FAST
@given(st.one_of(ODD_WORDS, st.sampled_from(["megatron", "nemo", "torchtitan", "maxtext", "nemo@24.07",
                                              "torchtitan@2024.12", "nemo@99", "megatron@0.0", "nope@1"])))
def test_train_framework_name_at_version(capsys, fw):
    from meshplan.train.frameworks import framework_options

    try:  # the preset table decides what is known (train/frameworks.py); the CLI must agree with it
        framework_options(fw, Options(), {})
        known = True
    except MeshplanError:
        known = False
    code, out, err = run_cli(DENSE + [f"--framework={fw}"], capsys)
    if known:
        assert code == 0, err
    else:
        one_error(code, err, "framework")


# --- train: flags that cannot apply are refused; where they apply they plan ----------------------------------

CONFLICTS = [
    (DENSE + ["--moe-dispatcher", "deepep"], "--moe-dispatcher needs a MoE model (llama3.2-1b has no experts)"),
    (DENSE + ["--moe-force-balance"], "--moe-force-balance needs a MoE model"),
    (DENSE + ["--moe-node-limit", "4"], "--moe-node-limit needs a MoE model"),
    (DENSE + ["--ep-overlap"], "--ep-overlap needs a MoE model"),
    (DENSE + ["--pp", "1", "--pp-overlap"], "--pp-overlap needs pipeline parallelism"),
    (DENSE + ["--pp", "1", "--pp-head-in-split"], "--pp-head-in-split needs pipeline parallelism"),
    (DENSE + ["--pp", "1", "--pp-schedule", "zb1p"], "--pp-schedule needs pipeline parallelism"),
    (DENSE + ["--fp8-recipe", "rowwise"], "--fp8-recipe goes with --dtype fp8 (the matmuls are bf16)"),
    (DENSE + ["--fp8-weight-cache"], "--fp8-weight-cache goes with --dtype fp8"),
    (DENSE[:4] + ["tpu-v5e"] + DENSE[5:] + ["--cuda-graph", "attn"], "--cuda-graph needs a GPU (tpu-v5e is a TPU)"),
    (DENSE + ["--sparsecore-reduce"], "--sparsecore-reduce needs a TPU (h100-sxm is a GPU)"),
    (DENSE + ["--iota-embedding"], "--iota-embedding needs a TPU (h100-sxm is a GPU)"),
    (DENSE + ["--cuda-graph", "none,attn"], "--cuda-graph must be none or a comma list"),
    (DENSE + ["--cuda-graph", ""], "--cuda-graph must be none or a comma list"),
    (DENSE + ["--recompute", ""], "unknown recompute policy ''"),
    (SERVE[:4] + ["tpu-v5e"] + SERVE[5:] + ["--engine", "trtllm"], "--engine trtllm runs on GPUs, not on tpu-v5e"),
    (DENSE + ["--framework", "megatron@"], "unknown version '' of framework 'megatron'"),
    (SERVE + ["--simulate", "--rate", "1", "--concurrency", "0"], "--concurrency must be an integer in [1, 100000]"),
    (["calibrate", "--show", ""], "cannot read profile ''"),
    # 2**24 tokens of activations in one step outgrow an H100 whatever the layout: the refusal names the budget
    (SERVE + ["--max-num-batched-tokens", str(2**24)], "with a step budget of 16,777,216 tokens"),
    (["verify", "-m", "llama3.2-1b", "--rank", "2"], "--rank goes with --plan"),
]


@pytest.mark.parametrize("args, needle", CONFLICTS, ids=[n[:48] for _, n in CONFLICTS])
def test_flag_that_cannot_apply_is_one_error(capsys, args, needle):
    one_error(*run_cli(args, capsys)[::2], needle)


@pytest.mark.parametrize("args", [
    MOE + ["--moe-dispatcher", "deepep", "--moe-force-balance", "--moe-node-limit", "1", "--ep-overlap"],
    DENSE + ["--pp-overlap", "--pp-head-in-split", "--pp-schedule", "zb1p"],  # pp searched: applies where pp > 1
    DENSE + ["--pp", "2", "--vpp", "2", "--pp-overlap", "--pp-head-in-split"],
    DENSE + ["--dtype", "fp8", "--fp8-recipe", "rowwise", "--no-fp8-weight-cache"],
    DENSE + ["--no-fp8-weight-cache", "--no-pp-overlap", "--no-moe-force-balance"],  # "off" contradicts nothing
    DENSE + ["--cuda-graph", "none"], DENSE + ["--framework", "megatron", "--pp", "1"],  # presets are not checked
    DENSE[:6] + ["1"] + DENSE[7:] + ["--seq-len", "1", "--global-batch", "1"],  # one chip, one token
    SERVE[:4] + ["tpu-v5e"] + SERVE[5:] + ["--engine", "vllm"],  # vLLM has a TPU backend
    DENSE[:4] + ["tpu-v6e"] + DENSE[5:] + ["--sparsecore-reduce"], DENSE + ["--no-sparsecore-reduce"],
    DENSE[:4] + ["tpu-v6e"] + DENSE[5:] + ["--iota-embedding"], DENSE + ["--no-iota-embedding"],
    SERVE + ["--concurrency", "4"],  # closed-loop clients without --simulate: the closed form ranks under them
])
def test_the_same_flags_plan_where_they_apply(capsys, args):
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    assert json.loads(out)["plans" if args[0] == "train" else "config"]


# --- serve: numbers of the new flags ---------------------------------------------------------------------------

@FAST
@given(st.sampled_from(["--concurrency", "--max-num-batched-tokens"]),
       st.one_of(st.integers(-3, 3), st.integers(2**16, 2**30), st.sampled_from([10**30, 2**53, 100_000, 100_001])))
def test_serve_simulation_numbers_are_bounded(capsys, flag, n):
    hi = {"--concurrency": 100_000, "--max-num-batched-tokens": 2**24}[flag]
    code, out, err = run_cli(SERVE + ["--simulate", "--rate", "2", "--requests", "20", f"{flag}={n}"], capsys)
    if not 1 <= n <= hi:
        one_error(code, err, flag)
    elif flag == "--concurrency" or n <= 8192:
        # a valid deployment plans: any number of clients; a step budget up to 8192 tokens (llama3.2-1b on one H100
        # holds its activations; a budget of 2**24 tokens does not, and is refused for memory, in one line)
        assert code == 0, err
        assert json.loads(out)["simulation"]
    else:
        assert code == 0 or "step budget" in one_error(code, err)


@FAST
@given(st.one_of(ODD_WORDS, st.sampled_from(["default", "vllm", "sglang", "trtllm", "lmdeploy"])))
def test_serve_engine_presets(capsys, engine):
    code, out, err = run_cli(SERVE + [f"--engine={engine}"], capsys)
    if engine in ("default", "vllm", "sglang", "trtllm", "lmdeploy"):
        assert code == 0 and json.loads(out)["engine"] == engine, err
    else:
        one_error(code, err, "--engine")


def test_serve_from_names_its_engine(tmp_path, capsys):
    code, _, err = run_cli(SERVE[:-1] + ["--export", "vllm", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    from_file = ["serve", "--from", str(tmp_path / "vllm.sh"), "--hardware", "h100-sxm", "--input-len", "256",
                 "--output-len", "32"]
    assert run_cli(from_file + ["--json"], capsys)[0] == 0
    one_error(*run_cli(from_file + ["--engine", "sglang"], capsys)[::2], "not a release of vllm, which the command line runs")


def test_train_from_file_checks_the_flags_against_the_files_job(tmp_path, capsys):
    """A torchtitan file of a dense bf16 job at pp=1 (the best plan of 8 H100s): MoE, fp8 and pipeline flags cannot
    apply to it and are refused; --cuda-graph can, and plans."""
    code, _, err = run_cli(DENSE[:-3] + ["--pp", "1", "--export", "torchtitan", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    base = ["train", "--from", str(tmp_path / "torchtitan.toml"), "--hardware", "h100-sxm", "-m", "llama3.2-1b",
            "--json"]
    for extra, needle in ((["--moe-dispatcher", "deepep"], "needs a MoE model"),
                          (["--fp8-recipe", "rowwise"], "goes with --dtype fp8"),
                          (["--pp-overlap"], "the layout pins pp=1")):
        one_error(*run_cli(base + extra, capsys)[::2], needle)
    code, out, err = run_cli(base + ["--cuda-graph", "attn"], capsys)
    assert code == 0 and json.loads(out)["framework"] == "torchtitan", err


@FAST
@given(st.binary(max_size=200))
def test_from_files_of_random_bytes(tmp_path_factory, capsys, body):
    p = tmp_path_factory.mktemp("from") / "job.sh"
    p.write_bytes(body)
    for args in (["train", "--from", str(p), "--hardware", "h100-sxm"],
                 ["serve", "--from", str(p), "--hardware", "h100-sxm", "--input-len", "256", "--output-len", "32"]):
        code, _, err = run_cli(args, capsys)
        one_error(code, err)  # random bytes never name a model and a layout


# --- verify: --plan FILE|- and --rank, checked before anything compiles ----------------------------------------

class Compiled(Exception):
    """Raised by the stub of run_verify: every check passed and the program would compile now."""


@pytest.fixture(scope="module")
def train_json() -> str:
    from meshplan.cli.app import main

    out = io.StringIO()
    stdout, sys.stdout = sys.stdout, out
    try:
        with pytest.raises(SystemExit):
            main(DENSE[:-3] + ["--top", "3", "--json"])
    finally:
        sys.stdout = stdout
    return out.getvalue()


@pytest.fixture
def no_compile(monkeypatch):
    pytest.importorskip("jax")
    from meshplan.measure import verify as mv

    seen = {}

    def stub(big, layout, *a, **k):
        seen["layout"] = layout
        raise Compiled

    monkeypatch.setattr(mv, "run_verify", stub)
    return seen


def verify_stdin(capsys, monkeypatch, text: str, *extra: str):
    """(exit code, stderr, compiled?) of `meshplan verify --plan - ...` with `text` on stdin."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    try:
        code, _, err = run_cli(["verify", "--plan", "-", "--no-loss-check", *extra], capsys)
    except Compiled:
        return 0, "", True
    return code, err, False


@settings(FAST, max_examples=20)
@given(st.data())
def test_verify_plan_truncated_on_stdin(capsys, monkeypatch, no_compile, train_json, data):
    end = train_json.rindex("}")
    cut = data.draw(st.integers(0, end))  # every proper prefix of the object is broken JSON
    code, err, compiled = verify_stdin(capsys, monkeypatch, train_json[:cut])
    assert not compiled
    one_error(code, err, "--plan")
    assert verify_stdin(capsys, monkeypatch, train_json)[2]  # the whole object passes every check


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
                           | st.text(max_size=8), lambda kids: st.lists(kids, max_size=3)
                           | st.dictionaries(st.text(max_size=4), kids, max_size=3), max_leaves=6)


@settings(FAST, max_examples=30)
@given(st.sampled_from([("problem", "chips"), ("problem", "model"), ("", "plans"), ("", "problem"),
                        ("config", "dp"), ("config", "tp"), ("plan", "config")]), JSON_VALUES)
def test_verify_plan_fields_of_any_json_type(capsys, monkeypatch, no_compile, train_json, where, value):
    data = json.loads(train_json)
    node = {"": data, "problem": data["problem"], "plan": data["plans"][0],
            "config": data["plans"][0]["config"]}[where[0]]
    node[where[1]] = value
    code, err, compiled = verify_stdin(capsys, monkeypatch, json.dumps(data))
    if compiled:  # what reaches the compiler is the plan's 8-chip layout, on 8 devices
        assert no_compile["layout"].devices == 8
        if where == ("problem", "chips") and value is not None:  # None: the --devices default, 8
            assert not isinstance(value, bool) and float(value) == 8
    else:
        one_error(code, err)


@FAST
@given(st.one_of(st.integers(-5, 8), st.sampled_from([10_000, 10_001, 2**63, 10**30])))
def test_verify_rank(capsys, monkeypatch, no_compile, train_json, rank):
    n = len(json.loads(train_json)["plans"])
    code, err, compiled = verify_stdin(capsys, monkeypatch, train_json, f"--rank={rank}")
    assert compiled == (1 <= rank <= n)
    if not compiled:
        one_error(code, err, "--rank")


@FAST
@given(st.sampled_from(["--model=llama3-8b", "--tp=2", "--pp=2", "--zero=1", "--recompute=full", "--devices=4"]))
def test_verify_plan_with_layout_flags_is_refused(capsys, monkeypatch, no_compile, train_json, flag):
    code, err, compiled = verify_stdin(capsys, monkeypatch, train_json, flag)
    assert not compiled
    one_error(code, err, "--plan")


def test_verify_plan_with_layout_flags_at_their_defaults_is_accepted(capsys, monkeypatch, no_compile, train_json):
    """--plan refuses a layout flag given at other than its default (above); at its default it changes nothing."""
    defaults = ("--fsdp=1", "--tp=1", "--cp=1", "--ep=1", "--pp=1", "--vpp=1", "--microbatch=0", "--recompute=none",
                "--zero=0", "--devices=8")
    assert verify_stdin(capsys, monkeypatch, train_json, *defaults)[2]


def test_verify_plan_file_not_text_or_nested_too_deep(tmp_path, capsys, monkeypatch, no_compile):
    p = tmp_path / "plan.json"
    p.write_bytes(b"\xff\xfe{}")
    one_error(*run_cli(["verify", "--plan", str(p)], capsys)[::2], "is not text")
    one_error(*run_cli(["verify", "--plan", str(tmp_path / "none.json")], capsys)[::2], "cannot read --plan file")
    code, err, compiled = verify_stdin(capsys, monkeypatch, "[" * 100_000)
    assert not compiled
    one_error(code, err, "nested too deeply")


@FAST
@given(st.one_of(ODD_WORDS, st.sampled_from(["materialized", "flash"])),
       st.one_of(ODD_WORDS, st.sampled_from(["jax", "megatron", "nemo", "torchtitan"])))
def test_verify_attention_and_framework(capsys, no_compile, attention, framework):
    from meshplan.measure.verify import program_options

    try:
        program_options(framework)
        fw_known = True
    except MeshplanError:
        fw_known = False
    try:
        code, _, err = run_cli(["verify", "-m", "llama3.2-1b", "--no-loss-check", f"--attention={attention}",
                                f"--framework={framework}"], capsys)
    except Compiled:
        assert attention in ("materialized", "flash") and fw_known
        return
    assert attention not in ("materialized", "flash") or not fw_known
    one_error(code, err)


# --- calibrate --show ------------------------------------------------------------------------------------------

@FAST
@given(st.one_of(st.binary(max_size=64), JSON_VALUES.map(lambda v: json.dumps(v).encode())))
def test_calibrate_show_never_calibrates(tmp_path_factory, capsys, monkeypatch, body):
    import meshplan.cli.calibrate as cal

    def refuse(*a, **k):
        raise AssertionError("--show started a calibration")

    monkeypatch.setattr(cal, "require_jax", refuse)
    p = tmp_path_factory.mktemp("show") / "profile.json"
    p.write_bytes(body)
    one_error(*run_cli(["calibrate", "--show", str(p)], capsys)[::2], "profile")


# --- Options(...) at construction --------------------------------------------------------------------------------

OPTION_WORDS = ["compute_dtype", "cp_impl", "attention_kernel", "zero3_fetch", "selective_flavor", "fp8_recipe",
                "moe_dispatcher", "pp_schedule"]
OPTION_NUMBERS = {"headroom": (-1e9, 0.99), "moe_node_limit": (0, 2**20), "moe_capacity_factor": (0, 1e3),
                  "master_bytes": (0, 8), "weight_dtype_bytes": (0, 8), "act_bytes": (0, 8), "param_bytes": (0, 8),
                  "fsdp_param_bytes": (0, 8), "grad_reduce_bytes": (0, 8)}
OPEN_LO = {"act_bytes", "param_bytes", "fsdp_param_bytes", "grad_reduce_bytes"}


@FAST
@given(st.sampled_from(OPTION_WORDS), ODD_WORDS)
def test_options_refuse_unknown_words(name, word):
    valid = {"compute_dtype": ("bf16", "fp8"), "cp_impl": ("ring", "torch", "allgather"),
             "attention_kernel": ATTENTION_KERNELS, "zero3_fetch": ("allgather", "broadcast"),
             "selective_flavor": ("attention", "op", "layer"), "fp8_recipe": tuple(fp8_recipes()),
             "moe_dispatcher": MOE_DISPATCHERS, "pp_schedule": PP_SCHEDULES}[name]
    if word in valid:
        assert getattr(Options(**{name: word}), name) == word
    else:
        with pytest.raises(MeshplanError, match="unknown"):
            Options(**{name: word})


@FAST
@given(st.sampled_from(sorted(OPTION_NUMBERS)), st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                                                          st.integers(-10, 10), st.booleans()))
def test_options_numbers_are_bounded(name, value):
    lo, hi = OPTION_NUMBERS[name]
    integer = name == "moe_node_limit"
    ok = (not isinstance(value, bool) and math.isfinite(value) and (lo < value if name in OPEN_LO else lo <= value)
          and value <= hi and (not integer or float(value).is_integer()))
    if ok:
        Options(**{name: value})
    else:
        with pytest.raises(MeshplanError, match=f"Options.{name} must be"):
            Options(**{name: value})


def test_verify_plan_takes_cp_impl_from_the_flag_unless_the_json_names_it(capsys, monkeypatch, no_compile, train_json):
    """A `train --json` plan does not say how CP runs attention, so --cp-impl decides it (it used to be dropped);
    a JSON that names another form refuses the flag."""
    from meshplan.measure.layout import Layout

    default = Layout().cp_impl
    other = next(c for c in ("allgather", "ring") if c != default)
    assert verify_stdin(capsys, monkeypatch, train_json, f"--cp-impl={other}")[2]
    assert no_compile["layout"].cp_impl == other
    assert verify_stdin(capsys, monkeypatch, train_json)[2]
    assert no_compile["layout"].cp_impl == default
    data = json.loads(train_json)
    data["plans"][0]["config"]["cp_impl"] = default
    code, err, compiled = verify_stdin(capsys, monkeypatch, json.dumps(data), f"--cp-impl={other}")
    assert not compiled
    one_error(code, err, "--cp-impl")
    data["plans"][0]["config"]["cp_impl"] = other  # the JSON and the flag agree
    assert verify_stdin(capsys, monkeypatch, json.dumps(data), f"--cp-impl={other}")[2]
