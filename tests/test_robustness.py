"""Issue #18: bad input never ends in a traceback or a hang; valid deployments are planned, not refused.

Each reproduction from the issue is one case: one `error:` line on stderr, exit 2 (or a correct answer).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from conftest import run_cli
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from meshplan.errors import MeshplanError
from meshplan.math.integers import divisors
from meshplan.specs.hardware import HARDWARE_DIR
from meshplan.specs.model import MODELS_DIR

TRAIN = ["train", "-m", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len", "4096",
         "--global-batch", "8"]
SERVE = ["serve", "-m", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--input-len", "512",
         "--output-len", "128"]


def _hardware_file(tmp_path: Path, **changes) -> str:
    data = yaml.safe_load((HARDWARE_DIR / "h100-sxm.yaml").read_text())
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = {"value": value, "source": "test"}
    p = tmp_path / "hw.yaml"
    p.write_text(yaml.safe_dump(data))
    return str(p)


def _model_file(tmp_path: Path, **changes) -> str:
    cfg = json.loads((MODELS_DIR / "llama3-8b.json").read_text())
    cfg.update(changes)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return str(p)


def assert_one_error(code: int, err: str, needle: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert needle in lines[0], lines[0]


A300 = "a" * 300

REPRODUCTIONS = [
    (["hardware", A300], "too long"),
    (["model", A300], "too long"),
    (["matmul", "-h", "h100-sxm", "-n", "8", "--mesh", "data=8", "--lhs", "B:data,D", "--rhs", "D,F",
      "--sizes", "B=inf,D=1,F=1"], "size B"),
    (["roofline", "-h", "h100-sxm", "--op", "attention:1,1,1,inf,1,1"], "size 4"),
    (["roofline", "-h", "h100-sxm", "--op", "attention:1,1,1,nan,1,1"], "size 4"),
    (["roofline", "-h", "h100-sxm", "--op", "matmul:nan,1,1"], "size 1"),
    (["roofline", "-h", "h100-sxm", "--op", "attention:1,1,1,1.5,1,1"], "integer"),  # 1.5 heads
    (["roofline", "-h", "h100-sxm", "-m", "llama3-8b", "--seq-len", "0"], "--seq-len"),
    (TRAIN[:-1] + ["9223372036854775808"], "--global-batch"),
    (TRAIN + ["--tokens", "inf"], "--tokens"),
    (SERVE + ["--simulate", "--rate", "1", "--seed", "-1"], "--seed"),
    (SERVE + ["--simulate", "--rate", "nan"], "--rate"),
    (SERVE[:6] + ["2147483648"] + SERVE[7:], "--chips"),
    (["collective", "allgather", "--hardware", "tpu-v5e", "--chips", "1" + "0" * 29, "--mesh", "a=4", "--axes", "a",
      "--bytes", "1e9"], "--chips"),
    (TRAIN + ["--plot", "/proc/x/y"], "cannot use"),
]


@pytest.mark.parametrize("args, needle", REPRODUCTIONS, ids=[" ".join(a)[:60] for a, _ in REPRODUCTIONS])
def test_issue_reproductions_give_one_error_line(capsys, args, needle):
    assert_one_error(*run_cli(args, capsys)[::2], needle)


def test_chip_count_bound_is_stated(capsys):
    code, _, err = run_cli(SERVE[:6] + ["2147483648"] + SERVE[7:], capsys)
    assert "1048576" in err and "more accelerators than any system has" in err


def test_hardware_yaml_tiny_peak_and_negative_usable_hbm(tmp_path, capsys):
    hw = _hardware_file(tmp_path, peak_flops_per_s__bf16=1e-300)
    assert_one_error(*run_cli(["serve", "-m", "llama3-8b", "--hardware", hw, "--chips", "8", "--input-len", "512",
                               "--output-len", "128"], capsys)[::2], "peak_flops_per_s.bf16")
    hw = _hardware_file(tmp_path, hbm_usable_bytes=-1)
    assert_one_error(*run_cli(["hardware", hw], capsys)[::2], "hbm_usable_bytes")


def test_config_json_whose_embedding_overflows_int64(tmp_path, capsys):
    # vocab 2**40 x d_model 2**30 = 2**70 parameters: beyond int64 (2**63) in the embedding alone
    cfg = _model_file(tmp_path, vocab_size=2**40, hidden_size=2**30, num_attention_heads=2**23, head_dim=128)
    assert_one_error(*run_cli(["model", cfg], capsys)[::2], "vocab_size x d_model")
    assert_one_error(*run_cli(["train", "-m", cfg] + TRAIN[3:], capsys)[::2], "vocab_size x d_model")


def test_divisors_bounded_and_exact():
    assert divisors(12) == (1, 2, 3, 4, 6, 12)
    assert divisors(1) == (1,)
    assert divisors(2**40) == tuple(2**k for k in range(41))
    assert divisors(1_099_511_627_689) == (1, 1_099_511_627_689)  # the largest prime below 2**40, fast
    with pytest.raises(MeshplanError, match="too large"):
        divisors(2**41)


@pytest.mark.parametrize("hardware", ["h100-sxm", "tpu-v5e"])
def test_unpinned_serve_plans_every_chip_count_to_256(hardware):
    """Every count from 1 to 256 is planned, or refused in one line saying why and which count would serve."""
    from meshplan.cli.serve import plan_serving

    refused = {}
    for n in range(1, 257):
        try:
            out = plan_serving("llama3-8b", hardware, n, 1024, 256)
            c = out["config"]
            assert c["tp"] * c["pp"] * c["replicas"] == n and c["chips"] == n
        except MeshplanError as exc:
            refused[n] = str(exc)
    for n, msg in refused.items():
        # Llama-3-8B in bf16 is 16.1 GB: a v5e holds 16 GB, so tp=1 cannot hold it; only prime counts
        # (no tp=2/4/8 divides them) or counts whose stages exceed the 32 layers are refused.
        assert hardware == "tpu-v5e", (n, msg)
        assert "cannot hold a replica" in msg and "\n" not in msg, msg
        assert n == 1 or "would serve it" in msg, msg
    # the issue's examples all plan
    for n in (12, 24, 48):
        assert n not in refused
    assert len(refused) < 60


@pytest.mark.parametrize("n", [24, 40, 48, 80, 96, 192])
def test_whole_h100_nodes_plan_unpinned(n):
    from meshplan.cli.serve import plan_serving

    assert plan_serving("llama3-70b", "h100-sxm", n, 1024, 256)["config"]["tp"] >= 1


# --- fuzz (bounded) and properties ---------------------------------------------------------------------------

def test_fuzz_bounded_part_no_tracebacks_no_hangs():
    """A bounded slice of benchmarks/fuzz.py (the full 5,000-invocation run is in benchmarks/README.md)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fuzz", Path(__file__).resolve().parents[1] / "benchmarks" / "fuzz.py")
    fuzz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fuzz)
    res = fuzz.fuzz(n=120, seed=18, timeout_s=30)
    c = res["counts"]
    assert not any(c.get(k, 0) for k in ("traceback", "hang", "crash", "bad_error")), res["problems"]
    assert not any(k.startswith("exit") for k in c), res["problems"]
    assert c.get("ok", 0) > 0 and c.get("error", 0) > 0  # both paths exercised
    assert len(res["per_command"]) >= 8


PROPS = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
train_cases = st.tuples(st.sampled_from(["llama3.2-1b", "llama3-8b"]), st.sampled_from(["h100-sxm", "tpu-v5e"]),
                        st.sampled_from([8, 16, 32]), st.sampled_from([2048, 4096]), st.sampled_from([32, 64, 128]))


def _best(model: str, chip, chips: int, seq: int, batch: int) -> dict:
    """The best plan; a case where nothing fits (Llama-3-8B's 128 GB of Adam state on 8 v5e) is skipped."""
    from meshplan.cost.efficiency import resolve_efficiency
    from meshplan.errors import InfeasibleError
    from meshplan.specs.model import load_model
    from meshplan.train.planner import plan
    from meshplan.train.space import Pins, Problem

    try:
        return plan(Problem(load_model(model), chip, chips, seq, batch), Pins(), resolve_efficiency(chip, None),
                    top=1).plans[0]
    except InfeasibleError:
        assume(False)


@PROPS
@given(train_cases, st.sampled_from(["hbm", "fast_link", "scale_out"]))
def test_more_hbm_or_faster_link_never_slower(case, what):
    from meshplan.specs.hardware import load_chip

    model, hw, chips, seq, batch = case
    chip = load_chip(hw)
    links = chip.links
    better = {
        "hbm": chip.with_overrides(hbm_bytes=chip.hbm_bytes * 2, hbm_usable_bytes=chip.usable_hbm_bytes * 2),
        "fast_link": chip.with_overrides(links=replace(
            links, nvlink_bandwidth_bytes_per_s=links.nvlink_bandwidth_bytes_per_s * 2,
            ici_bandwidth_per_link_bytes_per_s=links.ici_bandwidth_per_link_bytes_per_s * 2)),
        "scale_out": chip.with_overrides(links=replace(
            links, scale_out_bandwidth_bytes_per_s=links.scale_out_bandwidth_bytes_per_s * 2)),
    }[what]
    base = _best(model, chip, chips, seq, batch)["step_time_s"]
    assert _best(model, better, chips, seq, batch)["step_time_s"] <= base * (1 + 1e-9)


@PROPS
@given(train_cases)
def test_doubling_global_batch_keeps_tokens_per_chip(case):
    from meshplan.specs.hardware import load_chip

    model, hw, chips, seq, batch = case
    chip = load_chip(hw)
    one = _best(model, chip, chips, seq, batch)["tokens_per_s_per_chip"]
    two = _best(model, chip, chips, seq, 2 * batch)["tokens_per_s_per_chip"]
    assert two >= 0.98 * one, (one, two)


serve_cases = st.tuples(st.sampled_from(["llama3-8b", "mixtral-8x7b"]), st.sampled_from(["h100-sxm", "tpu-v5e"]),
                        st.sampled_from([8, 16]), st.sampled_from([128, 1024, 4096]), st.sampled_from([1, 16, 256]))


@PROPS
@given(serve_cases, st.sampled_from(["continuous", "static"]))
def test_serving_tpot_rises_with_batch_ttft_with_input_and_costs_are_finite(case, mode):
    import math

    from meshplan.cli.serve import plan_serving
    from meshplan.infer.config import Workload
    from meshplan.infer.frontier import frontier

    model, hw, chips, inp, outp = case
    out = plan_serving(model, hw, chips, inp, outp, mode=mode)
    m, chip, eff, w, best = out.pop("_objects")
    pts = frontier(m, chip, chips, best.config, eff, w, mode)
    tpots = [p.tpot_s for p in pts]
    assert tpots == sorted(tpots), tpots
    longer = frontier(m, chip, chips, best.config, eff, Workload(inp * 2, outp), mode, [1])
    assert not longer or longer[0].ttft_s >= pts[0].ttft_s
    for v in out["cost_per_million_tokens"].values():
        assert isinstance(v, float) and math.isfinite(v) and v > 0, out["cost_per_million_tokens"]


@pytest.mark.parametrize("args", [TRAIN + ["--json"], SERVE + ["--json"], ["model", "deepseek-v3", "--json"]])
def test_identical_inputs_identical_json(capsys, args):
    runs = []
    for _ in range(2):
        code, out, _ = run_cli(args, capsys)
        assert code == 0
        d = json.loads(out)
        d.pop("search_time_s", None)
        runs.append(d)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("mode", ["static", "continuous"])
def test_output_len_one(mode):
    """Issue #18: `--output-len 1 --batching static` gave $0.00 per million output tokens, and continuous batching a
    16 s TPOT beside a 0.16 s end-to-end latency. TPOT is now a decode step at that batch: no longer than the
    TPOT of the same deployment at --output-len 2 (whose mixed step also prefills)."""
    from meshplan.cli.serve import plan_serving

    one = plan_serving("llama3-8b", "h100-sxm", 8, 2048, 1, tp=8, batch=64, mode=mode)
    two = plan_serving("llama3-8b", "h100-sxm", 8, 2048, 2, tp=8, batch=64, mode=mode)
    assert one["cost_per_million_tokens"]["output"] > 0
    assert one["tpot_s"] <= two["tpot_s"] * (1 + 1e-9)


def test_offload_is_searched_and_host_memory_bounds_it():
    """Issue #18: on 1,024 v5e (Llama-3-70B, seq 8192, batch 1024) the search reported 27.0 s while --offload 1 found
    23.8 s. Offload is now a searched dimension, so the unpinned search finds that plan when host memory is not
    limited. That plan keeps 121 GB of activations per chip in host memory, but a v5e host VM has 384 GB for 8
    chips = 48 GB per chip (catalog, Google Cloud TPU v5e VM types): with the capacity checked it is rejected, and the
    search says so."""
    from meshplan.cost.efficiency import resolve_efficiency
    from meshplan.specs.hardware import load_chip
    from meshplan.specs.model import load_model
    from meshplan.train.planner import plan
    from meshplan.train.space import Pins, Problem

    v5e = load_chip("tpu-v5e")
    unlimited = v5e.with_overrides(host_memory_bytes=0.0)  # 0 = no host-memory figure, no limit
    eff = resolve_efficiency(v5e, None)

    def best(chip, pins):
        r = plan(Problem(load_model("llama3-70b"), chip, 1024, 8192, 1024), pins, eff, top=1)
        return r, r.plans[0]

    _, no_offload = best(unlimited, Pins(offload=0.0))
    _, searched = best(unlimited, Pins())
    # the issue's figures (27.0 s and 23.8 s) were the model's own output then, not a measurement, so they hold within
    # 5% as the model is refined: session 7's collective-matmul pairing (each TP collective hides only behind its own
    # GEMM) and XLA's saved set (a scanned layer keeps its matmul outputs, fewer bytes than Korthikanti's count, so
    # both plans now run without recompute) gave 27.38 s (TP4xCP4) and 23.42 s (FSDP-1024, offloaded). Session 11 adds
    # the TensorCore's merge inside each gradient reduce-scatter (collective_efficiency.yaml tpu_reduction, no
    # SparseCore offload on v5e): 3 HBM passes over (n-1)/n of the chip's fp32 gradient, per micro-batch, at 0.85 of
    # v5e's 8.2e11 B/s. By hand, Llama-3-70B's 70.6e9 parameters: TP4xCP4 x FSDP-64 with 16 micro-batches holds
    # 70.6e9/4 x 4 B = 70.6 GB: 16 x 3 x 70.6e9 x 63/64 / (0.85 x 8.2e11) = 16 x 0.2998 s = 4.80 s; FSDP-1024, one
    # micro-batch, 70.6e9 x 4 B: 3 x 282.4e9 x 1023/1024 / 6.97e11 = 1.214 s.
    merge_tp4_s = 16 * 3 * 70.6e9 / 4 * 4 * 63 / 64 / (0.85 * 8.2e11)
    merge_fsdp_s = 3 * 70.6e9 * 4 * 1023 / 1024 / (0.85 * 8.2e11)
    assert no_offload["step_time_s"] == pytest.approx(27.0 + merge_tp4_s, rel=5e-2)
    assert searched["step_time_s"] == pytest.approx(23.8 + merge_fsdp_s, rel=5e-2) and searched["config"]["offload"] > 0
    r, capped = best(v5e, Pins())
    assert r.infeasible.get("offloaded activations exceed host memory", 0) > 0
    i = r.plans.index(capped)
    assert i == 0 and no_offload["step_time_s"] > capped["step_time_s"] > searched["step_time_s"]


def test_dp_with_zero3_is_fsdp_over_those_ranks(capsys):
    code, out, err = run_cli(["train", "-m", "llama3-8b", "--hardware", "h100-sxm", "--chips", "64", "--seq-len", "4096",
                              "--global-batch", "64", "--dp", "32", "--zero", "3", "--json"], capsys)
    assert code == 0, err
    for p in json.loads(out)["plans"]:
        assert (p["config"]["fsdp"], p["config"]["dp"]) == (32, 1)


def test_dp_advice_respects_the_plans_zero_stage():
    from meshplan.cost.efficiency import resolve_efficiency
    from meshplan.specs.hardware import load_chip
    from meshplan.specs.model import load_model
    from meshplan.train.config import ParallelConfig
    from meshplan.train.costmodel import CostModel, Options
    from meshplan.train.planner import SUGGEST, _advice_for_plan
    from meshplan.train.space import Problem

    chip = load_chip("h100-sxm")
    p = Problem(load_model("llama3-8b"), chip, 64, 4096, 64)
    cm = CostModel(p, resolve_efficiency(chip, None), Options())
    at_zero2 = _advice_for_plan("dp", p, cm, ParallelConfig(dp=64, zero=2))
    assert "--zero 1/2" in SUGGEST["dp"] and "--zero" not in at_zero2 and "--fsdp" in at_zero2
    assert "--dp-overlap" not in at_zero2  # GPUs overlap the DP reduction by default
    assert "--zero 1/2" in _advice_for_plan("dp", p, cm, ParallelConfig(dp=64, zero=0))


def test_equal_step_time_ranks_less_memory_first():
    from meshplan.cost.efficiency import resolve_efficiency
    from meshplan.specs.hardware import load_chip
    from meshplan.specs.model import load_model
    from meshplan.train.planner import plan
    from meshplan.train.space import Pins, Problem

    chip = load_chip("h100-sxm")
    r = plan(Problem(load_model("llama3.2-1b"), chip, 8, 2048, 64), Pins(), resolve_efficiency(chip, None), top=50)
    for a, b in zip(r.plans, r.plans[1:], strict=False):
        if round(a["step_time_s"], 9) == round(b["step_time_s"], 9):
            assert a["memory_bytes_per_chip"]["total"] <= b["memory_bytes_per_chip"]["total"]
        assert a["step_time_s"] <= b["step_time_s"] + 1e-9


def test_cpu_only_profile_refused_for_planning(tmp_path, capsys, monkeypatch):
    prof = tmp_path / "cpu.json"
    prof.write_text(json.dumps({"schema": "meshplan-profile/1", "chip": "h100-sxm", "device_kind": "cpu",
                                "cpu_only": True, "efficiency": {"matmul_peak_fraction": 0.0001}}))
    for cmd in (TRAIN, SERVE):
        assert_one_error(*run_cli(cmd + ["--profile", str(prof)], capsys)[::2], "measured on a CPU")
    monkeypatch.setenv("MESHPLAN_ALLOW_CPU_PROFILE", "1")
    assert run_cli(TRAIN + ["--profile", str(prof), "--json"], capsys)[0] == 0


def test_measure_checks_memory_before_compiling(monkeypatch):
    """Issue #18: `measure --model llama3.2-1b` on a CPU ran 2.5 minutes, then died in XLA out of memory. The
    check runs before building anything: Llama-3.2-1B's 1.236e9 parameters x 4 copies (weights, gradients, AdamW
    m and v) x 4 B (fp32 on the CPU) = 19.8e9 B, more than a host with 8 GiB available."""
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from meshplan.measure import steps as st
    from meshplan.measure.layout import Layout
    from meshplan.specs.model import load_model

    m = load_model("llama3.2-1b")
    layout = Layout(dp=1, fsdp=1, tp=1, microbatch=1, recompute="none")
    need = st.memory_lower_bound_bytes(m, layout, 2048, jnp.float32)
    assert need == pytest.approx(16 * 1_235_814_400 + 32 * 2048**2 * 4, rel=0.01)
    monkeypatch.setattr(st, "available_memory_bytes", lambda platform: (8 * 2**30, "available host RAM"))
    with pytest.raises(MeshplanError, match="needs at least 18.9 GiB"):
        st.check_memory(m, layout, 2048, jnp.float32)


def test_price_basis_everywhere_and_price_override(capsys):
    from meshplan.specs.hardware import load_chip, preset_chips

    for name in preset_chips():  # every catalog chip states what its price is
        assert load_chip(name).price_basis not in ("", "catalog price")
    code, out, _ = run_cli(SERVE + ["--json"], capsys)
    base = json.loads(out)
    assert base["price"] == {"per_chip_hour": 11.06, "basis": "GCP on-demand list price, us-central1, 2025"}
    code, out, _ = run_cli(SERVE + ["--json", "--price", "5.53"], capsys)
    half = json.loads(out)
    assert half["price"]["basis"] == "--price override"
    # cost is linear in the price: half the price, half the cost per token
    assert half["cost_per_million_tokens"]["output"] == pytest.approx(base["cost_per_million_tokens"]["output"] / 2)
    code, out, _ = run_cli(TRAIN + ["--tokens", "1e12"], capsys)
    assert "at $11.06/chip-hour, GCP on-demand list price" in out
    code, out, _ = run_cli(SERVE, capsys)
    assert "(at $11.06/chip-hour, GCP on-demand list price" in out
    assert_one_error(*run_cli(SERVE + ["--price", "-1"], capsys)[::2], "--price")


def test_moe_roofline_counts_shared_experts():
    """DeepSeek-V3 (config.json: hidden 7168, moe_intermediate 2048, 8 routed of 256 + 1 shared expert, SwiGLU): the
    MLP matmuls of one token are 2 FLOPs x 3 matrices x 7168 x 2048 x (8 routed + 1 shared) = 792,723,456 FLOPs."""
    from meshplan.cost import roofline as rf
    from meshplan.specs.model import load_model

    ops = rf.layer_ops(load_model("deepseek-v3"), 4096, 4096)
    mlp = sum(o.flops for o in ops if o.name.startswith("mlp/") and "act" not in o.name)
    assert mlp / 4096 == pytest.approx(2 * 3 * 7168 * 2048 * 9)
    assert any(o.name == "mlp/shared_up" for o in ops)


def test_hardware_table_shows_usable_hbm(capsys):
    # H100 SXM 80GB: nvidia-smi reports 81,559 MiB = 79.65 GiB usable (catalog), beside the datasheet's 80 GB, shown as
    # the datasheet says it (session 21, QA finding: "74.51 GiB (79.65 GiB usable)" read as usable above total)
    code, out, _ = run_cli(["hardware", "h100-sxm"], capsys)
    assert code == 0 and "80 GB (79.65 GiB usable)" in out


def test_fsdp_under_pp_memory_is_explained(capsys):
    code, out, err = run_cli(["train", "-m", "llama3-70b", "--hardware", "h100-sxm", "--chips", "64", "--seq-len",
                              "4096", "--global-batch", "64", "--fsdp", "4", "--pp", "4", "--zero", "1", "--json"], capsys)
    assert code == 0, err
    plan = json.loads(out)["plans"][0]
    assert any("reshard_after_forward=False" in n for n in plan["notes"])
    code, out, _ = run_cli(TRAIN + ["--json"], capsys)  # no FSDP x PP, no note
    assert all("notes" not in p or not any("reshard" in n for n in p["notes"]) for p in json.loads(out)["plans"])


def test_simulation_size_is_bounded(capsys):
    # 100 requests x 100,001 output tokens would step 10.0e6 tokens (minutes): refused with the bound stated (on a
    # model whose context window holds such a request: Llama 3.1's 131,072 tokens)
    args = ["serve", "-m", "llama3.1-8b", *SERVE[3:-1], "100001", "--simulate", "--rate", "10", "--requests", "100"]
    assert_one_error(*run_cli(args, capsys)[::2], "at most 10,000,000")
    assert_one_error(*run_cli(SERVE + ["--simulate", "--rate", "1", "--requests", "100001"], capsys)[::2],
                     "--requests")


def test_web_api_requests_pass_the_same_validation():
    from meshplan.web.api import InputError, run

    params = {"model": "llama3-8b", "hardware": "h100-sxm", "chips": "2147483648", "seq_len": "4096",
              "global_batch": "8"}
    with pytest.raises(InputError, match=r"--chips must be an integer in \[1, 1048576\]"):
        run("train", params)


def test_hardware_yaml_with_part_of_the_superpod_section(tmp_path, capsys):
    """Found by benchmarks/fuzz.py after the rebase: a superpod section missing one key was a KeyError."""
    data = yaml.safe_load((HARDWARE_DIR / "h100-sxm.yaml").read_text())
    del data["superpod"]["switch_ports"]
    p = tmp_path / "hw.yaml"
    p.write_text(yaml.safe_dump(data))
    assert_one_error(*run_cli(["hardware", str(p)], capsys)[::2], "lacks switch_ports")
