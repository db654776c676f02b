"""`meshplan train`: search the layouts, rank by step time (= MFU), explain the winner."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from contextvars import ContextVar
from dataclasses import dataclass, field, replace

import numpy as np

from meshplan.cost.collectives import group_collective
from meshplan.cost.efficiency import Efficiency
from meshplan.errors import InfeasibleError, MeshplanError
from meshplan.specs.hardware import price_label
from meshplan.train.config import OFFLOAD_FLAGS, LayoutArrays
from meshplan.train.costmodel import CostModel, Options
from meshplan.train.evaluate import Evaluation, count_fitting, evaluate
from meshplan.train.evaluate import concat as concat_evaluations
from meshplan.train.space import Pins, Problem, enumerate_layouts, optimizer_offload_ok
from meshplan.units import fmt_bytes

SUGGEST = {
    "fsdp": "raise the per-chip batch (micro-batch) or add tensor/pipeline parallelism inside the fast domain "
            "so each FSDP gather has more compute to hide behind",
    "dp": "shard the optimizer (--zero 1/2) and overlap the gradient reduction, or grow the batch per replica",
    "tp": "lower the tensor-parallel degree (use FSDP or pipeline stages instead) or overlap it with "
          "collective matmuls (--tp-overlap)",
    "cp": "use less context parallelism: the ring passes outgrow the attention blocks they hide behind",
    "ep": "keep expert parallelism inside the fast domain or raise the tokens per expert",
    "pp": "use fewer pipeline stages",
    "bubble": "use more micro-batches per step (smaller micro-batch or larger global batch) or interleave (--vpp)",
    "other": "raise the batch per step, over which the fixed per-step costs spread",
    "compute": "the kernels themselves bound the step; a calibrated profile (--profile) sharpens this",
}


@dataclass
class PlanResult:
    plans: list[dict]
    searched: int
    feasible: int
    search_time_s: float
    infeasible: dict[str, int] = field(default_factory=dict)
    evaluation: Evaluation | None = None
    # layouts whose step time was computed: `searched` less the offload variants ruled out unevaluated (planner._search)
    evaluated: int | None = None

    def as_dict(self) -> dict:
        return {"plans": self.plans, "searched": self.searched, "evaluated": self.evaluated,
                "search_time_s": self.search_time_s,
                "feasible": self.feasible, "infeasible_reasons": self.infeasible}


# The most layouts one search may evaluate, where a caller bounds it (None: no bound). The web page sets it per request
# (web/api.py): its searches run one at a time, and an unbounded one (DeepSeek-V3 on a million chips: minutes and
# 14 GB) held every other user's request behind it (session 23, QA finding). Evaluation runs at about 1e5 layouts/s
# and ~2 KB each on one core (benchmarks/README.md, search speed).
SEARCH_LAYOUT_LIMIT: ContextVar[int | None] = ContextVar("SEARCH_LAYOUT_LIMIT", default=None)


def search(problem: Problem, pins: Pins, eff: Efficiency, options: Options | None = None,
           cm: CostModel | None = None) -> tuple[Evaluation, Counter, int]:
    """Enumerate and evaluate every layout, activation offload to host memory (none, half, all) included: offload
    frees HBM for a smaller TP/PP or a larger micro-batch, so it can win even when something fits without it (issue
    #18: 1,024 v5e, Llama-3-70B at 8k: 27.0 s without, 23.8 s with). Its limits are the host link (time, in
    evaluate) and host memory (capacity, in evaluate)."""
    ev, reasons, searched, _, _ = _search(problem, pins, eff, options, cm)
    return ev, reasons, searched


def _search(problem: Problem, pins: Pins, eff: Efficiency, options: Options | None = None,
            cm: CostModel | None = None, top: int | None = None,
            keep_ledger: bool = True) -> tuple[Evaluation, Counter, int, CostModel, int]:
    """`search`, and the cost model (the TPU slice orientation) its evaluation used; with `top`, model-state offload
    variants that cannot enter the `top` fastest plans are not evaluated; `keep_ledger` False: without the per-layout
    ledger (evaluate), which `plan` rebuilds for the plans it reports. The last value: the offload variants left
    untimed that fit (feasible, though never faster than the top plans)."""
    cm = cm or CostModel(problem, eff, _options_for(pins, options))
    free_state = [k for k in OFFLOAD_FLAGS if getattr(pins, k) is None]
    layouts, reasons = enumerate_layouts(problem, replace(pins, **{k: 0 for k in free_state}),
                                         offload_choices=OFFLOAD_CHOICES, pp_schedule=cm.opt.pp_schedule,
                                         whole_experts=not cm.opt.expert_tp)
    limit = SEARCH_LAYOUT_LIMIT.get()
    if limit is not None and len(layouts) > limit:
        raise MeshplanError(f"{len(layouts):,} layouts to search, more than the {limit:,} one request may: pin some "
                            "degrees (tp, pp, ep, micro-batch) or run `meshplan train` on the command line")
    ev = evaluate(cm, layouts, keep_ledger)
    pruned, pruned_fit = 0, 0
    if free_state:
        ev, pruned, pruned_fit = _with_state_offload(problem, pins, cm, ev, free_state, top, keep_ledger)
    # the layouts evaluated plus the offload variants ruled out unevaluated (slower than the top-th plan): the same
    # count whatever --top is
    searched = len(ev.layouts) + pruned
    ev, cm = _best_orientation(problem, eff, cm, ev, keep_ledger)
    over_host = ~ev.host_fits
    if over_host.any():
        # (activations alone, or with offloaded model state: optimizer, weights)
        reasons["offloaded activations exceed host memory"] += int((over_host & ev.hbm_fits).sum())
    unmappable = ~np.isfinite(ev.step_time_s)
    if unmappable.any():
        reasons["a parallel group does not map onto the topology"] += int(unmappable.sum())
        ev.fits = ev.fits & ~unmappable
    if (~ev.hbm_fits & ~unmappable).any():
        reasons["does not fit in HBM"] += int((~ev.hbm_fits & ~unmappable).sum())
    return ev, reasons, searched, cm, pruned_fit


def _with_state_offload(problem: Problem, pins: Pins, cm: CostModel, ev: Evaluation, free: list[str],
                        top: int | None = None, keep_ledger: bool = True) -> tuple[Evaluation, int, int]:
    """Model-state offload (optimizer: ZeRO-Offload; weights: ZeRO-Infinity) searched where it can matter. It only
    adds time (the host link and the host CPU are slower than HBM: evaluate, optimizer_terms), so a layout that
    fits in HBM without it is never beaten by its offloaded variant; the variants are evaluated for the layouts that
    do not fit but would without their optimizer state, gradients and weights on the device (everything they could
    free), which is every variant that can fit: the search misses nothing and stays near its former size. Returns the
    evaluation and the count of variants left unevaluated because their layout is already slower than the `top`-th
    plan (a variant is never faster), and how many of those fit (from their memory alone: count_fitting), so that
    the feasible count does not depend on `top` either."""
    mem = ev.memory
    could = ~ev.hbm_fits & np.isfinite(ev.step_time_s) & (mem["total"] - mem["optimizer"] - mem["params"]
                                                            - mem["grads"] <= ev.hbm_budget_bytes)
    # a free flag takes 0 and 1 (the optimizer only where the host CPU's Adam can be timed), a pinned one its pin;
    # every combination but the one already evaluated (each free flag 0)
    choices = {k: ([0, 1] if k != "offload_optimizer" or problem.chip.host_memory_bandwidth_bytes_per_s else [0])
               if k in free else [getattr(pins, k)] for k in OFFLOAD_FLAGS}
    variants = [{"offload_optimizer": o, "offload_params": w} for o in choices["offload_optimizer"]
                for w in choices["offload_params"]]
    variants = [v for v in variants if any(v[k] for k in free)]
    reach = np.ones(len(ev.layouts), dtype=bool)
    if top is not None:
        # a variant is never faster than its layout: one whose layout is already slower than the top-th plan that
        # fits cannot enter the top list
        fitting = np.sort(ev.step_time_s[ev.fits & np.isfinite(ev.step_time_s)])
        if fitting.size >= top:
            reach = ev.step_time_s < fitting[top - 1]
    idx = np.flatnonzero(could)
    if not idx.size or not variants:
        return ev, 0, 0
    extra = ev.layouts.take(idx, **variants[0])
    for v in variants[1:]:
        extra = LayoutArrays.concat(extra, ev.layouts.take(idx, **v))
    source = np.tile(idx, len(variants))  # the layout each variant comes from
    x = extra
    ok = optimizer_offload_ok(x.dp, x.fsdp, x.cp, x.pp, x.zero, x.offload_optimizer)
    untimed = extra.take(np.flatnonzero(ok & ~reach[source]))
    extra = extra.take(np.flatnonzero(ok & reach[source]))
    return ((concat_evaluations(ev, evaluate(cm, extra, keep_ledger)) if len(extra) else ev), len(untimed),
            count_fitting(cm, untimed))


def _best_orientation(problem: Problem, eff: Efficiency, cm: CostModel, ev: Evaluation,
                      keep_ledger: bool = True) -> tuple[Evaluation, CostModel]:
    """A TPU slice is the same torus whichever of its axes the device mesh walks first: JAX's
    `mesh_utils.create_device_mesh` assigns each logical mesh axis to physical torus axes of a matching size (a
    3072-chip v4 slice is 12x16x16 or 16x16x12 alike; PaLM ran 12-way model parallelism on it, Chowdhery et al.
    2022 §4). When no layout that fits can be placed on the slice in its default axis order, each other order is
    tried and the one with the fastest layout that fits (else the most layouts placed) is kept. (Only then: a
    search that already has a placed layout keeps the default order and its speed.)"""
    shape = cm.comm.cluster.slice_shape
    if not problem.chip.links.is_torus or (np.isfinite(ev.step_time_s) & ev.fits).any():
        return ev, cm
    best = (ev, cm)
    for order in sorted(set(itertools.permutations(shape)) - {shape}):
        cm2 = CostModel(replace(problem, slice_shape=order), eff, cm.opt)
        ev2 = evaluate(cm2, ev.layouts, keep_ledger)
        if _orientation_score(ev2) < _orientation_score(best[0]):
            best = (ev2, cm2)
    return best


def _orientation_score(ev: Evaluation) -> tuple[float, int]:
    placed = np.isfinite(ev.step_time_s)
    fitting = ev.step_time_s[placed & ev.fits]
    return (float(fitting.min()) if fitting.size else np.inf, -int(placed.sum()))


OFFLOAD_CHOICES = (0.0, 0.5, 1.0)  # fraction of saved activations kept in host memory


def _options_for(pins: Pins, options: Options | None) -> Options:
    """`--zero 3` shards over every rank that holds the same weights, the CP ranks included."""
    options = options or Options()
    return replace(options, fsdp_over_cp=True) if pins.zero == 3 else options


def plan(problem: Problem, pins: Pins, eff: Efficiency, options: Options | None = None, top: int = 5,
         tokens: float | None = None) -> PlanResult:
    """The best `top` feasible layouts, best first, each as the DESIGN.md JSON plan object."""
    t0 = time.perf_counter()
    cm = CostModel(problem, eff, _options_for(pins, options))
    # the search keeps no per-layout ledger (half its memory: 1.5 of 2.7 GB for DeepSeek-V3 on 2,048 GPUs); the
    # reported plans are evaluated again, with theirs
    ev, reasons, searched, cm, untimed_fit = _search(problem, pins, eff, options, cm, top, keep_ledger=False)
    if len(ev.step_time_s) == 0:
        why = reasons.most_common(1)[0][0] if reasons else "the pins leave no distinct layout"
        raise InfeasibleError(f"no layout satisfies the constraints: {why}")
    pinned_all = all(getattr(pins, k) is not None for k in ("dp", "fsdp", "tp", "pp", "cp"))
    if not np.isfinite(ev.step_time_s).any():
        raise InfeasibleError("no layout can be placed: a parallel group does not map onto the "
                              f"{problem.chips}-chip topology of {problem.chip.name}")
    if not ev.fits.any():
        raise InfeasibleError(_not_fit_message(problem, ev, pinned_all) + _what_fits(problem, pins, eff, options))
    # fastest first; on equal step time (to the nanosecond) the plan holding less memory per chip ranks first
    # (and before that the plan that offloads less model state to the host: the same speed without the host's part)
    state_offloads = ev.layouts.offload_optimizer + ev.layouts.offload_params
    order = np.lexsort((ev.memory["total"], state_offloads, np.round(np.where(ev.fits, ev.step_time_s, np.inf), 9)))
    chosen = [int(i) for i in order[:top] if ev.fits[i]]
    shown = evaluate(cm, ev.layouts.take(np.asarray(chosen, dtype=np.int64)))  # the same numbers, with the ledger
    plans = [plan_dict(problem, cm, shown, j, tokens) for j in range(len(chosen))]
    elapsed = time.perf_counter() - t0
    infeasible = {k: v for k, v in reasons.most_common()}
    return PlanResult(plans, searched, int(ev.fits.sum()) + untimed_fit, elapsed, infeasible, ev, len(ev.layouts))


def _not_fit_message(p: Problem, ev: Evaluation, pinned_all: bool) -> str:
    placed = np.isfinite(ev.step_time_s)
    in_hbm = placed & ev.hbm_fits if ev.hbm_fits is not None else np.zeros_like(placed)
    host = ""
    if in_hbm.any():
        # some layouts fit in HBM only by offloading more than the host holds
        k = int(np.argmin(np.where(in_hbm, ev.memory["host"], np.inf)))
        host = (f"; those that fit in HBM by offloading need at least {fmt_bytes(ev.memory['host'][k])} of host memory "
                f"per chip, {p.chip.name} has {fmt_bytes(p.chip.host_memory_bytes)} (best: "
                f"{ev.layouts.config(k).describe()})")
    if not (placed & ~in_hbm).any():
        return "no layout fits in host memory" + host
    # the smallest of the layouts that map onto the topology and miss HBM (the others never reach the memory test)
    i = int(np.argmin(np.where(placed & ~in_hbm, ev.memory["total"], np.inf)))
    need, have = ev.memory["total"][i], ev.hbm_budget_bytes
    cfg = ev.layouts.config(i)
    what = "the pinned layout does not fit" if pinned_all else "no layout fits"
    hint = ("try more chips, full recompute (--recompute full), FSDP/ZeRO (--fsdp, --zero), more tensor/pipeline "
            "parallelism, activation offload (--offload 1), or a smaller micro-batch")
    return (f"{what} in HBM: the smallest needs {fmt_bytes(need)} per chip but {p.chip.name} has "
            f"{fmt_bytes(have)} usable (short by {fmt_bytes(need - have)}; best: {cfg.describe()}){host}; {hint}")


def _what_fits(problem: Problem, pins: Pins, eff: Efficiency, options: Options | None) -> str:
    """When pins made everything too big, name the fastest layout that fits with every degree free."""
    free = Pins(sequence_parallel=pins.sequence_parallel)
    if pins == free:
        return ""
    try:
        ev, _, _ = search(problem, free, eff, options)
    except InfeasibleError:
        return ""
    if not ev.fits.any():
        return ""
    i = int(np.argmin(np.where(ev.fits, ev.step_time_s, np.inf)))
    return f"; with the pins released this fits: {ev.layouts.config(i).describe()} ({ev.step_time_s[i]:.3g} s/step)"


def _arr(d: dict, i: int) -> dict:
    return {k: float(v[i]) for k, v in d.items()}


def plan_dict(p: Problem, cm: CostModel, ev: Evaluation, i: int, tokens: float | None) -> dict:
    cfg = ev.layouts.config(i)
    t = _arr(ev.time, i)
    mem = _arr(ev.memory, i)
    bottleneck, explanation = explain(p, cm, ev, i)
    out = {
        "config": cfg.as_dict(),
        "step_time_s": float(ev.step_time_s[i]),
        "mfu": float(ev.mfu[i]),
        "hfu": float(ev.hfu[i]),
        "tokens_per_s": float(ev.tokens_per_s[i]),
        "tokens_per_s_per_chip": float(ev.tokens_per_s[i]) / p.chips,
        "model_flops_per_step": float(ev.model_flops_per_step),
        "hardware_flops_per_step": float(ev.hardware_flops_per_step[i]),
        "fits": bool(ev.fits[i]),
        "memory_bytes_per_chip": {k: mem[k] for k in ("params", "grads", "optimizer", "activations", "other", "total")},
        "time_s": {k: t[k] for k in ("compute", "exposed_comm", "bubble", "other")},
        "time_breakdown_s": t,
        "micro_batches": float(ev.n_micro[i]),
        "bottleneck": bottleneck,
        "explanation": explanation,
        "mesh": mesh_description(cm, cfg),
        "ledger": ev.ledger.plan(i),
    }
    notes = plan_notes(cfg)
    if notes:
        out["notes"] = notes
    if tokens:
        days = tokens / out["tokens_per_s"] / 86400
        out["training"] = {"tokens": tokens, "days": days,
                           "cost_usd": days * 24 * p.chips * p.chip.price_per_chip_hour,
                           "price": price_label(p.chip),
                           "chip_hours": days * 24 * p.chips}
    return out


def plan_notes(cfg) -> list[str]:
    """What a plan's memory assumes where it surprises (issue #18)."""
    notes = []
    if cfg.fsdp > 1 and cfg.pp > 1:
        notes.append("FSDP under pipeline parallelism keeps each stage's weights gathered and its gradients "
                     "unsharded from the first micro-batch to the last (torchtitan sets reshard_after_forward=False "
                     "with PP so the weights are not gathered again for every micro-batch), so more FSDP does not "
                     "lower the weight and gradient memory of a stage; with ZeRO-1/2 over dp instead, gradients and "
                     "optimizer state shrink with every rank")
    return notes


def _axis_groups(cfg) -> dict[str, tuple[int, int]]:
    """(size, stride) of each parallel axis in the chip order, tensor innermost (ParallelConfig.mesh); the EP group
    is the cost model's (CostModel.ep_group)."""
    return {"tp": (cfg.tp, 1), "cp": (cfg.cp, cfg.tp),
            "fsdp": (cfg.fsdp, cfg.tp * cfg.cp), "dp": (cfg.dp, cfg.tp * cfg.cp * cfg.fsdp),
            "pp": (cfg.pp, cfg.tp * cfg.cp * cfg.fsdp * cfg.dp)}


def _link(cm: CostModel, size: int, stride: int) -> str:
    return group_collective("allgather", 1e6, cm.comm.cluster, size, stride).link if size > 1 else "no link"


def mesh_description(cm: CostModel, cfg) -> str:
    """Which link each parallel axis lands on (tensor innermost)."""
    names = {"tp": "tensor", "cp": "context", "fsdp": "fsdp", "dp": "data", "pp": "pipeline"}
    parts = [f"{names[k]}={size} → {_link(cm, size, stride)}"
             for k, (size, stride) in _axis_groups(cfg).items() if k in names and size > 1]
    return "; ".join(parts) or "single chip"


def explain(p: Problem, cm: CostModel, ev: Evaluation, i: int) -> tuple[str, str]:
    """The bottleneck's name and a sentence a person can act on."""
    step = float(ev.step_time_s[i])
    parts = {k.split("/")[1]: float(v[i]) for k, v in ev.time.items() if k.startswith("exposed_comm/")}
    parts["bubble"] = float(ev.time["bubble"][i])
    parts["other"] = float(ev.time["other"][i])
    worst = max(parts, key=parts.get)
    compute = float(ev.time["compute"][i])
    mfu = float(ev.mfu[i])
    if parts[worst] < 0.1 * step:
        return "compute", (f"compute-bound: {compute / step:.0%} of the {step:.3g} s step is kernel time at "
                           f"{mfu:.1%} MFU; {SUGGEST['compute']}")
    share = parts[worst] / step
    other = {k: float(ev.time[f"other/{k}"][i]) for k in ("host", "offload", "offload_optimizer")
             if f"other/{k}" in ev.time}
    host = other.get("host", 0.0)
    if worst == "other" and host > 0.5 * parts["other"]:
        # the GPU waits for the CPU to issue its kernels (CostModel.host_bound_per_mb)
        return "host", (f"the CPU issuing kernels one by one holds the GPU back for {host / step:.0%} of the step; "
                        "capture the layers as CUDA graphs (--cuda-graph) or raise the micro-batch")
    # session 40, layout sweep: an optimizer offload that was 99% of `other` was called a fixed per-step overhead
    offload = max(("offload_optimizer", "offload"), key=lambda k: other.get(k, 0.0))
    if worst == "other" and other.get(offload, 0.0) > 0.5 * parts["other"]:
        said = {"offload_optimizer": "the optimizer step on the host (ZeRO-Offload: gradients out, Adam on the CPU, "
                                     "weights back) takes {:.0%} of the step; keep the optimizer on the device "
                                     "(--offload-optimizer 0) with more ZeRO/FSDP sharding, or overlap it with the "
                                     "next step (--offload-delayed-update)",
                "offload": "activation offload to host memory takes {:.0%} of the step beyond the compute it hides "
                           "behind; offload less (--offload) or recompute instead (--recompute)"}[offload]
        return "offload", said.format(other[offload] / step)
    if worst in ("bubble", "other"):
        what = "the pipeline bubble" if worst == "bubble" else "fixed per-step overhead"
        return worst, f"{what} takes {share:.0%} of the step; {SUGGEST[worst]}"
    link_t = float(ev.link_time[worst][i]) if worst in ev.link_time else parts[worst]
    exposed = parts[worst] / link_t if link_t > 0 else 1.0
    names = {"fsdp": "FSDP all-gathers/reduce-scatters", "dp": "data-parallel gradient reductions",
             "tp": "tensor-parallel collectives", "cp": "context-parallel KV passes",
             "ep": "expert all-to-alls", "pp": "pipeline sends"}
    if worst == "dp":
        names["dp"] = _grad_group(cm, ev.layouts.config(i))[2]
    advice = _advice_for_plan(worst, p, cm, ev.layouts.config(i)) or SUGGEST[worst]
    if worst == "fsdp" and cm.opt.zero3_fetch == "broadcast":
        advice = ("an owner-broadcast fetch passes each layer through one link and blocks on it: an all-gather "
                  "ZeRO-3/FSDP (--zero3-fetch allgather) spreads it over every link and hides it behind compute")
    if worst == "cp" and cm.opt.cp_impl == "torch":
        advice = ("PyTorch's all-gather rotation hides the gathered K/V behind the first block only and moves K/V "
                  "repeated to every head: a ring that passes GQA-sized blocks (torchtitan's "
                  "context_parallel_rotate_method='alltoall' and K/V left unrepeated, or --cp-impl ring) hides them")
    return (f"comm/{worst}", f"the {names[worst]} are {share:.0%} of the step ({min(exposed, 1):.0%} of their "
            f"link time is exposed on {_link_of(cm, ev, i, worst)}): {advice}")


def _grad_group(cm: CostModel, cfg) -> tuple[int, int, str]:
    """(size, stride, name) of the group that reduces the gradients of the replicas (the `dp` comm term): without
    FSDP the context ranks join it, dp x cp ranks of stride tp (costmodel `replicas`: Megatron-LM's data-parallel-with-
    context group); under FSDP (or ZeRO-3 over cp) only the dp replicas of a shard. Session 23, QA finding: a plan
    with dp 1 and cp 4 was told its gradient reduction ran 'on no link'."""
    if cm.fsdp_mode(cfg.fsdp, cfg.cp) or cfg.cp == 1:
        return cfg.dp, cfg.tp * cfg.cp * cfg.fsdp, "data-parallel gradient reductions"
    who = "context ranks" if cfg.dp == 1 else "data and context ranks"
    return cfg.dp * cfg.cp, cfg.tp, f"gradient reductions over the {who}"


def _link_of(cm: CostModel, ev: Evaluation, i: int, kind: str) -> str:
    cfg = ev.layouts.config(i)
    if kind == "ep":  # the cost model's own placement (ETP = 1 and EP folded over context ranks differ from the mesh's)
        return _link(cm, *cm.ep_group(cfg))
    size, stride = _grad_group(cm, cfg)[:2] if kind == "dp" else _axis_groups(cfg)[kind]
    return _link(cm, size, stride)


def _advice_for_plan(kind: str, p: Problem, cm: CostModel, cfg) -> str | None:
    """SUGGEST, without the steps this plan already takes (issue #18: `--zero 1/2` advised to a plan at zero=2)."""
    tp_overlap, dp_overlap = cm.opt.overlaps(p.chip.kind)
    if kind == "dp":
        steps = []
        if cfg.zero < 1 and cfg.fsdp == 1:
            steps.append("shard the optimizer (--zero 1/2)")
        elif cfg.zero < 3 and cfg.fsdp == 1:
            steps.append("shard the weights too (FSDP, --fsdp) so each rank reduce-scatters a shard")
        if not dp_overlap:
            steps.append("overlap the gradient reduction with the backward (--dp-overlap)")
        steps.append("grow the batch per replica" if cfg.dp > 1 or cfg.cp == 1 else
                     "lower the context-parallel degree (its ranks reduce every gradient too)")
        return ", or ".join(steps)
    if kind == "tp" and tp_overlap:
        return "lower the tensor-parallel degree (use FSDP or pipeline stages instead): it is already overlapped"
    if kind == "bubble" and cfg.vpp > 1:
        return "use more micro-batches per step (smaller micro-batch or larger global batch) or more virtual stages"
    return None
