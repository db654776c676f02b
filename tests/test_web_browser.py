"""End to end in a real headless browser: Debian's Chromium driven by Playwright (never a downloaded browser).

Skips where Playwright or Chromium is missing; `.ci/run` installs both. MESHPLAN_SCREENSHOTS=DIR also saves the
README's screenshots (training and serving) into DIR.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import threading
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = next((p for p in (os.environ.get("MESHPLAN_CHROMIUM"), shutil.which("chromium"), "/usr/bin/chromium",
                             shutil.which("chromium-browser")) if p and Path(p).is_file()), None)
if CHROMIUM is None:
    pytest.skip("no Chromium installed (Debian: apt-get install chromium)", allow_module_level=True)
# No sandbox as root; no background networking, component updates or sync: the closed network refuses them.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

from meshplan.infer.config import ServeConfig, engine_grouped_kernel  # noqa: E402
from meshplan.specs.hardware import load_chip  # noqa: E402
from meshplan.specs.model import MODELS_DIR  # noqa: E402
from meshplan.web import api  # noqa: E402
from meshplan.web.server import make_server  # noqa: E402

TRAIN = {"model": "llama3-8b", "hardware": "h100-sxm", "chips": "16", "seq_len": "4096", "global_batch": "64"}
SERVE = {"model": "llama3-8b", "hardware": "h100-sxm", "chips": "8", "input_len": "1000", "output_len": "200"}
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def base_url():
    server = make_server(0, quiet=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.fixture()
def page(browser):
    # bypass_csp: Playwright's wait_for_function evaluates strings, which the page's own policy forbids
    ctx = browser.new_context(viewport={"width": 1300, "height": 1000}, bypass_csp=True)
    pg = ctx.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    ctx.close()
    assert not errors, errors


def ms(text: str) -> float:
    """'7.4 ms' / '1.2 s' / '850.0 µs' -> milliseconds."""
    v, unit = re.fullmatch(r"([\d.]+) (µs|ms|s)", text.strip()).groups()
    return float(v) * {"µs": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def cli_error(argv: list[str]) -> str:
    from meshplan.cli.app import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        main(argv)
    return err.getvalue().strip()


def test_form_plans_tabs_pins_and_errors(page, base_url, tmp_path):
    page.goto(base_url)
    page.select_option("#f-model", "llama3-8b")
    page.select_option("#f-hardware", "h100-sxm")
    for k in ("chips", "seq_len", "global_batch"):
        page.fill(f"#f-{k}", TRAIN[k])
    page.click("#plan-btn")
    page.wait_for_function("document.querySelector('#train-title').textContent.startsWith('llama3-8b on 16')")
    want = api.run("train", TRAIN)  # the planner in-process, not through the page
    rows = page.locator("#plans tbody tr")
    assert rows.count() == len(want["plans"]) == 5
    assert rows.nth(0).locator("td").nth(3).inner_text() == f"{100 * want['plans'][0]['mfu']:.1f}%"
    assert "chips=16" in page.url and "model=llama3-8b" in page.url
    assert page.locator("#chart-memory svg rect[data-label]").count() == 5  # params grads optimizer activations other
    page.wait_for_function("document.querySelectorAll('#chart-mfu svg circle').length > 0")
    assert page.locator("#chart-timeline rect.slot").count() > 0
    rows.nth(1).click()
    assert "plan #2" in page.locator("#bottleneck").inner_text()

    config = {k: v for k, v in json.loads((MODELS_DIR / "llama3-8b.json").read_text()).items() if k[0] != "_"}
    upload = tmp_path / "my-8b.json"
    upload.write_text(json.dumps(config))
    page.set_input_files("#f-upload", str(upload))  # an uploaded HF config.json: the same model, another name
    page.wait_for_function("document.querySelector('#train-title').textContent.startsWith('my-8b on 16')")
    assert rows.nth(0).locator("td").nth(3).inner_text() == f"{100 * want['plans'][0]['mfu']:.1f}%"
    assert "model_json=" in page.url
    page.select_option("#f-model", "llama3-8b")

    page.click("#tab-serve")
    for k in ("input_len", "output_len"):
        page.fill(f"#f-s_{k}", SERVE[k])
    page.fill("#f-chips", SERVE["chips"])
    page.click("#plan-btn")
    page.wait_for_function("document.querySelector('#serve-title').textContent.startsWith('llama3-8b on 8')")
    searched = api.run("serve", SERVE)
    pinned = api.run("serve", {**SERVE, "tp": "8"})
    assert pinned["tpot_s"] != searched["tpot_s"]  # the pin must change the answer, or this test proves nothing
    tpot = page.locator("#card-tpot .v")
    assert ms(tpot.inner_text()) == pytest.approx(searched["tpot_s"] * 1e3, rel=0.01)
    before = tpot.inner_text()
    page.fill("#f-s_tp", "8")  # no button: the page replans on input
    page.wait_for_function(f"document.querySelector('#card-tpot .v').textContent !== {json.dumps(before)}")
    assert ms(tpot.inner_text()) == pytest.approx(pinned["tpot_s"] * 1e3, rel=0.01)
    assert "tp=8" in page.locator("#serve-title").inner_text()
    assert page.locator("#chart-frontier svg circle").count() == len(pinned["frontier"])
    assert "s_tp=8" in page.url and "tab=serve" in page.url

    link = page.url  # the link reproduces the plan
    page.goto("about:blank")
    page.goto(link)
    page.wait_for_function("document.querySelector('#card-tpot .v') !== null")
    assert ms(page.locator("#card-tpot .v").inner_text()) == pytest.approx(pinned["tpot_s"] * 1e3, rel=0.01)

    page.fill("#f-chips", "abc")
    spot = page.locator('.err[data-for="chips"]')
    spot.wait_for(state="visible")
    argv = ["serve", "--model=llama3-8b", "--hardware=h100-sxm", "--chips=abc", "--input-len=1000",
            "--output-len=200", "--quant=bf16", "--kv-quant=bf16", "--tp=8", "--json"]
    assert spot.inner_text() == cli_error(argv)
    # the cards still on screen are the last plan's: dimmed and labelled as such (session 23, QA finding)
    assert "stale" in page.locator("#serve-out").get_attribute("class")
    page.fill("#f-chips", "8")
    page.wait_for_function("!document.querySelector('#serve-out').classList.contains('stale')")


def test_interleaved_timeline_caption_and_chunks(page, base_url):
    # a pinned interleaved plan: the timeline draws every model chunk and says how many micro-batches it shows
    page.goto(base_url + "/?model=llama3-70b&hardware=h100-sxm&chips=64&seq_len=8192&global_batch=256&pp=4&vpp=2&tp=8")
    page.wait_for_function("document.querySelector('#timeline-shown') && "
                           "document.querySelector('#timeline-shown').textContent.length > 0", timeout=60_000)
    caption = page.locator("#timeline-shown").inner_text()
    assert "of 64 micro-batches shown" in caption and "2 model chunks each" in caption, caption
    shown = int(caption.split(" of ")[0])
    assert page.locator("#chart-timeline rect.slot").count() == 2 * 4 * shown * 2  # F and B, stages, chunks


def _open_offline(browser, path: Path):
    """A page on the file with every network request refused and recorded."""
    ctx = browser.new_context(offline=True, viewport={"width": 1300, "height": 1000}, bypass_csp=True)
    requested: list[str] = []

    def refuse(route):
        requested.append(route.request.url)
        route.abort() if not route.request.url.startswith("file://") else route.continue_()

    ctx.route("**/*", refuse)
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(path.as_uri())
    return ctx, pg, requested, errors


@contextlib.contextmanager
def _serve_report(browser, path: Path, args: list[str]):
    """The page of `meshplan serve ARGS --html PATH`, opened offline; after the block, no page error was raised."""
    _cli(["serve", *args, f"--html={path}"])
    ctx, pg, _, errors = _open_offline(browser, path)
    try:
        yield pg
    finally:
        ctx.close()
    assert not errors


def _cli(argv: list[str]) -> None:
    from meshplan.cli.app import main

    with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0


def test_html_report_renders_offline(browser, tmp_path):
    out = tmp_path / "train.html"
    _cli(["train", *[f"--{k.replace('_', '-')}={v}" for k, v in TRAIN.items()], "--top=3", f"--html={out}"])
    view = json.loads(out.read_text().split('type="application/json">')[1].split("</script>")[0])["view"]
    ctx, pg, requested, errors = _open_offline(browser, out)
    try:
        assert pg.locator("#plans tbody tr").count() == 3
        assert pg.locator("#chart-mfu svg circle").count() == len(view["scaling"]) > 1
        assert pg.locator("#chart-timeline rect.slot").count() == len(view["schedules"][0]["bars"]) > 0
        assert pg.locator("#chart-memory svg rect[data-label]").count() == 5
        assert pg.locator("#chart-time svg rect[data-label]").count() >= 2  # compute and at least one more part
        assert pg.locator("#f-chips").is_disabled()
    finally:
        ctx.close()
    assert [u for u in requested if not u.startswith("file://")] == [] and not errors

    out = tmp_path / "serve.html"
    _cli(["serve", *[f"--{k.replace('_', '-')}={v}" for k, v in SERVE.items()], f"--html={out}"])
    view = json.loads(out.read_text().split('type="application/json">')[1].split("</script>")[0])["view"]
    ctx, pg, requested, errors = _open_offline(browser, out)
    try:
        assert pg.locator("#chart-frontier svg circle").count() == len(view["serve"]["frontier"]) > 1
        assert ms(pg.locator("#card-tpot .v").inner_text()) == pytest.approx(view["serve"]["tpot_s"] * 1e3, rel=0.01)
        assert pg.locator("#card-cost-output .v").inner_text() == f"${view['serve']['cost_per_million_tokens']['output']:.3f}"
    finally:
        ctx.close()
    assert [u for u in requested if not u.startswith("file://")] == [] and not errors


def test_serve_report_names_the_sequences_the_budget_lets_decode(browser, tmp_path):
    # a batch past the step token budget's limit: 200 in flight, 81 decode at once (metrics.budget_batch_limit)
    with _serve_report(browser, tmp_path / "budget.html", [
            "--model=llama3.1-8b", "--hardware=h100-sxm", "--chips=1", "--tp=1", "--input-len=1000",
            "--output-len=10", "--batch=200"]) as pg:
        assert pg.locator("#card-batch .v").inner_text().endswith("81 decode at once (step budget)")


def test_serve_report_names_a_moes_expert_format(browser, tmp_path):
    # session 30: a MoE's card names the format the engine's MoE kernel runs the experts in and its measured rate
    with _serve_report(browser, tmp_path / "moe.html", [
            "--model=qwen3-235b-a22b-fp8", "--hardware=h200", "--chips=8", "--tp=8", "--engine=vllm",
            "--input-len=1000", "--output-len=200"]) as pg:
        assert pg.locator("#card-experts .v").inner_text() == "fp8_block"
        # the curve's fraction as serving.yaml states it for vLLM's block-FP8 experts on H200 (two decimals)
        fraction = engine_grouped_kernel(ServeConfig(engine="vllm"), load_chip("h200"), "fp8_block")[0]
        assert f"{fraction:.2f} of peak" in pg.locator("#card-experts .k").inner_text()
    with _serve_report(browser, tmp_path / "dense.html", [
            "--model=llama3.1-8b", "--hardware=h100-sxm", "--chips=1", "--tp=1", "--input-len=1000",
            "--output-len=10"]) as pg:
        assert pg.locator("#card-tpot .v").count() == 1 and pg.locator("#card-experts").count() == 0


@pytest.mark.skipif(not os.environ.get("MESHPLAN_SCREENSHOTS"), reason="set MESHPLAN_SCREENSHOTS=docs to save them")
def test_screenshots(page, base_url):
    d = Path(os.environ["MESHPLAN_SCREENSHOTS"])
    q = "model=llama3-70b&hardware=h100-sxm&chips=64"
    page.goto(f"{base_url}?tab=train&{q}&seq_len=8192&global_batch=256")
    page.wait_for_function("document.querySelectorAll('#chart-mfu svg circle').length > 0")
    page.screenshot(path=str(d / "web-train.png"), full_page=True)
    page.goto(f"{base_url}?tab=serve&model=llama3-70b&hardware=h100-sxm&chips=8&s_input_len=2048&s_output_len=512")
    page.wait_for_function("document.querySelectorAll('#chart-frontier svg circle').length > 0")
    page.screenshot(path=str(d / "web-serve.png"), full_page=True)
