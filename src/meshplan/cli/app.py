"""The Typer app, the error contract and shared option parsing.

Errors: bad input prints one line on stderr starting `error:` and exits with code 2, never a traceback.
"""

from __future__ import annotations

import json
import math
import sys
from contextvars import ContextVar
from typing import Annotated, Any

import typer
from rich.console import Console

from meshplan.errors import MeshplanError

# one layout degree the user may pin (`train` and `serve` share it); None = searched
Pin = Annotated[int | None, typer.Option(help="Pin this degree (omit to search it).", show_default=False)]

# Typer re-exports click's exceptions (newer versions vendor click); find the base class through them so
# this works whichever click Typer carries.
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")

app = typer.Typer(
    name="meshplan",
    help="Plan how to split a transformer across TPUs and GPUs, predict speed, memory and cost, and check it.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
# Rich assumes 80 columns when stdout is not a terminal; plans are wider than that.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True)
ARGV: list[str] = []  # the arguments `main` was given, for files that record the command that wrote them


def fail(message: str) -> None:
    """Raise the one-line user error."""
    raise MeshplanError(message)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and (math.isinf(obj) or math.isnan(obj)):
        return None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return obj.item()
    return obj


# Where print_json sends its object instead of stdout: `meshplan web` runs a command in its own thread and
# collects the very object `--json` prints (a ContextVar, so each request thread has its own).
json_sink: ContextVar[list | None] = ContextVar("json_sink", default=None)


def print_json(obj: Any) -> None:
    """One JSON object on stdout (NaN/inf become null so the output is strict JSON)."""
    sink = json_sink.get()
    if sink is not None:
        sink.append(_jsonable(obj))
        return
    sys.stdout.write(json.dumps(_jsonable(obj), indent=2) + "\n")


def parse_mesh(text: str) -> dict[str, int]:
    """`data=8,tensor=4` → {'data': 8, 'tensor': 4}."""
    mesh: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "=" not in part:
            fail(f"bad mesh '{text}': each axis is name=size, e.g. data=8,tensor=4")
        name, _, size = part.partition("=")
        name = name.strip()
        if not name.isidentifier():
            fail(f"bad mesh axis name '{name}' in '{text}'")
        if name in mesh:
            fail(f"mesh axis '{name}' appears twice in '{text}'")
        try:
            n = int(size)
        except ValueError:
            fail(f"bad mesh axis size '{size}' for axis '{name}' (must be a positive integer)")
        if n <= 0:
            fail(f"mesh axis '{name}' must have a positive size, got {n}")
        mesh[name] = n
    if not mesh:
        fail("mesh is empty: give axes as name=size, e.g. data=8,tensor=4")
    return mesh


def main(argv: list[str] | None = None) -> int:
    """Console entry point: run the app and turn every user error into `error: ...` + exit 2."""
    from meshplan.cli import commands  # noqa: F401  (registers the commands)

    args = sys.argv[1:] if argv is None else argv
    if not args:
        args = ["--help"]
    ARGV[:] = args
    try:
        result = run_app(args)
    except MeshplanError as exc:
        err_console.print(one_line(f"error: {exc}"), markup=False, highlight=False, soft_wrap=True)
        return _exit(2)
    except typer.Abort:
        err_console.print("error: aborted", markup=False, highlight=False)
        return _exit(130)
    except _ClickException as exc:
        msg = exc.format_message().replace("\n", " ")
        err_console.print(one_line(f"error: {msg}"), markup=False, highlight=False, soft_wrap=True)
        return _exit(2)
    except typer.Exit as exc:
        return _exit(exc.exit_code)
    except OSError as exc:  # the user's file system refused a path they gave (unwritable, too long, missing)
        where = f" '{exc.filename}'" if getattr(exc, "filename", None) else ""
        err_console.print(one_line(f"error: cannot use{where}: {exc.strerror or exc}"), markup=False,
                          highlight=False, soft_wrap=True)
        return _exit(2)
    return _exit(result if isinstance(result, int) else 0)


def one_line(message: str) -> str:
    """The error line with what would break it escaped: a user's value echoed in a message may hold a newline, a
    carriage return or another line separator (\\x1e, \\u2028, which str.splitlines() splits on) or a terminal
    escape; each non-printable character is written as its Python escape (\\n, \\x1e, \\x1b)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)


def run_app(args: list[str]) -> Any:
    """Run the app on `args` with every command's flags checked first (meshplan.validate): the CLI and the web API
    both enter here, so one validation layer guards them. Errors propagate (MeshplanError, click's)."""
    command = typer.main.get_command(app)
    _validate_before_running(command)
    return command.main(args=args, prog_name="meshplan", standalone_mode=False)


def _validate_before_running(group: Any) -> None:
    """Route every command through meshplan.validate.check_cli_params: one boundary check for every flag."""
    from meshplan.validate import check_cli_params

    for command_name, sub in getattr(group, "commands", {}).items():
        callback = sub.callback
        if callback is None or getattr(callback, "_validated", False):
            continue

        # a flag left at its default is the program's own choice (verify's --microbatch 0 = the whole batch),
        # not input: only the values the user gave are checked
        defaults = {p.name: p.default for p in sub.params}

        def checked(*a: Any, _run: Any = callback, _name: str = command_name, _defaults: dict = defaults,
                    **params: Any) -> Any:
            check_cli_params({k: v for k, v in params.items() if k not in _defaults or v != _defaults[k]}, _name)
            return _run(*a, **params)

        checked._validated = True  # type: ignore[attr-defined]
        sub.callback = checked


def _exit(code: int) -> int:
    if __name__ != "__main__":
        sys.exit(code)
    return code
