"""The search space: every layout of `chips` chips that the model, batch and pins allow.

Mesh shapes (tp, pp, cp, fsdp, dp) are few (products of divisors of the chip count); the rest of the
space (vpp, micro-batch, recompute, ZeRO stage, expert parallelism, offload) is crossed with numpy
broadcasting, so no Python code runs per layout.
"""

from __future__ import annotations

import numbers
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np

from meshplan.errors import InfeasibleError, MeshplanError
from meshplan.math import transformer as tm
from meshplan.math.integers import divisors
from meshplan.specs.hardware import Chip
from meshplan.specs.model import ModelConfig
from meshplan.train.config import OFFLOAD_FLAGS, RECOMPUTE_CODES, LayoutArrays, check_recompute

PP_SCHEDULES = ("1f1b", "zb1p", "dualpipe", "gpipe")




@dataclass
class Pins:
    """Degrees the user fixed; None means free."""

    dp: int | None = None
    fsdp: int | None = None
    tp: int | None = None
    pp: int | None = None
    vpp: int | None = None
    cp: int | None = None
    ep: int | None = None
    microbatch: int | None = None
    recompute: str | None = None
    zero: int | None = None
    offload: float | None = None
    sequence_parallel: bool = True
    offload_optimizer: int | None = None  # 0/1: ZeRO-Offload (optimizer state and update on the host)
    offload_params: int | None = None  # 0/1: ZeRO-Infinity (weights on the host, streamed per layer)
    # the values a free recompute policy / ZeRO stage may take (a framework's expressible ones: --framework); None = all
    recompute_choices: tuple[str, ...] | None = None
    zero_choices: tuple[int, ...] | None = None
    # False: FSDP shards over every data-parallel rank, no replicas beside it (Megatron FSDP, DeepSpeed ZeRO-3: what
    # their files can say); True: hybrid sharding (replicas of FSDP groups, HSDP) is searched too
    fsdp_replicas: bool = True


@dataclass(frozen=True)
class Problem:
    """What is being planned: a model on `chips` chips at a sequence length and global batch (sequences)."""

    model: ModelConfig
    chip: Chip
    chips: int
    seq_len: int
    global_batch: int
    # One fast domain: a TPU ICI slice shape (multislice jobs join several over DCN) or (GPUs per NVLink domain,);
    # None = the largest slice the pod allows (TPU) or full NVLink domains (GPU)
    slice_shape: tuple[int, ...] | None = None


# Megatron-Core can count the input embedding and the output layer + loss as one layer each when it splits the
# layers over (virtual) pipeline stages (`--account-for-embedding-in-pipeline-split`,
# `--account-for-loss-in-pipeline-split`, megatron/core/transformer/transformer_block.py get_num_layers_to_build):
# a stage may then hold only the embedding or only the loss, so up to L + 2 (virtual) stages are a valid layout
# (Qwen3-235B, 94 layers, runs at PP 32 x VP 3 = 96 in the Megatron-MoE-ModelZoo).
EXTRA_PIPELINE_STAGES = 2


def max_pipeline_stages(m: ModelConfig) -> int:
    """Most (virtual) pipeline stages the layers of `m` can fill: one layer each, plus embedding and loss."""
    return m.n_layers + EXTRA_PIPELINE_STAGES


def validate_pins(p: Problem, pins: Pins) -> None:
    """Reject impossible pins with a message that says why and what would work."""
    m = p.model
    for what, v in (("sequence length", p.seq_len), ("global batch", p.global_batch)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise MeshplanError(f"the {what} must be a positive integer, got {v!r}")
    for name in ("dp", "fsdp", "tp", "pp", "vpp", "cp", "ep", "microbatch"):
        v = getattr(pins, name)
        if v is not None and v < 1:
            raise MeshplanError(f"--{name} must be a positive integer, got {v}")
    if pins.tp and m.n_heads % pins.tp:
        ok = [d for d in divisors(m.n_heads) if d <= 64]
        raise MeshplanError(f"--tp {pins.tp} does not divide the {m.n_heads} attention heads of {m.name} "
                            f"(valid: {', '.join(map(str, ok))})")
    most = max_pipeline_stages(m)
    if pins.pp and pins.pp > most:
        raise MeshplanError(f"--pp {pins.pp} exceeds the {m.n_layers} layers of {m.name} (plus embedding and loss "
                            f"stages: at most {most})")
    if pins.pp and pins.vpp and pins.pp * pins.vpp > most:
        raise MeshplanError(f"--pp {pins.pp} × --vpp {pins.vpp} exceeds the {m.n_layers} layers of {m.name} (plus "
                            f"embedding and loss stages: at most {most})")
    if pins.ep and pins.ep > 1 and (not m.is_moe or m.n_experts % pins.ep):
        raise MeshplanError(f"--ep {pins.ep} needs a MoE model whose expert count it divides "
                            f"({m.name} has {m.n_experts or 'no'} experts)")
    if pins.vpp and pins.vpp > 1 and pins.pp == 1:
        raise MeshplanError(f"--vpp {pins.vpp} needs pipeline parallelism (--pp > 1): virtual stages interleave "
                            "the layers of several pipeline stages")
    if pins.cp and pins.cp > 1 and p.seq_len % (2 * pins.cp):
        raise MeshplanError(f"--cp {pins.cp}: sequence length {p.seq_len} must divide into 2×cp chunks "
                            "(load-balanced causal split)")
    if pins.recompute is not None:  # '' is no policy (it was searched as if unpinned)
        check_recompute(pins.recompute)
        if pins.recompute:
            tm.check_recompute_for(m, pins.recompute)
    if pins.zero == 3 and pins.fsdp not in (None, 1) and pins.dp not in (None, 1):
        raise MeshplanError("--zero 3 shards everything over the data-parallel ranks: use --fsdp (and --dp for "
                            "replicas of the sharded group) instead")
    if pins.zero is not None and pins.zero not in (0, 1, 2, 3):
        raise MeshplanError(f"--zero must be 0, 1, 2 or 3, got {pins.zero}")
    if pins.offload is not None and not 0.0 <= pins.offload <= 1.0:
        raise MeshplanError(f"--offload is a fraction between 0 and 1, got {pins.offload}")
    for name in OFFLOAD_FLAGS:
        v = getattr(pins, name)
        if v is not None and v not in (0, 1):
            raise MeshplanError(f"--{name.replace('_', '-')} is 0 or 1, got {v}")
    if pins.offload_optimizer and not p.chip.host_memory_bandwidth_bytes_per_s:
        raise MeshplanError(f"--offload-optimizer 1 runs Adam on the host CPU, but {p.chip.name} has no "
                            "host_memory_bandwidth_bytes_per_s figure in its hardware file to time it")
    fixed = 1
    for name in ("dp", "fsdp", "tp", "pp", "cp"):
        fixed *= getattr(pins, name) or 1
    if p.chips % fixed:
        raise MeshplanError(f"the pinned degrees multiply to {fixed}, which does not divide {p.chips} chips")
    if all(getattr(pins, n) for n in ("dp", "fsdp", "tp", "pp", "cp")) and fixed != p.chips:
        raise MeshplanError(f"dp×fsdp×tp×pp×cp = {fixed} but there are {p.chips} chips")


def _choices(pin, candidates):
    return [pin] if pin is not None else candidates


def _mesh_shapes(p: Problem, pins: Pins, reasons: Counter) -> list[tuple[int, int, int, int, int]]:
    """All (tp, pp, cp, fsdp, dp) with product = chips that pass the per-degree rules."""
    m, n = p.model, p.chips
    max_tp = 64 if p.chip.kind == "tpu" else max(p.chip.links.nvlink_domain_size, 8)
    shapes = []
    for tp in _choices(pins.tp, [d for d in divisors(n) if d <= max_tp]):
        if m.n_heads % tp:
            reasons["attention heads not divisible by tp"] += 1
            continue
        for pp in _choices(pins.pp, [d for d in divisors(n // tp) if d <= max_pipeline_stages(m)]):
            rest = n // (tp * pp)
            if rest * tp * pp != n:
                continue
            for cp in _choices(pins.cp, [d for d in divisors(rest) if d <= 32]):
                if p.seq_len % (2 * cp) and cp > 1:
                    reasons["sequence not divisible into 2×cp chunks"] += 1
                    continue
                data = rest // cp
                if data * cp != rest:
                    continue
                shapes += _data_splits(data, pins, tp, pp, cp)
    return shapes


def _data_splits(data: int, pins: Pins, tp: int, pp: int, cp: int) -> list[tuple[int, int, int, int, int]]:
    out = []
    for fs in _choices(pins.fsdp, divisors(data)):
        dp = data // fs
        if dp * fs != data or (pins.dp is not None and pins.dp != dp):
            continue
        out.append((tp, pp, cp, fs, dp))
    return out


def normalize_pins(pins: Pins) -> Pins:
    """ZeRO-3 over the data-parallel ranks is FSDP: every data rank shards unless --dp keeps replicas.

    `--dp N --zero 3` (DeepSpeed's reading: ZeRO-3 partitions over the N data-parallel ranks) is fsdp=N, dp=1; with
    --fsdp also given, --dp counts replicas of the sharded group (HSDP)."""
    if pins.zero == 3:
        if pins.dp is not None and pins.fsdp is None:
            return replace(pins, zero=0, fsdp=pins.dp, dp=1)
        return replace(pins, zero=0, dp=1 if pins.dp is None and pins.fsdp is None else pins.dp)
    return pins


def enumerate_layouts(p: Problem, pins: Pins, offload_choices: tuple[float, ...] = (0.0,),
                      pp_schedule: str = "1f1b", whole_experts: bool = False) -> tuple[LayoutArrays, Counter]:
    """Every candidate layout as arrays, and a count of rejected ones by reason."""
    validate_pins(p, pins)
    if pp_schedule not in PP_SCHEDULES:
        raise MeshplanError(f"unknown pipeline schedule '{pp_schedule}' (known: {', '.join(PP_SCHEDULES)})")
    if pp_schedule not in ("1f1b", "gpipe"):  # interleaved 1F1B and looped breadth-first have virtual stages
        if pins.vpp not in (None, 1):
            raise MeshplanError(f"the {pp_schedule} schedule has no virtual stages: drop --vpp {pins.vpp}")
        if pp_schedule == "dualpipe" and pins.pp is not None and pins.pp > 1 and pins.pp % 2:
            raise MeshplanError(f"DualPipe pairs pipeline ranks from both ends: --pp {pins.pp} must be even")
        pins = replace(pins, vpp=1)
    pins = normalize_pins(pins)
    reasons: Counter = Counter()
    shapes = _mesh_shapes(p, pins, reasons)
    if not shapes:
        raise InfeasibleError(_no_shape_message(p, pins, reasons))
    mesh = np.asarray(shapes, dtype=np.int64)  # [n_shapes, 5]
    m = p.model
    vpp_c = np.asarray(_choices(pins.vpp, [1, 2, 4, 8]), dtype=np.int64)
    mb_c = np.asarray(_choices(pins.microbatch, [1, 2, 4, 8, 16]), dtype=np.int64)
    # a free policy takes the values the model has something to apply to (mla-up-proj only under MLA)
    rc_c = np.asarray([RECOMPUTE_CODES[pins.recompute]] if pins.recompute else
                      [RECOMPUTE_CODES[r] for r in (pins.recompute_choices or RECOMPUTE_CODES)
                       if m.is_mla or r not in tm.MLA_ONLY_POLICIES])
    zero_c = np.asarray(_choices(pins.zero, [z for z in (0, 1, 2) if pins.zero_choices is None
                                             or z in pins.zero_choices]), dtype=np.int64)
    ep_c = np.asarray(_choices(pins.ep, divisors(m.n_experts) if m.is_moe else [1]), dtype=np.int64)
    off_c = np.asarray([pins.offload] if pins.offload is not None else list(offload_choices), dtype=float)
    # optimizer offload is searched only where the host CPU's Adam can be timed (host memory bandwidth known)
    oo_c = np.asarray(_choices(pins.offload_optimizer, [0, 1] if p.chip.host_memory_bandwidth_bytes_per_s else [0]),
                      dtype=np.int64)
    op_c = np.asarray(_choices(pins.offload_params, [0, 1]), dtype=np.int64)
    # the model-state offloads cross the mesh shapes as one axis of (optimizer, params) pairs
    state_c = np.asarray([(a, b) for a in oo_c for b in op_c], dtype=np.int64)
    grids = np.meshgrid(np.arange(len(mesh)), vpp_c, mb_c, rc_c, zero_c, ep_c, off_c, np.arange(len(state_c)),
                        indexing="ij")
    idx, vpp, mb, rc, zero, ep, off, st = (g.ravel() for g in grids)
    tp, pp, cp, fs, dp = (mesh[idx, k] for k in range(5))
    keep = _feasible(p, pins, tp, pp, cp, fs, dp, vpp, mb, zero, ep, reasons, pp_schedule, whole_experts)
    if not pins.fsdp_replicas:
        hybrid = keep & (fs > 1) & (dp > 1)
        if hybrid.any():
            reasons["FSDP with data-parallel replicas (hybrid sharding) is not what the framework runs"] += \
                int(hybrid.sum())
            keep &= ~hybrid
    bad = keep & ~optimizer_offload_ok(dp, fs, cp, pp, zero, state_c[st, 0])
    if bad.any():
        reasons[OPTIMIZER_OFFLOAD_RULE] += int(bad.sum())
        keep &= ~bad
    arrays = LayoutArrays(dp=dp[keep], fsdp=fs[keep], tp=tp[keep], pp=pp[keep], vpp=vpp[keep], cp=cp[keep],
                          ep=ep[keep], microbatch=mb[keep], recompute=rc[keep], zero=zero[keep],
                          offload=off[keep], sequence_parallel=pins.sequence_parallel,
                          offload_optimizer=state_c[st[keep], 0], offload_params=state_c[st[keep], 1])
    return arrays, reasons


OPTIMIZER_OFFLOAD_RULE = ("optimizer offload needs each micro-batch's gradients reduced (ZeRO-2 over the replicas, or "
                          "none) and no stage-long gradient accumulation on the device (FSDP under PP)")


def optimizer_offload_ok(dp, fs, cp, pp, zero, offload_optimizer) -> np.ndarray:
    """ZeRO-Offload copies the rank's reduced gradient partition to the host as each micro-batch's backward produces
    it (Ren et al. 2021 §4.1, with ZeRO-2), so the device never accumulates a step's gradients: the reduction must
    run per micro-batch (ZeRO-2 over the replicas, or no replicas) and FSDP must not hold the stage's gradients
    through a pipelined step."""
    replicas = np.where(fs > 1, dp, dp * cp)
    return (offload_optimizer == 0) | (((zero == 2) | (replicas == 1)) & ~((fs > 1) & (pp > 1)))


def expert_tp_degree(expert_tp: bool, tp, cp, data, ep, sp):
    """Megatron-Core's expert tensor parallel size of a layout (Options.expert_tp): TP, or 1 where the option says so
    or where the layout exists only with whole experts: parallel_state.initialize_model_parallel needs the stage's
    tp·cp·data ranks to divide by etp·ep (MoE Parallel Folding, Liu et al. 2025), so EP beyond the context × data
    ranks (Qwen3-235B TP 2 EP 32 DP 16 in the Megatron-MoE-ModelZoo) means ETP 1. ETP 1 needs sequence parallelism
    (`sp`: SP with tp > 1); without it the experts stay split over TP. Scalars or numpy arrays."""
    whole = np.logical_not(expert_tp) | (np.asarray(cp * data) % ep != 0)
    return np.where(whole & np.asarray(sp, bool), 1.0, np.asarray(tp, float))


def _feasible(p, pins, tp, pp, cp, fs, dp, vpp, mb, zero, ep, reasons: Counter, pp_schedule: str = "1f1b",
              whole_experts: bool = False) -> np.ndarray:
    """Mask of layouts that satisfy the divisibility rules; counts the rest by reason. `whole_experts`: the
    framework runs the routed experts unsplit over TP (Options.expert_tp False)."""
    m = p.model
    data = dp * fs
    # the layout's experts are whole (expert TP 1), as the cost model decides it (expert_tp_degree, its geometry)
    etp_one = expert_tp_degree(not whole_experts, tp, cp, data, ep, pins.sequence_parallel) < tp
    rules = [
        ("global batch not divisible by data-parallel degree × micro-batch", p.global_batch % (data * mb) == 0),
        # an uneven split (126 layers on 16 stages, as Llama 3 405B) is allowed and timed by its busiest stage,
        # which holds ceil(L / (pp·vpp)) layers per virtual stage
        ("more pipeline stages × virtual stages than layers (+ embedding and loss)",
         pp * vpp <= max_pipeline_stages(m)),
        # Megatron-Core's MoE parallel folding: the expert grid (ETP × EP × expert-DP) re-divides the same
        # TP × CP × DP ranks of a pipeline stage (parallel_state.initialize_model_parallel: world_size must be
        # divisible by expert_tensor_parallel_size × expert_model_parallel_size × pipeline_model_parallel_size;
        # Liu et al. 2025, "MoE Parallel Folding"), so EP may exceed DP when the experts are not tensor-split
        # (ETP = 1): EP must divide tp × cp × dp.
        ("expert parallelism must divide the tensor × context × data-parallel ranks", (tp * cp * data) % ep == 0),
        # with FSDP the expert ranks are carved out of the replicas (Megatron-Core's expert-data-parallel group; the
        # CP ranks are FSDP shards here, and the experts stay tensor-split, so ep | dp: costmodel `_carved`) or out of
        # the FSDP group (torchtitan, parallel_dims.py: `dp_shard * cp % ep == 0`, ep = dp_shard_in_ep·cp, the experts
        # FSDP-sharded over the rest, dp_shard_mod_ep), and with whole experts (ETP 1: torchtitan's default since
        # #1555, 2025-08-13, its only mesh since #3167; `dp_shard * cp * tp % ep == 0`, ep = dp_shard_in_ep·cp·tp)
        # out of the FSDP group's tensor ranks too; an EP group across replicas and shards has no framework and no
        # mesh (the replicas do not split the dense weights, the FSDP ranks do)
        ("with FSDP, expert parallelism must divide the replicas (dp), the FSDP group (fsdp × cp), or with whole "
         "experts (ETP 1) its tensor ranks too (fsdp × cp × tp)",
         (fs == 1) | (dp % ep == 0) | ((fs * cp) % ep == 0) | (etp_one & ((fs * cp * tp) % ep == 0))),
        # DualPipe pairs the pipeline ranks from both ends (DeepSeek-V3 §3.2.1)
        ("DualPipe needs an even number of pipeline stages", (pp_schedule != "dualpipe") | (pp == 1) | (pp % 2 == 0)),
        # interleaving shrinks the bubble only when every stage has a micro-batch to run while the first waits for its
        # other chunks: Megatron-Core's interleaved 1F1B runs micro-batches in groups of pp (schedules.py
        # forward_backward_pipelining_with_interleaving, microbatch_group_size_per_vp_stage defaults to pp) and the JAX
        # program `meshplan verify` compiles needs as many; with fewer, a micro-batch's vpp chunks run one after
        # another and the step is no shorter than without interleaving (session 21, QA finding)
        ("an interleaved pipeline (vpp > 1) needs at least pp micro-batches per step",
         (vpp == 1) | (p.global_batch >= pp * data * mb)),
    ]
    # combinations that are not distinct layouts (vpp without pp, a ZeRO stage with no replicas) are dropped
    # silently; the rest are counted by reason
    # (ZeRO-1/2 without FSDP shards over the dp×cp replicas: the CP ranks hold the same weights)
    keep = ((vpp == 1) | (pp > 1)) & ((zero == 0) | (dp > 1) | ((fs == 1) & (cp > 1)) | (pins.zero is not None))
    for reason, ok in rules:
        bad = keep & ~ok
        if bad.any():
            reasons[reason] += int(bad.sum())
        keep &= ok
    return keep


def _no_shape_message(p: Problem, pins: Pins, reasons: Counter) -> str:
    why = reasons.most_common(1)[0][0] if reasons else "the pinned degrees do not multiply to the chip count"
    return f"no layout of {p.chips} chips fits the constraints for {p.model.name}: {why}"
