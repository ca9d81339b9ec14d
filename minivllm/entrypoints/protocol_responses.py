"""The Responses API's request body (`POST /v1/responses`), text only: OpenAI's names, and vLLM's
choice to refuse by name what it does not serve.

What minivllm serves: `input` as a string or a list of messages (`role` + `content`, a string or
`input_text` / `output_text` parts), `instructions` (a system message ahead of the input),
`max_output_tokens`, `temperature`, `top_p`, `stream`, `user` and `metadata` (echoed), `text.format`
(text, a JSON object, a JSON schema), output logprobs (`include` + `top_logprobs`), and the stored
responses' fields (`store`, `previous_response_id`, `background`; responses_store.py). Tools and
reasoning are a 400 that says so.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from minivllm.entrypoints.protocol import _Request, _unsupported
from minivllm.entrypoints.response_schemas import _Response


class InputTextPart(_Request):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # sent back by clients replaying an output_text


class InputMessage(_Request):
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputTextPart]
    id: str | None = None  # replayed output items carry them; not used
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content


class TextFormat(_Request):
    """`text.format`: plain text, any JSON object, or JSON that a schema validates (OpenAI's
    names; the schema becomes the request's structured-output constraint)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class ResponsesRequest(_Request):
    model: str | None = Field(None, description="A served model name; omitted: the first one.")
    input: str | list[InputMessage] = Field(description="A prompt, or a list of messages.")
    instructions: str | None = Field(None, description="A system message ahead of `input`.")
    max_output_tokens: int | None = Field(None, description="Omitted: what the context leaves.")
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = Field(False, description="Send the Responses API's server-sent events.")
    store: bool = Field(
        True, description="Keep the response (bounded, least recently used evicted) for GET, "
        "previous_response_id and background runs.",
    )  # fmt: skip
    background: bool = Field(False, description="Answer `queued` now; GET the result later.")
    previous_response_id: str | None = Field(
        None, description="Continue a stored response's conversation."
    )
    include: list[Literal["message.output_text.logprobs"]] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: TextConfig | None = None
    truncation: Literal["disabled"] | None = None
    parallel_tool_calls: bool | None = None
    tools: Any = _unsupported("tools are not supported on /v1/responses by minivllm")
    tool_choice: Any = _unsupported("tool_choice is not supported on /v1/responses by minivllm")
    reasoning: Any = _unsupported("reasoning is not supported by minivllm")
    prompt: Any = _unsupported("prompt templates are not supported by minivllm")


# ---------------------------------------------------------------------- responses
class OutputText(_Response):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any] | None = None


class OutputMessage(_Response):
    id: str
    type: Literal["message"]
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: dict[str, int]  # cached_tokens: prompt tokens served by the prefix cache
    output_tokens: int
    output_tokens_details: dict[str, int]  # reasoning_tokens: always 0 here
    total_tokens: int


class ResponsesResponse(_Response):
    model_config = ConfigDict(extra="allow")  # the request's settings are echoed beside these
    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    incomplete_details: dict[str, str] | None = None
    output: list[OutputMessage]
    usage: ResponseUsage | None = None
    error: dict[str, str] | None = None


class ResponsesStreamEvent(_Response):
    """One event of a stream: `response.created`, `response.in_progress`,
    `response.output_item.added`, `response.content_part.added`, `response.output_text.delta`
    (many), `response.output_text.done`, `response.content_part.done`,
    `response.output_item.done`, then `response.completed` (or `response.incomplete`, or
    `response.failed`)."""

    model_config = ConfigDict(extra="allow")  # each event type's own fields
    type: str
    sequence_number: int
