"""The server with its engine in a process of its own (`minivllm/engine/`: `core.py`,
`client.py`): the same greedy answers as the in-thread engine, aborts that reach the core and
free its blocks, a dead core that fails every request with `EngineDeadError` (500, /health 503),
and no core that outlives its server, whether the server shuts down or is killed.

Every fixture kills what it started, pass or fail: the core of an in-process server through its
client, a `minivllm serve` subprocess and its children by pid.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.core_client import AsyncMPClient, EngineCoreClient
from minivllm.engine.llm_engine import LLMEngine
from minivllm.exceptions import EngineDeadError
from minivllm.sampling_params import SamplingParams
from tests.utils.engine_utils import save_tiny_llama
from tests.utils.server_utils import (
    InProcessServer,
    is_gone,
    run_server,
    serve_in_process,
    wait_gone,
)

PROMPTS = ["The capital of France is", "Once upon a time", "Hello, my name is"]
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
LONG = 900  # tokens: a request that runs for many steps (the tests stop it long before)
ENGINE = {"max_model_len": 1024, "block_size": 4, "num_gpu_blocks_override": 300}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def config(model: Path) -> Any:
    return EngineArgs(model=str(model), **ENGINE).create_engine_config()  # type: ignore[arg-type]


def start_core(model: Path, request: pytest.FixtureRequest) -> EngineCoreClient:
    client = EngineCoreClient(config(model), torch_threads=1)
    request.addfinalizer(lambda: client.process.kill() if client.process.is_alive() else None)
    return client


@pytest.fixture(scope="module")
def core_server(model: Path, request: pytest.FixtureRequest):
    with serve_in_process(start_core(model, request)) as s:
        yield s


@pytest.fixture
def doomed_server(model: Path, request: pytest.FixtureRequest):
    """A server of its own, for a test that kills its core."""
    with serve_in_process(start_core(model, request)) as s:
        yield s


def completions(url: str, stream: bool) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        body = {"prompt": prompt, "stream": stream, **GREEDY}
        if not stream:
            texts.append(httpx.post(url + "/completions", json=body, timeout=60).json())
            continue
        with httpx.stream("POST", url + "/completions", json=body, timeout=60) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        texts.append("".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]))
    if not stream:
        return [t["choices"][0]["text"] for t in texts]
    return texts


def test_core_process_answers_as_the_in_thread_engine(
    model: Path, core_server: InProcessServer
) -> None:
    core = completions(core_server.base_url, False), completions(core_server.base_url, True)
    with serve_in_process(LLMEngine(config(model))) as thread_server:
        in_thread = completions(thread_server.base_url, False)
        in_thread_stream = completions(thread_server.base_url, True)
    assert core == (in_thread, in_thread_stream)
    assert in_thread == in_thread_stream and all(in_thread)
    # The metrics hooks ran in the frontend, from what the core sent.
    metrics = httpx.get(core_server.url + "/metrics").text
    lines = [line for line in metrics.splitlines() if line.startswith("vllm:request_success_total")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in lines) >= 2 * len(PROMPTS)


def test_speculative_decoding_runs_in_the_core_process(
    model: Path, request: pytest.FixtureRequest
) -> None:
    """The draft model loads in the core with the target; answers equal the in-thread engine's
    without speculation, and the frontend's /metrics counts the core's drafts."""
    spec = {"model": str(model), "num_speculative_tokens": 3}
    cfg = EngineArgs(model=str(model), speculative_config=spec, **ENGINE).create_engine_config()  # type: ignore[arg-type]
    client = EngineCoreClient(cfg, torch_threads=1)
    request.addfinalizer(lambda: client.process.kill() if client.process.is_alive() else None)
    with serve_in_process(client) as server:
        speculating = completions(server.base_url, False), completions(server.base_url, True)
        metrics = httpx.get(server.url + "/metrics").text
    with serve_in_process(LLMEngine(config(model))) as thread_server:
        plain = completions(thread_server.base_url, False)
    assert speculating == (plain, plain)
    name = "vllm:spec_decode_num_draft_tokens_total"
    drafted = [line for line in metrics.splitlines() if line.startswith(name)]
    assert drafted and float(drafted[0].rsplit(" ", 1)[1]) > 0, drafted


def wait_stats(server: InProcessServer, done: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while not done(stats := server.app.state.engine_client.stats):
        assert time.monotonic() < deadline, f"timed out; stats: {stats}"
        time.sleep(0.05)
    return stats


def test_a_client_disconnect_aborts_in_the_core_and_frees_its_blocks(
    core_server: InProcessServer,
) -> None:
    before = wait_stats(core_server, lambda s: s.num_running == 0).num_generated_tokens
    body = {"prompt": PROMPTS[0], "stream": True, "max_tokens": LONG, "ignore_eos": True}
    with httpx.stream("POST", core_server.base_url + "/completions", json=body, timeout=60) as r:
        next(r.iter_lines())  # the first chunk: the request runs in the core
    stats = wait_stats(
        core_server, lambda s: s.num_running == 0 and s.num_free_kv_blocks == s.num_kv_blocks
    )
    assert stats.num_generated_tokens - before < LONG  # stopped early: the abort reached the core


def test_a_request_the_core_refuses_fails_alone(core_server: InProcessServer) -> None:
    client = core_server.app.state.engine_client
    assert isinstance(client, AsyncMPClient)
    params = SamplingParams(max_tokens=4, temperature=0)

    async def submit() -> list[Any]:  # token ids the handlers would refuse; the core does too
        out: asyncio.Queue[Any] = asyncio.Queue()
        client.add_request("bad", [10**9], params, out)
        client.add_request("good", "Hello", params, out)
        items = [await out.get(), await out.get()]
        while not items[-1].finished:
            items.append(await out.get())
        return items

    future = asyncio.run_coroutine_threadsafe(submit(), client._loop)
    error, *outputs = future.result(timeout=60)
    assert isinstance(error, ValueError) and "10000000" in str(error), error
    assert {o.request_id for o in outputs} == {"good"}
    assert len(outputs[-1].outputs[0].token_ids) == 4
    assert httpx.get(core_server.url + "/health").status_code == 200


def test_a_killed_core_fails_open_and_new_requests_and_health(
    doomed_server: InProcessServer,
) -> None:
    client = doomed_server.app.state.engine_client.engine
    responses: list[httpx.Response] = []
    events: list[str] = []
    body = {"prompt": PROMPTS[1], "max_tokens": LONG, "ignore_eos": True}

    def stream() -> None:
        url = doomed_server.base_url + "/completions"
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
            events.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))

    requests = [
        threading.Thread(
            target=lambda: responses.append(
                httpx.post(doomed_server.base_url + "/completions", json=body, timeout=60)
            )
        ),
        threading.Thread(target=stream),
    ]
    for r in requests:
        r.start()
    wait_stats(doomed_server, lambda s: s.num_running == 2)
    os.kill(client.pid, signal.SIGKILL)
    for r in requests:
        r.join(60)
    assert events[-1] == "[DONE]"  # the stream had begun: the error comes in-band
    assert "engine core process exited" in json.loads(events[-2])["error"]["message"]
    assert responses[0].status_code == 500
    error = responses[0].json()["error"]
    assert error["code"] == 500 and "engine core process exited" in error["message"]
    assert isinstance(doomed_server.app.state.engine_client.dead_error, EngineDeadError)
    assert httpx.get(doomed_server.url + "/health").status_code == 503
    again = httpx.post(doomed_server.base_url + "/completions", json=body, timeout=60)
    assert again.status_code == 500 and "restart the server" in again.json()["error"]["message"]


# ---------------------------------------------------------------------- `minivllm serve` processes
def core_pid(server_pid: int) -> int:
    """The server's engine-core child (not multiprocessing's resource tracker)."""
    # -ww: without a terminal, ps cuts each line at 80 columns, which in a long checkout path
    # cuts "resource_tracker" off the tracker's line.
    out = subprocess.run(
        ["ps", "-ww", "--ppid", str(server_pid), "-o", "pid=,args="],
        text=True,
        capture_output=True,
    ).stdout
    pids = [int(line.split()[0]) for line in out.splitlines() if "resource_tracker" not in line]
    assert len(pids) == 1, out
    return pids[0]


@pytest.fixture
def reap() -> Any:
    pids: list[int] = []
    yield pids
    for pid in pids:  # whatever the test left, by pid
        if not is_gone(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("how", ["shutdown", "kill -9"])
def test_the_core_never_outlives_its_server(model: Path, how: str, reap: list[int]) -> None:
    args = ["--model", str(model), "--engine-core-process", "--engine-core-threads", "1"]
    args += [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    with run_server(args) as server:
        core = core_pid(server.process.pid)
        reap.append(core)
        body = {"prompt": PROMPTS[0], **GREEDY}
        assert (
            httpx.post(server.base_url + "/completions", json=body, timeout=60).status_code == 200
        )
        if how == "kill -9":
            server.process.kill()
            server.process.wait()
            assert wait_gone(core, timeout=10.0), "the core outlived its killed server"
    assert wait_gone(core, timeout=10.0), "the core outlived its server's shutdown"
