"""The docs' screenshots of the trace page, taken at the steps where tutorial 09's events happen.

tests/test_tutorials.py takes them from its own run of tutorial 09 (into a temporary folder); the
committed copies in docs/img/trace/ are written the same way:

    python tutorials/09_watch_the_scheduler.py /tmp/t09
    python tests/utils/trace_screenshots.py /tmp/t09/09_trace docs/img/trace
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout: import this tree's minivllm

from minivllm.trace.screenshot import UNSTICK, launch_browser  # noqa: E402

# file name -> (the event whose first step is shown, the element to shoot; None: the top of the page)
SHOTS: dict[str, tuple[str, str | None]] = {
    "09_shared_prefix.png": ("cache_hits", "main"),
    "09_copy_on_write.png": ("copies", "main"),
    "09_preemption.png": ("preempted", None),
}
WIDTH, HEIGHT = 1100, 640


def take_screenshots(trace_dir: Path, out_dir: Path, browser: Any = None) -> dict[str, Path]:
    """One PNG per entry of SHOTS; returns {file name: path}."""
    if browser is None:
        with launch_browser() as own:
            return take_screenshots(trace_dir, out_dir, own)
    trace = json.loads((trace_dir / "trace.json").read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
    try:
        for name, (event, selector) in SHOTS.items():
            step = next(s["step"] for s in trace["steps"] if s[event])
            page.goto(f"{(trace_dir / 'index.html').resolve().as_uri()}#step={step}")
            page.wait_for_selector("#grid .block")
            page.add_style_tag(content=UNSTICK)
            path = out_dir / name
            if selector is None:
                page.evaluate("window.scrollTo(0, 0)")
                page.screenshot(path=str(path))
            else:
                page.locator(selector).screenshot(path=str(path))
            written[name] = path
    finally:
        page.close()
    return written


if __name__ == "__main__":
    for path in take_screenshots(Path(sys.argv[1]), Path(sys.argv[2])).values():
        print(path, path.stat().st_size, "bytes")
