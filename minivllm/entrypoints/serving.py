"""The two generation endpoints: OpenAI request -> engine requests -> OpenAI response or SSE stream.

vLLM's `OpenAIServingCompletion` / `OpenAIServingChat` (vllm/entrypoints/openai/serving_*.py) in one
class, because the two differ only in how the prompt is made (text or token ids vs. the chat
template) and in the names of the response fields. Every check that can fail runs before the first
byte is sent, so a bad request is a 400 and never a broken stream; a failure after the stream began
is sent as an error event followed by `data: [DONE]`.

A completion with several prompts becomes one engine request per prompt, sharing one output queue;
the choices are numbered prompt-major (`prompt_index * n + sample_index`), as OpenAI does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from minivllm.entrypoints.async_engine import AsyncLLMEngine, StreamItem
from minivllm.entrypoints.logprobs import chat_logprobs, completion_logprobs
from minivllm.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    unsupported_fields,
)
from minivllm.inputs import PromptType
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger("minivllm")

# Fields of SamplingParams whose ValueError messages name them (and so the 400's `param`).
_PARAM_NAMES = {f for f in SamplingParams.__dataclass_fields__} | {"top_logprobs"}


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        served_model_names: list[str],
        max_waiting_requests: int,
        max_num_seqs: int,
    ) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.max_waiting_requests = max_waiting_requests
        self.max_num_seqs = max_num_seqs
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len

    # ------------------------------------------------------------------ checks
    def check_model(self, model: str | None) -> str:
        if model is None:
            return self.served_model_names[0]
        if model not in self.served_model_names:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, param="model")
        return model

    def check_capacity(self) -> None:
        if self.engine.num_waiting >= self.max_waiting_requests:
            raise OpenAIError(
                f"the server is overloaded: {self.engine.num_waiting} requests are waiting "
                f"(bound: {self.max_waiting_requests}); retry later",
                503,
                headers={"Retry-After": "1"},
            )

    def _max_tokens(self, requested: int | None, num_prompt: int, field: str) -> int:
        if num_prompt >= self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {num_prompt} tokens, which leaves no room for the completion.",
                param="messages" if field == "max_completion_tokens" else "prompt",
            )
        if requested is None:
            return self.max_model_len - num_prompt
        if requested >= 1 and num_prompt + requested > self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt + requested} tokens ({num_prompt} in the prompt, "
                f"{requested} in the completion). Please reduce the prompt or {field}.",
                param=field,
            )
        return requested  # < 1 is refused by SamplingParams, with its own message

    def sampling_params(self, req: Any, max_tokens: int, logprobs: int | None) -> SamplingParams:
        if req.n > self.max_num_seqs:
            raise OpenAIError(
                f"n must be at most max_num_seqs ({self.max_num_seqs}), got {req.n}", param="n"
            )
        extras = {
            k: v
            for k, v in (
                ("temperature", req.temperature),
                ("top_p", req.top_p),
                ("top_k", req.top_k),
                ("min_p", req.min_p),
                ("repetition_penalty", req.repetition_penalty),
            )
            if v is not None
        }
        try:
            return SamplingParams(
                n=req.n,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                seed=req.seed,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                **extras,
            )
        except ValueError as exc:  # SamplingParams' messages name the field and the range
            name = str(exc).split(" ", 1)[0]
            raise OpenAIError(str(exc), param=name if name in _PARAM_NAMES else None) from None

    # ------------------------------------------------------------------ /v1/completions
    async def create_completion(self, req: CompletionRequest, is_disconnected: Any) -> Any:
        model = self.check_model(req.model)
        unsupported_fields(req)
        if req.echo and req.logprobs is not None:
            raise OpenAIError("echo with logprobs (prompt logprobs) is not supported", param="echo")
        prompts = _split_prompts(req.prompt)
        tokenized: list[tuple[str | None, list[int]]] = []
        for p in prompts:
            try:
                tokenized.append(self.engine.engine.tokenize_prompt(p))
            except ValueError as exc:
                raise OpenAIError(str(exc), param="prompt") from None
        params = [
            self.sampling_params(
                req, self._max_tokens(req.max_tokens, len(ids), "max_tokens"), req.logprobs
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
        created = int(time.time())

        def choice(i: int, c: Any, text: str, start: int, offset: int) -> dict[str, Any]:
            lps = None
            if k is not None and c.logprobs is not None:
                lps = completion_logprobs(c.token_ids[start:], c.logprobs[start:], k, offset)
            return {"index": i, "text": text, "logprobs": lps, "finish_reason": None}

        header = {"id": rid, "object": "text_completion", "created": created, "model": model}
        ids_in: list[PromptType] = [{"prompt_token_ids": ids} for _, ids in tokenized]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            def chunk(prompt_i: int, c: Any, prev_text: int, prev_tok: int, first: bool) -> Any:
                echo = echo_texts[prompt_i] if first else ""
                offset = len(echo_texts[prompt_i]) + prev_text
                ch = choice(prompt_i * n + c.index, c, echo + c.text[prev_text:], prev_tok, offset)
                ch["finish_reason"] = _finish(c)
                return {**header, "choices": [ch]}

            return self._stream(rid, ids_in, params, header, chunk, include_usage, None, req.echo)

        finals = await self._collect(rid, ids_in, params, is_disconnected)
        choices = []
        for pi, out in enumerate(finals):
            for c in out.outputs:
                ch = choice(pi * n + c.index, c, echo_texts[pi] + c.text, 0, len(echo_texts[pi]))
                ch["finish_reason"] = _finish(c)
                choices.append(ch)
        return {**header, "choices": choices, "usage": _usage(finals)}

    # ------------------------------------------------------------------ /v1/chat/completions
    async def create_chat_completion(self, req: ChatCompletionRequest, is_disconnected: Any) -> Any:
        model = self.check_model(req.model)
        unsupported_fields(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        ids = self.apply_chat_template(req.messages, req.add_generation_prompt)
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = [self.sampling_params(req, self._max_tokens(requested, len(ids), field), k)]
        self.check_capacity()
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        header = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
        }
        ids_in: list[PromptType] = [{"prompt_token_ids": ids}]

        def logprobs_of(c: Any, start: int) -> dict[str, Any] | None:
            if k is None or c.logprobs is None:
                return None
            return {"content": chat_logprobs(c.token_ids[start:], c.logprobs[start:], k)}

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            chunk_header = {**header, "object": "chat.completion.chunk"}

            def chunk(_pi: int, c: Any, prev_text: int, prev_tok: int, first: bool) -> Any:
                delta = {"content": c.text[prev_text:]}
                ch = {"index": c.index, "delta": delta, "logprobs": logprobs_of(c, prev_tok)}
                ch["finish_reason"] = _finish(c)
                return {**chunk_header, "choices": [ch]}

            def role_chunk(index: int) -> dict[str, Any]:
                ch = {"index": index, "delta": {"role": "assistant", "content": ""}}
                return {
                    **chunk_header,
                    "choices": [{**ch, "logprobs": None, "finish_reason": None}],
                }

            return self._stream(rid, ids_in, params, chunk_header, chunk, include_usage, role_chunk)

        finals = await self._collect(rid, ids_in, params, is_disconnected)
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs_of(c, 0),
                "finish_reason": _finish(c),
            }
            for c in finals[0].outputs
        ]
        return {**header, "choices": choices, "usage": _usage(finals)}

    def apply_chat_template(self, messages: list[Any], add_generation_prompt: bool) -> list[int]:
        conversation = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in messages
        ]
        try:
            ids = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=True
            )
        except Exception as exc:  # jinja's TemplateError: e.g. roles the template refuses
            raise OpenAIError(f"the chat template failed: {exc}", param="messages") from None
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    # ------------------------------------------------------------------ engine plumbing
    def _submit(
        self, rid: str, prompts: list[PromptType], params: list[SamplingParams]
    ) -> tuple[asyncio.Queue[StreamItem], list[str]]:
        out: asyncio.Queue[StreamItem] = asyncio.Queue()
        rids = [f"{rid}-{i}" for i in range(len(prompts))]
        for sub, prompt, p in zip(rids, prompts, params):
            self.engine.add_request(sub, prompt, p, out)
        return out, rids

    async def _results(
        self, submitted: tuple[asyncio.Queue[StreamItem], list[str]]
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(prompt index, cumulative output) until every prompt's request finished; on any exit
        (a client disconnect cancels us), the requests still running are aborted."""
        out, rids = submitted
        index = {r: i for i, r in enumerate(rids)}
        pending = set(rids)
        try:
            while pending:
                item = await out.get()
                if isinstance(item, BaseException):
                    raise OpenAIError(f"the request failed: {item}", 500)
                if item.error is not None:
                    raise OpenAIError(f"the request failed: {item.error}", 500)
                if item.finished:
                    pending.discard(item.request_id)
                yield index[item.request_id], item
        finally:
            if pending:
                self.engine.abort(sorted(pending))

    async def _collect(
        self,
        rid: str,
        prompts: list[PromptType],
        params: list[SamplingParams],
        is_disconnected: Any,
    ) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(prompts)
        # Submitted now, not at the first iteration: the waiting bound must count this request
        # before the next handler checks it.
        results = self._results(self._submit(rid, prompts, params))

        async def consume() -> None:
            async for i, o in results:
                finals[i] = o

        task = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(is_disconnected())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():  # the client went away: cancelling aborts the requests
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await results.aclose()
        task.result()  # re-raise a failure
        return [f for f in finals if f is not None]

    def _stream(
        self,
        rid: str,
        prompts: list[PromptType],
        params: list[SamplingParams],
        header: dict[str, Any],
        chunk: Callable[[int, Any, int, int, bool], dict[str, Any]],
        include_usage: bool,
        role_chunk: Callable[[int], dict[str, Any]] | None,
        emit_first: bool = False,
    ) -> StreamingResponse:
        n = params[0].n
        submitted = self._submit(rid, prompts, params)  # now, as in _collect

        async def events() -> AsyncIterator[str]:
            # (prompt, sample) -> (characters, tokens) sent so far
            prev: dict[tuple[int, int], tuple[int, int]] = {}
            done: set[tuple[int, int]] = set()
            finals: dict[int, RequestOutput] = {}
            results = self._results(submitted)
            try:
                if role_chunk is not None:
                    for i in range(n):
                        yield _sse(role_chunk(i))
                async for pi, out in results:
                    finals[pi] = out
                    for c in out.outputs:
                        key = (pi, c.index)
                        if key in done:
                            continue
                        first = key not in prev
                        p_text, p_tok = prev.get(key, (0, 0))
                        grew = len(c.text) > p_text or c.finish_reason is not None
                        if not (grew or (first and emit_first)):
                            continue  # text held back (a possible stop string): nothing to send
                        prev[key] = (len(c.text), len(c.token_ids))
                        yield _sse(chunk(pi, c, p_text, p_tok, first))
                        if c.finish_reason is not None:
                            done.add(key)
                if include_usage:
                    usage = _usage([finals[i] for i in sorted(finals)])
                    yield _sse({**header, "choices": [], "usage": usage})
            except OpenAIError as exc:
                yield _sse(exc.to_dict())
            except Exception as exc:  # the stream has begun: report in-band, never a broken stream
                logger.exception("stream failed")
                yield _sse(OpenAIError(f"internal error: {type(exc).__name__}", 500).to_dict())
            finally:
                await results.aclose()  # aborts what still runs (a disconnect lands here)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


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


def _finish(c: Any) -> str | None:
    reason = c.finish_reason
    return "length" if reason == "length" else ("stop" if reason is not None else None)


def _usage(outputs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.to_dict(), status_code=exc.status_code, headers=exc.headers)
