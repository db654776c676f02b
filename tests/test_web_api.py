"""`meshplan web`'s JSON API against the CLI itself: the same objects, the same error messages, and a server that
answers every request (no 500, no file outside its own page)."""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import re
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshplan.web import api
from meshplan.web.server import make_server

TRAIN = {"model": "llama3-8b", "hardware": "h100-sxm", "chips": "16", "seq_len": "4096", "global_batch": "64"}
SERVE = {"model": "llama3-8b", "hardware": "h100-sxm", "chips": "8", "input_len": "1000", "output_len": "200"}


@pytest.fixture(scope="module")
def port():
    server = make_server(0, quiet=True)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def request(port: int, method: str, path: str, body: bytes | None = None,
            headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def post(port: int, path: str, params: dict) -> tuple[int, dict]:
    status, body = request(port, "POST", path, json.dumps(params).encode(), {"Content-Type": "application/json"})
    return status, json.loads(body)


def cli(argv: list[str]) -> tuple[int, str, str]:
    """The real entry point in-process: (exit code, stdout, stderr)."""
    from meshplan.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def flags(kind: str, params: dict) -> list[str]:
    """The command line written out by hand (not through api.argv_for)."""
    return [kind] + [f"--{k.replace('_', '-')}={v}" for k, v in params.items()] + ["--json"]


def _addresses(text: str) -> list[str]:
    """Every URL in a page but the SVG namespace name (an identifier, never fetched)."""
    return [u for u in re.findall(r"(?:https?:)?//[\w.-]+\.[a-z]{2,}[^\s\"']*", text) if u != "http://www.w3.org/2000/svg"]


def _without_timing(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "search_time_s"}


def test_api_train_is_train_json(port):
    status, got = post(port, "/api/train", {**TRAIN, "tp": "2", "top": "3"})
    code, out, _ = cli(flags("train", {**TRAIN, "tp": "2", "top": "3"}))
    assert status == 200 and code == 0
    assert _without_timing(got) == _without_timing(json.loads(out))  # search_time_s is a stopwatch reading
    assert [p["config"]["tp"] for p in got["plans"]] == [2, 2, 2]


def test_api_serve_is_serve_json_and_get_works(port):
    status, body = request(port, "GET", "/api/serve?" + "&".join(f"{k}={v}" for k, v in SERVE.items()) + "&tp=2")
    code, out, _ = cli(flags("serve", {**SERVE, "tp": "2"}))
    assert status == 200 and code == 0
    assert json.loads(body) == json.loads(out)


@pytest.mark.parametrize(("kind", "change", "field"), [
    ("train", {"chips": "abc"}, "chips"),
    ("train", {"chips": "0"}, "chips"),
    ("train", {"tp": "3"}, "tp"),
    ("train", {"model": "llama3-8bx"}, "model"),
    ("train", {"hardware": "h100"}, "hardware"),
    ("train", {"dtype": "fp4"}, "dtype"),
    ("train", {"framework": "paxml"}, "framework"),
    ("serve", {"quant": "int3"}, "quant"),
    ("serve", {"output_len": "-1"}, "output_len"),
])
def test_bad_input_gets_the_cli_message_and_its_field(port, kind, change, field):
    params = {**(TRAIN if kind == "train" else SERVE), **change}
    status, got = post(port, f"/api/{kind}", params)
    code, _, err = cli(flags(kind, params))
    assert code == 2 and err.startswith("error: ")
    assert status == 400
    assert got == {"error": err.removeprefix("error: ").rstrip("\n"), "field": field}


def test_uploaded_config_plans_like_the_preset_and_bad_config_errs_like_the_cli(port, tmp_path):
    from meshplan.specs.model import MODELS_DIR

    text = (MODELS_DIR / "llama3-8b.json").read_text()
    params = {k: v for k, v in TRAIN.items() if k != "model"}
    status, got = post(port, "/api/train", {**params, "model_json": text, "model_name": "mine.json"})
    _, preset = post(port, "/api/train", TRAIN)
    assert status == 200
    assert [p["config"] for p in got["plans"]] == [p["config"] for p in preset["plans"]]
    assert [p["mfu"] for p in got["plans"]] == [p["mfu"] for p in preset["plans"]]
    bad = tmp_path / "broken.json"
    bad.write_text('{"hidden_size": 4096,')
    status, got = post(port, "/api/train", {**params, "model_json": f" {bad.read_text()}\n", "model_name": "broken.json"})
    code, _, err = cli(flags("train", {**params, "model": str(bad)}))
    assert code == 2 and status == 400
    # the CLI names the file by its path; the page by the uploaded file's name
    assert got["error"] == err.removeprefix("error: ").rstrip("\n").replace(str(bad), "broken.json")
    assert got["field"] == "model"


@pytest.mark.parametrize("path", [
    "/../../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd", "/assets/../../../etc/passwd", "//etc/passwd",
    "/api/../../pyproject.toml", "/index.html/../../../etc/passwd", "/..%2f..%2fetc%2fpasswd", "/%00",
    "/web/assets/app.js", "/meshplan/web/page.py", "/" + "a" * 4000, "/api/train/../../../../etc/passwd",
])
def test_nothing_outside_the_page_is_served(port, path):
    status, body = request(port, "GET", path)
    assert status == 404, (path, status)
    assert b"root:" not in body and b"import" not in body
    assert json.loads(body)["error"].startswith("no such page")


def test_page_and_presets(port):
    status, body = request(port, "GET", "/")
    assert status == 200 and b"<svg" not in body[:100] and b'id="plans"' in body
    assert not _addresses(body.decode())  # nothing outside the page is referenced
    status, body = request(port, "GET", "/api/presets")
    assert status == 200 and "llama3-8b" in json.loads(body)["models"]


@pytest.mark.parametrize(("method", "path", "body", "headers", "expect"), [
    ("POST", "/api/train", b"{not json", {}, 400),
    ("POST", "/api/train", b"[1, 2]", {}, 400),
    ("POST", "/api/train", b'{"chips": [16]}', {}, 400),
    ("POST", "/api/train", b"\xff\xfe", {}, 400),
    ("POST", "/api/train", b"{}", {"Content-Length": str(1 << 30)}, 413),
    ("POST", "/api/train", b"{}", {}, 400),  # the CLI's missing-option error
    ("PUT", "/api/train", b"{}", {}, 405),
    ("DELETE", "/", None, {}, 405),
    ("GET", "/api/train?chips=1&chips=2", None, {}, 400),
    ("GET", "/api/train?bogus=1", None, {}, 400),
    ("GET", "/api/train?model=/etc/passwd", None, {}, 400),
    ("GET", "/api/train?model=pyproject.toml&hardware=README.md", None, {}, 400),
    ("GET", "/api/schedule?pp=0&vpp=1&micro_batches=4&compute_s=1", None, {}, 400),
    ("GET", "/api/schedule?pp=4&vpp=1&micro_batches=4&compute_s=nan", None, {}, 400),
])
def test_malformed_requests_are_4xx(port, method, path, body, headers, expect):
    if "Content-Length" in headers:  # a lying length: the server must refuse it before reading
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.putrequest(method, path)
        conn.putheader("Content-Length", headers["Content-Length"])
        conn.endheaders()
        status = conn.getresponse().status
        conn.close()
    else:
        status, _ = request(port, method, path, body, headers)
    assert status == expect


def test_schedule_matches_the_plot_bars(port):
    # pp=2, 2 micro-batches, compute 6 s: a unit of 6/2/3 = 1 s; 1F1B slots (Narayanan et al. Fig. 4): stage 0
    # F0 at 0, stage 1 F0 at 1, stage 0 F1 at 1; 8 slots (2 stages x 2 micro-batches x F and B).
    status, got = post(port, "/api/schedule", {"pp": 2, "vpp": 1, "micro_batches": 2, "compute_s": 6.0})
    assert status == 200
    bars = {(b["stage"], b["kind"], b["micro_batch"]): (b["start_s"], b["duration_s"]) for b in got["bars"]}
    assert len(bars) == 8
    assert bars[(0, "F", 0)] == (0.0, 1.0) and bars[(1, "F", 0)] == (1.0, 1.0) and bars[(1, "B", 0)][1] == 2.0


_value = st.one_of(st.integers(-3, 300).map(str), st.sampled_from(["", "0", "1e3", "2.5", "abc", "-", "--json", "8"]),
                   st.text(max_size=6))
_train = st.fixed_dictionaries({k: st.one_of(st.just(v), _value) for k, v in TRAIN.items()},
                               optional={k: _value for k in ("tp", "pp", "dp", "cp", "microbatch", "zero", "dtype",
                                                             "recompute", "framework", "tokens", "offload")})
_serve = st.fixed_dictionaries({k: st.one_of(st.just(v), _value) for k, v in SERVE.items()},
                               optional={k: _value for k in ("tp", "pp", "ep", "batch", "quant", "kv_quant")})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind_params=st.one_of(st.tuples(st.just("train"), _train), st.tuples(st.just("serve"), _serve)))
def test_fuzzed_requests_are_answered_with_the_cli_message(port, kind_params):
    kind, params = kind_params
    status, got = post(port, f"/api/{kind}", params)
    assert status in (200, 400), got
    if status == 200:
        return
    assert got["error"] and "\n" not in got["error"]
    try:
        argv = api.argv_for(kind, params)
    except api.InputError as exc:  # refused by the web layer itself (a path for --model, say): its own message
        assert got["error"] == str(exc)
        return
    code, _, err = cli(argv)
    assert code == 2 and err == f"error: {got['error']}\n"


def test_server_still_answers_after_everything(port):
    assert request(port, "GET", "/api/presets")[0] == 200


def test_html_file_is_self_contained(tmp_path):
    out = tmp_path / "plan.html"
    code, _, err = cli(["train", *sum(([f"--{k.replace('_', '-')}", v] for k, v in TRAIN.items()), []), "--top", "2",
                        "--html", str(out)])
    assert code == 0, err
    text = out.read_text()
    assert not _addresses(text) and "<script src" not in text and "<link" not in text
    data = json.loads(text.split('<script id="meshplan-data" type="application/json">')[1].split("</script>")[0])
    assert data["mode"] == "static" and len(data["view"]["train"]["plans"]) == 2
    assert Path(out).stat().st_size < 400_000


def test_web_command_prints_its_address_and_stops_on_ctrl_c(port):
    import os
    import signal
    import subprocess
    import sys
    import urllib.request

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    # Ctrl-C as a terminal delivers it: the child raises KeyboardInterrupt on SIGINT even where this run inherited
    # SIGINT ignored (a test run started as a background job of a non-interactive shell ignores it, as does every
    # process it starts, and Python then installs no handler: session 14's local CI check). Set in the child's own
    # code, not by preexec_fn, which forks a process that has JAX's threads
    code = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from meshplan.cli import main; main()")
    proc = subprocess.Popen([sys.executable, "-c", code, "web", "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert url, line
        with urllib.request.urlopen(url.group(0) + "api/presets", timeout=30) as r:
            assert r.status == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    code, _, err = cli(["web", f"--port={port}"])  # the test server holds this port
    assert code == 2 and err.startswith(f"error: cannot listen on 127.0.0.1:{port}")


def test_scaling_endpoint_agrees_with_the_html_report(port, tmp_path):
    # Two routes to MFU vs chips: the server runs `train --json` per chip count, --html calls the planner in-process
    # (report.train_plots.mfu_scaling, as --plot does); both must give the same points.
    out = tmp_path / "t.html"
    argv = flags("train", TRAIN)[:-1] + [f"--html={out}"]
    assert cli(argv)[0] == 0
    view = json.loads(out.read_text().split('type="application/json">')[1].split("</script>")[0])["view"]
    status, got = post(port, "/api/scaling", TRAIN)
    assert status == 200 and len(got["points"]) > 1
    assert got["points"] == view["scaling"]
    assert {"chips": 16, "mfu": view["train"]["plans"][0]["mfu"]} in got["points"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=st.dictionaries(st.sampled_from(["pp", "vpp", "micro_batches", "compute_s", "x"]),
                              st.one_of(st.integers(-2, 5000), st.floats(allow_nan=True), st.text(max_size=5)),
                              max_size=5))
def test_fuzzed_schedule_requests_are_4xx_or_bars(port, params):
    status, got = post(port, "/api/schedule", params)
    assert status in (200, 400), got
    if status == 200:
        # every stage runs each shown micro-batch's forward and backward once, or once per model chunk where the
        # interleaved schedule is drawn chunk by chunk
        shown = got["shown_micro_batches"]
        assert shown == min(int(params["micro_batches"]), 16) or int(params["vpp"]) > 1
        from collections import Counter
        per = set(Counter((b["stage"], b["kind"], b["micro_batch"]) for b in got["bars"]).values())
        assert per in ({1}, {int(params["vpp"])})
        assert len(got["bars"]) == 2 * int(params["pp"]) * shown * per.pop()


def test_embedded_data_cannot_close_its_script_element():
    from meshplan.web.page import render, serve_view

    hostile = "</script><script>alert(1)</script><!--"
    text = render(serve_view({"model": hostile}, {"model": hostile}))
    blob = text.split('<script id="meshplan-data" type="application/json">')[1].split("</script>")[0]
    assert json.loads(blob)["view"]["inputs"]["model"] == hostile  # the whole object survives inside one element
    assert "<script>alert" not in text


def test_a_search_larger_than_the_request_bound_is_refused_with_its_size():
    # session 23, QA finding: one unbounded search (minutes, gigabytes) held every other request behind the lock.
    # The count the message names is the CLI's own `searched` before the offload variants (train --json evaluates
    # at least that many), so a bound one below it refuses and the CLI's count itself passes
    code, out, err = cli(flags("train", TRAIN) + ["--top", "1"])
    assert code == 0, err
    d = json.loads(out)
    n = d["evaluated"]
    with pytest.raises(api.InputError, match=r"layouts to search, more than the 10 one request may: pin some degrees"):
        api.run("train", TRAIN, max_layouts=10)
    assert api.run("train", TRAIN, max_layouts=n)["plans"][0]["step_time_s"] == d["plans"][0]["step_time_s"]
    # the bound is the request's own: the next request without one is not refused
    assert api.run("train", TRAIN)["plans"]


def test_a_stalled_connection_is_closed_after_the_timeout():
    # a body shorter than its Content-Length: the handler's read stalls; the server gives up after `timeout`
    import socket
    import time

    server = make_server(0, quiet=True, timeout=0.5)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with socket.create_connection(server.server_address, timeout=10) as s:
            s.sendall(b"POST /api/train HTTP/1.1\r\nHost: x\r\nContent-Length: 999999\r\n\r\nabc")
            t0 = time.monotonic()
            data = b""
            with contextlib.suppress(OSError):
                while chunk := s.recv(4096):
                    data += chunk
            assert time.monotonic() - t0 < 5  # closed by the server, not by this client's 10 s
    finally:
        server.shutdown()
        server.server_close()


def test_an_error_is_tied_to_a_field_the_user_filled_in():
    # 'no layout fits' names --recompute in its suggestions; the user left recompute empty, so the error belongs to the
    # form, not to that menu (session 23, QA finding). A field the user did fill in is still named.
    with pytest.raises(api.InputError) as exc:
        api.run("train", {"model": "llama3-405b", "hardware": "h100-sxm", "chips": "8", "seq_len": "8192",
                          "global_batch": "8"})
    assert "--recompute" in str(exc.value) and exc.value.field is None
    with pytest.raises(api.InputError) as exc:
        api.run("serve", {**SERVE, "ep": "2"})  # a dense model: the ep field, with a message that says why
    assert exc.value.field == "ep" and "dense" in str(exc.value)
    assert api.field_of("--tp must be positive, got 0", "train", {"tp"}) == "tp"
    assert api.field_of("missing option --seq-len", "train", set()) == "seq_len"


def test_interleaved_schedule_is_drawn_chunk_by_chunk(port):
    # pp=2, vpp=2, 2 micro-batches, compute 6 s: a micro-batch's forward unit on a stage is 6/2/3 = 1 s, each chunk's
    # forward 0.5 s and backward 1 s (Narayanan et al. 2021 §2.2). Megatron-LM's interleaved order: stage 0 warms up
    # with (pp - 1) x 2 + (vpp - 1) x pp = 4 forwards: F(chunk 0, mb 0) at 0, F(c0, mb 1) at 0.5; stage 1 runs F(c0,
    # mb 0) once stage 0's is done, at 0.5; stage 0's chunk 1 of mb 0 (virtual stage 2) waits for stage 1's, at 1.0.
    status, got = post(port, "/api/schedule", {"pp": 2, "vpp": 2, "micro_batches": 2, "compute_s": 6.0})
    assert status == 200 and got["shown_micro_batches"] == 2
    bars = {(b["stage"], b["kind"], b["micro_batch"], b["chunk"]): (b["start_s"], b["duration_s"]) for b in got["bars"]}
    assert len(bars) == 2 * 2 * 2 * 2  # stages x micro-batches x chunks x (F, B)
    assert bars[(0, "F", 0, 0)] == (0.0, 0.5) and bars[(0, "F", 1, 0)] == (0.5, 0.5)
    assert bars[(1, "F", 0, 0)] == (0.5, 0.5) and bars[(0, "F", 0, 1)] == (1.0, 0.5)
    assert bars[(1, "B", 0, 1)][1] == 1.0
    # each stage is busy for the whole compute time: 2 micro-batches x (1 + 2) units of 1 s = 6 s
    for st_ in (0, 1):
        assert sum(d for (s_, *_), (_, d) in bars.items() if s_ == st_) == pytest.approx(6.0)
    # no stage runs two slots at once
    for st_ in (0, 1):
        spans = sorted(v for k, v in bars.items() if k[0] == st_)
        assert all(a[0] + a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:], strict=False))


def test_a_deep_interleaved_pipeline_is_drawn_the_plain_way_quickly(port):
    # 3,015 stages x 229 chunks x 3,015 micro-batches (a hypothesis example that hung the server): past the chunk-level
    # drawing's size bound the timeline shows at most 16 micro-batches, one slot each, as before session 23
    status, got = post(port, "/api/schedule", {"pp": 3015, "vpp": 229, "micro_batches": 3015, "compute_s": 0})
    assert status == 200 and got["shown_micro_batches"] == 16
    assert len(got["bars"]) == 2 * 3015 * 16
