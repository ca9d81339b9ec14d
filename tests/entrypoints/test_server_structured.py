"""Structured outputs and tool calls through the official `openai` client, against SmolLM2.

A forced call ("required", a named function) must validate against the function's parameter
schema for any model, greedy or sampled; a stream's deltas must reassemble to the same call; a bad
schema is a 400 naming the field.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.utils.server_utils import RemoteServer, run_server

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
}
TIME = {
    "type": "object",
    "properties": {"tz": {"type": "string", "maxLength": 20}},
    "required": ["tz"],
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time", "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MODEL: list[str] = []  # the served name, set by the client fixture
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def server():
    with run_server(["--max-model-len", "1024", "--max-num-seqs", "8"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    MODEL[:] = [client.models.list().data[0].id]
    return client


def check_call(call: Any, name: str | None = None) -> None:
    assert call.type == "function" and call.id
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# Sampled, one call each (parallel_tool_calls=false): an unbounded array of sampled calls could
# outgrow max_tokens, which would end it with "length" (as it should).
@pytest.mark.parametrize(("temperature", "parallel"), [(0.0, None), (1.0, False)])
def test_required_tool_choice_always_validates(
    client: openai.OpenAI, temperature: float, parallel: bool | None
) -> None:
    extra: dict[str, Any] = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = client.chat.completions.create(
        model=MODEL[0], messages=ASK, tools=TOOLS, tool_choice="required", n=3, seed=1,
        temperature=temperature, max_tokens=300, **extra,
    )  # fmt: skip
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            check_call(call)
        assert parallel is None or len(choice.message.tool_calls) == 1


def test_named_function_validates_and_streams_to_the_same_call(client: openai.OpenAI) -> None:
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    kw: dict[str, Any] = dict(
        model=MODEL[0], messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=200
    )
    full = client.chat.completions.create(**kw)
    (call,) = full.choices[0].message.tool_calls or []
    check_call(call, "get_weather")
    name, args, ids = "", "", set()
    for chunk in client.chat.completions.create(**kw, stream=True):
        for delta_call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            assert delta_call.index == 0
            ids.add(delta_call.id) if delta_call.id else None
            name += delta_call.function.name or ""
            args += delta_call.function.arguments or ""
    assert (name, args) == ("get_weather", call.function.arguments) and len(ids) == 1


def test_required_stream_reassembles_to_the_same_calls(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model=MODEL[0],
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=200,
    )
    full = client.chat.completions.create(**kw).choices[0].message.tool_calls or []
    calls: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(d.index, ["", ""])
            entry[0] += d.function.name or ""
            entry[1] += d.function.arguments or ""
    assert [tuple(calls[i]) for i in sorted(calls)] == [
        (c.function.name, c.function.arguments) for c in full
    ]


def test_response_format_json_schema_and_json_object(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    r = client.chat.completions.create(
        model=MODEL[0], messages=ASK, response_format=fmt, temperature=0, max_tokens=200
    )
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), WEATHER)
    r = client.chat.completions.create(
        model=MODEL[0], messages=ASK, response_format={"type": "json_object"}, temperature=0,
        max_tokens=300,
    )  # fmt: skip
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


def test_completions_take_vllms_structured_outputs_and_guided_fields(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL[0], prompt="Is Paris in France?", max_tokens=10, temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(
        model=MODEL[0], prompt="A phone number:", max_tokens=20, temperature=1.0, seed=3,
        extra_body={"guided_regex": r"\d{3}-\d{4}"},
    )  # fmt: skip
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text)


BAD = [
    ("bad-schema", "/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, "response_format"),
    ("bad-regex", "/v1/completions", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ("bad-grammar", "/v1/completions", {"guided_grammar": "root ::= nowhere"}, "guided_grammar"),
    ("two-kinds", "/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("two-ways", "/v1/completions", {"guided_regex": "a", "structured_outputs": {"choice": ["a"]}}, "guided_regex"),
    ("with-beam-search", "/v1/completions", {"guided_choice": ["a"], "use_beam_search": True}, "use_beam_search"),
    ("unknown-tool", "/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "path", "body", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_constraint_is_a_400_naming_it(
    server: RemoteServer, case: str, path: str, body: dict[str, Any], param: str
) -> None:
    base: dict[str, Any] = (
        {"messages": ASK} if path.endswith("chat/completions") else {"prompt": "x"}
    )
    r = httpx.post(server.url + path, json={**base, "max_tokens": 5, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
