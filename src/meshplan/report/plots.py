"""PNG plots (matplotlib, Agg backend; imported only when a plot is asked for)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from meshplan.errors import MeshplanError


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_path(path: str) -> Path:
    """Where a plot file goes: its folder must exist, and its suffix must name an image format matplotlib writes
    (none: PNG). One clear error instead of matplotlib's traceback (session 23, QA finding: `--plot x.txt`)."""
    p = Path(path)
    if p.parent and not p.parent.exists():
        raise MeshplanError(f"cannot write plot '{path}': folder '{p.parent}' does not exist")
    suffix = p.suffix.lower().lstrip(".")
    if suffix:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        kinds = FigureCanvasAgg.get_supported_filetypes()
        if suffix not in kinds:
            raise MeshplanError(f"cannot write plot '{path}': '.{suffix}' is not an image format "
                                f"(use .png, .pdf or .svg; matplotlib writes {', '.join(sorted(kinds))})")
    return p


def plot_roofline(rows: Sequence, chip, path: str, dtype: str = "bf16") -> None:
    """Log-log roofline: attainable FLOP/s = min(C, AI·W), with each op placed at its intensity."""
    import numpy as np

    plt = _pyplot()
    out = plot_path(path)
    C, W = chip.peak(dtype), chip.hbm_bandwidth_bytes_per_s
    ai = np.logspace(-1, 5, 400)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.loglog(ai, np.minimum(C, ai * W), "k-", lw=2, label=f"{chip.name} {dtype}")
    ax.axvline(C / W, color="grey", ls=":", label=f"critical intensity {C / W:.0f}")
    for r in rows:
        ax.loglog([r.intensity], [min(C, r.intensity * W)], "o")
        ax.annotate(r.name, (r.intensity, min(C, r.intensity * W)), fontsize=7, xytext=(3, -10),
                    textcoords="offset points")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("attainable FLOP/s")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"roofline: {chip.name}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
