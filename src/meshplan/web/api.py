"""The web page's JSON API: a request's fields become the very `meshplan train|serve ... --json` command line, run
in this process; the answer is the object `--json` prints, and a bad input gets the CLI's own `error:` message.

Kept thin on purpose: no validation or planning happens here that the CLI does not do itself, except that the
page may only name presets (the server must not read arbitrary paths) or upload a config.json.
"""

from __future__ import annotations

import atexit
import hashlib
import re
import shutil
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshplan.errors import MeshplanError, unknown_name_error
from meshplan.specs.hardware import preset_chips
from meshplan.specs.model import preset_models

# field -> CLI flag. Boolean fields take 0/1 and map to the flag's two spellings.
TRAIN_FIELDS = {f: "--" + f.replace("_", "-") for f in (
    "model", "hardware", "chips", "seq_len", "global_batch", "tokens", "dtype", "framework", "dp", "fsdp", "tp",
    "pp", "vpp", "cp", "ep", "microbatch", "recompute", "zero", "offload", "offload_optimizer", "offload_params", "pp_schedule", "attention_kernel",
    "headroom", "top")}
SERVE_FIELDS = {f: "--" + f.replace("_", "-") for f in (
    "model", "hardware", "chips", "input_len", "output_len", "batch", "tp", "pp", "ep", "quant", "kv_quant",
    "tpot_target", "ttft_target", "batching")}
BOOL_FIELDS = {"train": {"sp": ("--sp", "--no-sp")}, "serve": {"search": ("--search", None)}}
FIELDS = {"train": TRAIN_FIELDS, "serve": SERVE_FIELDS}
MAX_MODEL_JSON_BYTES = 256 * 1024
_FLAG_RE = re.compile(r"--([a-z][a-z0-9-]*)")
_lock = threading.Lock()  # the planner keeps lru caches; one command at a time (each takes well under a second)
# the most layouts one request's search may evaluate (train/planner.SEARCH_LAYOUT_LIMIT): about 20 s and 3 GB on one
# core (DeepSeek-V3 on 2,048 H100 is 3.1M: 17 s, 2.4 GB; results/search_speed_cpu_2026-12-05_s23.md), so that no
# request holds the others behind the lock for minutes; larger searches belong on the command line
MAX_SEARCH_LAYOUTS = 4_000_000
_upload_dir = Path(tempfile.mkdtemp(prefix="meshplan-web-"))
atexit.register(shutil.rmtree, _upload_dir, ignore_errors=True)


class InputError(MeshplanError):
    """Bad input: the CLI's one-line message and, where it names one, the form field it is about."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def field_of(message: str, kind: str, given: set[str] | None = None) -> str | None:
    """The form field an error message names: the first CLI flag in it that the form has and the user filled in
    (`given`; None: any). A flag the user left empty is named by a suggestion ('or --recompute full'), not by the
    error, so the message stays with the form (session 23, QA finding: 'no layout fits' marked the recompute menu),
    unless the message says that flag is missing."""
    fields = FIELDS[kind]
    named = [f.replace("-", "_") for f in _FLAG_RE.findall(message)]
    named = [n for n in named if n in fields or n in BOOL_FIELDS[kind]]
    if given is None or message.lower().startswith("missing"):
        if named:
            return named[0]
    else:
        for name in named:
            if name in given:
                return name
        if named:
            return None
    low = message.lower()  # messages that name the quantity in words ("output length must be ...")
    for name in sorted(fields, key=len, reverse=True):
        if name.replace("_", " ") in low:
            return name
    return None


def _model_path(text: str, filename: str | None) -> str:
    """Store an uploaded config.json under this server's temp folder; its path is what --model gets."""
    data = text.encode("utf-8", "surrogatepass")
    if len(data) > MAX_MODEL_JSON_BYTES:
        raise InputError(f"model config is larger than {MAX_MODEL_JSON_BYTES // 1024} KiB", "model")
    stem = re.sub(r"[^A-Za-z0-9._-]", "", Path(filename or "").stem)[:64].strip(".") or "uploaded"
    d = _upload_dir / hashlib.sha256(data).hexdigest()[:16]
    d.mkdir(exist_ok=True)
    p = d / f"{stem}.json"
    if not p.exists():
        p.write_bytes(data)
    return str(p)


def _preset(kind: str, name: str, presets: list[str]) -> None:
    """The page names presets only: a name that is not one gets the CLI's own unknown-name message, and the server
    never reads a file a request names (the CLI would take a path)."""
    if name.lower() not in presets:
        raise InputError(str(unknown_name_error(kind, name, presets)), kind)


def argv_for(kind: str, params: Mapping[str, str]) -> list[str]:
    """The command line the CLI would get for these form fields (empty fields are left out: searched)."""
    return command(kind, params)[0]


def command(kind: str, params: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """(argv, {stored upload's path: the uploaded file's name}) for these form fields."""
    if kind not in FIELDS:
        raise InputError(f"unknown command '{kind}' (known: train, serve)")
    fields, bools = FIELDS[kind], BOOL_FIELDS[kind]
    argv = [kind]
    params = {k: str(v).strip() for k, v in params.items() if v is not None and str(v).strip() != ""}
    for key, value in params.items():
        if key != "model_json" and any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
            raise InputError(f"field '{key}' has a control character", key if key in fields else None)
    model_json = params.pop("model_json", None)
    model_name = params.pop("model_name", None)
    renames = {}
    if model_json is not None:
        params["model"] = _model_path(model_json, model_name)
        renames[params["model"]] = model_name or "uploaded.json"
    elif "model" in params:
        _preset("model", params["model"], preset_models())
    if "hardware" in params:
        _preset("hardware", params["hardware"], preset_chips())
    for key, value in params.items():
        if key in bools:
            on, off = bools[key]
            if value not in ("0", "1", "true", "false"):
                raise InputError(f"{on} must be 0 or 1, got '{value}'", key)
            flag = on if value in ("1", "true") else off
            if flag:
                argv.append(flag)
        elif key in fields:
            argv.append(f"{fields[key]}={value}")
        else:
            raise InputError(f"unknown field '{key}' for {kind}")
    argv.append("--json")
    return argv, renames


def run(kind: str, params: Mapping[str, str], max_layouts: int = MAX_SEARCH_LAYOUTS) -> dict[str, Any]:
    """The object `meshplan <kind> ... --json` prints for these fields; InputError with the CLI's message. A training
    search of more than `max_layouts` layouts is refused with the planner's message."""
    from meshplan.cli import commands  # noqa: F401  (registers the commands)
    from meshplan.cli.app import _ClickException, json_sink, run_app
    from meshplan.train.planner import SEARCH_LAYOUT_LIMIT

    argv, uploaded = command(kind, params)
    given = {k for k, v in params.items() if v is not None and str(v).strip() != ""}
    sink: list = []
    token = json_sink.set(sink)
    limit = SEARCH_LAYOUT_LIMIT.set(max_layouts)
    try:
        with _lock:
            run_app(argv)
    except InputError:
        raise
    except MeshplanError as exc:
        msg = str(exc)
        for path, name in uploaded.items():  # the page's user knows their file's name, not the server's folder
            msg = msg.replace(path, name)
        raise InputError(msg, field_of(msg, kind, given)) from None
    except _ClickException as exc:
        msg = exc.format_message().replace("\n", " ")
        raise InputError(msg, field_of(msg, kind, given)) from None
    finally:
        json_sink.reset(token)
        SEARCH_LAYOUT_LIMIT.reset(limit)
    if len(sink) != 1:
        raise RuntimeError(f"'{' '.join(argv)}' printed {len(sink)} JSON objects, expected 1")
    return sink[0]
