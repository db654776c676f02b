"""The one page, as one self-contained HTML string (styles, script and, for `--html`, the data inline).

The same page serves `meshplan web` (live: it asks the JSON API) and `train|serve --html FILE` (static: one result
embedded). Charts are inline SVG drawn by the page's own script (assets/app.js); nothing is fetched from elsewhere.
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path
from typing import Any

from meshplan.report.train_plots import schedule_bars, shown_micro_batches

ASSETS = files("meshplan.web") / "assets"


def presets() -> dict[str, Any]:
    """The names the page's menus offer (the CLI's own preset lists)."""
    from meshplan.infer.metrics import MODES
    from meshplan.math.transformer import RECOMPUTE_POLICIES
    from meshplan.specs.hardware import load_chip, preset_chips
    from meshplan.specs.model import preset_models
    from meshplan.train.frameworks import FRAMEWORKS
    from meshplan.train.space import PP_SCHEDULES

    return {"models": preset_models(), "hardware": preset_chips(), "frameworks": sorted(FRAMEWORKS),
            "hbm_usable_bytes": {name: load_chip(name).usable_hbm_bytes for name in preset_chips()},
            "recompute": list(RECOMPUTE_POLICIES), "pp_schedules": list(PP_SCHEDULES), "batching": list(MODES)}


def schedule(pp: int, vpp: int, micro_batches: float, compute_s: float) -> dict[str, Any]:
    """The pipeline timeline's bars, as the PNG schedule plot draws them, and how many micro-batches they show."""
    bars = schedule_bars(pp, vpp, micro_batches, compute_s)
    return {"bars": [{"stage": s, "start_s": x, "duration_s": w, "kind": k, "micro_batch": i, "chunk": c}
                     for s, x, w, k, i, c in bars],
            "shown_micro_batches": shown_micro_batches(pp, vpp, micro_batches),
            "micro_batches": max(int(micro_batches), 1)}


def train_view(result: dict, inputs: dict, scaling: list[tuple[int, float]]) -> dict[str, Any]:
    """What the page shows for one `train --json` result: the result itself, every plan's timeline, MFU vs chips."""
    scheds = [schedule(p["config"]["pp"], p["config"]["vpp"], p.get("micro_batches", 1), p["time_s"]["compute"])
              for p in result["plans"]]
    inputs = {k: v for k, v in inputs.items() if v is not None}
    return {"kind": "train", "inputs": inputs, "train": result, "schedules": scheds,
            "scaling": [{"chips": n, "mfu": m} for n, m in scaling]}


def serve_view(result: dict, inputs: dict) -> dict[str, Any]:
    return {"kind": "serve", "inputs": {k: v for k, v in inputs.items() if v is not None}, "serve": result}


def _script_json(obj: Any) -> str:
    """JSON safe inside a <script> element: '<', '>' and '&' (only ever inside JSON strings) as \\u escapes, so
    nothing in the data can close the element or open a comment."""
    return (json.dumps(obj, separators=(",", ":"))
            .replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))


def render(view: dict | None = None) -> str:
    """The page: live (view None) or static with one result inline."""
    html = (ASSETS / "index.html").read_text(encoding="utf-8")
    boot = {"mode": "static" if view else "live", "presets": presets(), "view": view}
    return (html.replace("/*STYLE*/", (ASSETS / "style.css").read_text(encoding="utf-8"))
                .replace("/*SCRIPT*/", (ASSETS / "app.js").read_text(encoding="utf-8"))
                .replace("/*DATA*/", _script_json(boot)))


def write_html(path: str, view: dict) -> None:
    """`--html FILE`: the page for one result, one self-contained file."""
    from meshplan.cli.app import _jsonable
    from meshplan.errors import MeshplanError

    try:
        Path(path).write_text(render(_jsonable(view)), encoding="utf-8")
    except OSError as exc:
        raise MeshplanError(f"cannot write --html file '{path}': {exc.strerror}") from None
