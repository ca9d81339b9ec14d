"""The trace page: one self-contained HTML file that draws a step trace, offline or live.

A learner opens it from the file system, with no network and no build step, so everything is
inline: the style (static/trace.css), the script (static/trace.js, plain JavaScript, no library)
and the trace itself, as a JSON script element. The live dashboard
(minivllm/entrypoints/dashboard.py) serves the same page with no trace in it and a `live` config
that tells the script where to poll for recent steps.

What the page shows at step K is described on the docs' Trace page (docs/trace.md); its elements
carry `data-block`, `data-refcount` and `data-seq` attributes so that the browser tests can hold
it equal to the trace (tests/trace/test_trace_page.py). See the docs' architecture page
(docs/architecture.md) for where the trace comes from.
"""

from __future__ import annotations

import html
import json
from importlib import resources
from pathlib import Path
from typing import Any

TEMPLATE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<link rel="icon" href="data:,">
<style>
{css}
</style>
</head>
<body>
<header>
  <h1>{title}</h1>
  <p id="meta"></p>
</header>
<nav id="controls" aria-label="steps">
  <button id="first" title="first step (Home)">&laquo;</button>
  <button id="prev" title="previous step (&#x2190;)">&#x25C0;</button>
  <button id="play" title="play / pause (space)">play</button>
  <button id="next" title="next step (&#x2192;)">&#x25B6;</button>
  <button id="last" title="last step (End)">&raquo;</button>
  <input id="slider" type="range" min="0" max="0" value="0" aria-label="step">
  <span id="step-label"></span>
  <label id="follow-label" hidden><input id="follow" type="checkbox" checked> follow</label>
  <span id="status"></span>
</nav>
<form id="key-form" hidden>
  <label>API key <input id="key" type="password" autocomplete="off"></label>
  <button type="submit">connect</button>
</form>
<section id="usage-section">
  <h2>KV cache usage over the run</h2>
  <div id="usage-frame">
    <span class="ylabel">blocks held</span>
    <span id="usage-ymax" class="ytick"></span><span class="ytick y0">0</span>
    <svg id="usage" viewBox="0 0 1000 120" preserveAspectRatio="none" role="img"></svg>
    <span id="usage-xmin" class="xtick"></span><span class="xlabel">engine step</span>
    <span id="usage-xmax" class="xtick xmax"></span>
  </div>
  <p class="legend">
    <span class="mark preempt"></span> preemption
    <span class="mark copy"></span> copy-on-write
    <span class="mark cursor"></span> the step on screen (click the chart to move it)
  </p>
</section>
<main>
  <section id="pool-section">
    <h2>Physical blocks <small id="pool-summary"></small></h2>
    <div id="grid"></div>
    <p class="legend">
      <span class="block swatch owned"></span> held (colour: request)
      <span class="block swatch shared"></span> shared (reference count &gt; 1)
      <span class="block swatch cached"></span> cached, free (a prefix-cache hit waiting)
      <span class="block swatch"></span> free
    </p>
    <p class="legend">
      <span class="block swatch copied"></span> copy-on-write destination
      <span class="block swatch hit"></span> prefix-cache hit taken
      <span class="block swatch evicted"></span> cache name evicted
      <span class="block swatch freed"></span> freed (a preemption, or out of a sliding window)
    </p>
  </section>
  <section id="batch-section">
    <h2>This step's batch <small id="batch-summary"></small></h2>
    <table id="batch"><thead><tr><th>seq</th><th>request</th><th>computed before</th>
      <th>new tokens</th><th>kind</th><th id="lora-head" hidden>adapter (slot)</th></tr></thead>
      <tbody></tbody></table>
    <p id="pipeline" hidden></p>
    <p id="lora-slots" hidden></p>
    <p id="waiting"></p>
    <h2>Events</h2>
    <ul id="events"></ul>
  </section>
  <section id="tables-section">
    <h2>Block tables <small>logical block &#x2192; physical block: the tokens it holds</small></h2>
    <div id="tables"></div>
  </section>
</main>
<script type="application/json" id="trace-data">{data}</script>
<script type="application/json" id="page-config">{config}</script>
<script>
{js}
</script>
</body>
</html>
"""


def _static(name: str) -> str:
    return resources.files("minivllm.trace").joinpath("static", name).read_text(encoding="utf-8")


def _inline_json(value: Any) -> str:
    """JSON that is safe inside a <script> element: `</` cannot close it early."""
    return json.dumps(value, separators=(",", ":")).replace("</", "<\\/")


def render_page(
    trace: dict[str, Any] | None = None,
    live: dict[str, Any] | None = None,
    title: str = "minivllm trace",
) -> str:
    """The page's HTML: a recorded `trace` (StepRecorder.to_dict()), or `live` =
    {"endpoint": URL, "poll_ms": N} for a page that polls a server for its recent steps."""
    if (trace is None) == (live is None):
        raise ValueError("give exactly one of trace and live")
    return TEMPLATE.format(
        title=html.escape(title),
        css=_static("trace.css"),
        js=_static("trace.js"),
        data=_inline_json(trace),
        config=_inline_json({"live": live}),
    )


def write_page(trace: dict[str, Any], path: str | Path, title: str = "minivllm trace") -> Path:
    path = Path(path)
    path.write_text(render_page(trace, title=title), encoding="utf-8")
    return path
