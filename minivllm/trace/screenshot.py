"""Screenshots of the trace page in a real browser: for the docs, and for the browser tests.

Playwright (PyPI) drives the system's Chromium (Debian's `chromium` package; `make install`
installs it when missing): no browser is downloaded, so it works where only package registries
are reachable. Set `MINIVLLM_CHROMIUM` to use another Chromium binary.

    python -m minivllm.trace.screenshot DIR/index.html OUT.png --step 12 [--selector "#pool-section"]

The docs' screenshots (docs/img/trace/) are made this way from tutorial 09's run; see the docs'
Trace page (docs/trace.md) and the architecture page (docs/architecture.md) for the trace.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# No GPU, no sandbox (CI runs as root), and nothing that reaches for the network on its own.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]


# The step controls stick to the top of the window while scrolling; in a picture of one element
# they would cover its top.
UNSTICK = "#controls { position: static; }"


class BrowserNotFoundError(RuntimeError):
    """No Chromium, or no Playwright, to take the screenshot with."""


def find_chromium() -> str:
    path = os.environ.get("MINIVLLM_CHROMIUM") or shutil.which("chromium")
    if path is None:
        raise BrowserNotFoundError(
            "no Chromium found: `make install` installs Debian's chromium package (as root), or "
            "`apt-get install chromium`, or set MINIVLLM_CHROMIUM to a Chromium binary"
        )
    return path


@contextmanager
def launch_browser() -> Iterator[Any]:
    """A headless Chromium under Playwright, closed (with Playwright's driver) on exit."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        raise BrowserNotFoundError("playwright is not installed: pip install playwright") from exc
    executable = find_chromium()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def screenshot(
    page_path: str | Path,
    out: str | Path,
    step: int | None = None,
    selector: str | None = None,
    width: int = 1200,
    browser: Any = None,
) -> Path:
    """Save a PNG of the trace page at `step` (the step number, as in `#step=K`): the whole page,
    or only the element `selector` matches."""
    if browser is None:
        with launch_browser() as own:
            return screenshot(page_path, out, step, selector, width, own)
    url = Path(page_path).resolve().as_uri() + (f"#step={step}" if step is not None else "")
    page = browser.new_page(viewport={"width": width, "height": 800})
    try:
        page.goto(url)
        page.wait_for_selector("#grid .block")
        page.add_style_tag(content=UNSTICK)
        target = page.locator(selector) if selector else page
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        if selector:
            target.screenshot(path=str(out))
        else:
            page.screenshot(path=str(out), full_page=True)
        return out
    finally:
        page.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minivllm.trace.screenshot")
    parser.add_argument(
        "page", help="a trace page (index.html written by trace.save or minivllm trace)"
    )
    parser.add_argument("out", help="the PNG to write")
    parser.add_argument(
        "--step", type=int, default=None, help="the step to show (default: the first)"
    )
    parser.add_argument("--selector", default=None, help="only this element, e.g. '#pool-section'")
    parser.add_argument("--width", type=int, default=1200, help="viewport width in CSS pixels")
    args = parser.parse_args(argv)
    path = screenshot(args.page, args.out, args.step, args.selector, args.width)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
