"""`/score`, `/rerank` and `/v1/rerank` over a pooling model (vLLM's `ServingScores`,
vllm/entrypoints/openai/serving_score.py), `/pooling`, the pooler's raw output, and `/classify`
(vLLM's `ServingClassification`): a classifier's probabilities per input, with the label of the
most probable class from the checkpoint's `id2label`.

A score is what `LLM.score` computes (minivllm/pooling/scoring.py): a cross-encoder reads each
(text_1, text_2) pair as its tokenizer joins pairs and gives the sigmoid of its one logit; an
embedding model embeds every text once and gives the cosine of the two vectors. `/rerank` is the
same scores of the query against each document, ordered best first (Jina's and Cohere's shape:
`results` of `index`, `relevance_score`, `document`), cut to `top_n`.

As for `/v1/embeddings`, every text is tokenized and checked (empty, too long) before any request
is queued, so a hostile body is a 400 naming its field and nothing runs.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from minivllm.entrypoints.protocol import OpenAIError
from minivllm.entrypoints.protocol_pooling import (
    ClassificationRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from minivllm.entrypoints.serving import invalid_param
from minivllm.entrypoints.serving_embedding import MAX_INPUTS, OpenAIServingEmbedding
from minivllm.inputs import PromptType, truncate_prompt
from minivllm.pooling.config import class_labels
from minivllm.pooling.pooling_params import PoolingParams
from minivllm.pooling.scoring import cosine, pair_prompt


class OpenAIServingScore(OpenAIServingEmbedding):
    async def create_score(self, req: ScoreRequest, is_disconnected: Any) -> Any:
        model = self.check_model(req.model)
        firsts = self._texts(req.text_1, "text_1")
        seconds = self._texts(req.text_2, "text_2")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise OpenAIError(
                f"text_1 must be one text or as many as text_2 ({len(seconds)}), got {len(firsts)}",
                param="text_1",
            )
        rid = f"score-{uuid.uuid4().hex}"
        scores, num_tokens = await self._scores(
            rid, firsts, seconds, req.truncate_prompt_tokens, ("text_1", "text_2"), is_disconnected
        )
        return {
            "id": rid,
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }

    async def create_rerank(self, req: RerankRequest, is_disconnected: Any) -> Any:
        model = self.check_model(req.model)
        query = self._texts(req.query, "query")[0]
        documents = self._texts(req.documents, "documents")
        if req.top_n is not None and req.top_n < 0:
            raise OpenAIError(f"top_n must be at least 0, got {req.top_n}", param="top_n")
        rid = f"rerank-{uuid.uuid4().hex}"
        scores, num_tokens = await self._scores(
            rid,
            [query] * len(documents),
            documents,
            req.truncate_prompt_tokens,
            ("query", "documents"),
            is_disconnected,
        )
        order = sorted(range(len(documents)), key=lambda i: -scores[i])  # stable: ties by index
        top_n = req.top_n or len(documents)
        results = []
        for i in order[:top_n]:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if req.return_documents:
                result["document"] = {"text": documents[i]}
            results.append(result)
        return {
            "id": rid,
            "model": model,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
            "results": results,
        }

    async def create_pooling(self, req: PoolingRequest, is_disconnected: Any) -> Any:
        """The pooler's output per input: an embedding model's vector, a classifier's probs."""
        model = self.check_model(req.model)
        params = self._params(req.truncate_prompt_tokens)
        return await self._pool_each(
            req, params, model, is_disconnected, "pool",
            lambda i, vector: {"index": i, "object": "pooling", "data": vector},
        )  # fmt: skip

    async def create_classify(self, req: ClassificationRequest, is_disconnected: Any) -> Any:
        """Each input's class probabilities (softmax; a sigmoid for one class) and label."""
        model = self.check_model(req.model)
        pooler = self.engine_client.config.pooler
        assert pooler is not None, "the classify route is added for pooling models only"
        if pooler.task != "classify":
            raise refuse_classification(pooler.task)
        params = self._params(req.truncate_prompt_tokens)
        prompts = [self._tokenized(p, params) for p in self._inputs(req.input)]
        self.check_capacity()
        rid = f"classify-{uuid.uuid4().hex}"
        outputs = await self._collect(rid, prompts, [params] * len(prompts), is_disconnected)
        labels = class_labels(self.engine_client.config.resolved.source.path, pooler.hidden_size)
        data = []
        for i, out in enumerate(outputs):
            probs = out.pooled
            assert probs is not None
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(
                {"index": i, "label": labels[best], "probs": probs, "num_classes": len(probs)}
            )
        num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return {
            "id": rid,
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }

    # ------------------------------------------------------------------ helpers
    async def _scores(
        self,
        rid: str,
        firsts: list[str],
        seconds: list[str],
        truncate: int | None,
        fields: tuple[str, str],
        is_disconnected: Any,
    ) -> tuple[list[float], int]:
        """Each pair's score and the prompt tokens read: a cross-encoder's pairs, or the
        embeddings of every distinct text and their cosines."""
        pooler = self.engine_client.config.pooler
        assert pooler is not None, "the score routes are added for pooling models only"
        params = self._params(truncate)
        if pooler.task == "classify":
            if pooler.hidden_size != 1:
                raise OpenAIError(
                    f"scores need a cross-encoder (a classifier of one label); this model has "
                    f"{pooler.hidden_size} labels",
                    param="model",
                )
            tok = self.engine_client.tokenizer
            if tok is None:
                raise OpenAIError("scores of texts need a tokenizer (skip_tokenizer_init is set)")
            pairs = [
                self._checked(pair_prompt(tok, a, b, pooler.use_pad_token), params, fields[1])
                for a, b in zip(firsts, seconds)
            ]
            self.check_capacity()
            outputs = await self._collect(rid, pairs, [params] * len(pairs), is_disconnected)
            scores = [out.pooled[0] for out in outputs if out.pooled is not None]
            return scores, sum(len(o.prompt_token_ids) for o in outputs)
        texts = list(dict.fromkeys([*firsts, *seconds]))  # each distinct text embedded once
        names = {t: fields[0] for t in firsts} | {t: fields[1] for t in seconds}
        prompts = [self._checked(t, params, names[t]) for t in texts]
        self.check_capacity()
        outputs = await self._collect(rid, prompts, [params] * len(prompts), is_disconnected)
        vectors = {t: out.pooled for t, out in zip(texts, outputs)}
        scores = [cosine(vectors[a] or [], vectors[b] or []) for a, b in zip(firsts, seconds)]
        return scores, sum(len(o.prompt_token_ids) for o in outputs)

    def _params(self, truncate: int | None) -> PoolingParams:
        try:
            return PoolingParams(truncate_prompt_tokens=truncate)
        except ValueError as exc:
            raise invalid_param(exc) from None

    def _checked(self, prompt: PromptType, params: PoolingParams, field: str) -> PromptType:
        """The prompt tokenized, truncated and refused (400, `field`) when too long."""
        try:
            if isinstance(prompt, dict):
                ids = list(prompt["prompt_token_ids"])
            else:
                _, ids = self.engine_client.tokenize_prompt(prompt)
        except ValueError as exc:
            raise OpenAIError(f"{field}: {exc}", param=field) from None
        kept = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)
        if len(kept) > self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(kept)} tokens in {field}. Please reduce the length of the "
                "input.",
                param=field,
            )
        checked: dict[str, Any] = {"prompt_token_ids": kept}
        if isinstance(prompt, dict) and "token_type_ids" in prompt:
            checked["token_type_ids"] = list(prompt["token_type_ids"])[len(ids) - len(kept) :]
        return checked

    @staticmethod
    def _texts(value: str | list[str], field: str) -> list[str]:
        """One text or a list of them, none empty, at most MAX_INPUTS."""
        texts = [value] if isinstance(value, str) else list(value)
        if not texts:
            raise OpenAIError(f"{field} must not be empty", param=field)
        if len(texts) > MAX_INPUTS:
            raise OpenAIError(
                f"{field} must have at most {MAX_INPUTS} items, got {len(texts)}", param=field
            )
        if any(not t.strip() for t in texts):
            raise OpenAIError(f"{field} must not contain an empty text", param=field)
        return texts


def refuse_classification(task: str) -> OpenAIError:
    """What /classify answers on a model that is not a classifier (vLLM: "The model does not
    support Classification API")."""
    return OpenAIError(
        f"this model (task {task!r}) is not a classifier: /classify needs one (a "
        "*ForSequenceClassification checkpoint, or runner='pooling' with convert='classify')",
        param="model",
    )
