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


def schedule_bars(pp: int, vpp: int, micro_batches: float, compute_s: float,
                  max_shown: int = 16) -> list[tuple[int, float, float, str, int]]:
    """Bars (stage, start_s, duration_s, 'F'|'B', micro-batch) of the schedule drawing: the step's compute split
    evenly over the micro-batches, a backward twice a forward (Narayanan et al. 2021), at most `max_shown`
    micro-batches drawn; interleaving (vpp) as vpp-times shorter slots."""
    m = max(int(min(micro_batches, max_shown)), 1)
    per_unit = (compute_s / max(micro_batches, 1)) / 3.0
    return [(s, start * per_unit / vpp, (1 if kind == "F" else 2) * per_unit / vpp, kind, i)
            for s, start, kind, i in schedule_1f1b(pp, m, vpp)]


def plot_schedule(plan: dict, path: str, pp_schedule: str = "1f1b") -> None:
    """Timeline of the chosen plan: forward, backward, bubbles and exposed communication per stage. The slots are
    drawn as 1F1B; under a zero-bubble or DualPipe schedule the title gives that schedule's (smaller) bubble."""
    plt = _pyplot()
    cfg = plan["config"]
    pp, vpp = cfg["pp"], cfg["vpp"]
    m = int(min(plan.get("micro_batches", 1), 16))
    fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * pp))
    for s, x, w, kind, i in schedule_bars(pp, vpp, plan.get("micro_batches", 1), plan["time_s"]["compute"]):
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
    ax.set_title(f"{name} schedule: pp={pp}, vpp={vpp}, {m} micro-batches shown; "
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
