"""`POST /v1/responses` through the official `openai` client: the same text as a chat completion
of the same messages, the event sequence of a stream, and clear 400s for what minivllm does not
serve (tools, reasoning). Stored responses: test_server_responses_store.py."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.utils.engine_utils import save_tiny_llama
from tests.utils.server_utils import InProcessServer, serve_tiny_model


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    with serve_tiny_model(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> str:
    resp = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
    )
    return resp.choices[0].message.content or ""


def test_a_response_is_the_chat_completion_of_the_same_messages(client: openai.OpenAI) -> None:
    resp = client.responses.create(
        model=client.models.list().data[0].id,
        instructions="Answer briefly.",
        input="Name a colour.",
        max_output_tokens=12,
        temperature=0,
    )
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a colour."},
    ]
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.output_text == chat_text(client, messages, 12)
    assert resp.output[0].type == "message" and resp.output[0].role == "assistant"
    assert resp.usage is not None and resp.usage.output_tokens <= 12
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    if resp.usage.output_tokens == 12:  # cut by max_output_tokens (a random model rarely stops)
        assert resp.status == "incomplete"
        assert resp.incomplete_details is not None
        assert resp.incomplete_details.reason == "max_output_tokens"


def test_input_as_messages_with_parts(client: openai.OpenAI) -> None:
    history = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Count to three."},
    ]
    resp = client.responses.create(
        model=client.models.list().data[0].id,
        input=history,  # type: ignore[arg-type]
        max_output_tokens=8,
        temperature=0,
    )
    flat = [{"role": "user", "content": "Hi"}, *history[1:]]
    assert resp.output_text == chat_text(client, flat, 8)


def test_stream_sends_the_event_sequence_and_the_same_text(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    whole = client.responses.create(
        model=model, input="Once upon", max_output_tokens=10, temperature=0
    )
    stream = client.responses.create(
        model=model, input="Once upon", max_output_tokens=10, temperature=0, stream=True
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    assert events[-1].response.output_text == whole.output_text


@pytest.mark.parametrize(
    ("field", "value"),
    [("tools", [{"type": "web_search"}]), ("reasoning", {"effort": "low"})],
)
def test_what_is_not_served_is_a_400_naming_it(
    server: InProcessServer, field: str, value: object
) -> None:
    body = {"input": "Hi", field: value}
    resp = httpx.post(server.base_url + "/responses", json=body)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == field


def test_max_output_tokens_past_the_context_is_a_400(server: InProcessServer) -> None:
    resp = httpx.post(
        server.base_url + "/responses", json={"input": "Hi", "max_output_tokens": 10_000}
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_output_tokens"
