"""Totals over layouts: step time, MFU/HFU, tokens/s, memory fit, bottleneck (all numpy arrays)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

from meshplan.cost.efficiency import comm_hbm_share, dispatcher_sm_slowdown
from meshplan.math import transformer as tm
from meshplan.train.config import LayoutArrays
from meshplan.train.costmodel import CostModel, Terms
from meshplan.train.ledger import Ledger

COMM_KINDS = ("tp", "cp", "ep", "pp", "fsdp", "dp")
MB_KINDS = COMM_KINDS[:5]  # the families with per-micro-batch terms (DP reduces once a step)


@dataclass
class Evaluation:
    layouts: LayoutArrays
    step_time_s: np.ndarray
    time: Terms  # compute, exposed_comm, bubble, other (+ exposed_comm/<kind>, offload)
    memory: Terms  # params, grads, optimizer, activations, other, total
    fits: np.ndarray
    model_flops_per_step: float
    hardware_flops_per_step: np.ndarray
    mfu: np.ndarray
    hfu: np.ndarray
    tokens_per_s: np.ndarray
    link_time: Terms  # time each kind of traffic occupies its links per step (hidden or not)
    n_micro: np.ndarray
    hbm_budget_bytes: float
    ledger: Ledger  # per device per step: FLOPs, collective bytes, HBM bytes, memory (train/ledger.py)
    hbm_fits: np.ndarray | None = None  # fits in HBM (fits = this and host_fits)
    host_fits: np.ndarray | None = None  # what is offloaded fits in the chip's share of host memory


def _bubble(cm: CostModel, g: dict, ct, per_mb):
    """Idle pipeline time per step. 1F1B: (p-1)/v micro-batch slots (Narayanan et al. 2021, interleaved); with
    W the weight-gradient GEMMs of a stage's micro-batch (the forward GEMMs' FLOPs again), zero-bubble ZB-H1 fills
    part of it: (p-1)(F + B - 2W) (Qi et al. 2024); DualPipe: (p/2 - 1)(F&B + B - 3W) (DeepSeek-V3 Table 2, F&B
    the overlapped forward and backward chunk, taken as the micro-batch's whole time). An SPMD pipeline loop
    (Options.pp_spmd_loop, MaxText) computes in those slots instead of idling: the same seconds, less the head."""
    pp = g["pp"]
    w = g["layers_stage"] * ct["layer_matmul_fwd"]
    schedule = cm.opt.pp_schedule
    if schedule == "zb1p":
        return (pp - 1) * np.maximum(per_mb - 2 * w, 0)
    if schedule == "dualpipe":
        return np.maximum(pp / 2 - 1, 0) * np.maximum(per_mb + ct["bwd"] - 3 * w, 0)
    if cm.opt.pp_spmd_loop:  # the bubble iterations run the stage's layers, not the head outside the loop (MaxText)
        return (pp - 1) / g["vpp"] * (per_mb - ct["loss_s"])
    return (pp - 1) / g["vpp"] * per_mb


def comm_per_step(cc: Terms, m) -> tuple[Terms, Terms]:
    """Each collective family's seconds per step, from the cost model's per-micro-batch and once-a-step terms
    (CostModel.comm_terms): on its links (hidden or not), and exposed (not hidden behind compute). FSDP has both
    kinds of term; DP only the once-a-step one."""
    link = Terms({k: m * cc[f"{k}_link_mb"] for k in MB_KINDS})
    exposed = Terms({k: m * cc[f"{k}_mb"] for k in MB_KINDS})
    link["fsdp"] = link["fsdp"] + cc["fsdp_link_step"]
    exposed["fsdp"] = exposed["fsdp"] + cc["fsdp_step"]
    link["dp"], exposed["dp"] = cc["dp_link_step"], cc["dp_step"]
    return link, exposed


def hidden_per_step(links: Terms, exposed: Terms) -> dict:
    """Each collective family's hidden (overlapped) seconds per step: its link time less its exposed time
    (comm_per_step), never below 0."""
    return {k: np.clip(links[k] - exposed[k], 0, None) for k in COMM_KINDS}


def _hidden_sm_slowdown(cm: CostModel, links: Terms, exposed: Terms):
    """SM slow-down of compute over the hidden (overlapped) collective time: each family's own slow-down weighted by
    its hidden seconds (hidden_per_step). NCCL families hold NCCL's
    channels (comm_compute_interference, efficiency.nccl_sm_slowdown on GPUs); the EP all-to-all under a
    DeepEP/HybridEP dispatcher holds the dispatcher's SMs (efficiency.dispatcher_sm_slowdown). E.g. 1 ms hidden DP
    reduce-scatter and 1 ms hidden HybridEP all-to-all on H100: (16/116 + 32/100) / 2 over 2 ms, the same as
    16/116 * 1 ms + 32/100 * 1 ms."""
    nccl = cm.eff.comm_compute_interference
    ep = dispatcher_sm_slowdown(cm.opt.moe_dispatcher, cm.p.chip)
    ep = nccl if ep is None else ep
    hidden = hidden_per_step(links, exposed)
    total = sum(hidden.values())
    weighted = nccl * (total - hidden["ep"]) + ep * hidden["ep"]
    return np.where(total > 0, weighted / np.maximum(total, 1e-30), nccl)


# Layouts evaluated at once: the cost model's vectorised terms hold a few hundred arrays of this length at a time,
# so a search of millions of layouts (DeepSeek-V3 on 2,048 GPUs: 3.1M) evaluated in one piece peaked at about twice
# the memory its result keeps (5.8 GB against 2.7 GB; session 23, QA finding). Each layout's terms depend only on
# that layout, so evaluating in pieces gives the same numbers.
EVALUATE_CHUNK = 1 << 18


def evaluate(cm: CostModel, L: LayoutArrays, keep_ledger: bool = True) -> Evaluation:
    """Evaluate every layout in `L` under the cost model. A layout whose group cannot map onto the topology
    has infinite collective cost; the inf - inf it meets on the way is expected (the planner drops it).
    `keep_ledger` False: the evaluation carries an empty ledger (a search ranks by the step time and memory; the
    ledger, half of what an evaluation holds, is rebuilt for the plans it reports by evaluating them again)."""

    def one(layouts: LayoutArrays) -> Evaluation:
        ev = _evaluate(cm, layouts, keep_ledger)
        return ev if keep_ledger else replace(ev, ledger=Ledger())

    with np.errstate(invalid="ignore"):
        if len(L) <= EVALUATE_CHUNK:
            return one(L)
        return concat_all([one(L.take(np.arange(i, min(i + EVALUATE_CHUNK, len(L)))))
                           for i in range(0, len(L), EVALUATE_CHUNK)])


def _evaluate(cm: CostModel, L: LayoutArrays, collectives: bool = True) -> Evaluation:
    p, e = cm.p, cm.eff
    g = cm.geometry(L)
    g["ledger"].collectives = collectives  # the per-axis bytes only where the ledger is kept (`evaluate`)
    ct = cm.compute_terms(L, g)
    cc = cm.comm_terms(L, g, ct)
    mem = cm.memory_terms(L, g)
    m = g["n_micro"]
    # activation offload: out in the forward, back in the backward over the host link, hidden behind the
    # micro-batch's compute where it fits (the seed talk's pipeline-aware offload)
    act_mb = mem["offloaded_per_microbatch"]
    bw = p.chip.host_bandwidth_bytes_per_s  # one direction
    host = act_mb / bw
    # weight offload (ZeRO-Infinity §6.2): every layer fetched host→device before its forward and again before its
    # backward, prefetched behind the previous layer's compute. The link is full duplex: in the forward the weights
    # come in while the activations go out; in the backward both come in.
    fetch = mem["param_fetch_per_microbatch"] / bw
    # out during the forward, back during the backward, each hidden behind that pass's compute
    offload_exposed = np.maximum(np.maximum(host, fetch) - ct["fwd"], 0) + np.maximum(host + fetch - ct["bwd"], 0)
    led = g["ledger"]
    led.add("host/device_to_host", m * act_mb)
    led.add("host/host_to_device", m * (act_mb + 2 * mem["param_fetch_per_microbatch"]))
    opt_update = cm.optimizer_terms(L, g)
    # optimizer offload: each micro-batch's gradients go out during its backward (the other direction of the link
    # from the activations and weights coming in)
    offload_exposed = offload_exposed + np.maximum(g["grad_copy_mb_s"] - ct["bwd"], 0)
    per_mb_comm = sum(cc[f"{k}_mb"] for k in MB_KINDS)
    per_mb = ct["fwd"] + ct["bwd"] + cc["fsdp_copy_mb"] + per_mb_comm + offload_exposed
    # the CPU issues every kernel of an eager step: where it is slower than the GPU, the GPU waits (host_bound_per_mb)
    gpu_mb = per_mb
    per_mb, _ = cm.host_bound_per_mb(L, g, ct, per_mb)
    host_wait = per_mb - gpu_mb
    bubble = _bubble(cm, g, ct, per_mb)
    compute = m * (ct["fwd"] + ct["bwd"] + cc["fsdp_copy_mb"]) + cc["fsdp_copy_step"]
    if cm.opt.offload_delayed_update:
        # ZeRO-Offload's one-step delayed parameter update (Ren et al. 2021 §4.2, DPU; asked for, since it changes the
        # training): step i's copies and CPU Adam run beside step i+1's forward and backward; the excess shows
        opt_update = np.where(L.offload_optimizer == 1, np.maximum(opt_update - m * (ct["fwd"] + ct["bwd"]), 0),
                              opt_update)
    # overlapped collectives slow the compute they hide behind (SM/HBM contention on GPUs)
    step_comm = cc["dp_step"] + cc["fsdp_step"]  # once-a-step collectives
    links, exposed = comm_per_step(cc, m)
    exposed_total = sum(exposed.values())
    hidden = sum(hidden_per_step(links, exposed).values())
    # SMs: each collective's SMs are missing from every kernel beside it; over the hidden time, each family's
    # slow-down weighted by its hidden seconds (_hidden_sm_slowdown). HBM: the collective's memory traffic takes a share
    # of HBM bandwidth (efficiency.comm_hbm_share) from the HBM-bound part of the layer (the pointwise kernels, what
    # is neither GEMM nor attention core), which runs that much slower (NVIDIA/nccl#1428).
    layer = np.maximum(ct["layer_fwd"], 1e-30)
    hbm_bound = np.clip(1 - (ct["layer_matmul_fwd"] + ct["layer_core_fwd"]) / layer, 0, 1)
    share = comm_hbm_share(p.chip)
    interference = _hidden_sm_slowdown(cm, links, exposed) + hbm_bound * share / max(1 - share, 1e-9)  # guard: share < 1 on every chip
    contention = interference * np.minimum(hidden, compute)
    step = m * per_mb + bubble + step_comm + cc["fsdp_copy_step"] + opt_update + e.step_overhead_s + contention
    time = Terms(compute=compute + contention, exposed_comm=exposed_total,
                 bubble=bubble, other=opt_update + e.step_overhead_s + m * (offload_exposed + host_wait))
    for k in COMM_KINDS:
        time[f"exposed_comm/{k}"] = exposed[k]
    time["other/offload"] = m * offload_exposed
    time["other/host"] = m * host_wait
    time["other/offload_optimizer"] = np.where(L.offload_optimizer == 1, opt_update, 0.0)
    tokens = p.global_batch * p.seq_len
    tf = tm.flops_per_token(p.model, p.seq_len, causal=True)
    model_flops = tokens * tf.training
    rc_flops = np.array([tokens * tm.recompute_flops_per_token(p.model, p.seq_len, pol) for pol in tm.RECOMPUTE_POLICIES])
    full_rc = rc_flops[tm.RECOMPUTE_POLICIES.index("full")]
    attn_rc = rc_flops[tm.RECOMPUTE_POLICIES.index("selective")]
    # torchtitan's selective flavours: half the layer matmuls ("op") or half the layers ("layer") again
    rc_flops[tm.RECOMPUTE_POLICIES.index("selective")] = {
        "attention": attn_rc, "op": 0.5 * (full_rc - attn_rc), "layer": 0.5 * full_rc}[cm.opt.selective_flavor]
    hw_flops = model_flops + rc_flops[L.recompute]
    if cm.opt.flash_attention:
        # a fused attention kernel's backward recomputes the score matrix: attention_bwd_flops_ratio x the forward
        # instead of the model count's 2x (Dao 2023, FlashAttention-2 §3.1.2; the ledger's attention flops count the
        # same), FLOPs the chip runs that HFU counts (PaLM, Chowdhery et al. 2022, App. B: hardware FLOPs include
        # rematerialisation)
        hw_flops = hw_flops + tokens * tf.forward_attention * (e.attention_bwd_flops_ratio - 2.0)
    denom = step * p.chips * cm.peak_bf16
    budget, hbm_fits, host_fits = _fits(cm, mem)
    return Evaluation(L, step, time, mem, hbm_fits & host_fits, model_flops, hw_flops, model_flops / denom,
                      hw_flops / denom, tokens / step, links, m, budget, g["ledger"], hbm_fits, host_fits)


def _fits(cm: CostModel, mem: Terms) -> tuple[float, np.ndarray, np.ndarray]:
    """(HBM budget, fits in HBM, fits in the host's memory) of the layouts whose memory terms are `mem`."""
    budget = cm.p.chip.usable_hbm_bytes * (1 - cm.opt.headroom)  # what the driver exposes
    # offloaded activations and model state live in the host's memory: each chip's share of it (host_memory_bytes, per
    # chip in the catalog) bounds them; a chip without that figure is not limited here
    host_cap = cm.p.chip.host_memory_bytes or np.inf
    return budget, mem["total"] <= budget, mem["host"] <= host_cap


def count_fitting(cm: CostModel, L: LayoutArrays) -> int:
    """How many of the layouts `L` fit in HBM and in the host's memory, from their memory terms alone (no step time):
    the planner counts the offload variants it does not time (planner._with_state_offload) among the feasible ones."""
    if not len(L):
        return 0
    with np.errstate(invalid="ignore"):
        _, hbm, host = _fits(cm, cm.memory_terms(L, cm.geometry(L)))
    return int((hbm & host).sum())


def concat(a: Evaluation, b: Evaluation) -> Evaluation:
    """Two evaluations of one problem as one (b's layouts after a's); scalars broadcast, absent keys are 0."""
    return concat_all([a, b])


def concat_all(parts: list[Evaluation]) -> Evaluation:
    """Evaluations of one problem as one, in order; scalars broadcast, absent keys are 0."""
    sizes = [len(e.layouts) for e in parts]

    def join(xs):
        return np.concatenate([np.broadcast_to(np.asarray(x, float), (n,)) for x, n in zip(xs, sizes, strict=True)])

    out = {}
    for f in fields(Evaluation):
        xs = [getattr(e, f.name) for e in parts]
        x = xs[0]
        if f.name == "layouts":
            out[f.name] = LayoutArrays.concat(*xs)
        elif isinstance(x, dict):
            keys = dict.fromkeys(k for d in xs for k in d)  # first-seen order
            out[f.name] = type(x)({k: join([d.get(k, 0.0) for d in xs]) for k in keys})
        elif isinstance(x, np.ndarray) and x.dtype == bool:
            out[f.name] = np.concatenate(xs)
        elif isinstance(x, np.ndarray):
            out[f.name] = join(xs)
        else:
            out[f.name] = x  # the problem's scalars (model FLOPs, HBM budget)
    return Evaluation(**out)
