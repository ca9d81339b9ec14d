"""The trace page, in a real browser (Playwright driving Debian's Chromium), equals its trace.

The page is written for the run of tests/utils/trace_scenario.py (a prefix-cache hit, a preemption, an
`n = 2` fork and its copy-on-write). At the steps where those happen the page's block grid
(`data-block`, `data-refcount`, `data-owners`) and its block tables must equal the trace; the
slider, the arrow keys and `#step=K` must move between steps; the page must log no console error
and ask the network for nothing (it opens from file://). Screenshots are taken on the way, as the
docs' are (minivllm/trace/screenshot.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from minivllm.trace.page import write_page
from minivllm.trace.screenshot import launch_browser, screenshot
from tests.utils.engine_utils import save_tiny_llama
from tests.utils.trace_scenario import make_llm, run_traced

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    out = tmp_path_factory.mktemp("trace")
    trace = run_traced(make_llm(model), out)
    return {"trace": trace, "page": out / "index.html"}


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with launch_browser() as b:
        yield b


@pytest.fixture
def page(browser: Any, traced: dict[str, Any]) -> Iterator[Any]:
    """A fresh tab that records console errors and every request that is not a local file."""
    tab = browser.new_page(viewport={"width": 1200, "height": 900})
    tab.problems = []
    tab.on("console", lambda m: m.type == "error" and tab.problems.append(m.text))
    tab.on("pageerror", lambda e: tab.problems.append(str(e)))
    tab.on(
        "request",
        lambda r: r.url.startswith(("file:", "data:")) or tab.problems.append(f"fetch {r.url}"),
    )
    try:
        yield tab
        assert tab.problems == []
    finally:
        tab.close()


def open_step(page: Any, traced: dict[str, Any], step: int) -> None:
    page.goto(f"{traced['page'].as_uri()}#step={step}")
    page.wait_for_selector("#grid .block")


def shown_step(page: Any) -> int:
    return int(page.locator("#step-label").inner_text().split()[1])


def grid(page: Any) -> dict[int, tuple[int, str, str]]:
    """block id -> (reference count, owners, cached) as the page shows them."""
    cells = page.eval_on_selector_all(
        "#grid [data-block]",
        "nodes => nodes.map(n => [n.dataset.block, n.dataset.refcount, n.dataset.owners,"
        " n.classList.contains('cached')])",
    )
    return {int(b): (int(rc), owners, cached) for b, rc, owners, cached in cells}


def tables(page: Any) -> dict[str, list[int]]:
    rows = page.eval_on_selector_all(
        "#tables .seqrow",
        "rows => rows.map(r => [r.dataset.seq,"
        " [...r.querySelectorAll('[data-logical]')].map(b => Number(b.dataset.block))])",
    )
    return dict(rows)


def assert_page_shows(page: Any, trace: dict[str, Any], step: dict[str, Any]) -> None:
    assert shown_step(page) == step["step"]
    shown = grid(page)
    assert len(shown) == trace["num_blocks"]
    cached = set(step["cached_blocks"])
    for b, (rc, owners, cached_free) in shown.items():
        expected_owners = sorted(int(s) for s, t in step["block_tables"].items() if b in t)
        assert rc == step["ref_counts"].get(str(b), 0), (step["step"], b)
        assert owners == " ".join(map(str, expected_owners)), (step["step"], b)
        assert cached_free == (rc == 0 and b in cached), (step["step"], b)
    assert tables(page) == step["block_tables"]
    batch = page.eval_on_selector_all("#batch tbody tr", "rows => rows.map(r => r.dataset.seq)")
    assert [int(s) for s in batch] == [i["seq_id"] for i in step["scheduled"]]


def event_steps(trace: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The first step of each kind of event."""
    firsts = {}
    for key in ("cache_hits", "preempted", "forked", "copies", "finished", "evicted"):
        firsts[key] = next(s for s in trace["steps"] if s[key])
    return firsts


def test_blocks_and_reference_counts_equal_the_trace_where_events_happen(
    page: Any, browser: Any, traced: dict[str, Any], tmp_path: Path
) -> None:
    trace = traced["trace"]
    for kind, step in event_steps(trace).items():
        open_step(page, traced, step["step"])
        assert_page_shows(page, trace, step)
        events = page.eval_on_selector_all("#events li", "items => items.map(i => i.dataset.kind)")
        label = {"cache_hits": "cache hit", "copies": "copy-on-write"}.get(kind, kind)
        assert label in events, (kind, events)
    shared = [b for b, (rc, _, _) in grid(page).items() if rc > 1]
    assert page.locator("#grid .shared").count() == len(shared)
    copy_step = event_steps(trace)["copies"]["step"]
    path = screenshot(traced["page"], tmp_path / "copy.png", copy_step, browser=browser)
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_slider_and_arrow_keys_move_between_steps(page: Any, traced: dict[str, Any]) -> None:
    trace = traced["trace"]
    steps = trace["steps"]
    open_step(page, traced, 5)
    page.keyboard.press("ArrowRight")
    assert shown_step(page) == 6 and page.evaluate("location.hash") == "#step=6"
    assert_page_shows(page, trace, steps[5])
    page.keyboard.press("ArrowLeft")
    page.keyboard.press("ArrowLeft")
    assert shown_step(page) == 4
    page.keyboard.press("End")
    assert_page_shows(page, trace, steps[-1])
    page.keyboard.press("Home")
    assert shown_step(page) == 1
    page.locator("#slider").fill("9")  # index 9: the tenth step
    assert_page_shows(page, trace, steps[9])
    page.locator("#slider").focus()  # a focused slider moves once per key press, not twice
    page.keyboard.press("ArrowRight")
    assert shown_step(page) == 11
    page.locator("#next").click()
    assert shown_step(page) == 12
    page.locator("#play").click()
    page.wait_for_function(
        "document.getElementById('step-label').textContent.startsWith('step 14 ')"
    )
    page.locator("#play").click()
    stopped = shown_step(page)
    page.wait_for_timeout(900)  # longer than one play tick: paused means it stays
    assert shown_step(page) == stopped


def test_step_in_the_address_opens_that_step_and_follows_hash_changes(
    page: Any, traced: dict[str, Any]
) -> None:
    trace = traced["trace"]
    preempted = event_steps(trace)["preempted"]
    open_step(page, traced, preempted["step"])
    assert_page_shows(page, trace, preempted)
    page.evaluate("location.hash = '#step=3'")
    page.wait_for_function(
        "document.getElementById('step-label').textContent.startsWith('step 3 ')"
    )
    assert_page_shows(page, trace, trace["steps"][2])
    page.goto(traced["page"].as_uri())  # no step named: the first
    assert shown_step(page) == 1


def test_the_block_table_shows_the_tokens_each_block_holds(
    page: Any, traced: dict[str, Any]
) -> None:
    trace = traced["trace"]
    step = event_steps(trace)["cache_hits"]
    open_step(page, traced, step["step"])
    bs = trace["block_size"]
    for seq, table in step["block_tables"].items():
        info = trace["sequences"][seq]
        computed = step["num_computed_tokens"][seq]
        for i in range(len(table)):
            cell = page.locator(f'#tables .seqrow[data-seq="{seq}"] [data-logical="{i}"] .tok')
            expected = info["tokens"][i * bs : min((i + 1) * bs, computed)]
            assert cell.all_text_contents() == expected


def test_a_preemption_shows_the_freed_blocks_the_queue_and_its_mark(
    page: Any, traced: dict[str, Any]
) -> None:
    """A preempted sequence does not just vanish: the blocks it freed are marked, the waiting queue
    is listed by name, the usage chart has a red tick at each preemption and an orange one at each
    copy, and the legend names every ring and mark the page draws."""
    trace = traced["trace"]
    steps = trace["steps"]
    k = next(i for i, s in enumerate(steps) if s["preempted"])
    step, before = steps[k], steps[k - 1]
    open_step(page, traced, step["step"])
    freed = {
        b
        for s in step["preempted"]
        for b in before["block_tables"][str(s)]
        if step["ref_counts"].get(str(b), 0) == 0
    }
    shown = page.eval_on_selector_all("#grid .freed", "ns => ns.map(n => Number(n.dataset.block))")
    assert set(shown) == freed and freed
    waiting = page.locator("#waiting").inner_text()
    for seq in step["waiting"]:
        assert f"seq {seq} (request " in waiting, waiting
    marks = page.evaluate(
        "({p: document.querySelectorAll('#usage .preempt').length,"
        " c: document.querySelectorAll('#usage .copy').length})"
    )
    assert marks["p"] == sum(1 for s in steps if s["preempted"])
    assert marks["c"] == sum(1 for s in steps if s["copies"])
    cursor = page.evaluate("getComputedStyle(document.querySelector('#usage-cursor')).stroke")
    assert cursor != "rgb(198, 40, 40)"  # red means a preemption, not the step on screen
    legend = " ".join(page.locator(".legend").all_inner_texts())
    for word in ("copy-on-write", "prefix-cache hit", "evicted", "preemption", "freed"):
        assert word in legend, word
    # A preempted sequence coming back is a "resume", never a "decode" or a "recompute".
    back = next(s for s in steps[k:] for h in s["cache_hits"] if h["seq_id"] in step["preempted"])
    open_step(page, traced, back["step"])
    kinds = page.eval_on_selector_all("#batch tbody tr", "rows => rows.map(r => r.innerText)")
    victim_rows = [r for r in kinds if r.split()[0] in {str(s) for s in step["preempted"]}]
    assert victim_rows and all("resume" in r for r in victim_rows), kinds


def test_with_pipeline_stages_a_line_names_the_batch_and_the_batches_in_flight(
    page: Any, traced: dict[str, Any], tmp_path: Path
) -> None:
    """The page draws what the trace says (tests/distributed/test_pipeline_parallel.py records a
    real two-stage run's); here the one-stage trace, relabelled as two stages' first commits."""
    open_step(page, traced, 1)
    assert page.locator("#pipeline").is_hidden()  # one stage: nothing to say
    trace = {**traced["trace"], "pipeline_parallel_size": 2}
    trace["steps"] = [{**trace["steps"][0], "in_flight": [2]}, *trace["steps"][1:]]
    staged = write_page(trace, tmp_path / "index.html")
    page.goto(f"{staged.as_uri()}#step=1")
    page.wait_for_selector("#grid .block")
    line = page.locator("#pipeline")
    assert (line.get_attribute("data-batch"), line.get_attribute("data-in-flight")) == ("1", "2")
    assert "in flight: batch 2" in line.inner_text()
