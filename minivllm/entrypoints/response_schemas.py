"""The response bodies of the OpenAI-compatible server, as pydantic models.

The handlers build plain dicts; these models document them: `openapi.py` publishes them in the
server's schema (what `/docs` shows and what clients generate code from), and the schema-driven
fuzz test (tests/entrypoints/test_server_fuzz.py) fails on any field a handler sends that is not named here.
The request models, which validate, are in `protocol.py`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from minivllm.entrypoints.protocol_structured import DeltaToolCall, ToolCall


class _Response(BaseModel):
    # Exact shapes: the fuzz test fails on a field the handlers send but this file does not name.
    model_config = ConfigDict(extra="forbid")


class ErrorInfo(_Response):
    message: str
    type: str = Field(description="vLLM's error type, e.g. BadRequestError.")
    param: str | None = Field(description="The request field at fault, when there is one.")
    code: int = Field(description="The HTTP status.")


class ErrorResponse(_Response):
    error: ErrorInfo


FinishReason = Literal["stop", "length", "tool_calls"] | None
# vLLM's extra beside finish_reason "stop": the stop token id or stop string that ended the choice
# (null for EOS, for any other reason, and until the choice ends).
StopReason = Annotated[int | str | None, Field(description="The stop token id or string hit.")]


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="None: an echoed first prompt token.")
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(_Response):
    logprob: float
    rank: int
    decoded_token: str | None


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(_Response):
    index: int = Field(description="prompt_index * n + sample_index")
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    stop_reason: StopReason
    prompt_token_ids: list[int] | None = Field(None, description="With return_token_ids.")
    token_ids: list[int] | None = Field(None, description="With return_token_ids.")
    prompt_logprobs: PromptLogprobs | None = Field(None, description="With prompt_logprobs.")


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    service_tier: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(_Response):
    """One `data:` event of a completion stream."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice] = Field(description="Empty in the final usage chunk.")
    usage: UsageInfo | None = Field(
        None, description="With include_usage (last chunk) or continuous_usage_stats (each chunk)."
    )


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprobEntry(ChatTokenLogprob):
    top_logprobs: list[ChatTokenLogprob]


class ChatChoiceLogprobs(_Response):
    content: list[ChatTokenLogprobEntry]


class ChatResponseMessage(_Response):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer is only tool calls.")
    # OpenAI's message fields minivllm never fills, sent as null (as vLLM's ChatMessage does).
    refusal: None = None
    annotations: None = None
    audio: None = None
    function_call: None = None
    tool_calls: list[ToolCall] = Field(default_factory=list, description="[] without calls.")
    reasoning_content: str | None = Field(
        None, description="vLLM's reasoning parsers' field; always null (minivllm has none)."
    )


class ChatCompletionChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None
    finish_reason: FinishReason
    stop_reason: StopReason
    token_ids: list[int] | None = Field(None, description="With return_token_ids.")


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    service_tier: str | None = None
    system_fingerprint: str | None = None
    usage: UsageInfo
    prompt_token_ids: list[int] | None = Field(None, description="With return_token_ids.")
    prompt_logprobs: PromptLogprobs | None = Field(None, description="With prompt_logprobs.")


class ChatDelta(_Response):
    role: Literal["assistant"] | None = Field(
        None, description="Only in each choice's first chunk."
    )
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None
    finish_reason: FinishReason
    stop_reason: StopReason = None
    token_ids: list[int] | None = Field(None, description="With return_token_ids: new ids.")


class ChatCompletionStreamResponse(_Response):
    """One `data:` event of a chat completion stream."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice] = Field(description="Empty in the usage chunk.")
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = Field(
        None, description="With return_token_ids, in the first chunk."
    )


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class LoadResponse(_Response):
    server_load: int  # generation requests in flight


class TokenizerInfoResponse(_Response):
    model_config = ConfigDict(extra="allow")  # the tokenizer's own init settings follow
    tokenizer_class: str


class DetokenizeResponse(_Response):
    prompt: str


class ModelCard(_Response):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str = Field(description="The model the name serves (an adapter: its folder).")
    parent: str | None = Field(description="A LoRA adapter's base model name; null otherwise.")
    max_model_len: int
    task: str = Field(description="generate, or a pooling model's task: embed or classify.")


class ModelList(_Response):
    object: Literal["list"]
    data: list[ModelCard]


class VersionResponse(_Response):
    version: str


class EmbeddingData(_Response):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(description="Numbers, or base64 float32 bytes.")


class EmbeddingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Response):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class ScoreData(_Response):
    index: int
    object: Literal["score"]
    score: float


class ScoreResponse(_Response):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankDocument(_Response):
    text: str


class RerankResult(_Response):
    index: int = Field(description="The document's place in the request's `documents`.")
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(_Response):
    id: str
    model: str
    usage: EmbeddingUsage
    results: list[RerankResult] = Field(description="Best first, at most top_n.")


class PoolingData(_Response):
    index: int
    object: Literal["pooling"]
    data: list[float] | str = Field(description="Numbers, or base64 float32 bytes.")


class PoolingResponse(_Response):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[PoolingData]
    usage: EmbeddingUsage


class ClassificationData(_Response):
    index: int
    label: str | None = Field(description="id2label of the most probable class.")
    probs: list[float] = Field(description="Softmax over the classes (a sigmoid for one).")
    num_classes: int


class ClassificationResponse(_Response):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ClassificationData]
    usage: EmbeddingUsage
