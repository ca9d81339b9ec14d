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
