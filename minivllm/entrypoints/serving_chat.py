"""POST /v1/chat/completions: messages through the model's chat template (vLLM's serving_chat.py).

A stream starts with one `{"role": "assistant"}` delta per choice, as OpenAI's does; the choices
are the request's n samples of its one prompt.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from minivllm.entrypoints.logprobs import chat_logprobs
from minivllm.entrypoints.protocol import ChatCompletionRequest, OpenAIError, unsupported_fields
from minivllm.entrypoints.serving import OpenAIServing, finish_reason, usage
from minivllm.inputs import PromptType
from minivllm.outputs import CompletionOutput


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, req: ChatCompletionRequest, is_disconnected: Any) -> Any:
        model = self.check_model(req.model)
        unsupported_fields(req)
        self.check_stream_options(req.stream, req.stream_options)
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        req, from_model = self.with_model_defaults(req)
        ids = self.apply_chat_template(
            req.messages,
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
            req.documents,
        )
        ids = self.truncate(req, ids)
        last = req.messages[-1]
        echo = last.text() if req.echo and last.role == "assistant" else ""
        requested: int | None = req.max_tokens
        field = "max_tokens"
        if req.max_completion_tokens is not None:
            field, requested = "max_completion_tokens", req.max_completion_tokens
        cap = field in from_model
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = [self.sampling_params(req, self.max_tokens(requested, len(ids), field, cap), k)]
        self.check_capacity()
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        header = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
        }
        ids_in: list[PromptType] = [{"prompt_token_ids": ids}]

        as_ids = self.return_tokens_as_token_ids

        def logprobs_of(c: CompletionOutput, start: int) -> dict[str, Any] | None:
            if k is None or c.logprobs is None:
                return None
            return {"content": chat_logprobs(c.token_ids[start:], c.logprobs[start:], k, as_ids)}

        def with_ids(ch: dict[str, Any], c: CompletionOutput, start: int) -> dict[str, Any]:
            return {**ch, "token_ids": c.token_ids[start:]} if req.return_token_ids else ch

        prompt_ids = {"prompt_token_ids": ids} if req.return_token_ids else {}

        if req.stream:
            chunk_header = {**header, "object": "chat.completion.chunk"}

            def chunk(
                _pi: int, c: CompletionOutput, prev_text: int, prev_tok: int, _f: bool
            ) -> Any:
                ch = {
                    "index": c.index,
                    "delta": {"content": c.text[prev_text:]},
                    "logprobs": logprobs_of(c, prev_tok),
                    "finish_reason": finish_reason(c),
                }
                return {**chunk_header, "choices": [with_ids(ch, c, prev_tok)]}

            def role_chunk(index: int) -> dict[str, Any]:
                delta = {"role": "assistant", "content": echo}
                ch = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
                if req.return_token_ids:
                    ch["token_ids"] = []
                return {**chunk_header, "choices": [ch], **prompt_ids}

            return self._stream(
                rid, ids_in, params, chunk_header, chunk, req.stream_options, role_chunk
            )

        finals = await self._collect(rid, ids_in, params, is_disconnected)
        choices = [
            with_ids(
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": echo + c.text},
                    "logprobs": logprobs_of(c, 0),
                    "finish_reason": finish_reason(c),
                },
                c,
                0,
            )
            for c in finals[0].outputs
        ]
        return {**header, "choices": choices, "usage": usage(finals), **prompt_ids}

    def apply_chat_template(
        self,
        messages: list[Any],
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        documents: list[dict[str, str]] | None = None,
    ) -> list[int]:
        if add_generation_prompt and continue_final_message:  # vLLM's rule and wording
            raise OpenAIError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )
        conversation = [
            {
                **(m.model_extra or {}),
                "role": "system" if m.role == "developer" else m.role,
                "content": m.text(),
                **({"name": m.name} if m.name is not None else {}),
            }
            for m in messages
        ]
        kwargs = dict(chat_template_kwargs or {})
        reserved = {"conversation", "tokenize", "add_generation_prompt", "continue_final_message"}
        clash = sorted(reserved & set(kwargs))
        if clash:
            raise OpenAIError(
                f"chat_template_kwargs must not set {clash[0]!r}: it is a request field or "
                "decided by the server",
                param="chat_template_kwargs",
            )
        try:
            ids = self.tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                documents=documents,
                tokenize=True,
                **kwargs,
            )
        except Exception as exc:  # jinja's TemplateError: e.g. roles the template refuses
            raise OpenAIError(f"the chat template failed: {exc}", param="messages") from None
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
