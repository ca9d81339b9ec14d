"""The pooling APIs' request bodies: OpenAI's `/v1/embeddings` (`openai-python`'s
`EmbeddingCreateParams`) with vLLM's extras. Validated as the other requests are (protocol.py:
unknown fields and wrong types are 400s that name the field)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from minivllm.entrypoints.protocol import _Request

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(_Request):
    model: str | None = None
    input: EmbeddingInput = Field(
        description="A string, a list of strings, a list of token ids, or a list of those."
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, description="Matryoshka models only: keep this many.")
    user: str | None = None
    # vLLM's extras
    truncate_prompt_tokens: int | None = Field(None, description="Keep the last k tokens; -1: all.")
    normalize: bool | None = Field(None, description="Unit length; null: the model's default.")


class ScoreRequest(_Request):
    """vLLM's `/score`: one `text_1` against each `text_2` (1:N), or pairwise (N:N)."""

    model: str | None = None
    text_1: str | list[str] = Field(description="A text, or one per text_2.")
    text_2: str | list[str] = Field(description="The texts to score against text_1.")
    truncate_prompt_tokens: int | None = Field(None, description="Keep the last k tokens; -1: all.")


class RerankRequest(_Request):
    """vLLM's `/rerank` and `/v1/rerank` (Jina's and Cohere's shape): the documents ordered by
    their score against the query, the best `top_n` (0 or unset: all)."""

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = Field(None, description="How many results; 0 or null: every document.")
    return_documents: bool = Field(True, description="Include each document's text.")
    truncate_prompt_tokens: int | None = Field(None, description="Keep the last k tokens; -1: all.")


class PoolingRequest(_Request):
    """vLLM's `/pooling`: the pooler's raw output per input (an embedding or a classifier's
    probabilities), as `/v1/embeddings` takes its inputs."""

    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    truncate_prompt_tokens: int | None = Field(None, description="Keep the last k tokens; -1: all.")


class ClassificationRequest(_Request):
    """vLLM's `/classify`: a classifier's probabilities and most probable label per input."""

    model: str | None = None
    input: EmbeddingInput
    truncate_prompt_tokens: int | None = Field(None, description="Keep the last k tokens; -1: all.")
