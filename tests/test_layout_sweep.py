"""Session 40: what benchmarks/layout_sweep.py found planning framework-legal layouts of every preset, and the sweep
itself on a small draw (no exception, hang or insane plan may escape `main()`)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from meshplan.cost.efficiency import default_efficiency
from meshplan.errors import MeshplanError
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model
from meshplan.train.config import ParallelConfig
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.planner import plan
from meshplan.train.space import Pins, Problem
from tests.conftest import run_cli

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import layout_sweep  # noqa: E402


def _pinned(cfg: ParallelConfig) -> Pins:
    return Pins(**{k: getattr(cfg, k) for k in ("dp", "fsdp", "tp", "pp", "vpp", "cp", "ep", "microbatch",
                                                 "recompute", "zero", "offload", "offload_optimizer",
                                                 "offload_params")})


def test_ep_folded_over_context_ranks_is_placed_tp_apart() -> None:
    """Mixtral 8x7B on 8 H100s, dp 2 cp 2 pp 2 ep 4 (tp 1): ep does not divide dp, only dp x cp, which Megatron-Core
    allows by folding the expert grid (expert_decoder_rank_generator, order tp-ep-dp: the EP ranks etp = tp = 1
    apart, the two context ranks of both data replicas). Before session 40 the EP group was placed tp x cp = 2 apart,
    needing 4 x 2 = 8 ranks of a 4-rank stage, and the layout was refused ('does not map')."""
    prob = Problem(load_model("mixtral-8x7b"), load_chip("h100-sxm"), 8, 4096, 64)
    cfg = ParallelConfig(dp=2, cp=2, pp=2, ep=4, microbatch=1, recompute="full", zero=1)
    opts = replace(Options(), headroom=-1e6)  # timed whatever the memory (the layout is about placement)
    best = plan(prob, _pinned(cfg), default_efficiency(prob.chip), opts, top=1).plans[0]
    assert (best["config"]["ep"], best["config"]["cp"], best["config"]["dp"]) == (4, 2, 2)
    cm = CostModel(prob, default_efficiency(prob.chip), opts)
    assert cm.ep_group(cfg) == (4, 1)  # tp = 1 apart: ranks r, r+1, r+2, r+3 of the stage
    # the ledger names the axes the all-to-all crosses: context (2) then data (2), no expert axis of its own
    keys = [k for k in best["ledger"]["collective_bytes"] if k.startswith("all_to_all/")]
    assert keys == ["all_to_all/data+context"]


def test_ep_with_tensor_ranks_explained_on_its_own_link(capsys) -> None:
    """gpt-oss-20b on 16 A800s (8 per node), dp 4 tp 4 ep 16 under NeMo (whole experts, ETP 1): the EP group is 16
    consecutive ranks (Megatron-Core's expert grid), two nodes. The plan's explanation named its link from a second
    copy of the mesh (ep tp·cp apart: 64 ranks) and failed with 'a group of 16 chips with stride 4 needs 64 chips'."""
    code, out, err = run_cli(["train", "-m", "gpt-oss-20b", "--hardware", "a800", "--chips", "16", "--seq-len", "8192",
                              "--global-batch", "16", "--dp", "4", "--tp", "4", "--pp", "1", "--cp", "1",
                              "--microbatch", "1", "--recompute", "selective", "--ep", "16", "--framework", "nemo",
                              "--top", "1"], capsys)
    assert code == 0, err
    assert "whole experts per rank (ETP 1)" in out
    # 16 consecutive ranks on 8-GPU nodes: two nodes, so NVLink inside each and InfiniBand between them
    assert "bottleneck: comm/ep" in out and "exposed on nvlink+infiniband" in " ".join(out.split())


def test_torchtitan_selective_is_its_per_op_policy(capsys, tmp_path) -> None:
    """`--framework torchtitan --recompute selective` means torchtitan's selective AC, the per-op policy (torchtitan
    SelectiveAC, selective_ac_option 'op'); it was planned as Megatron's attention-core recompute, which torchtitan
    cannot run, and refused."""
    args = ["train", "-m", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len", "4096",
            "--global-batch", "64", "--fsdp", "8", "--recompute", "selective", "--framework", "torchtitan", "--top", "1"]
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    code, out, err = run_cli(args + ["--export", "torchtitan", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    import tomllib

    doc = tomllib.loads(next(tmp_path.glob("*.toml")).read_text())
    assert doc["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}


def test_optimizer_offload_is_named_as_the_bottleneck(capsys) -> None:
    """A plan whose `other` time is the host's optimizer step (ZeRO-Offload) was explained as 'fixed per-step
    overhead; raise the batch per step'."""
    code, out, err = run_cli(["train", "-m", "mixtral-8x7b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len",
                              "8192", "--global-batch", "16", "--dp", "2", "--tp", "2", "--cp", "2", "--ep", "4",
                              "--pp", "1", "--microbatch", "1", "--recompute", "full", "--zero", "2",
                              "--offload-optimizer", "1", "--top", "1", "--json"], capsys)
    assert code == 0, err
    p = yaml.safe_load(out)["plans"][0]
    t = p["time_breakdown_s"]
    # the step's largest non-compute part is `other`, and the host's optimizer step is most of it
    assert t["other"] > max(t["exposed_comm"], t["bubble"]) and t["other/offload_optimizer"] > 0.5 * t["other"]
    assert p["bottleneck"] == "offload"
    assert "optimizer step on the host" in p["explanation"] and "--offload-optimizer 0" in p["explanation"]


def test_maxtext_refuses_ep_outside_fsdp_in_one_line(capsys) -> None:
    """MaxText's expert axis is carved out of its fsdp axis; a plan with ep not dividing fsdp was written with
    ici_fsdp_parallelism 0 and refused by the read-back ('must be positive or -1, got 0')."""
    code, out, err = run_cli(["train", "-m", "gpt-oss-20b", "--hardware", "tpu-v4", "--chips", "64", "--seq-len",
                              "4096", "--global-batch", "16", "--dp", "8", "--tp", "8", "--pp", "1", "--cp", "1",
                              "--microbatch", "1", "--recompute", "full", "--ep", "16", "--framework", "maxtext",
                              "--top", "1"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "maxtext cannot express this plan: expert parallelism = 16 does not divide the FSDP degree 1" in err


def test_deepspeed_refusal_points_megatron_deepspeed_users_to_megatron(capsys) -> None:
    code, out, err = run_cli(["train", "-m", "llama3-70b", "--hardware", "a100-80gb", "--chips", "64", "--seq-len",
                              "2048", "--global-batch", "512", "--tp", "4", "--pp", "4", "--dp", "4", "--framework",
                              "deepspeed"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "tensor parallelism = 4" in err and "plan with --framework megatron --zero 1" in err
    code, out, err = run_cli(["train", "-m", "llama3-70b", "--hardware", "a100-80gb", "--chips", "64", "--seq-len",
                              "2048", "--global-batch", "512", "--tp", "4", "--pp", "4", "--dp", "4", "--framework",
                              "megatron", "--zero", "1", "--top", "1"], capsys)
    assert code == 0, err


def test_states_bound_shards_experts_and_optimizer() -> None:
    """The sweep's lower bound for suspect refusals, by hand: Mixtral 8x7B (46.70B parameters, 44.99B of them in
    32 x 8 experts of 3 x 4096 x 14336) at tp 2 pp 2 ep 4 dp 8 on 80 GB H100s: dense 1.70B / 4 + experts 44.99B /
    (2 x 4 x 2) (the largest ETP the layout allows: 2, ep x etp = 8 dividing dp x cp x tp = 16), times
    4 + 12 / 8 bytes."""
    case = {"model": "mixtral-8x7b", "hardware": "h100-sxm", "tp": 2, "pp": 2, "ep": 4, "dp": 8, "cp": 1, "args": []}
    experts = 32 * 8 * 3 * 4096 * 14336
    from meshplan.math.transformer import param_counts

    total = float(param_counts(load_model("mixtral-8x7b")).total)
    want = ((total - experts) / 4 + experts / 16) * (4 + 12 / 8) / load_chip("h100-sxm").hbm_bytes
    assert layout_sweep.states_fraction(case) == pytest.approx(want, rel=1e-12)


def test_small_sweep_has_no_defects() -> None:
    """A small draw of the sweep (30 pinned training layouts, 30 serving layouts, 10 searched training problems): every
    invocation exits 0 with a sane plan or 2 with one error line."""
    for kind, n in (("train", 30), ("serve", 30), ("search", 10)):
        res = layout_sweep.sweep(kind, n, seed=11, timeout_s=120.0)
        assert res["defects"] == [], res["defects"]
        assert sum(res["counts"].values()) == n


def test_ep_beyond_data_and_context_ranks_stays_refused() -> None:
    """The fold needs ep x etp to divide the stage's tp x cp x dp ranks: ep 8 over dp 2 x cp 2 (tp 1) stays refused."""
    with pytest.raises(MeshplanError):
        prob = Problem(load_model("mixtral-8x7b"), load_chip("h100-sxm"), 8, 4096, 64)
        cfg = ParallelConfig(dp=2, cp=2, pp=2, ep=8, microbatch=1, recompute="full", zero=1)
        plan(prob, _pinned(cfg), default_efficiency(prob.chip), replace(Options(), headroom=-1e6), top=1)


def test_a_dedup_dispatcher_with_every_candidate_filtered_is_one_line(capsys) -> None:
    """DeepSeek-V3 on 8 B200s, 2 replicas of FSDP 2 x TP 2 with EP 8 under a deduplicating dispatcher: no layout
    passes the FSDP/EP rule (EP across replicas and shards), and the empty layout array reached np.vectorize in the
    dispatcher's copy count, whose error escaped main() ('cannot call `vectorize` on size 0 inputs'; session 40 found
    it with FSDP 2 x TP 4, which whole experts over the FSDP group's tensor ranks now allow). Now the planner's own
    refusal, one line."""
    code, out, err = run_cli(["train", "-m", "deepseek-v3", "--hardware", "b200", "--chips", "8", "--seq-len", "2048",
                              "--global-batch", "4", "--dp", "2", "--fsdp", "2", "--tp", "2", "--pp", "1", "--cp", "1",
                              "--microbatch", "1", "--recompute", "selective", "--ep", "8", "--moe-dispatcher",
                              "hybridep", "--top", "1"], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: no layout satisfies the constraints")


def test_torchtitan_ep_over_the_context_ranks_is_placed_tp_apart() -> None:
    """torchtitan builds EP as dp_shard_in_ep x cp (ParallelDims; mesh [dp_shard_mod_ep, dp_shard_in_ep, cp, tp]): Qwen3-30B-A3B
    on 8 H800s, pp 2 cp 4 ep 4 (tp 1, no FSDP beyond the context ranks) has its EP group on the 4 context ranks of a
    stage, 1 apart. It was placed tp x cp = 4 apart (16 ranks for a 4-rank stage) and refused ('does not map')."""
    from meshplan.train.frameworks import framework_options

    prob = Problem(load_model("qwen3-30b-a3b"), load_chip("h800"), 8, 8192, 16)
    opts = framework_options("torchtitan", replace(Options(), headroom=-1e6), {})
    cfg = ParallelConfig(pp=2, cp=4, ep=4, microbatch=4, recompute="selective")
    best = plan(prob, _pinned(cfg), default_efficiency(prob.chip), opts, top=1).plans[0]
    assert (best["config"]["ep"], best["config"]["cp"], best["config"]["pp"]) == (4, 4, 2)
    assert CostModel(prob, default_efficiency(prob.chip), opts).ep_group(cfg) == (4, 1)
    keys = [k for k in best["ledger"]["collective_bytes"] if k.startswith("all_to_all/")]
    assert keys == ["all_to_all/context"]


# ---- metamorphic: more recompute never makes a step faster or its saved activations larger -------------------------

_META_MODELS = ["llama3-8b", "llama3-70b", "mixtral-8x7b", "qwen3-30b-a3b", "gemma2-9b", "deepseek-v2"]
_META_CHIPS = ["h100-sxm", "a100-80gb", "b200", "mi300x", "tpu-v5p"]


def _step_and_acts(prob: Problem, opts: Options, **degrees) -> tuple[float, float, float]:
    cfg = ParallelConfig(**degrees)
    p = plan(prob, _pinned(cfg), default_efficiency(prob.chip), opts, top=1).plans[0]
    return p["step_time_s"], p["memory_bytes_per_chip"]["activations"], p["time_breakdown_s"].get("other/host", 0.0)


@pytest.mark.parametrize("seed", range(4))
def test_more_recompute_is_never_faster_nor_holds_more(seed) -> None:
    """Recompute none -> selective -> full adds work and saves fewer tensors (Korthikanti et al. 2022, Table 2: per layer
    sbh(34 + 5as/h) bytes without recompute, 34sbh with selective, 2sbh with full), so with every other degree pinned the step time may not
    fall and the saved activations may not rise; a larger micro-batch saves more. Drawn layouts; steps the CPU's kernel
    issue bounds are left out of the time check (there the GPU waits on the host whatever it computes: a longer GPU
    backward can hide more of the DP reduction, session 40's exploratory check found <= 1% inversions there only)."""
    import random

    rng = random.Random(seed)
    checked = 0
    while checked < 10:
        m, chip = load_model(rng.choice(_META_MODELS)), load_chip(rng.choice(_META_CHIPS))
        n = rng.choice((8, 16, 64))
        tp = rng.choice([t for t in (1, 2, 4, 8) if m.n_heads % t == 0 and (m.n_kv_heads % t == 0 or t % m.n_kv_heads == 0)])
        pp = rng.choice([p for p in (1, 2, 4) if m.n_layers % p == 0])
        if n % (tp * pp):
            continue
        dp = n // (tp * pp)
        ep = rng.choice([e for e in (1, 2, 4, 8) if m.n_experts % e == 0 and dp % e == 0]) if m.is_moe else 1
        prob = Problem(m, chip, n, rng.choice((2048, 4096)), dp * rng.choice((4, 8)))
        opts = replace(Options(), headroom=-1e6)
        res = {(rc, mb): _step_and_acts(prob, opts, dp=dp, tp=tp, pp=pp, ep=ep, microbatch=mb, recompute=rc,
                                        zero=1 if dp > 1 else 0)
               for rc in ("none", "selective", "full") for mb in (1, 2)}
        for mb in (1, 2):
            t, a, host = zip(*(res[(rc, mb)] for rc in ("none", "selective", "full")), strict=True)
            assert a[0] >= a[1] * (1 - 1e-9) and a[1] >= a[2] * (1 - 1e-9), (m.name, chip.name, tp, pp, dp, ep, a)
            if max(host) == 0:
                assert t[0] <= t[1] * (1 + 1e-9) and t[1] <= t[2] * (1 + 1e-9), (m.name, chip.name, tp, pp, dp, ep, t)
        for rc in ("none", "selective", "full"):
            assert res[(rc, 2)][1] >= res[(rc, 1)][1] * (1 - 1e-9)
        checked += 1
