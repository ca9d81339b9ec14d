"""The OpenAI wire format: pydantic models of the requests, the error shape, and the responses.

Field names and defaults are OpenAI's (`openai-python`'s `CompletionCreateParams` and
`ChatCompletionCreateParams`) plus vLLM's sampling extras (vllm/entrypoints/openai/protocol.py).
Two rules make a request either honoured or refused, never half-honoured:

- `extra="forbid"`: a field this server does not know is a 400 that names it.
- Fields that OpenAI defines but minivllm cannot honour (logit_bias, suffix, ...) are declared with
  `_unsupported(reason)`, so that `unsupported_fields` refuses them with a message saying *why*,
  rather than "unknown", and the published schema says the same.

`strict=True`: the body is validated from JSON (`model_validate_json`), where strict mode still
accepts an integer for a float, but refuses "0.5" for a number and 1 for a bool — the types on the
wire are the types of the API.

The structured-output and tool-calling models live in `protocol_structured.py`.

The request models are also the published OpenAPI schema of the request bodies (one source of
truth: see `openapi.py`). The response models only document what the handlers send; the handlers
build plain dicts, and the schema-driven fuzz test (tests/entrypoints/test_server_fuzz.py) holds the two equal.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from minivllm.entrypoints.protocol_structured import (
    ChatTool,
    ResponseFormat,
    StructuredOutputsRequest,
    ToolCallIn,
    ToolChoice,
)


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
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


# ---------------------------------------------------------------------- requests
class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _unsupported(reason: str) -> Any:
    """A field OpenAI or vLLM defines that minivllm refuses (400, `reason`) whenever it is set."""
    return Field(
        None,
        description=f"Refused with a 400 unless null: {reason}.",
        json_schema_extra={"x-unsupported": reason},
    )


class StreamOptions(_Request):
    include_usage: bool = Field(
        False, description="End the stream with a chunk that has `usage` and no choices."
    )
    continuous_usage_stats: bool = Field(
        False,
        description="vLLM's extra: with include_usage, every chunk carries the `usage` of its choice so far.",
    )


def check_stream_options(stream: bool, options: StreamOptions | None) -> None:
    # OpenAI and vLLM refuse it too: without a stream there is no chunk to carry the usage.
    if options is not None and not stream:
        raise OpenAIError(
            "stream_options is only allowed when stream is true", param="stream_options"
        )


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = Field(None, description="A served model name; omitted: the first one.")
    n: int = Field(1, description="Samples per prompt, at most the server's max_num_seqs.")
    temperature: float | None = Field(
        None, description="0 is greedy; omitted: the model's generation_config.json, else 1.0."
    )
    top_p: float | None = None
    stream: bool = Field(False, description="Send server-sent events, ending with `[DONE]`.")
    stream_options: StreamOptions | None = Field(None, description="Only with `stream: true`.")
    stop: str | list[str] | None = None
    seed: int | None = Field(
        None, ge=-(2**63), le=2**63 - 1, description="A 64-bit integer (vLLM's bounds)."
    )
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
    truncate_prompt_tokens: int | None = Field(
        None, description="vLLM's extra: keep the prompt's last k tokens (-1: max_model_len)."
    )
    use_beam_search: bool = Field(
        False,
        description="vLLM's beam search: `n` (or `best_of`) beams, the best first; greedy unless "
        "`temperature` > 0. Sampling-only fields (penalties, top_p/top_k/min_p, seed, stop, "
        "logprobs, ...) are refused with it.",
    )
    length_penalty: float = Field(
        1.0,
        description="Beam search only: beams are ranked by cum_logprob / len ** length_penalty.",
    )
    return_token_ids: bool = Field(
        False,
        description="vLLM's extra: the prompt's and each choice's token ids in the response (in "
        "a stream: the prompt's in the first chunk, each chunk's new ids).",
    )
    return_tokens_as_token_ids: bool | None = Field(
        None,
        description="vLLM's extra: in logprobs, name each token 'token_id:N'; omitted: the "
        "server's --return-tokens-as-token-ids.",
    )
    # OpenAI's and vLLM's fields that minivllm cannot honour
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> a bias in [-100, 100] added to its logit."
    )
    allowed_token_ids: list[int] | None = Field(
        None, description="vLLM's extra: only these tokens may be sampled."
    )
    bad_words: list[str] | None = Field(
        None, description="vLLM's extra: words that must not be generated."
    )
    best_of: Any = Field(None, description="Only equal to `n`: every sample (or beam) is returned.")
    prompt_logprobs: int | None = Field(
        None,
        description="vLLM's extra: top logprobs of every prompt token (up to --max-logprobs; -1: "
        "the vocabulary), returned as `prompt_logprobs` (the prompt is computed, not taken from "
        "the prefix cache).",
    )
    # Structured outputs (minivllm/structured_output/): at most one of these four ways.
    response_format: ResponseFormat | None = Field(
        None, description="OpenAI's: text, json_object, or json_schema with a schema."
    )
    structured_outputs: StructuredOutputsRequest | None = Field(
        None, description="vLLM's: exactly one of json, regex, choice, grammar, json_object."
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's older name.")
    guided_regex: str | None = Field(None, description="vLLM's older name.")
    guided_choice: list[str] | None = Field(None, description="vLLM's older name.")
    guided_grammar: str | None = Field(None, description="vLLM's older name.")


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput = Field(
        description="A string, a list of strings, token ids, or a list of token-id lists."
    )
    max_tokens: int | None = Field(16, description="OpenAI's default for completions: 16.")
    logprobs: int | None = Field(
        None, description="Top logprobs per token, up to --max-logprobs; -1: the vocabulary."
    )
    echo: bool = False
    suffix: Any = _unsupported("suffix (insertion) is not supported by minivllm")
    prompt_embeds: Any = Field(
        None,
        description="vLLM's extra (--enable-prompt-embeds): refused with a 400 unless null or "
        "empty; empty means none, as vLLM takes it.",
    )


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    # Other fields (e.g. `reasoning_content`) are kept and handed to the chat template with the
    # message, as vLLM does: a template that knows them uses them.
    model_config = ConfigDict(extra="allow", strict=True)
    # OpenAI's roles ("developer" is its new name for "system", "function" its older "tool"), or
    # any other: vLLM's CustomChatCompletionMessageParam hands an unknown role to the chat
    # template as it is, and the template decides what it means.
    role: str = Field(description="system, developer, user, assistant, tool, function, or any.")
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="An assistant's calls.")
    tool_call_id: str | None = Field(None, description="A tool message: the call it answers.")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, description="Omitted: what the context leaves.")
    max_completion_tokens: int | None = Field(
        None, description="OpenAI's newer name for max_tokens; wins over it."
    )
    logprobs: bool = Field(False, description='A boolean; the strings "true"/"false" too.')
    top_logprobs: int | None = Field(
        None, description="Up to --max-logprobs (-1: the vocabulary); needs `logprobs: true`."
    )

    @field_validator("logprobs", mode="before")
    @classmethod
    def _lax_logprobs(cls, value: Any) -> Any:
        # vLLM's models are not strict, so clients send `"logprobs": "true"` and vLLM takes it
        # (pydantic's lax bool strings); every other field keeps its strict JSON type.
        lax = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}
        if isinstance(value, str) and value.lower() in lax:
            return lax[value.lower()]
        return value

    add_generation_prompt: bool = Field(True, description="vLLM's extra.")
    continue_final_message: bool = Field(
        False,
        description="vLLM's extra: leave the last (assistant) message open, to be continued; "
        "needs add_generation_prompt false.",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM's extra: more variables for the chat template."
    )
    documents: list[dict[str, str]] | None = Field(
        None, description="vLLM's extra: documents for a RAG chat template (each a dict)."
    )
    echo: bool = Field(
        False,
        description="vLLM's extra: start the reply with the last message's content when that "
        "message is the assistant's (with continue_final_message).",
    )
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = Field(
        None,
        description='"none", "auto" (needs --enable-auto-tool-choice), "required" or a named '
        "function; omitted: auto with tools, else none",
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call.")
    functions: Any = _unsupported("function calling (functions) is not supported by minivllm")
    function_call: Any = _unsupported(
        "function calling (function_call) is not supported by minivllm"
    )
    audio: Any = _unsupported("audio output is not supported by minivllm")
    modalities: Any = _unsupported("output modalities are not supported by minivllm")
    prediction: Any = _unsupported("predicted outputs are not supported by minivllm")
    reasoning_effort: Any = _unsupported("reasoning_effort is not supported by minivllm")
    web_search_options: Any = _unsupported("web search is not supported by minivllm")


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = Field(None, description="Exactly one of prompt and messages.")
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = Field(
        None, description="Rendered by the chat template, as a chat completion's tools are."
    )
    return_token_strs: bool = Field(False, description="Also return each token's string (vLLM).")


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Request):  # POST /v1/load_lora_adapter (vLLM's body)
    lora_name: str = Field(description="The model name requests will use for the adapter.")
    lora_path: str = Field(description="The adapter's PEFT folder, on the server.")


class UnloadLoRAAdapterRequest(_Request):  # POST /v1/unload_lora_adapter (vLLM's body)
    lora_name: str
    lora_int_id: int | None = Field(None, description="vLLM's field; the name decides.")


# Fields that shape sampling, meaningless for beam search (which ranks whole beams): refused there.
BEAM_SEARCH_REFUSED = (
    "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "min_tokens", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs", "echo",
    "prompt_logprobs", "logit_bias", "allowed_token_ids", "bad_words",
)  # fmt: skip


def refuse_unsupported(req: BaseModel) -> None:
    """Refuse, by name, every field declared `_unsupported` that the request set."""
    for name, field in type(req).model_fields.items():
        extra = field.json_schema_extra
        if isinstance(extra, dict) and "x-unsupported" in extra and getattr(req, name) is not None:
            raise OpenAIError(str(extra["x-unsupported"]), param=name)


def unsupported_fields(req: _SamplingFields) -> None:
    """Refuse, by name, every declared field that minivllm cannot honour."""
    refuse_unsupported(req)
    if getattr(req, "prompt_embeds", None):  # an empty list is no embeddings (vLLM's reading)
        raise OpenAIError("prompt_embeds is not supported by minivllm", param="prompt_embeds")
    if req.best_of is not None and req.best_of != req.n:
        raise OpenAIError(
            f"best_of must equal n ({req.n}): minivllm returns every sample, got {req.best_of!r}",
            param="best_of",
        )
    if req.use_beam_search:
        fields = type(req).model_fields
        for name in BEAM_SEARCH_REFUSED:
            if name in fields and getattr(req, name) != fields[name].default:
                raise OpenAIError(f"{name} is not supported with use_beam_search", param=name)
    elif req.length_penalty != 1.0:
        raise OpenAIError("length_penalty needs use_beam_search", param="length_penalty")
