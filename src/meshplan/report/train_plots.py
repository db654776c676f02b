"""PNG plots for `meshplan train --plot DIR`: memory breakdown, pipeline schedule, MFU vs chip count."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from meshplan.errors import MeshplanError
from meshplan.report.plots import _pyplot
from meshplan.units import GIB


def write_train_plots(out_dir: str, problem, pins, eff, opts, result) -> list[str]:
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    best = result.plans[0]
    paths = [str(d / "memory.png"), str(d / "schedule.png"), str(d / "mfu_vs_chips.png")]
    plot_memory(best, problem, paths[0])
    plot_schedule(best, paths[1], getattr(opts, "pp_schedule", "1f1b"))
    plot_mfu_scaling(problem, pins, eff, opts, paths[2])
    return paths


def plot_memory(plan: dict, problem, path: str) -> None:
    """Stacked bar of memory per chip with the HBM line."""
    plt = _pyplot()
    mem = plan["memory_bytes_per_chip"]
    fig, ax = plt.subplots(figsize=(5, 5))
    bottom = 0.0
    for k in ("params", "grads", "optimizer", "activations", "other"):
        ax.bar([0], [mem[k] / GIB], bottom=[bottom], label=f"{k} {mem[k] / GIB:.1f} GiB")
        bottom += mem[k] / GIB
    hbm = problem.chip.usable_hbm_bytes
    ax.axhline(hbm / GIB, color="k", ls="--", label=f"HBM {hbm / GIB:.0f} GiB")
    ax.set_xticks([])
    ax.set_ylabel("GiB per chip")
    ax.set_title("memory per chip (busiest stage)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def schedule_1f1b(pp: int, m: int, vpp: int = 1) -> list[tuple[int, int, str, int]]:
    """Slots (stage, start, kind 'F'|'B', micro-batch) of a 1F1B schedule with unit-time forward and
    two-unit backward (Narayanan et al. 2021 Fig. 4); interleaving is drawn as vpp× shorter slots."""
    ev: list[tuple[int, int, str, int]] = []
    busy = [0] * pp
    f_done = [[-1] * m for _ in range(pp)]
    for s in range(pp):
        t = s
        warm = min(pp - s, m)
        for i in range(warm):
            t = max(t, f_done[s - 1][i] if s else 0)
            ev.append((s, t, "F", i))
            f_done[s][i] = t + 1
            t += 1
        busy[s] = t
    # backward: last stage first, each backward 2 units, alternating with remaining forwards
    b_done = [[0] * m for _ in range(pp)]
    for i in range(m):
        for s in reversed(range(pp)):
            start = max(busy[s], f_done[s][i], b_done[s + 1][i] if s + 1 < pp else 0)
            ev.append((s, start, "B", i))
            b_done[s][i] = start + 2
            busy[s] = start + 2
            j = i + min(pp - s, m)
            if j < m:
                fs = max(busy[s], f_done[s - 1][j] if s else 0)
                ev.append((s, fs, "F", j))
                f_done[s][j] = fs + 1
                busy[s] = fs + 1
    return ev


MAX_DRAWN_SLOTS = 20_000  # the chunk-level drawing's size bound (a deeper pipeline is drawn a micro-batch per slot)


def _drawn_chunk_by_chunk(pp: int, m: int, vpp: int) -> bool:
    """Whether m micro-batches of pp stages are drawn as the interleaved schedule's chunks: vpp > 1, whole groups of
    pp (Megatron-LM requires them), within the size bound."""
    return vpp > 1 and m % pp == 0 and 2 * m * vpp * pp <= MAX_DRAWN_SLOTS


def schedule_interleaved(pp: int, m: int, vpp: int) -> list[tuple[int, float, str, int, int]] | None:
    """Slots (stage, start, kind, micro-batch, model chunk) of the interleaved 1F1B schedule (Narayanan et al. 2021
    §2.2; Megatron-LM schedules.forward_backward_pipelining_with_interleaving): each stage holds vpp model chunks
    (virtual stage v = chunk x pp + stage); a chunk's forward takes 1/vpp of a micro-batch's forward unit and its
    backward 2/vpp. Each stage runs its warm-up forwards ((pp - stage - 1) x 2 + (vpp - 1) x pp), then one forward
    and one backward in turn, then its last backwards; forward k runs chunk (k // pp) mod vpp of micro-batch
    (k // (pp vpp)) pp + k mod pp, backward k the chunks in reverse. A slot starts when its stage is free and its
    input is ready (the previous virtual stage's forward, the next one's backward). None where the schedule does not
    apply (micro-batches not a multiple of pp, as Megatron-LM requires)."""
    if not _drawn_chunk_by_chunk(pp, m, vpp):
        return None
    total, V = m * vpp, pp * vpp

    def op(kind: str, k: int) -> tuple[str, int, int]:
        c = (k // pp) % vpp
        return kind, (vpp - 1 - c if kind == "B" else c), (k // (pp * vpp)) * pp + k % pp

    orders = []
    for s in range(pp):
        warm = min((pp - s - 1) * 2 + (vpp - 1) * pp, total)
        seq = [op("F", k) for k in range(warm)]
        for j in range(total - warm):
            seq += [op("F", warm + j), op("B", j)]
        seq += [op("B", k) for k in range(total - warm, total)]
        orders.append(seq)
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, micro-batch) -> end time
    free, pos, out = [0.0] * pp, [0] * pp, []
    while any(pos[s] < len(orders[s]) for s in range(pp)):
        moved = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                kind, c, i = orders[s][pos[s]]
                v = c * pp + s
                dep = ("F", v - 1, i) if kind == "F" else (("B", v + 1, i) if v + 1 < V else ("F", v, i))
                if kind == "F" and v == 0:
                    ready = 0.0
                elif dep in done:
                    ready = done[dep]
                else:
                    break
                start = max(free[s], ready)
                free[s] = done[(kind, v, i)] = start + (1 if kind == "F" else 2) / vpp
                out.append((s, start, kind, i, c))
                pos[s] += 1
                moved = True
        if not moved:  # an order the dependencies cannot follow: drawn the plain way instead
            return None
    return out


def shown_micro_batches(pp: int, vpp: int, micro_batches: float, max_shown: int = 16) -> int:
    """Micro-batches a schedule drawing shows: at most `max_shown`, whole groups of pp under interleaving."""
    m = max(int(min(micro_batches, max_shown)), 1)
    total = max(int(micro_batches), 1)
    whole = min(total, max(pp, (max_shown // pp) * pp))
    # only where the chunk-level drawing applies (its size bound): a deeper pipeline is drawn the plain way, with
    # at most max_shown micro-batches (session 23: 3,015 stages x 3,015 micro-batches hung the web server)
    return whole if total % pp == 0 and _drawn_chunk_by_chunk(pp, whole, vpp) else m


def schedule_bars(pp: int, vpp: int, micro_batches: float, compute_s: float,
                  max_shown: int = 16) -> list[tuple[int, float, float, str, int, int]]:
    """Bars (stage, start_s, duration_s, 'F'|'B', micro-batch, model chunk) of the schedule drawing: the step's compute
    split evenly over the micro-batches, a backward twice a forward (Narayanan et al. 2021), the first
    `shown_micro_batches` drawn; interleaving (vpp) as each micro-batch's vpp chunks (`schedule_interleaved`; session
    23, QA finding: they were drawn as one slot vpp times too short)."""
    m = shown_micro_batches(pp, vpp, micro_batches, max_shown)
    per_unit = (compute_s / max(micro_batches, 1)) / 3.0
    inter = schedule_interleaved(pp, m, vpp)
    if inter is not None:
        return [(s, start * per_unit, (1 if kind == "F" else 2) * per_unit / vpp, kind, i, c)
                for s, start, kind, i, c in inter]
    return [(s, start * per_unit / vpp, (1 if kind == "F" else 2) * per_unit / vpp, kind, i, 0)
            for s, start, kind, i in schedule_1f1b(pp, m, vpp)]


def plot_schedule(plan: dict, path: str, pp_schedule: str = "1f1b") -> None:
    """Timeline of the chosen plan: forward, backward, bubbles and exposed communication per stage. The slots are
    drawn as 1F1B; under a zero-bubble or DualPipe schedule the title gives that schedule's (smaller) bubble."""
    plt = _pyplot()
    cfg = plan["config"]
    pp, vpp = cfg["pp"], cfg["vpp"]
    total = plan.get("micro_batches", 1)
    m = shown_micro_batches(pp, vpp, total)
    fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * pp))
    for s, x, w, kind, i, _ in schedule_bars(pp, vpp, total, plan["time_s"]["compute"]):
        ax.barh(s, w, left=x, color="tab:blue" if kind == "F" else "tab:green", edgecolor="white")
        if m <= 8:
            ax.text(x + w / 2, s, f"{kind}{i}", ha="center", va="center", fontsize=6, color="white")
    comm = plan["time_s"]["exposed_comm"] / max(plan.get("micro_batches", 1), 1)
    if comm > 0:
        ax.barh(-1, comm, left=0, color="tab:red", label="exposed comm per micro-batch")
    ax.set_yticks(range(-1, pp), ["comm"] + [f"stage {s}" for s in range(pp)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (white gaps = bubbles)")
    name = {"zb1p": "ZB-H1 (drawn as 1F1B)", "dualpipe": "DualPipe (drawn as 1F1B)",
            "gpipe": "GPipe (drawn as 1F1B)"}.get(pp_schedule, "1F1B")
    ax.set_title(f"{name} schedule: pp={pp}, vpp={vpp}, {m} of {max(int(total), 1)} micro-batches shown; "
                 f"bubble {plan['time_s']['bubble']:.3g} s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SCALING_FACTORS = (0.125, 0.25, 0.5, 1, 2, 4)  # chip counts around the requested one


def scaling_chip_counts(chips: int, global_batch: int) -> list[int]:
    """The chip counts of the MFU-vs-chips curve (same global batch)."""
    out = []
    for f in SCALING_FACTORS:
        n = int(chips * f)
        if n < 1 or global_batch % max(1, n // 64) and n > global_batch * 64:
            continue
        out.append(n)
    return out


def mfu_scaling(problem, pins, eff, opts) -> list[tuple[int, float]]:
    """(chips, MFU of the best plan) at chip counts around the requested one; data and FSDP degrees searched."""
    from meshplan.train.planner import plan

    points = []
    for n in scaling_chip_counts(problem.chips, problem.global_batch):
        try:
            best = plan(replace(problem, chips=n), replace(pins, dp=None, fsdp=None), eff, opts, top=1).plans[0]
        except MeshplanError:
            continue
        points.append((n, best["mfu"]))
    return points


def plot_mfu_scaling(problem, pins, eff, opts, path: str) -> None:
    """Best plan's MFU at chip counts around the requested one (same global batch)."""
    plt = _pyplot()
    points = mfu_scaling(problem, pins, eff, opts)
    xs, ys = [n for n, _ in points], [m for _, m in points]
    plt_fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, ys, "o-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chips")
    ax.set_ylabel("MFU of the best plan")
    ax.set_title(f"{problem.model.name} on {problem.chip.name}, batch {problem.global_batch}")
    ax.grid(alpha=0.3)
    plt_fig.tight_layout()
    plt_fig.savefig(path, dpi=110)
    plt.close(plt_fig)
