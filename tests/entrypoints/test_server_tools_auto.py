"""tool_choice "auto" end to end, with a chat template that reads tools (a tiny random Llama).

A random model never chooses to call a tool by itself, so the test makes it: `structured_outputs`
forces the text of a hermes call, and what is tested is everything around it — the tools and the
tool messages rendered by the template, the hermes parser, `tool_calls` in the response and in
the stream's deltas.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.utils.engine_utils import save_tiny_llama
from tests.utils.server_utils import RemoteServer, run_server

TEMPLATE = """{%- if tools %}<|im_start|>system
Tools: {{ tools | tojson }}<|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", \
"arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}{% else %}{{ m.content }}\
{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}},
]  # fmt: skip
CALL = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
FORCE = {
    "structured_outputs": {"regex": "Checking[.] " + CALL.replace("{", "\\{").replace("}", "\\}")}
}
ASK = [{"role": "user", "content": "What time is it?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model = save_tiny_llama(tmp_path_factory.mktemp("tiny-tools"))
    (model / "chat_template.jinja").write_text(TEMPLATE)
    args = [str(model), "--max-model-len", "512", "--num-gpu-blocks-override", "128"]
    args += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with run_server(args) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_auto_finds_the_hermes_call_and_keeps_the_content(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=model_of(client),
        messages=ASK,
        tools=TOOLS,
        max_tokens=80,
        extra_body=FORCE,  # type: ignore[arg-type]
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"tz": "UTC"}


def test_auto_stream_sends_content_then_the_call(client: openai.OpenAI) -> None:
    content, calls, reasons = "", [], []
    for chunk in client.chat.completions.create(
        model=model_of(client), messages=ASK, tools=TOOLS, max_tokens=80, extra_body=FORCE,  # type: ignore[arg-type]
        stream=True,
    ):  # fmt: skip
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        reasons.append(chunk.choices[0].finish_reason)
    assert content == "Checking. " and "<tool_call>" not in content
    assert [(c.function.name, json.loads(c.function.arguments or "")) for c in calls] == [
        ("get_time", {"tz": "UTC"})
    ]
    assert reasons[-1] == "tool_calls"


def test_auto_without_a_call_is_plain_content(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=model_of(client), messages=ASK, tools=TOOLS, max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["It is noon."]}},  # type: ignore[arg-type]
    )  # fmt: skip
    assert r.choices[0].message.content == "It is noon." and not r.choices[0].message.tool_calls


def test_tool_messages_and_calls_go_through_the_template(server: RemoteServer) -> None:
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]  # fmt: skip
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30).json()
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids["tokens"]}, timeout=30)
    prompt = text.json()["prompt"]
    assert CALL in prompt  # the arguments reached the template as an object
    assert "<|im_start|>tool\n12:00" in prompt
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": messages, "tools": TOOLS, "tool_choice": "none", "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 200, r.text
