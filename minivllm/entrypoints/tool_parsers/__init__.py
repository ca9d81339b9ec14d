"""Tool-call parsers: the model's text -> OpenAI `tool_calls` (vLLM: `entrypoints/openai/tool_parsers/`).

With `tool_choice: "auto"` the model decides whether to call a tool, and says so in the format
its chat template taught it; a parser, chosen by `--tool-call-parser NAME`, finds the calls in the
finished text. With `"required"` or a named function there is nothing to find: the grammar engine
forced the output into a known JSON shape (`forced.py`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ExtractedToolCall:
    name: str
    arguments: str  # JSON text

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ExtractedToolCall] = field(default_factory=list)
    content: str | None = None  # the text that is not a call (None when there is none)


class ToolParser:
    """Finds tool calls in a finished text; `content_end` says how much of a growing text is
    surely plain content, so that a stream can send it before the call (if any) is complete."""

    name = ""

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        raise NotImplementedError


def call_from_json(obj: Any) -> ExtractedToolCall | None:
    """{"name": ..., "arguments" | "parameters": {...}} -> a call; anything else -> None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ExtractedToolCall(obj["name"], text)


def get_tool_parser(name: str) -> ToolParser:
    from minivllm.entrypoints.tool_parsers.hermes import HermesToolParser
    from minivllm.entrypoints.tool_parsers.llama3_json import Llama3JsonToolParser

    parsers: dict[str, type[ToolParser]] = {
        "hermes": HermesToolParser,
        "llama3_json": Llama3JsonToolParser,
    }
    if name not in parsers:
        raise ValueError(f"tool_call_parser must be one of {sorted(parsers)}, got {name!r}")
    return parsers[name]()


TOOL_PARSER_NAMES = ("hermes", "llama3_json")
