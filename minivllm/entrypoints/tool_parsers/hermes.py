"""Hermes-style calls (NousResearch Hermes, Qwen 2.5): `<tool_call>{"name": .., "arguments": ..}</tool_call>`.

vLLM's `hermes_tool_parser.py`: every tagged block is one call; the text outside the blocks is the
message's content.
"""

from __future__ import annotations

import json
import re

from minivllm.entrypoints.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ToolParser,
    call_from_json,
)

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if START not in text:
            return ExtractedToolCalls(False, content=text)
        calls = []
        for block in _BLOCK.findall(text):
            try:
                call = call_from_json(json.loads(block.strip()))
            except json.JSONDecodeError:
                call = None
            if call is None:  # a malformed block: the whole text stays content (as vLLM)
                return ExtractedToolCalls(False, content=text)
            calls.append(call)
        content = text[: text.index(START)].strip()
        return ExtractedToolCalls(True, calls, content or None)

    def content_end(self, text: str) -> int:
        if START in text:
            return text.index(START)
        # Hold back a tail that may be the start of "<tool_call>".
        for k in range(min(len(START) - 1, len(text)), 0, -1):
            if START.startswith(text[-k:]):
                return len(text) - k
        return len(text)
