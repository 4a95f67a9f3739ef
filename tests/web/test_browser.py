"""The browser in a real headless Chromium (Debian's ``chromium`` driven by Playwright; no browser
is downloaded): thumbnails are real pixels, paging and search work, a sample page shows its
fields, the statistics page draws its plots, and HTML in the data never runs."""

from __future__ import annotations

import io
import os
import re
import shutil

import numpy as np
import pytest
from PIL import Image

from tarshards.web import serve

pytestmark = pytest.mark.timeout(180)

CHROMIUM = os.environ.get("TARSHARDS_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="the browser tests need playwright (pip install playwright)"
    )
    if not os.path.exists(CHROMIUM):
        pytest.skip(
            f"the browser tests need Chromium ({CHROMIUM} is missing: apt install chromium)"
        )
    with sync_api.sync_playwright() as p:
        try:
            b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        except Exception as exc:  # a Chromium that does not start here
            pytest.skip(f"Chromium does not start: {str(exc).splitlines()[0]}")
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def server(dataset):
    with serve(dataset[0], page_size=12) as srv:
        yield srv


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.errors = errors
    try:
        yield pg
    finally:
        context.close()


def _variance(png: bytes) -> float:
    return float(np.asarray(Image.open(io.BytesIO(png)).convert("L"), dtype=np.float64).var())


def test_grid_renders_real_thumbnails(page, server):
    page.goto(server.url)
    cells = page.locator("article.cell")
    assert cells.count() == 12
    thumbs = page.locator("img.thumb")
    assert thumbs.count() == 12
    page.wait_for_function(
        "() => [...document.querySelectorAll('img.thumb')].every(i => i.complete)"
    )
    widths = page.eval_on_selector_all("img.thumb", "els => els.map(e => e.naturalWidth)")
    assert all(w > 0 for w in widths), widths  # every thumbnail decoded by the browser
    for k in (0, 5, 11):
        shot = thumbs.nth(k).screenshot()
        assert _variance(shot) > 100, f"thumbnail {k} looks blank"
    # a blank area of the page (no thumbnail) has no such variance: the check can fail
    assert _variance(page.locator("header").screenshot()) < _variance(thumbs.nth(0).screenshot())
    # captions and JSON shown as text
    assert "caption of sample 1" in cells.nth(1).inner_text()
    assert '"i": 1' in cells.nth(1).inner_text()


def test_paging(page, server):
    page.goto(server.url)
    assert page.locator("article.cell").first.get_attribute("data-index") == "0"
    page.locator("nav.pager a.next").first.click()
    page.wait_for_url("**page=1**")
    assert page.locator("article.cell").first.get_attribute("data-index") == "12"
    page.locator("nav.pager a.last").first.click()
    page.wait_for_url("**page=9**")
    indices = page.eval_on_selector_all("article.cell", "els => els.map(e => e.dataset.index)")
    assert indices == [str(i) for i in range(108, 120)]
    # the page number form
    form = page.locator("form.goto-page").first
    form.locator("input[name=page]").fill("4")
    form.locator("button").click()
    page.wait_for_url("**page=4**")
    assert page.locator("article.cell").first.get_attribute("data-index") == "48"


def test_search_and_jump(page, server):
    page.goto(server.url)
    page.fill("header input[name=q]", "img011")
    page.click("header form.search button")
    page.wait_for_url("**/search?q=img011**")
    assert "10 samples with keys starting with" in page.locator("p.result").inner_text()
    indices = page.eval_on_selector_all("article.cell", "els => els.map(e => e.dataset.index)")
    assert indices == [str(i) for i in range(110, 120)]
    page.fill("header input[name=i]", "42")
    page.click("header form.jump button")
    page.wait_for_url("**/sample/42")
    assert page.locator("h1.sample-key").inner_text() == "img0042"


def test_sample_page_shows_every_field(page, server, dataset):
    made = dataset[2]
    page.goto(server.url + "sample/3")
    names = page.eval_on_selector_all("section.field h2", "els => els.map(e => e.textContent)")
    assert sorted(names) == sorted(k for k in made[3] if not k.startswith("__"))
    text = page.locator("main").inner_text()
    assert "caption of sample 3" in text and "train-0000.tar" in text
    assert f"{len(made[3]['bin']):,} bytes" in text
    checksums = page.eval_on_selector_all(
        "section.field tr",
        "rows => rows.filter(r => r.cells[0]?.textContent == 'checksum')"
        ".map(r => r.cells[1].textContent)",
    )
    assert len(checksums) == len(names) and all(
        re.fullmatch(r"\w+:[0-9a-f]{16}", c) for c in checksums
    )
    img = page.locator("img.full")
    page.wait_for_function("() => document.querySelector('img.full').complete")
    assert img.evaluate("e => e.naturalWidth") > 0 and _variance(img.screenshot()) > 100


def test_statistics_page_draws_its_plots(page, server):
    page.goto(server.url + "stats")
    plots = page.locator("svg.plot")
    assert plots.count() >= 6
    bars = page.eval_on_selector_all(
        "svg.plot rect.bar", "els => els.map(e => e.getBoundingClientRect().height)"
    )
    assert sum(1 for h in bars if h > 1) >= 10  # bars of real height, laid out by the browser
    assert page.locator("svg.plot circle.point").count() >= 6  # image sizes (12 distinct)
    titles = page.eval_on_selector_all("svg.plot > title", "els => els.map(e => e.textContent)")
    assert "samples per shard" in titles and "cls: classes" in titles
    assert _variance(plots.first.screenshot()) > 10  # drawn, not blank


def test_html_in_the_data_never_runs(page, server, evil):
    for url in ("sample/7", "?page=0&size=12", "search?q=evil"):
        page.goto(server.url + url)
        assert page.evaluate("() => window.__xss") is None, url
        assert page.locator("script").count() == 0
        assert page.locator("main img:not(.thumb):not(.full)").count() == 0  # no injected <img>
    page.goto(server.url + "sample/7")
    assert page.locator("h1.sample-key").inner_text() == evil[0]
    assert evil[1] in page.locator("main").inner_text()
    assert not page.errors


# ---- audio and video (a data set written with PyAV and soundfile) -----------------------------
@pytest.fixture(scope="module")
def media_server(media_dataset):
    with serve(media_dataset[0], page_size=6) as srv:
        yield srv


@pytest.fixture
def media_page(browser, media_server):
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    pg = context.new_page()
    blocked: list[str] = []  # Content-Security-Policy violations, as Chromium reports them
    pg.on(
        "console",
        lambda m: blocked.append(m.text) if "Content Security Policy" in m.text else None,
    )
    pg.blocked = blocked
    try:
        yield pg
    finally:
        context.close()


def test_media_grid_shows_posters_and_players(media_page, media_server):
    page = media_page
    page.goto(media_server.url)
    posters = page.locator("img.thumb.poster")
    assert posters.count() == 6
    page.wait_for_function(
        "() => [...document.querySelectorAll('img.poster')].every(i => i.complete)"
    )
    widths = page.eval_on_selector_all("img.poster", "els => els.map(e => e.naturalWidth)")
    assert widths[0] == 64 and widths[4] == 0, widths  # sample 4's mp4 is not a video
    shot = posters.nth(0).screenshot()
    assert _variance(shot) > 100, "the poster frame looks blank"
    assert _variance(page.locator("header").screenshot()) < _variance(shot)
    assert "0.80 s" in page.locator("article.cell").nth(0).inner_text()  # the duration
    assert page.locator("audio.player").count() == 12  # preload="none": loaded when played
    assert not page.blocked, page.blocked


def test_media_sample_page_players_load(media_page, media_server):
    page = media_page
    page.goto(media_server.url + "sample/1")
    audio = page.locator("audio.player")
    assert audio.count() == 2
    # Chromium loads each tone's header through the raw-field route (byte ranges)
    page.wait_for_function(
        "() => [...document.querySelectorAll('audio.player')].every(a => a.readyState >= 1)",
        timeout=10_000,
    )
    duration = audio.nth(1).evaluate("a => a.duration")  # the sample's second player: its wav
    assert duration == pytest.approx(0.5, abs=0.02)
    src = audio.nth(1).get_attribute("src")
    # the browser's own requests for it succeeded (its Resource Timing entries)
    statuses = page.evaluate(
        "src => performance.getEntriesByType('resource')"
        ".filter(e => new URL(e.name).pathname == src).map(e => e.responseStatus)",
        src,
    )
    assert statuses and all(s in (200, 206) for s in statuses), statuses
    # a range of it, as a player seeking asks (the page's CSP allows no fetch from scripts)
    r = page.request.get(media_server.url + src.lstrip("/"), headers={"Range": "bytes=0-3"})
    assert (r.status, r.headers["content-type"], r.body()) == (206, "audio/wav", b"RIFF")
    assert not page.blocked, page.blocked  # media-src 'self' lets the players load


def test_media_sample_page_poster_and_metadata_histograms(media_page, media_server):
    page = media_page
    page.goto(media_server.url + "sample/1")
    page.wait_for_function("() => document.querySelector('img.full.poster').complete")
    poster = page.locator("img.full.poster")
    assert poster.evaluate("e => e.naturalWidth") == 64 and _variance(poster.screenshot()) > 100
    assert page.locator("video.player").count() == 1 and page.locator("audio.player").count() == 2
    page.goto(media_server.url + "stats")
    titles = page.eval_on_selector_all("svg.plot > title", "els => els.map(e => e.textContent)")
    assert "metadata: mp4.duration" in titles and "metadata: wav.rate" in titles
    hist = page.locator("svg.plot", has=page.locator("title", has_text="metadata: mp4.duration"))
    heights = hist.first.locator("rect.bar").evaluate_all(
        "els => els.map(e => e.getBoundingClientRect().height)"
    )
    assert max(heights) > 50  # five samples of one duration: a tall bar, laid out
    assert not page.blocked, page.blocked
