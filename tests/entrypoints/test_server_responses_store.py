"""Stored responses on `/v1/responses` as vLLM serves them (its tests/v1/entrypoints/openai/
responses/test_stateful.py and test_structured_output.py at 505805b6): GET by id, `store: false`
leaves nothing to GET, `previous_response_id` continues the stored conversation, `background`
answers `queued` and GET shows the result, cancel stops a running one and refuses a finished one,
`text.format` constrains the text, and the store is bounded (least recently used evicted)."""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest

from minivllm.entrypoints.protocol import ChatMessage, OpenAIError
from minivllm.entrypoints.responses_store import ResponsesStore
from tests.utils.engine_utils import save_tiny_llama
from tests.utils.server_utils import InProcessServer, serve_tiny_model


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    with serve_tiny_model(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def test_a_stored_response_is_retrieved_and_an_unstored_one_is_not_found(
    client: openai.OpenAI,
) -> None:
    kept = client.responses.create(input="Hello!", max_output_tokens=4)
    assert kept.status in ("completed", "incomplete") and kept.store
    again = client.responses.retrieve(kept.id)
    assert again.output_text == kept.output_text and again.id == kept.id
    gone = client.responses.create(input="Hello!", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError, match=r"Response with id .* not found\."):
        client.responses.retrieve(gone.id)
    with pytest.raises(openai.BadRequestError, match="Expected an ID that begins with 'resp'"):
        client.responses.retrieve("msg_1")


def test_previous_response_id_continues_the_stored_conversation(
    client: openai.OpenAI, server: InProcessServer
) -> None:
    first = client.responses.create(input="My name is John.", max_output_tokens=3, temperature=0)
    second = client.responses.create(
        input="What is my name?", previous_response_id=first.id, max_output_tokens=3, temperature=0
    )
    # The same conversation sent whole to chat completions gives the same greedy text.
    chat = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[
            {"role": "user", "content": "My name is John."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
        max_tokens=3,
        temperature=0,
    )
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="Hi", previous_response_id="resp_unknown")


def test_background_is_queued_then_completed_and_needs_store(client: openai.OpenAI) -> None:
    queued = client.responses.create(input="Hello!", background=True, max_output_tokens=4)
    assert queued.status == "queued"
    deadline = time.monotonic() + 60
    while (resp := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert resp.status in ("completed", "incomplete") and resp.output_text is not None
    with pytest.raises(openai.BadRequestError, match=r"Cannot cancel a synchronous response\."):
        client.responses.cancel(queued.id)
    with pytest.raises(
        openai.BadRequestError, match="background can only be used when `store` is true"
    ):
        client.responses.create(input="Hi", background=True, store=False)


def test_cancel_stops_a_running_background_response_and_frees_the_engine(
    client: openai.OpenAI, server: InProcessServer
) -> None:
    queued = client.responses.create(
        input="Tell a long story.", background=True, max_output_tokens=200
    )
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    server.wait_idle()  # the engine request was aborted
    time.sleep(0.2)
    assert client.responses.retrieve(queued.id).status == "cancelled"


def test_text_format_json_schema_constrains_the_output(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    resp = client.responses.create(
        input="Give a JSON object.",
        max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "thing", "schema": schema}},
    )
    if resp.status == "completed":
        value = json.loads(resp.output_text)
        assert set(value) == {"name", "n"} and isinstance(value["n"], int)
    assert resp.text.format.type == "json_schema"  # type: ignore[union-attr]


def test_output_logprobs_come_with_include_and_top_logprobs(client: openai.OpenAI) -> None:
    resp = client.responses.create(
        input="Hi", max_output_tokens=3, include=["message.output_text.logprobs"], top_logprobs=5
    )
    part = resp.output[-1].content[-1]  # type: ignore[union-attr]
    assert part.logprobs and all(len(lp.top_logprobs) == 5 for lp in part.logprobs)


def test_the_store_keeps_the_most_recently_used_and_cancels_an_evicted_run() -> None:
    async def scenario() -> None:
        store = ResponsesStore(max_responses=2)
        message = [ChatMessage.model_validate({"role": "user", "content": "hi"})]
        running = asyncio.create_task(asyncio.sleep(60))
        for rid in ("resp_a", "resp_b"):
            store.put(rid, {"status": "completed", "output": []}, message)
        store.get("resp_a")  # now the most recently used: b is the one to go
        store.put("resp_c", {"status": "queued", "output": []}, message)
        store.get("resp_c").task = running
        with pytest.raises(OpenAIError, match="not found"):
            store.get("resp_b")
        store.get("resp_a")
        store.put("resp_d", {"status": "completed", "output": []}, message)  # evicts c
        await asyncio.sleep(0)
        assert running.cancelled() and len(store) == 2

    asyncio.run(scenario())
