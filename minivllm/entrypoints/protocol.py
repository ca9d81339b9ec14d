"""The OpenAI wire format: pydantic models of the requests, and the error shape.

Field names and defaults are OpenAI's (`openai-python`'s `CompletionCreateParams` and
`ChatCompletionCreateParams`) plus vLLM's sampling extras (vllm/entrypoints/openai/protocol.py).
Two rules make a request either honoured or refused, never half-honoured:

- `extra="forbid"`: a field this server does not know is a 400 that names it.
- Fields that OpenAI defines but minivllm cannot honour (tools, logit_bias, ...) are declared, so
  that `unsupported_fields` can refuse them with a message saying *why*, rather than "unknown".

`strict=True`: the body is validated from JSON (`model_validate_json`), where strict mode still
accepts an integer for a float, but refuses "0.5" for a number and 1 for a bool — the types on the
wire are the types of the API.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIError(Exception):
    """An error the client caused (or may retry), returned as OpenAI's error object."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        param: str | None = None,
        err_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.err_type = err_type or ERROR_TYPES.get(status_code, "BadRequestError")
        self.headers = headers

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status_code,
            }
        }


# vLLM's error types (vllm/entrypoints/openai/protocol.py: ErrorResponse), by status code.
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestEntityTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None  # None: 1.0, OpenAI's default
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI fields minivllm cannot honour: declared only to be refused with a reason.
    logit_bias: Any = None
    best_of: Any = None
    # vLLM extras minivllm cannot honour
    prompt_logprobs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # top logprobs per token, 0..20
    echo: bool = False
    suffix: Any = None  # unsupported


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    # "developer" is OpenAI's new name for "system"; "tool"/"function" need tool calling.
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: what the context leaves
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM's extra
    # unsupported
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


def unsupported_fields(req: _SamplingFields) -> None:
    """Refuse, by name, every declared field that minivllm cannot honour."""
    why = {
        "logit_bias": "logit_bias is not supported by minivllm",
        "suffix": "suffix (insertion) is not supported by minivllm",
        "prompt_logprobs": "prompt_logprobs is not supported by minivllm",
        "tools": "tool calling (tools) is not supported by minivllm",
        "tool_choice": "tool calling (tool_choice) is not supported by minivllm",
        "parallel_tool_calls": "tool calling (parallel_tool_calls) is not supported by minivllm",
        "functions": "function calling (functions) is not supported by minivllm",
        "function_call": "function calling (function_call) is not supported by minivllm",
        "audio": "audio output is not supported by minivllm",
        "modalities": "output modalities are not supported by minivllm",
        "prediction": "predicted outputs are not supported by minivllm",
        "reasoning_effort": "reasoning_effort is not supported by minivllm",
        "web_search_options": "web search is not supported by minivllm",
    }
    for name in type(req).model_fields:
        value = getattr(req, name)
        if name in why and value is not None:
            raise OpenAIError(why[name], param=name)
        if name.startswith("guided_") and value is not None:
            raise OpenAIError(f"guided decoding ({name}) is not supported by minivllm", param=name)
    if req.best_of is not None and req.best_of != req.n:
        raise OpenAIError(
            f"best_of must equal n ({req.n}): minivllm returns every sample, got {req.best_of!r}",
            param="best_of",
        )
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt != {"type": "text"}:
        raise OpenAIError(
            "response_format other than {'type': 'text'} (JSON mode, json_schema) is not "
            "supported by minivllm",
            param="response_format",
        )
