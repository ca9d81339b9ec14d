"""`minivllm serve --enable-dashboard`: the live trace page follows the engine while the official
`openai` client is served, behind the API key, with a bounded window of steps.

One server (a tiny random Llama, a 32-block pool, a window of 12 steps) and one Chromium tab
(Playwright, Debian's Chromium) for the whole file; both are closed whatever happens.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from minivllm.trace.screenshot import launch_browser
from tests.utils.engine_utils import save_tiny_llama
from tests.utils.server_utils import RemoteServer, run_server

API_KEY = "sk-dashboard-test"
WINDOW = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    model = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    args = [str(model), "--block-size", "4", "--num-gpu-blocks-override", "32",
            "--max-model-len", "128", "--attention-backend", "reference",
            "--enable-dashboard", "--dashboard-max-steps", str(WINDOW)]  # fmt: skip
    with run_server(args, api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tab(server: RemoteServer) -> Iterator[Any]:
    with launch_browser() as browser:
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.problems = []
        page.on(
            "console",
            lambda m: m.type == "error" and "401" not in m.text and page.problems.append(m.text),
        )
        page.on("pageerror", lambda e: page.problems.append(str(e)))
        yield page


def steps(server: RemoteServer, after: int = 0) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.get(f"{server.url}/dashboard/api/steps?after={after}", headers=headers, timeout=10)
    r.raise_for_status()
    return r.json()


def shown_step(tab: Any) -> int:
    return int(tab.locator("#step-label").inner_text().split()[1])


def wait_for_step(tab: Any, step: int) -> None:
    tab.wait_for_function(
        "k => Number((document.getElementById('step-label').textContent.match(/^step (\\d+)/)"
        " || [0, 0])[1]) >= k",
        arg=step,
        timeout=30_000,
    )


def test_the_steps_route_wants_the_api_key(server: RemoteServer) -> None:
    url = f"{server.url}/dashboard/api/steps"
    assert httpx.get(url, timeout=10).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.get(url, headers=wrong, timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/dashboard", timeout=10).status_code == 200  # holds no data


def test_the_dashboard_follows_the_engine_while_the_openai_client_is_served(
    server: RemoteServer, client: openai.OpenAI, tab: Any, tmp_path: Path
) -> None:
    tab.goto(f"{server.url}/dashboard")
    tab.wait_for_selector("#key-form:not([hidden])")  # asked for the key: no data without it
    tab.fill("#key", API_KEY)
    tab.press("#key", "Enter")
    tab.wait_for_selector("#key-form", state="hidden")

    model = client.models.list().data[0].id
    client.completions.create(model=model, prompt="The sky is", max_tokens=6, temperature=0)
    first = steps(server)["num_recorded"]
    assert first >= 6  # a prefill and five decodes, at least
    wait_for_step(tab, first)

    # n = 2 shares the prompt's blocks; the page follows the new steps without a reload.
    client.completions.create(
        model=model, prompt="A cat and a map", n=2, max_tokens=8, temperature=0.9, seed=1
    )
    window = steps(server)
    last = window["num_recorded"]
    assert last > first
    wait_for_step(tab, last)
    assert shown_step(tab) == last

    # The window is bounded on both sides: the server keeps WINDOW steps, so does the page.
    assert len(window["steps"]) == WINDOW
    assert [s["step"] for s in window["steps"]] == list(range(last - WINDOW + 1, last + 1))
    assert tab.locator("#slider").get_attribute("max") == str(WINDOW - 1)

    # What the page shows is the server's newest step.
    newest = window["steps"][-1]
    cells = tab.eval_on_selector_all(
        "#grid [data-block]", "nodes => nodes.map(n => [n.dataset.block, n.dataset.refcount])"
    )
    assert len(cells) == window["num_blocks"] == 32
    assert {int(b): int(rc) for b, rc in cells} == {
        b: newest["ref_counts"].get(str(b), 0) for b in range(32)
    }
    assert any(s["forked"] for s in window["steps"])  # the n = 2 fork is in the window
    assert window["sequences"]  # with the text of the tokens in each block
    tab.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    assert tab.problems == []
