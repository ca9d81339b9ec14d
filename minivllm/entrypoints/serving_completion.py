"""POST /v1/completions: OpenAI's legacy text completion (vLLM's serving_completion.py).

A completion with several prompts becomes one engine request per prompt, sharing one output queue;
the choices are numbered prompt-major (`prompt_index * n + sample_index`), as OpenAI does.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from minivllm.entrypoints.logprobs import (
    completion_logprobs,
    echo_logprobs,
    prompt_logprobs_json,
)
from minivllm.entrypoints.protocol import CompletionRequest, OpenAIError, unsupported_fields
from minivllm.entrypoints.serving import OpenAIServing, finish_reason, usage
from minivllm.inputs import PromptType
from minivllm.outputs import CompletionOutput, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, req: CompletionRequest, is_disconnected: Any) -> Any:
        model = self.check_model(req.model)
        unsupported_fields(req)
        self.check_stream_options(req.stream, req.stream_options)
        req, from_model = self.with_model_defaults(req)
        tokenized: list[tuple[str | None, list[int]]] = []
        for p in _split_prompts(req.prompt):
            try:
                text, ids = self.engine.engine.tokenize_prompt(p)
            except ValueError as exc:
                raise OpenAIError(str(exc), param="prompt") from None
            kept = self.truncate(req, ids)
            tokenized.append((text, ids) if len(kept) == len(ids) else (None, kept))
        cap = "max_tokens" in from_model
        structured = await self.structured_outputs(req)
        # echo + logprobs (OpenAI's legacy way to score a text, what lm-eval sends): the prompt's
        # tokens need their logprobs too, so the request asks for its prompt's (vLLM does so).
        echo_k = req.logprobs if req.echo else None
        prompt_k = req.prompt_logprobs if req.prompt_logprobs is not None else echo_k
        params = [
            self.sampling_params(
                req,
                self.max_tokens(req.max_tokens, len(ids), "max_tokens", cap),
                req.logprobs,
                structured,
                prompt_k,
            )
            for _, ids in tokenized
        ]
        self.check_capacity()
        echo_texts = [
            (text if text is not None else self.tokenizer.decode(ids)) if req.echo else ""
            for text, ids in tokenized
        ]
        n, k = req.n, req.logprobs
        rid = f"cmpl-{uuid.uuid4().hex}"
        header = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
        }

        as_ids = self.tokens_as_ids(req)

        def choice(
            i: int,
            c: CompletionOutput,
            text: str,
            start: int,
            offset: int,
            whole: RequestOutput,
            first: bool = True,
        ) -> Any:
            lps = None
            if k is not None and c.logprobs is not None:
                head = None
                if req.echo and first and whole.prompt_logprobs is not None:
                    head, offset = echo_logprobs(
                        tokenized[i // n][1], whole.prompt_logprobs, k, self.decode_one, as_ids
                    )
                lps = completion_logprobs(
                    c.token_ids[start:], c.logprobs[start:], k, offset, as_ids
                )
                if head is not None:
                    lps = {key: head[key] + lps[key] for key in lps}
            out = {"index": i, "text": text, "logprobs": lps, "finish_reason": finish_reason(c)}
            if req.return_token_ids:  # vLLM: the prompt's ids once, then each chunk's new ids
                if first:
                    out["prompt_token_ids"] = tokenized[i // n][1]
                out["token_ids"] = c.token_ids[start:]
            if (
                first
            ):  # vLLM's extra, on the choice (its CompletionResponseChoice), null unless asked
                out["prompt_logprobs"] = (
                    prompt_logprobs_json(whole.prompt_logprobs, as_ids)
                    if req.prompt_logprobs is not None
                    else None
                )
            return out

        ids_in: list[PromptType] = [{"prompt_token_ids": ids} for _, ids in tokenized]
        if req.stream:

            def chunk(
                pi: int,
                c: CompletionOutput,
                prev_text: int,
                prev_tok: int,
                first: bool,
                whole: RequestOutput,
            ) -> Any:
                echo = echo_texts[pi] if first else ""
                offset = len(echo_texts[pi]) + prev_text
                text = echo + c.text[prev_text:]
                ch = choice(pi * n + c.index, c, text, prev_tok, offset, whole, first)
                return {**header, "choices": [ch]}

            return self._stream(
                rid,
                ids_in,
                params,
                header,
                chunk,
                req.stream_options,
                emit_first=req.echo or req.return_token_ids or req.prompt_logprobs is not None,
            )

        finals = await self._collect(rid, ids_in, params, is_disconnected)
        choices = [
            choice(pi * n + c.index, c, echo_texts[pi] + c.text, 0, len(echo_texts[pi]), out)
            for pi, out in enumerate(finals)
            for c in out.outputs
        ]
        return {**header, "choices": choices, "usage": usage(finals)}


def _split_prompts(prompt: Any) -> list[PromptType]:
    """OpenAI's four prompt shapes -> a list of engine prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError("prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": list(prompt)}]
    if isinstance(prompt[0], list):
        return [{"prompt_token_ids": list(p)} for p in prompt]
    return list(prompt)
