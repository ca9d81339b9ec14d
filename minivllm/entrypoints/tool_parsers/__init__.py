"""Tool-call parsers: the model's text -> OpenAI `tool_calls` (vLLM: `entrypoints/openai/tool_parsers/`).

With `tool_choice: "auto"` the model decides whether to call a tool, and says so in the format its
chat template taught it; a parser, chosen by `--tool-call-parser NAME`, finds the calls in the
finished text. With `"required"` or a named function there is nothing to find: the grammar engine
forced the output into a known JSON shape (`forced.py`).

One direction only: the parsers import `abstract_tool_parser.py`; this registry names them by
qualified path (as vLLM's `ToolParserManager` registers lazily) and imports only the one asked for.
"""

from __future__ import annotations

import importlib

from minivllm.entrypoints.tool_parsers.abstract_tool_parser import ToolParser

# --tool-call-parser NAME -> "module:Class", imported when a server asks for it.
TOOL_PARSERS = {
    "hermes": "minivllm.entrypoints.tool_parsers.hermes:HermesToolParser",
    "llama3_json": "minivllm.entrypoints.tool_parsers.llama3_json:Llama3JsonToolParser",
}
TOOL_PARSER_NAMES = tuple(TOOL_PARSERS)


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got {name!r}")
    module, cls = TOOL_PARSERS[name].split(":")
    parser: type[ToolParser] = getattr(importlib.import_module(module), cls)
    return parser()
