"""The wire format of structured outputs and tool calling (OpenAI's and vLLM's names).

Requests: `response_format` (OpenAI: text, json_object, json_schema), vLLM's `structured_outputs`
object (`StructuredOutputsParams` as JSON), `tools` / `tool_choice` / `parallel_tool_calls`, and
the messages that carry calls (`assistant` with `tool_calls`, `tool` with `tool_call_id`).
Responses: the `tool_calls` of a message, and their streamed deltas.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------- requests
class JsonSchemaFormat(_Request):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(description="The schema's name (OpenAI requires one).")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(
        None, alias="schema", description="The JSON schema the output must validate against."
    )
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description='With type "json_schema".')


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs` request field: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON schema.")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="EBNF; its start rule is `root`.")
    json_object: bool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments.")
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallIn(_Request):
    name: str
    arguments: str = Field(description="The arguments as JSON text, as the model produced them.")


class ToolCallIn(_Request):
    id: str
    type: Literal["function"]
    function: FunctionCallIn


# ---------------------------------------------------------------------- responses (documented)
class FunctionCall(_Response):
    name: str
    arguments: str


class ToolCall(_Response):
    id: str
    type: Literal["function"]
    function: FunctionCall


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall
