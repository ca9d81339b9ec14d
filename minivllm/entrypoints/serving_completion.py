"""POST /v1/completions: OpenAI's legacy text completion (vLLM's serving_completion.py).

A completion with several prompts becomes one engine request per prompt, sharing one output queue;
the choices are numbered prompt-major (`prompt_index * n + sample_index`), as OpenAI does.
"""

from __future__ import annotations

import functools
import time
import uuid
from dataclasses import dataclass
from typing import Any

from minivllm.core.outputs import CompletionOutput, RequestOutput
from minivllm.engine.beam_search import BeamSearchParams
from minivllm.entrypoints.logprobs import (
    completion_logprobs,
    echo_logprobs,
    prompt_logprobs_json,
)
from minivllm.entrypoints.protocol import CompletionRequest, OpenAIError, unsupported_fields
from minivllm.entrypoints.serving import OpenAIServing, finish_reason, usage
from minivllm.inputs import PromptType
from minivllm.lora.request import LoRARequest
from minivllm.sampling_params import SamplingParams


@dataclass
class CompletionPlan:
    """A checked completion request, ready to run: everything its response is built from."""

    req: CompletionRequest  # with the model's sampling defaults filled in
    prompt_ids: list[list[int]]  # each prompt's token ids (truncated)
    echo_texts: list[str]  # each prompt's text, when `echo` asks for it; else ""
    params: list[SamplingParams | BeamSearchParams]  # one per prompt
    header: dict[str, Any]  # id, object, created, model
    lora_request: LoRARequest | None = None  # the adapter `model` named; None: the base model

    @property
    def prompts(self) -> list[PromptType]:
        return [{"prompt_token_ids": ids} for ids in self.prompt_ids]


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, req: CompletionRequest, is_disconnected: Any) -> Any:
        plan = await self.prepare_completion(req)  # every 400 comes from here
        self.check_capacity()
        rid, req = plan.header["id"], plan.req
        if req.stream:
            return self._stream(
                rid,
                plan.prompts,
                plan.params,
                plan.header,
                functools.partial(self.stream_chunk, plan),
                req.stream_options,
                emit_first=req.echo or req.return_token_ids or req.prompt_logprobs is not None,
                lora_request=plan.lora_request,
            )
        finals = await self._collect(
            rid, plan.prompts, plan.params, is_disconnected, plan.lora_request
        )
        n, echo_texts = req.n, plan.echo_texts
        choices = [
            self.choice(
                plan, pi * n + c.index, c, echo_texts[pi] + c.text, 0, len(echo_texts[pi]), out
            )
            for pi, out in enumerate(finals)
            for c in out.outputs
        ]
        return {**plan.header, "choices": choices, "service_tier": None, "usage": usage(finals)}

    async def prepare_completion(self, req: CompletionRequest) -> CompletionPlan:
        """Check the request, tokenize its prompts, and make one sampling parameters each."""
        model, lora_request = self.check_model_lora(req.model)
        unsupported_fields(req)
        self.check_stream_options(req.stream, req.stream_options)
        req, from_model = self.with_model_defaults(req)
        tokenized: list[tuple[str | None, list[int]]] = []
        for p in _split_prompts(req.prompt):
            try:
                text, ids = self.engine_client.tokenize_prompt(p)
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
        echo_texts = [
            (text if text is not None else self.tokenizer.decode(ids)) if req.echo else ""
            for text, ids in tokenized
        ]
        header = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": None,  # OpenAI's field, which vLLM also sends as null
        }
        prompt_ids = [ids for _, ids in tokenized]
        return CompletionPlan(req, prompt_ids, echo_texts, params, header, lora_request)

    def stream_chunk(
        self,
        plan: CompletionPlan,
        pi: int,
        c: CompletionOutput,
        prev_text: int,
        prev_tok: int,
        first: bool,
        whole: RequestOutput,
    ) -> dict[str, Any]:
        """One stream event: the new text of prompt `pi`'s choice (its echo before the first)."""
        echo = plan.echo_texts[pi] if first else ""
        offset = len(plan.echo_texts[pi]) + prev_text
        text = echo + c.text[prev_text:]
        ch = self.choice(plan, pi * plan.req.n + c.index, c, text, prev_tok, offset, whole, first)
        return {**plan.header, "choices": [ch]}

    def choice(
        self,
        plan: CompletionPlan,
        i: int,
        c: CompletionOutput,
        text: str,
        start: int,
        offset: int,
        whole: RequestOutput,
        first: bool = True,
    ) -> dict[str, Any]:
        """Choice `i` (prompt-major) from token `start` on; `offset`: its text's first character
        in the whole choice (what logprobs' `text_offset` counts from)."""
        req, k, as_ids = plan.req, plan.req.logprobs, self.tokens_as_ids(plan.req)
        prompt_ids = plan.prompt_ids[i // req.n]
        lps = None
        if k is not None and c.logprobs is not None:
            head = None
            if req.echo and first and whole.prompt_logprobs is not None:
                head, offset = echo_logprobs(
                    prompt_ids, whole.prompt_logprobs, k, self.decode_one, as_ids
                )
            lps = completion_logprobs(c.token_ids[start:], c.logprobs[start:], k, offset, as_ids)
            if head is not None:
                lps = {key: head[key] + lps[key] for key in lps}
        reason = finish_reason(c)
        stop_reason = c.stop_reason if reason else None  # vLLM's extra: which stop ended it
        out = {
            "index": i,
            "text": text,
            "logprobs": lps,
            "finish_reason": reason,
            "stop_reason": stop_reason,
        }
        if req.return_token_ids:  # vLLM: the prompt's ids once, then each chunk's new ids
            if first:
                out["prompt_token_ids"] = prompt_ids
            out["token_ids"] = c.token_ids[start:]
        if first:  # vLLM's extra, on the choice (its CompletionResponseChoice), null unless asked
            out["prompt_logprobs"] = (
                prompt_logprobs_json(whole.prompt_logprobs, as_ids)
                if req.prompt_logprobs is not None
                else None
            )
        return out


def _split_prompts(prompt: Any) -> list[PromptType]:
    """OpenAI's four prompt shapes -> a list of engine prompts (text or token ids)."""
    if not prompt:  # vLLM's words (its clients match them); prompt_embeds are refused
        raise OpenAIError(
            "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt"
        )
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": list(prompt)}]
    if isinstance(prompt[0], list):
        return [{"prompt_token_ids": list(p)} for p in prompt]
    return list(prompt)
