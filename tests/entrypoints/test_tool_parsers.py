"""The tool-call parsers find calls in a model's text, and let plain content stream early."""

from __future__ import annotations

import json

import pytest

from minivllm.entrypoints.tool_parsers import get_tool_parser
from minivllm.entrypoints.tool_parsers.forced import parse_required, required_schema


def test_hermes_finds_every_tagged_call_and_keeps_the_content_before() -> None:
    p = get_tool_parser("hermes")
    text = (
        'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call><tool_call>{"name": "now", "arguments": {}}</tool_call>'
    )
    out = p.extract_tool_calls(text)
    assert out.tools_called and out.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("now", {}),
    ]
    assert not p.extract_tool_calls("no call here").tools_called
    assert not p.extract_tool_calls("<tool_call>{not json</tool_call>").tools_called


def test_hermes_streams_content_but_holds_back_a_possible_tag() -> None:
    p = get_tool_parser("hermes")
    assert p.content_end("Hello") == 5
    assert p.content_end("Hello <tool") == len("Hello ")
    assert p.content_end("Hi <tool_call>{") == len("Hi ")


def test_llama3_json_reads_one_or_several_calls() -> None:
    p = get_tool_parser("llama3_json")
    out = p.extract_tool_calls('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g"}')
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("f", {"x": 1}),
        ("g", {}),
    ]
    assert out.content is None
    plain = p.extract_tool_calls("Paris is the capital.")
    assert not plain.tools_called and plain.content == "Paris is the capital."
    assert p.content_end('{"na') == 0 and p.content_end("Paris") == 5


def test_unknown_parser_is_named() -> None:
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        get_tool_parser("mistral")


def test_required_schema_and_its_parse() -> None:
    class F:
        def __init__(self, name: str) -> None:
            self.function = type("Fn", (), {"name": name, "parameters": {"type": "object"}})()

    schema = required_schema([F("a"), F("b")], parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    calls = parse_required('[{"name": "a", "parameters": {"k": 2}}]')
    assert calls is not None and calls[0].name == "a" and json.loads(calls[0].arguments) == {"k": 2}
    assert parse_required('[{"name": "a", "param') is None
