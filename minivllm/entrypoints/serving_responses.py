"""POST /v1/responses: OpenAI's Responses API for text (vLLM's serving_responses.py, minus tools).

A response is one assistant message item with one `output_text` part. The prompt is made as for
chat completions (`instructions` as a system message, then `input`, through the chat template);
the engine request is the same. What differs is the shape: `output` items instead of `choices`,
`usage` as input/output tokens, `status` "incomplete" when `max_output_tokens` cut the text, and a
stream of typed events (`response.created`, `response.output_text.delta`, ...,
`response.completed`), each with a `sequence_number`, instead of chunks.

Tier: frontends (may import anything below; nothing below imports it).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from minivllm.entrypoints.protocol import ChatMessage, OpenAIError, refuse_unsupported
from minivllm.entrypoints.protocol_responses import ResponsesRequest
from minivllm.entrypoints.serving import OpenAIServing
from minivllm.entrypoints.serving_chat import OpenAIServingChat
from minivllm.inputs import PromptType
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger("minivllm")


class OpenAIServingResponses(OpenAIServing):
    def __init__(self, chat: OpenAIServingChat, *args: Any) -> None:
        super().__init__(*args)
        self.chat = chat  # the chat template, applied as for chat completions

    async def create_response(self, req: ResponsesRequest, is_disconnected: Any) -> Any:
        model = self.check_model(req.model)
        refuse_unsupported(req)
        if req.store:
            raise OpenAIError(
                "store must be false: minivllm keeps no responses to retrieve later",
                param="store",
            )
        req, from_model = self.with_model_defaults(req)
        ids = self.chat.apply_chat_template(self._messages(req), add_generation_prompt=True)
        cap = "max_output_tokens" in from_model
        max_tokens = self.max_tokens(req.max_output_tokens, len(ids), "max_output_tokens", cap)
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,  # OpenAI's default
                top_p=1.0 if req.top_p is None else req.top_p,
            )
        except ValueError as exc:
            name = str(exc).split(" ", 1)[0]
            raise OpenAIError(
                str(exc), param=name.replace("max_tokens", "max_output_tokens")
            ) from None
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
            "metadata": req.metadata or {},
            "user": req.user,
            "store": False,
            "previous_response_id": None,
            "parallel_tool_calls": True,
            "tool_choice": "none",
            "tools": [],
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "reasoning": None,
            "error": None,
        }
        item_id = f"msg_{uuid.uuid4().hex}"
        prompts: list[PromptType] = [{"prompt_token_ids": ids}]
        if req.stream:
            return self._stream_events(rid, prompts, params, base, item_id)
        finals = await self._collect(rid, prompts, [params], is_disconnected)
        return _response(base, item_id, finals[0])

    @staticmethod
    def _messages(req: ResponsesRequest) -> list[ChatMessage]:
        messages = []
        if req.instructions is not None:
            messages.append(
                ChatMessage.model_validate({"role": "system", "content": req.instructions})
            )
        if isinstance(req.input, str):
            messages.append(ChatMessage.model_validate({"role": "user", "content": req.input}))
        else:
            messages += [
                ChatMessage.model_validate({"role": m.role, "content": m.text()}) for m in req.input
            ]
        return messages

    def _stream_events(
        self,
        rid: str,
        prompts: list[PromptType],
        params: SamplingParams,
        base: dict[str, Any],
        item_id: str,
    ) -> StreamingResponse:
        submitted = self._submit(rid, prompts, [params])  # now: the waiting bound counts it

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
            done = _response(base, item_id, final)
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


def _response(base: dict[str, Any], item_id: str, out: RequestOutput) -> dict[str, Any]:
    c = out.outputs[0]
    cut = c.finish_reason == "length"
    num_in, num_out = len(out.prompt_token_ids), len(c.token_ids)
    message = {
        "id": item_id,
        "type": "message",
        "status": "incomplete" if cut else "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": c.text, "annotations": [], "logprobs": []}],
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
