"""The tool-parser interface: what a parser returns, and the base class every parser extends.

vLLM's `abstract_tool_parser.py` (vllm/entrypoints/openai/tool_parsers/). The parsers import this
module; the package's registry (`__init__.py`) names them by qualified path, so no module of the
package imports the package itself.
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
