"""`/v1/embeddings`: OpenAI's embeddings API over a pooling model (vLLM's
`OpenAIServingEmbedding`, vllm/entrypoints/openai/serving_embedding.py).

The request (`EmbeddingRequest`) is OpenAI's: `input` is a string, a list of strings, a list of
token ids or a list of those; `encoding_format` "float" (a list of numbers) or "base64" (the
float32 values' little-endian bytes, base64: what the `openai` client asks for by default and
decodes itself); `dimensions` (matryoshka models only). Every input is tokenized and checked
before any is queued, so a bad one is a 400 naming `input` and nothing runs; each input is then
one prefill-only request, and the response lists them in input order with OpenAI's `usage`.

A generating model's server has no embeddings; a pooling model's refuses generation with a 400
that names its task (`refuse_generation`).
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Callable
from typing import Any

from minivllm.entrypoints.protocol import OpenAIError
from minivllm.entrypoints.protocol_pooling import EmbeddingInput, EmbeddingRequest, PoolingRequest
from minivllm.entrypoints.serving import OpenAIServing, invalid_param
from minivllm.inputs import PromptType, truncate_prompt
from minivllm.pooling.pooling_params import PoolingParams

MAX_INPUTS = 2048  # OpenAI's bound on the inputs of one request


class OpenAIServingEmbedding(OpenAIServing):
    async def create_embedding(self, req: EmbeddingRequest, is_disconnected: Any) -> Any:
        model = self.check_model(req.model)
        pooler = self.engine_client.config.pooler
        assert pooler is not None, "the embeddings route is added for pooling models only"
        try:
            params = PoolingParams(
                dimensions=req.dimensions,
                normalize=req.normalize,
                truncate_prompt_tokens=req.truncate_prompt_tokens,
            )
            params.verify(pooler)
        except ValueError as exc:
            raise invalid_param(exc) from None
        return await self._pool_each(
            req, params, model, is_disconnected, "embd", lambda i, vector: {
                "object": "embedding", "index": i, "embedding": vector,
            },
        )  # fmt: skip

    async def _pool_each(
        self,
        req: Any,  # an EmbeddingRequest or a PoolingRequest: `input`, `encoding_format`
        params: PoolingParams,
        model: str,
        is_disconnected: Any,
        id_prefix: str,
        item: Callable[[int, Any], dict[str, Any]],  # (index, encoded vector) -> one `data` entry
    ) -> dict[str, Any]:
        """Pool every input of a request (/v1/embeddings, /pooling) and answer in OpenAI's list
        shape, `usage` counting the prompts' tokens."""
        prompts = [self._tokenized(p, params) for p in self._inputs(req.input)]
        self.check_capacity()
        rid = f"{id_prefix}-{uuid.uuid4().hex}"
        outputs = await self._collect(rid, prompts, [params] * len(prompts), is_disconnected)
        data = []
        for i, out in enumerate(outputs):
            assert out.pooled is not None
            data.append(item(i, encode(out.pooled, req)))
        num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return {
            "id": rid,
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }

    @staticmethod
    def _inputs(value: EmbeddingInput) -> list[PromptType]:
        """The request's inputs, one prompt each (a flat list of ints is one tokenized input)."""
        if isinstance(value, str):
            return [value]
        if not value:
            raise OpenAIError("input must not be empty", param="input")
        if len(value) > MAX_INPUTS:
            raise OpenAIError(
                f"input must have at most {MAX_INPUTS} items, got {len(value)}", param="input"
            )
        if all(isinstance(v, int) for v in value):
            return [list(value)]  # type: ignore[arg-type]
        return list(value)  # type: ignore[arg-type]

    def _tokenized(self, prompt: PromptType, params: PoolingParams) -> PromptType:
        """The input's token ids, refused (400, `input`) when empty, out of the vocabulary or
        longer than max_model_len after any truncation."""
        try:
            _, ids = self.engine_client.tokenize_prompt(prompt)
        except ValueError as exc:
            raise OpenAIError(f"input: {exc}", param="input") from None
        ids = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)
        if len(ids) > self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(ids)} tokens in the input for embedding generation. Please "
                "reduce the length of the input.",
                param="input",
            )
        return {"prompt_token_ids": ids}


def encode(embedding: list[float], req: EmbeddingRequest | PoolingRequest) -> list[float] | str:
    """OpenAI's two encodings: the numbers, or their float32 little-endian bytes in base64."""
    if req.encoding_format == "float":
        return embedding
    import numpy as np

    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")


def refuse_generation(task: str) -> OpenAIError:
    """What a generation route answers on a pooling model (vLLM's server has no such handler)."""
    return OpenAIError(
        f"this model runs with runner='pooling' (task {task!r}): it does not support "
        "generation; use /v1/embeddings",
        param="model",
    )
