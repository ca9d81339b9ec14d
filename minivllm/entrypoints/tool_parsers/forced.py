"""Forced tool calls: `tool_choice` "required" or a named function, for any model.

As vLLM does (`_get_json_schema_from_tool` in vllm/entrypoints/openai/protocol.py), the choice
becomes a JSON schema for the grammar engine: a named function's output *is* its arguments
object; "required" is a non-empty array of `{"name": <one of the tools>, "parameters": {...}}`,
each item valid for the function it names. A valid call then needs no parser and no luck.
"""

from __future__ import annotations

import json
from typing import Any

from minivllm.entrypoints.tool_parsers.abstract_tool_parser import ExtractedToolCall

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def named_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    return parameters or ANY_OBJECT


def required_schema(tools: list[Any], parallel: bool) -> dict[str, Any]:
    """tools: `ChatTool`s. One array item per call; `parallel=False` allows exactly one.

    A tool's `$defs` move to the array's root, where its `#/$defs/...` references now point
    (vLLM's `get_tool_schema_defs`); two tools defining one name differently are refused."""
    items: list[dict[str, Any]] = []
    defs: dict[str, Any] = {}
    for t in tools:
        parameters = dict(named_schema(t.function.parameters))
        for name, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, definition) != definition:
                raise ValueError(
                    f"Tool definition '{name}' has multiple schemas, which is not supported."
                )
        items.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def parse_required(text: str) -> list[ExtractedToolCall] | None:
    """The calls of a finished "required" output; None when it was cut short (max_tokens)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    return [
        ExtractedToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
        for item in items
    ]
