"""A step that raises, through the server: the requests it carried fail with OpenAI's 500 (an
error event on a stream), every other request completes exactly as without the fault, /health
stays 200, and every KV block is free once the rest finish.

The server runs in this process (`serve_in_process`), so the test can reach its engine: a forward
hook on the first decoder layer raises once, at a position only the victim's tokens reach. With
`max_num_seqs=1` the failing step carries the victim alone (a step fails every request it
carries, and with continuous batching every running request is in every step); the others are in
flight all the same: submitted while the victim's prefill fails, or waiting in the scheduler when
its decode fails. The hook first holds the engine thread until they are submitted, so that this is
so on every run.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from typing import Any

import httpx
import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from tests.utils.engine_utils import save_tiny_llama
from tests.utils.server_utils import InProcessServer, serve_in_process

OTHERS = ["The capital of France is", "Once upon a time", "Hello, my name is"]
# Longer than any other prompt plus its completion, so only the victim's tokens reach its positions.
VICTIM = " ".join(["the victim of an injected fault is this long prompt"] * 4)
MAX_TOKENS = 6
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


class FaultOnce:
    """A forward hook that, at the first forward over `hold_at`, waits for `release`, and at the
    first forward over `fail_at` raises. Positions: the last token position the step computes."""

    def __init__(self, engine: LLMEngine, hold_at: int, fail_at: int) -> None:
        self.engine = engine
        self.hold_at, self.fail_at = hold_at, fail_at
        self.held = threading.Event()
        self.release = threading.Event()
        self.fired = False
        self.waiting_at_fault = -1  # sequences in the scheduler's waiting queue when it raised

    def __call__(self, module: Any, args: tuple[Any, ...], _output: Any) -> None:
        positions = inspect.signature(module.forward).bind(*args).arguments["positions"]  # [T]
        position = int(positions[-1])
        if position == self.hold_at and not self.held.is_set():
            self.held.set()
            assert self.release.wait(timeout=60), "the test never released the engine thread"
        if position == self.fail_at and not self.fired:
            self.fired = True
            self.waiting_at_fault = self.engine.get_stats().num_waiting
            raise RuntimeError("injected fault")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    config = EngineArgs(
        model=str(model),
        max_model_len=128,
        block_size=4,
        num_gpu_blocks_override=128,
        max_num_seqs=1,
    ).create_engine_config()
    with serve_in_process(LLMEngine(config)) as s:
        yield s


def victim_len(server: InProcessServer) -> int:
    return len(server.engine.tokenizer.encode(VICTIM))


def completion_text(server: InProcessServer, prompt: str) -> str:
    body = {"prompt": prompt, **GREEDY}
    r = httpx.post(server.base_url + "/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def chat_body(stream: bool) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": VICTIM}], "stream": stream, **GREEDY}


async def run_with_fault(
    server: InProcessServer, hook: FaultOnce, victim: tuple[str, dict[str, Any]]
) -> tuple[httpx.Response, list[str]]:
    """The victim's response, and the others' texts: sent once the victim holds the engine."""
    submitted: list[str] = []
    engine_client = server.app.state.engine_client
    add_request = engine_client.add_request

    def spy(request_id: str, *args: Any) -> None:
        submitted.append(request_id)
        add_request(request_id, *args)

    engine_client.add_request = spy
    layer = server.engine.model.model.layers[0]
    handle = layer.register_forward_hook(hook)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            path, body = victim
            victim_task = asyncio.create_task(client.post(path, json=body))
            assert await asyncio.to_thread(hook.held.wait, 60), "the victim never ran"
            other_tasks = [
                asyncio.create_task(client.post("/v1/completions", json={"prompt": p, **GREEDY}))
                for p in OTHERS
            ]
            while len(submitted) < 1 + len(OTHERS):  # every request is in the engine's hands
                await asyncio.sleep(0.01)
            hook.release.set()
            victim_response = await victim_task
            others = await asyncio.gather(*other_tasks)
    finally:
        hook.release.set()  # never leave the engine thread waiting
        handle.remove()
        engine_client.add_request = add_request
    assert all(r.status_code == 200 for r in others), [r.text for r in others]
    return victim_response, [r.json()["choices"][0]["text"] for r in others]


def assert_healthy_and_free(server: InProcessServer) -> None:
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    stats = server.wait_idle()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, stats


def test_prefill_fault_is_a_500_for_its_request_only(server: InProcessServer) -> None:
    alone = [completion_text(server, p) for p in OTHERS]
    victim_alone = completion_text(server, VICTIM)
    last_prompt_position = victim_len(server) - 1
    hook = FaultOnce(server.engine, hold_at=last_prompt_position, fail_at=last_prompt_position)
    body = {"prompt": VICTIM, **GREEDY}
    victim, others = asyncio.run(run_with_fault(server, hook, ("/v1/completions", body)))
    assert hook.fired
    assert victim.status_code == 500
    error = victim.json()["error"]
    assert error["type"] == "InternalServerError" and error["code"] == 500
    assert "injected fault" in error["message"]
    assert others == alone
    assert_healthy_and_free(server)
    assert completion_text(server, VICTIM) == victim_alone  # nothing of the fault was cached


def test_decode_fault_ends_its_stream_with_an_error_event(server: InProcessServer) -> None:
    alone = [completion_text(server, p) for p in OTHERS]
    chat = httpx.post(server.base_url + "/chat/completions", json=chat_body(False), timeout=60)
    num_prompt = chat.json()["usage"]["prompt_tokens"]
    # Hold at the first decode (the others join the waiting queue), fail two tokens later.
    hook = FaultOnce(server.engine, hold_at=num_prompt, fail_at=num_prompt + 2)
    victim, others = asyncio.run(
        run_with_fault(server, hook, ("/v1/chat/completions", chat_body(True)))
    )
    assert hook.waiting_at_fault == len(OTHERS)  # the others were in the scheduler's hands
    assert victim.status_code == 200  # the stream had begun: the error comes in-band
    events = [line[len("data: ") :] for line in victim.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and "injected fault" in error["message"]
    content = [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-2]]
    assert "".join(content)  # tokens were streamed before the fault
    assert chat.json()["choices"][0]["message"]["content"].startswith("".join(content))
    assert others == alone
    assert_healthy_and_free(server)
