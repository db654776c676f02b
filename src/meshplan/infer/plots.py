"""The latency-throughput frontier as a PNG (matplotlib Agg, imported only when asked)."""

from __future__ import annotations

from collections.abc import Sequence

from meshplan.errors import MeshplanError
from meshplan.infer.metrics import ServePoint
from meshplan.report.plots import plot_path


def plot_frontier(points: Sequence[ServePoint], path: str, title: str = "") -> None:
    """TPOT (x, ms) against output tokens/s per chip (y), one marker per batch, labelled with the batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = plot_path(path)
    if not points:
        raise MeshplanError("nothing to plot: no batch fits")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [p.tpot_s * 1e3 for p in points]
    ys = [p.throughput_per_chip for p in points]
    ax.plot(xs, ys, "o-")
    for p, x, y in zip(points, xs, ys, strict=True):
        ax.annotate(f"B={p.batch}", (x, y), fontsize=7, xytext=(3, -10), textcoords="offset points")
    ax.set_xlabel("time per output token (ms)")
    ax.set_ylabel("output tokens/s per chip")
    ax.set_title(title or "latency-throughput frontier")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=120)
    except OSError as exc:
        raise MeshplanError(f"cannot write plot '{path}': {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
