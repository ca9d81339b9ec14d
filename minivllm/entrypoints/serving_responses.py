"""POST /v1/responses: OpenAI's Responses API for text (vLLM's serving_responses.py, minus tools).

A response is one assistant message item with one `output_text` part. The prompt is made as for
chat completions (`instructions` as a system message, then `input`, through the chat template);
the engine request is the same. What differs is the shape: `output` items instead of `choices`,
`usage` as input/output tokens, `status` "incomplete" when `max_output_tokens` cut the text, and a
stream of typed events (`response.created`, `response.output_text.delta`, ...,
`response.completed`), each with a `sequence_number`, instead of chunks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from minivllm.core.outputs import RequestOutput
from minivllm.entrypoints.logprobs import chat_logprobs
from minivllm.entrypoints.protocol import ChatMessage, OpenAIError, refuse_unsupported
from minivllm.entrypoints.protocol_responses import ResponsesRequest
from minivllm.entrypoints.responses_store import ResponsesStore, StoredResponse
from minivllm.entrypoints.serving import OpenAIServing, invalid_param
from minivllm.entrypoints.serving_chat import OpenAIServingChat
from minivllm.entrypoints.structured_requests import compile_or_400
from minivllm.inputs import PromptType
from minivllm.lora.request import LoRARequest
from minivllm.sampling_params import SamplingParams
from minivllm.structured_output.params import StructuredOutputsParams

logger = logging.getLogger("minivllm")


class OpenAIServingResponses(OpenAIServing):
    def __init__(
        self, chat: OpenAIServingChat, *args: Any, store: ResponsesStore | None = None
    ) -> None:
        super().__init__(*args)
        self.chat = chat  # the chat template, applied as for chat completions
        self.store = store if store is not None else ResponsesStore()

    async def create_response(self, req: ResponsesRequest, is_disconnected: Any) -> Any:
        model, lora_request = self.check_model_lora(req.model)
        refuse_unsupported(req)
        if req.background and not req.store:  # vLLM's wording
            raise OpenAIError("background can only be used when `store` is true", param="store")
        if req.background and req.stream:
            raise OpenAIError(
                "background responses are not streamed by minivllm: GET the response instead",
                param="stream",
            )
        prev = None
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id, "previous_response_id")
        req, from_model = self.with_model_defaults(req)
        messages = self._messages(req, prev)
        ids = self.chat.apply_chat_template(messages, add_generation_prompt=True)
        params = await self._sampling_params(req, len(ids), from_model)
        self.check_capacity()
        rid = f"resp_{uuid.uuid4().hex}"
        base = {
            "id": rid,
            "object": "response",
            "created_at": int(time.time()),
            "model": model,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_logprobs": req.top_logprobs,
            "metadata": req.metadata or {},
            "user": req.user,
            "store": req.store,
            "background": req.background,
            "previous_response_id": req.previous_response_id,
            "parallel_tool_calls": True,
            "tool_choice": "none",
            "tools": [],
            "text": {"format": _format_of(req)},
            "truncation": "disabled",
            "reasoning": None,
            "error": None,
        }
        prompts: list[PromptType] = [{"prompt_token_ids": ids}]
        run = _Run(rid, f"msg_{uuid.uuid4().hex}", prompts, params, base, lora_request)
        keep = messages if req.store else None
        if req.stream:
            return self._stream_events(run, keep)
        if req.background:
            return self._start_background(run, messages)
        finals = await self._collect(rid, run.prompts, [params], is_disconnected, lora_request)
        done = _response(base, run.item_id, finals[0], params.logprobs)
        if keep is not None:
            self.store.put(rid, done, keep)
        return done

    async def retrieve_response(self, rid: str) -> dict[str, Any]:
        return self.store.get(rid).response

    async def cancel_response(self, rid: str) -> dict[str, Any]:
        return await self.store.cancel(rid)

    async def _sampling_params(
        self, req: ResponsesRequest, num_prompt: int, from_model: Any
    ) -> SamplingParams:
        cap = "max_output_tokens" in from_model
        max_tokens = self.max_tokens(req.max_output_tokens, num_prompt, "max_output_tokens", cap)
        structured = _structured_outputs(req)
        if structured is not None:  # compiled now, off the event loop: a bad schema is a 400
            manager = self.engine_client.structured_output_manager
            await asyncio.to_thread(compile_or_400, manager, structured, "text.format")
        with_logprobs = req.include is not None and "message.output_text.logprobs" in req.include
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,  # OpenAI's default
                top_p=1.0 if req.top_p is None else req.top_p,
                logprobs=(req.top_logprobs or 0) if with_logprobs else None,
                structured_outputs=structured,
            )
        except ValueError as exc:
            raise invalid_param(exc, {"max_tokens": "max_output_tokens"}) from None

    def _start_background(self, run: _Run, messages: list[ChatMessage]) -> dict[str, Any]:
        """Store the response as `queued` and run it in a task; GET reads its progress."""
        queued = {**run.base, "status": "queued", "output": [], "usage": None}
        self.store.put(run.rid, queued, messages)

        async def background() -> None:
            try:
                finals = await self._collect(
                    run.rid, run.prompts, [run.params], _never, run.lora_request
                )
                done = _response(run.base, run.item_id, finals[0], run.params.logprobs)
            except OpenAIError as exc:
                done = {**queued, "status": "failed", "error": _error(exc)}
            except Exception as exc:  # the run is nobody's request now: record it
                logger.exception("background response %s failed", run.rid)
                error = OpenAIError(f"internal error: {type(exc).__name__}", 500)
                done = {**queued, "status": "failed", "error": _error(error)}
            self.store.finish(run.rid, done)

        self.store.get(run.rid).task = asyncio.create_task(background())
        return queued

    @staticmethod
    def _messages(req: ResponsesRequest, prev: StoredResponse | None) -> list[ChatMessage]:
        """instructions, then the previous response's conversation and its answer, then input
        (vLLM's `_construct_input_messages`)."""
        messages = []
        if req.instructions is not None:
            messages.append(
                ChatMessage.model_validate({"role": "system", "content": req.instructions})
            )
        if prev is not None:
            messages += prev.messages
            for item in prev.response["output"]:
                for part in item["content"]:
                    messages.append(
                        ChatMessage.model_validate({"role": "assistant", "content": part["text"]})
                    )
        if isinstance(req.input, str):
            messages.append(ChatMessage.model_validate({"role": "user", "content": req.input}))
        else:
            messages += [
                ChatMessage.model_validate({"role": m.role, "content": m.text()}) for m in req.input
            ]
        return messages

    def _stream_events(self, run: _Run, keep: list[ChatMessage] | None) -> StreamingResponse:
        """`keep`: the conversation to store the finished response with (None: not stored)."""
        rid, item_id, base, params = run.rid, run.item_id, run.base, run.params
        # Now: the waiting bound counts it.
        submitted = self._submit(rid, run.prompts, [params], run.lora_request)

        async def events() -> AsyncIterator[str]:
            seq = 0

            def event(kind: str, **fields: Any) -> str:
                nonlocal seq
                seq += 1
                body = {"type": kind, "sequence_number": seq - 1, **fields}
                return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

            in_progress = {**base, "status": "in_progress", "output": [], "usage": None}
            yield event("response.created", response=in_progress)
            yield event("response.in_progress", response=in_progress)
            item = {
                "id": item_id, "type": "message", "status": "in_progress",
                "role": "assistant", "content": [],
            }  # fmt: skip
            yield event("response.output_item.added", output_index=0, item=item)
            part = {"type": "output_text", "text": "", "annotations": []}
            where = {"item_id": item_id, "output_index": 0, "content_index": 0}
            yield event("response.content_part.added", **where, part=part)
            results = self._results(submitted)
            sent = 0
            final: RequestOutput | None = None
            try:
                async for _, out in results:
                    final = out
                    text = out.outputs[0].text
                    if len(text) > sent:
                        yield event(
                            "response.output_text.delta", **where, delta=text[sent:], logprobs=[]
                        )
                        sent = len(text)
            except OpenAIError as exc:
                failed = {**in_progress, "status": "failed", "error": _error(exc)}
                yield event("response.failed", response=failed)
                return
            except Exception as exc:  # the stream has begun: report in-band
                logger.exception("stream failed")
                failed = {
                    **in_progress,
                    "status": "failed",
                    "error": _error(OpenAIError(f"internal error: {type(exc).__name__}", 500)),
                }
                yield event("response.failed", response=failed)
                return
            finally:
                await results.aclose()  # aborts the request if the client went away
            assert final is not None
            done = _response(base, item_id, final, params.logprobs)
            if keep is not None:
                self.store.put(rid, done, keep)
            message = done["output"][0]
            text_part = message["content"][0]
            yield event("response.output_text.done", **where, text=text_part["text"], logprobs=[])
            yield event("response.content_part.done", **where, part=text_part)
            yield event("response.output_item.done", output_index=0, item=message)
            kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
            yield event(kind, response=done)

        return StreamingResponse(events(), media_type="text/event-stream")


def _error(exc: OpenAIError) -> dict[str, Any]:
    return {"code": str(exc.status_code), "message": str(exc)}


def _response(
    base: dict[str, Any], item_id: str, out: RequestOutput, k: int | None
) -> dict[str, Any]:
    """`k`: the top logprobs per token (None: no logprobs were asked for)."""
    c = out.outputs[0]
    cut = c.finish_reason == "length"
    num_in, num_out = len(out.prompt_token_ids), len(c.token_ids)
    logprobs = chat_logprobs(c.token_ids, c.logprobs, k) if k is not None and c.logprobs else []
    message = {
        "id": item_id,
        "type": "message",
        "status": "incomplete" if cut else "completed",
        "role": "assistant",
        "content": [
            {"type": "output_text", "text": c.text, "annotations": [], "logprobs": logprobs}
        ],
    }
    return {
        **base,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": [message],
        "usage": {
            "input_tokens": num_in,
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
            "output_tokens": num_out,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_in + num_out,
        },
    }


@dataclass
class _Run:
    """One response's engine request and the fields its body starts from."""

    rid: str
    item_id: str
    prompts: list[PromptType]
    params: SamplingParams
    base: dict[str, Any]
    lora_request: LoRARequest | None = None  # the adapter `model` named; None: the base model


async def _never() -> bool:
    """A background run's client never disconnects: only a cancel stops it."""
    await asyncio.Event().wait()
    return True


def _format_of(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return {"type": "text"}
    return fmt.model_dump(by_alias=True, exclude_none=True)


def _structured_outputs(req: ResponsesRequest) -> StructuredOutputsParams | None:
    """`text.format` as the request's structured-output constraint (vLLM's `to_sampling_params`)."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None:
        raise OpenAIError('text.format of type "json_schema" needs a schema', param="text.format")
    return StructuredOutputsParams(json=fmt.json_schema)
