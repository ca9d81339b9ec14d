"""Llama 3.x JSON calls: the whole answer is `{"name": .., "parameters": ..}` (several joined by
`;`), optionally after `<|python_tag|>` (vLLM's `llama_tool_parser.py`).
"""

from __future__ import annotations

import json

from minivllm.entrypoints.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ToolParser,
    call_from_json,
)

TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        body = text.strip().removeprefix(TAG).strip()
        if not body.startswith("{"):
            return ExtractedToolCalls(False, content=text)
        decoder = json.JSONDecoder()
        calls, i = [], 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except json.JSONDecodeError:
                return ExtractedToolCalls(False, content=text)
            call = call_from_json(obj)
            if call is None:
                return ExtractedToolCalls(False, content=text)
            calls.append(call)
            i = end
            while i < len(body) and body[i] in " \n\t;":
                i += 1
        return ExtractedToolCalls(True, calls, None)

    def content_end(self, text: str) -> int:
        stripped = text.lstrip()
        # A call starts the answer, or nothing does: until the first character says which, and
        # from then on when it is a call, nothing is surely content.
        if not stripped or stripped.startswith("{") or TAG.startswith(stripped[: len(TAG)]):
            return 0
        return len(text)
