"""Shared helpers for reading spec files: {value, source} leaves, typed field checks with clear errors."""

from __future__ import annotations

import json
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from meshplan.errors import MeshplanError, unknown_name_error
from meshplan.validate import check_name

DATA_DIR = Path(__file__).parent / "data"
SPEC_SUFFIXES = (".json", ".yaml", ".yml")  # what a path to a user's spec file ends in
# the largest user file meshplan reads (a model config, hardware spec, profile, plan or server command is kilobytes;
# a profile with its benchmark records well under a MiB)
MAX_INPUT_FILE_BYTES = 64 * 2**20


def find_spec(name_or_path: str, kind: str, presets_dir: Path, preset_suffix: str, presets: Callable[[], list[str]],
              file_what: str, dir_file: str | None = None) -> Path:
    """The file a `--model`/`--hardware` value names: the preset `presets_dir/<name, lower case><preset_suffix>`, or a
    path to a JSON/YAML file (with `dir_file`, also a folder holding that file). One-line errors: an empty or
    overlong name, a path to no file ("<file_what> '<path>' does not exist"), an unknown preset (the closest names)."""
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise MeshplanError(f"{kind} name is empty")
    key = check_name(name_or_path.strip(), kind)
    preset = presets_dir / f"{key.lower()}{preset_suffix}"
    if preset.is_file():
        return preset
    p = Path(key)
    if dir_file and p.is_dir():
        p = p / dir_file
        if not p.is_file():
            raise MeshplanError(f"folder '{key}' has no {dir_file} (give the {file_what} file or its folder)")
    elif p.is_dir():
        raise MeshplanError(f"'{key}' is a folder, not a {file_what}")
    elif not (p.suffix.lower() in SPEC_SUFFIXES or p.is_file()):
        raise unknown_name_error(kind, key, presets())
    if not p.is_file():
        raise MeshplanError(f"{file_what} '{key}' does not exist")
    return p


def read_text(path: Path, what: str, expected: str = "", stdin: bool = False) -> str:
    """A user's file as text, or a one-line MeshplanError: unreadable, or not text (`expected`: what the file should
    hold, said in that message). With `stdin`, the path "-" is standard input."""
    from_stdin = stdin and str(path) == "-"
    where = f"{what} on standard input" if from_stdin else f"{what} file '{path}'"
    try:
        if from_stdin:
            text = sys.stdin.read(MAX_INPUT_FILE_BYTES + 1)
        else:
            # a regular file of bounded size: /dev/zero or a FIFO would be read forever (session 23, QA finding)
            st = path.stat()
            if not stat.S_ISREG(st.st_mode):
                raise MeshplanError(f"cannot read {where}: not a regular file")
            if st.st_size > MAX_INPUT_FILE_BYTES:
                raise MeshplanError(f"cannot read {where}: {st.st_size / 2**20:.0f} MiB, more than the "
                                    f"{MAX_INPUT_FILE_BYTES // 2**20} MiB any meshplan input needs")
            text = path.read_text()
        if len(text) > MAX_INPUT_FILE_BYTES:
            raise MeshplanError(f"cannot read {where}: more than {MAX_INPUT_FILE_BYTES // 2**20} MiB")
        return text
    except OSError as exc:
        raise MeshplanError(f"cannot read {where}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        hint = f" (expected {expected})" if expected else ""
        raise MeshplanError(f"malformed {where}: it is not text{hint}") from None


def read_mapping(path: Path, what: str) -> dict[str, Any]:
    """Parse a YAML or JSON file into a mapping, or raise a one-line MeshplanError."""
    text = read_text(path, what)
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MeshplanError(f"malformed {what} file '{path}': {first}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise MeshplanError(f"malformed {what} file '{path}': {type(exc).__name__}") from None
    if not isinstance(data, dict):
        raise MeshplanError(f"malformed {what} file '{path}': expected a mapping at the top level")
    return data


def unwrap(node: Any) -> tuple[Any, str | None]:
    """A leaf is either a bare value or {value: ..., source: ...}; return (value, source)."""
    if isinstance(node, dict) and "value" in node:
        src = node.get("source")
        return node["value"], (str(src) if src is not None else None)
    return node, None


class FieldReader:
    """Reads typed fields from a nested mapping; errors name the file and the dotted field."""

    def __init__(self, data: dict[str, Any], origin: str, rules: Callable[[str], Any] | None = None):
        self.data = data
        self.origin = origin
        self.rules = rules  # dotted field -> meshplan.validate.Rule (bounds) or None
        self.sources: dict[str, str] = {}

    def _get(self, dotted: str, required: bool) -> Any:
        node: Any = self.data
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                if required:
                    raise MeshplanError(f"{self.origin}: missing field '{dotted}'")
                return None
            node = node[part]
        value, src = unwrap(node)
        if value is None and required:  # `field:` or `field: null` is as good as missing
            raise MeshplanError(f"{self.origin}: field '{dotted}' is empty")
        if src:
            self.sources[dotted] = src
        return value

    def number(self, dotted: str, *, required: bool = True, positive: bool = True,
               default: float | None = None) -> float | None:
        value = self._get(dotted, required and default is None)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            try:
                value = float(value)  # YAML reads "1e14" (no dot) as a string
            except (TypeError, ValueError):
                raise MeshplanError(f"{self.origin}: field '{dotted}' must be a number, got {value!r}") from None
        try:
            value = float(value)
        except OverflowError:  # an int beyond float range
            raise MeshplanError(f"{self.origin}: field '{dotted}' is out of range") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise MeshplanError(f"{self.origin}: field '{dotted}' must be finite, got {value!r}")
        if positive and value <= 0:
            raise MeshplanError(f"{self.origin}: field '{dotted}' must be positive, got {value!r}")
        rule = self.rules(dotted) if self.rules else None
        if rule is not None and not (value == 0 and not positive):  # 0 = "no figure" where zero is allowed
            rule.check(value, f"{self.origin}: field '{dotted}'")
        return value

    def integer(self, dotted: str, *, required: bool = True, default: int | None = None) -> int | None:
        value = self.number(dotted, required=required, default=default)
        if value is None:
            return None
        if value != int(value):
            raise MeshplanError(f"{self.origin}: field '{dotted}' must be an integer, got {value!r}")
        return int(value)

    def string(self, dotted: str, *, required: bool = True, choices: tuple[str, ...] | None = None,
               default: str | None = None) -> str | None:
        value = self._get(dotted, required and default is None)
        if value is None:
            return default
        if not isinstance(value, str):
            raise MeshplanError(f"{self.origin}: field '{dotted}' must be a string, got {value!r}")
        if choices and value not in choices:
            raise MeshplanError(f"{self.origin}: field '{dotted}' must be one of {', '.join(choices)}, got '{value}'")
        return value

    def boolean(self, dotted: str, *, default: bool = False) -> bool:
        value = self._get(dotted, False)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise MeshplanError(f"{self.origin}: field '{dotted}' must be true or false, got {value!r}")
        return value

    def int_list(self, dotted: str, *, required: bool = True) -> tuple[int, ...] | None:
        value = self._get(dotted, required)
        if value is None:
            return None
        if (not isinstance(value, list) or not value
                or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
            raise MeshplanError(f"{self.origin}: field '{dotted}' must be a list of positive integers, got {value!r}")
        return tuple(value)
