"""`meshplan web`: the interactive page on 127.0.0.1 (src/meshplan/web)."""

from __future__ import annotations

from typing import Annotated

import typer

from meshplan.cli.app import app, console, fail


@app.command()
def web(
    port: Annotated[int, typer.Option(help="Port on 127.0.0.1 (0: a free one).")] = 0,
    quiet: Annotated[bool, typer.Option("--quiet", help="Do not log each request.")] = False,
) -> None:
    """Serve the planner's page on 127.0.0.1: plans, memory, timeline, MFU vs chips, serving; Ctrl-C stops."""
    from meshplan.web.server import make_server

    if not 0 <= port <= 65535:
        fail(f"--port must be between 0 and 65535, got {port}")
    try:
        server = make_server(port, quiet)
    except OSError as exc:
        fail(f"cannot listen on 127.0.0.1:{port}: {exc.strerror}")
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    console.print(f"meshplan web: {url}  (Ctrl-C stops)", markup=False, highlight=False)
    console.file.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
