"""The built docs work from file:// with the network off, in a real browser (Chromium).

mkdocs builds the site into a temporary folder (as `make docs` does into site/); Chromium opens
its pages as files while every request that is not a file is refused and recorded. The
architecture page's diagrams must render from the vendored mermaid (docs/javascripts/vendor/)
with no script error, links must point at .html files (no directory listings), and the search
must answer from the inlined index.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from minivllm.trace.screenshot import launch_browser

ROOT = Path(__file__).resolve().parent.parent
# The theme draws diagrams into closed shadow roots; opened here so the test can look inside.
OPEN_SHADOW_ROOTS = """
const attach = Element.prototype.attachShadow;
Element.prototype.attachShadow = function (init) { return attach.call(this, {...init, mode: "open"}); };
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture
def offline_page(site: Path) -> Iterator[Any]:
    """A tab in which only file:// requests succeed; the others are refused and listed."""
    with launch_browser() as browser:
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.add_init_script(OPEN_SHADOW_ROOTS)
        page.refused = []
        page.errors = []

        def route(r: Any) -> None:
            if r.request.url.startswith("file:"):
                r.continue_()
            else:
                page.refused.append(r.request.url)
                r.abort()

        page.route("**/*", route)
        page.on("pageerror", lambda e: page.errors.append(str(e)))
        yield page


def test_architecture_diagrams_render_from_the_vendored_library_offline(
    site: Path, offline_page: Any
) -> None:
    page = offline_page
    page.goto((site / "architecture.html").as_uri())
    page.wait_for_function(
        "document.querySelectorAll('div.mermaid').length === 5 && [...document.querySelectorAll("
        "'div.mermaid')].every(d => d.shadowRoot && d.shadowRoot.querySelector('svg g'))",
        timeout=30_000,
    )
    texts = page.evaluate(
        "[...document.querySelectorAll('div.mermaid')].map(d => d.shadowRoot.textContent)"
    )
    layers, listener, step, life, rooms = texts
    for layer in ("Engine", "Scheduler", "Executor", "Model runner", "Custom ops", "Platform"):
        assert layer in layers, layer
    assert "StepListener" in listener and "Trace recorder" in listener and "Stats" in listener
    assert "OutputProcessor" in step and "SchedulerOutput" in step
    assert "execute_model" in life
    for room in ("entrypoints/", "engine/", "worker/", "core/", "model/", "attention/abstract.py"):
        assert room in rooms, room
    # Readable at the page's normal size: the smallest rendered label is at least 11 px high
    # (a 688 px wide drawing of a wide diagram once put its text at ~5 px).
    smallest = page.evaluate(
        """[...document.querySelectorAll('div.mermaid')].map(d => Math.min(...[
            ...d.shadowRoot.querySelectorAll('text, foreignObject span, foreignObject p')]
            .filter(t => t.textContent.trim() && t.getClientRects().length === 1)
            .map(t => t.getBoundingClientRect().height)))"""
    )
    assert all(h >= 11 for h in smallest), smallest
    for height in page.evaluate(
        "[...document.querySelectorAll('div.mermaid')].map(d => d.getBoundingClientRect().height)"
    ):
        assert height > 60  # drawn, not an empty box
    assert page.errors == []  # a diagram that does not parse raises in the page
    assert page.refused == []  # nothing asked of a CDN


def test_pages_link_to_files_and_search_answers_offline(site: Path, offline_page: Any) -> None:
    page = offline_page
    page.goto((site / "index.html").as_uri())
    hrefs = page.eval_on_selector_all(".md-nav__link[href]", "links => links.map(a => a.href)")
    assert hrefs and all(h.split("#")[0].endswith(".html") for h in hrefs if h.startswith("file:"))
    page.fill("input.md-search__input", "block table")
    page.wait_for_function(
        "/^\\d+ matching/.test(document.querySelector('.md-search-result__meta').textContent)",
        timeout=30_000,
    )
    assert page.locator(".md-search-result__item").count() > 0
    assert page.errors == [] and page.refused == []


def test_text_diagrams_fit_a_laptop_screen(site: Path, offline_page: Any) -> None:
    """The Paging page's text diagram is shown whole on a 1280 px laptop screen, not clipped on the right."""
    page = offline_page
    page.set_viewport_size({"width": 1280, "height": 800})  # both sidebars: the narrowest column
    page.goto((site / "concepts" / "paging.html").as_uri())
    widths = page.evaluate(
        "[...document.querySelectorAll('pre > code')].map(c => [c.scrollWidth, c.clientWidth])"
    )
    assert widths
    for scroll, client in widths[:1]:  # the pool diagram is the page's first block
        assert scroll <= client, (scroll, client)
