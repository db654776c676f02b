"""`meshplan web`: the standard library's threading HTTP server on 127.0.0.1.

Routes (GET with a query string, or POST with a JSON object of the same fields):
  /                 the page
  /api/train        exactly `meshplan train ... --json`      /api/serve     exactly `meshplan serve ... --json`
  /api/scaling      MFU of the best plan at chip counts around the requested one (train fields)
  /api/schedule     a pipeline timeline's bars (pp, vpp, micro_batches, compute_s)
  /api/presets      the menus' names
Bad input: 400 with {"error": the CLI's message, "field": the form field or null}. Nothing else is served: no
file is read from a request's path, so there is nothing to traverse to.
"""

from __future__ import annotations

import json
import math
import sys
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from meshplan.report.train_plots import scaling_chip_counts
from meshplan.web import api, page

MAX_BODY_BYTES = 1 << 20


def _int_field(params: dict, name: str) -> int:
    try:
        return int(params[name])
    except (KeyError, ValueError, TypeError):
        raise api.InputError(f"{name} must be an integer", name) from None


def scaling(params: dict[str, str]) -> dict[str, Any]:
    """(chips, best MFU) around the requested chip count, each point a `train --json` run with the data and FSDP
    degrees searched (report.train_plots.mfu_scaling does the same in-process for --plot and --html)."""
    api.run("train", params)  # the request itself must be valid: its error is the answer
    base = {k: v for k, v in params.items() if k not in ("dp", "fsdp", "top", "chips")}
    points = []
    for n in scaling_chip_counts(_int_field(params, "chips"), _int_field(params, "global_batch")):
        try:
            # each point's search smaller than the request's own: the sweep runs several behind the one lock, and a
            # point too large to search is left out like one that does not fit
            best = api.run("train", {**base, "chips": str(n), "top": "1"},
                           max_layouts=api.MAX_SEARCH_LAYOUTS // 4)["plans"][0]
        except api.InputError:
            continue
        points.append({"chips": n, "mfu": best["mfu"]})
    return {"points": points}


def schedule(params: dict[str, str]) -> dict[str, Any]:
    vals = {}
    for name, lo in (("pp", 1), ("vpp", 1), ("micro_batches", 1)):
        vals[name] = _int_field(params, name)
        if not lo <= vals[name] <= 4096:
            raise api.InputError(f"{name} must be between {lo} and 4096, got {vals[name]}", name)
    try:
        compute_s = float(params.get("compute_s", ""))
    except ValueError:
        compute_s = math.nan
    if not math.isfinite(compute_s) or compute_s < 0:
        raise api.InputError("compute_s must be a non-negative number of seconds", "compute_s")
    return page.schedule(vals["pp"], vals["vpp"], vals["micro_batches"], compute_s)


ROUTES = {
    "/api/train": lambda p: api.run("train", p),
    "/api/serve": lambda p: api.run("serve", p),
    "/api/scaling": scaling,
    "/api/schedule": schedule,
    "/api/presets": lambda p: page.presets(),
}


class Handler(BaseHTTPRequestHandler):
    server_version = "meshplan"
    quiet = False
    # seconds a connection may stall (a body shorter than its Content-Length, a client that sends nothing) before
    # its thread gives up (socketserver.StreamRequestHandler.timeout; session 23, QA finding: such a connection
    # held a thread forever)
    timeout = 30

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        if not self.quiet:
            super().log_message(format, *args)

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        if self.command != "HEAD":
            try:
                self.wfile.write(body)
            except ConnectionError:  # the page moved on (a newer request): nothing to answer
                pass

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _error(self, status: int, message: str, field: str | None = None) -> None:
        self._json(status, {"error": message, "field": field})

    def _params_from_query(self, query: str) -> dict[str, str] | None:
        parsed = parse_qs(query, keep_blank_values=True, max_num_fields=200)
        twice = [k for k, v in parsed.items() if len(v) > 1]
        if twice:
            self._error(400, f"field '{twice[0]}' given more than once", twice[0])
            return None
        return {k: v[0] for k, v in parsed.items()}

    def _handle(self, params: dict[str, Any] | None, path: str) -> None:
        if path in ("/", "/index.html"):
            self._send(200, page.render().encode(), "text/html; charset=utf-8")
            return
        route = ROUTES.get(path)
        if route is None:
            self._error(404, f"no such page '{path[:200]}'")
            return
        if params is None:
            return
        bad = [k for k, v in params.items() if not isinstance(v, str | int | float | bool) or v is None]
        if bad:
            self._error(400, f"field '{bad[0]}' must be a string or a number", bad[0])
            return
        try:
            self._json(200, route({k: str(int(v) if isinstance(v, bool) else v) for k, v in params.items()}))
        except api.InputError as exc:
            self._error(400, str(exc), exc.field)
        except Exception as exc:  # a planner bug, not bad input: logged, answered, the server goes on
            traceback.print_exc(file=sys.stderr)
            self._error(500, f"internal error: {type(exc).__name__}: {exc}")

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        try:
            url = urlsplit(self.path)
            self._handle(self._params_from_query(url.query), url.path)
        except ConnectionError:  # the client went away: nothing to answer
            pass
        except Exception as exc:
            self._error(400, f"bad request: {type(exc).__name__}")

    do_HEAD = do_GET

    def do_POST(self) -> None:  # noqa: N802
        try:
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            if length < 0 or length > MAX_BODY_BYTES:
                self._error(413, f"request body must be at most {MAX_BODY_BYTES} bytes")
                return
            raw = self.rfile.read(length)
            try:
                params = json.loads(raw.decode("utf-8")) if raw.strip() else {}
            except (UnicodeDecodeError, ValueError):
                self._error(400, "request body must be a JSON object")
                return
            if not isinstance(params, dict):
                self._error(400, "request body must be a JSON object")
                return
            self._handle(params, url.path)
        except ConnectionError:
            pass
        except Exception as exc:
            self._error(400, f"bad request: {type(exc).__name__}")

    def _not_allowed(self) -> None:
        self._error(405, f"method {self.command} not allowed")

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed


def make_server(port: int = 0, quiet: bool = False, timeout: float = Handler.timeout) -> ThreadingHTTPServer:
    """A server on 127.0.0.1 (port 0: a free one); the caller runs serve_forever(). `timeout`: seconds a stalled
    connection keeps its thread."""
    handler = type("QuietHandler" if quiet else "Handler", (Handler,), {"quiet": quiet, "timeout": timeout})
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    return server
