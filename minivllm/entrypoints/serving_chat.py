"""POST /v1/chat/completions: messages through the model's chat template (vLLM's serving_chat.py).

A stream starts with one `{"role": "assistant"}` delta per choice, as OpenAI's does; the choices are
the request's n samples of its one prompt.

Tool calling (`tools`, `tool_choice`): "none" generates text; "required" and a named function
force a valid call through the grammar engine (`tool_parsers/forced.py`); "auto" lets the model
choose, and the server's `--tool-call-parser` finds the calls in its text. The tools reach the
model through its chat template (`tools=`), so a template that never reads them is refused where
the model would have to know them (auto, or a conversation that carries calls).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from minivllm.core.outputs import CompletionOutput, RequestOutput
from minivllm.engine.beam_search import BeamSearchParams
from minivllm.entrypoints.logprobs import chat_logprobs, prompt_logprobs_json
from minivllm.entrypoints.protocol import ChatCompletionRequest, OpenAIError, unsupported_fields
from minivllm.entrypoints.serving import OpenAIServing, finish_reason, usage
from minivllm.entrypoints.tool_parsers.abstract_tool_parser import (
    ExtractedToolCall,
    ExtractedToolCalls,
    ToolParser,
)
from minivllm.entrypoints.tool_parsers.forced import named_schema, parse_required, required_schema
from minivllm.inputs import PromptType
from minivllm.lora.request import LoRARequest
from minivllm.sampling_params import SamplingParams
from minivllm.structured_output.params import StructuredOutputsParams


@dataclass
class ChatPlan:
    """A checked chat request, ready to run: everything its response is built from."""

    req: ChatCompletionRequest  # with the model's sampling defaults filled in
    mode: str  # tool mode: "none" | "auto" | "required" | "named"
    named: str | None  # the named function, in "named" mode
    ids: list[int]  # the prompt, through the chat template (and truncated)
    echo: str  # the last assistant message, continued, when `echo` asks for it
    k: int | None  # top logprobs per token; None: no logprobs
    params: list[SamplingParams | BeamSearchParams]
    header: dict[str, Any]  # id, object, created, model
    as_ids: bool  # --return-tokens-as-token-ids
    lora_request: LoRARequest | None = None  # the adapter `model` named; None: the base model

    @property
    def prompts(self) -> list[PromptType]:
        return [{"prompt_token_ids": self.ids}]

    @property
    def prompt_extras(self) -> dict[str, Any]:
        return {"prompt_token_ids": self.ids} if self.req.return_token_ids else {}

    def logprobs_of(self, c: CompletionOutput, start: int) -> dict[str, Any] | None:
        if self.k is None or c.logprobs is None:
            return None
        lps = chat_logprobs(c.token_ids[start:], c.logprobs[start:], self.k, self.as_ids)
        return {"content": lps}

    def with_ids(self, ch: dict[str, Any], c: CompletionOutput, start: int) -> dict[str, Any]:
        return {**ch, "token_ids": c.token_ids[start:]} if self.req.return_token_ids else ch


# OpenAI's message fields minivllm never fills: sent as null, as vLLM's ChatMessage sends them, so
# the JSON has every key a client's model of the message declares.
UNSET_MESSAGE_FIELDS = {"refusal": None, "annotations": None, "audio": None, "function_call": None}


class OpenAIServingChat(OpenAIServing):
    tool_parser: ToolParser | None = None  # --tool-call-parser
    enable_auto_tool_choice = False  # --enable-auto-tool-choice

    async def create_chat_completion(self, req: ChatCompletionRequest, is_disconnected: Any) -> Any:
        plan = await self.prepare_chat(req)  # every 400 comes from here, before anything runs
        self.check_capacity()
        if req.stream:
            return self.stream_chat(plan)
        rid = plan.header["id"]
        finals = await self._collect(
            rid, plan.prompts, plan.params, is_disconnected, plan.lora_request
        )
        return self.chat_response(plan, finals)

    async def prepare_chat(self, req: ChatCompletionRequest) -> ChatPlan:
        """Check the request, render its prompt, and make its sampling parameters."""
        model, lora_request = self.check_model_lora(req.model)
        unsupported_fields(req)
        self.check_stream_options(req.stream, req.stream_options)
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        req, from_model = self.with_model_defaults(req)
        mode, forced = self.tool_mode(req)
        ids = self.apply_chat_template(
            req.messages,
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
            req.documents,
            tools=req.tools,
        )
        ids = self.truncate(req, ids)
        last = req.messages[-1]
        echo = last.text() if req.echo and last.role == "assistant" else ""
        requested: int | None = req.max_tokens
        field = "max_tokens"
        if req.max_completion_tokens is not None:
            field, requested = "max_completion_tokens", req.max_completion_tokens
        k = (req.top_logprobs or 0) if req.logprobs else None
        budget = self.max_tokens(requested, len(ids), field, field in from_model)
        structured = await self.structured_outputs(req, forced)
        params = [self.sampling_params(req, budget, k, structured, req.prompt_logprobs)]
        header = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
        }
        named = req.tool_choice.function.name if mode == "named" else None  # type: ignore[union-attr]
        as_ids = self.tokens_as_ids(req)
        return ChatPlan(req, mode, named, ids, echo, k, params, header, as_ids, lora_request)

    def stream_chat(self, plan: ChatPlan) -> StreamingResponse:
        """One role delta per choice, then content (or tool-call) deltas as the text grows."""
        req, mode = plan.req, plan.mode
        chunk_header = {**plan.header, "object": "chat.completion.chunk"}
        sent: dict[int, int] = {}  # choice -> characters of content sent (tool modes)

        def chunk(
            _pi: int,
            c: CompletionOutput,
            prev_text: int,
            prev_tok: int,
            _f: bool,
            _out: RequestOutput,
        ) -> Any:
            delta: dict[str, Any] = {"content": c.text[prev_text:]}
            reason = finish_reason(c)
            if mode == "named":  # the arguments stream as they are generated
                fn: dict[str, Any] = {"arguments": c.text[prev_text:]}
                call: dict[str, Any] = {"index": 0, "function": fn}
                if prev_text == 0:
                    call |= {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function"}
                    fn["name"] = plan.named
                delta = {"content": None, "tool_calls": [call]}
            elif mode in ("required", "auto"):
                delta, reason = self._tool_delta(mode, c, sent, reason)
            ch = {
                "index": c.index,
                "delta": delta,
                "logprobs": plan.logprobs_of(c, prev_tok),
                "finish_reason": reason,
                "stop_reason": c.stop_reason if reason else None,
            }
            return {**chunk_header, "choices": [plan.with_ids(ch, c, prev_tok)]}

        def role_chunk(index: int) -> dict[str, Any]:
            delta = {"role": "assistant", "content": plan.echo}
            ch = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
            if req.return_token_ids:
                ch["token_ids"] = []
            return {**chunk_header, "choices": [ch], **plan.prompt_extras}

        rid = plan.header["id"]
        return self._stream(
            rid,
            plan.prompts,
            plan.params,
            chunk_header,
            chunk,
            req.stream_options,
            role_chunk,
            lora_request=plan.lora_request,
        )

    def chat_response(self, plan: ChatPlan, finals: list[RequestOutput]) -> dict[str, Any]:
        """The whole response, once every choice finished; tool calls found in the text."""
        choices = []
        for c in finals[0].outputs:
            # `reasoning_content`: vLLM's field for a reasoning parser's output; minivllm has no
            # reasoning parser, so it is always null (present, as in vLLM's responses).
            message: dict[str, Any] = {
                "role": "assistant",
                "content": plan.echo + c.text,
                **UNSET_MESSAGE_FIELDS,
                "tool_calls": [],
                "reasoning_content": None,
            }
            reason = finish_reason(c)
            extracted = self._extract(plan.mode, plan.named, c)
            if extracted is not None and extracted.tools_called:
                # A forced call's message has content "" (vLLM's), an auto call's what the
                # parser left around the calls.
                forced = plan.mode in ("named", "required")
                message["content"] = "" if forced else extracted.content
                message["tool_calls"] = [t.to_openai() for t in extracted.tool_calls]
                reason = "tool_calls" if plan.mode != "named" else reason
            choice = {
                "index": c.index,
                "message": message,
                "logprobs": plan.logprobs_of(c, 0),
                "finish_reason": reason,
                "stop_reason": c.stop_reason,
            }
            choices.append(plan.with_ids(choice, c, 0))
        extras = dict(plan.prompt_extras)
        # vLLM's extra, at the top level (its ChatCompletionResponse), null unless asked for
        extras["prompt_logprobs"] = (
            prompt_logprobs_json(finals[0].prompt_logprobs, plan.as_ids)
            if plan.req.prompt_logprobs is not None
            else None
        )
        # OpenAI's fields that vLLM sends as null; a client's model_dump() has them either way.
        unset = {"service_tier": None, "system_fingerprint": None}
        return {**plan.header, "choices": choices, **unset, "usage": usage(finals), **extras}

    # ------------------------------------------------------------------ tool calling
    def tool_mode(
        self, req: ChatCompletionRequest
    ) -> tuple[str, tuple[StructuredOutputsParams, str] | None]:
        """("none" | "auto" | "required" | "named", the forced call's constraint if any)."""
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none"):
                raise OpenAIError("tool_choice needs tools", param="tool_choice")
            if req.parallel_tool_calls is not None:
                raise OpenAIError("parallel_tool_calls needs tools", param="parallel_tool_calls")
            return "none", None
        if choice is None:
            choice = "auto"  # OpenAI's default when tools are given
        if choice == "none":
            return "none", None
        if choice == "auto":
            if not (self.enable_auto_tool_choice and self.tool_parser is not None):
                raise OpenAIError(
                    '"auto" tool choice requires --enable-auto-tool-choice and '
                    "--tool-call-parser to be set",
                    param="tool_choice",
                )
            return "auto", None
        constrained = (req.response_format is not None and req.response_format.type != "text") or (
            req.structured_outputs is not None
        )
        if constrained:
            raise OpenAIError(
                "a forced tool call cannot be combined with response_format or structured_outputs",
                param="tool_choice",
            )
        if choice == "required":
            try:
                schema = required_schema(req.tools, req.parallel_tool_calls is not False)
            except ValueError as exc:
                raise OpenAIError(str(exc), param="tools") from None
            return "required", (StructuredOutputsParams(json=schema), "tools")
        by_name = {t.function.name: t for t in req.tools}
        name = choice.function.name
        if name not in by_name:
            raise OpenAIError(
                f"tool_choice names the function {name!r}, which is not in tools",
                param="tool_choice",
            )
        schema = named_schema(by_name[name].function.parameters)
        return "named", (StructuredOutputsParams(json=schema), "tools")

    def _extract(
        self, mode: str, named: str | None, c: CompletionOutput
    ) -> ExtractedToolCalls | None:
        if mode == "named" and c.finish_reason != "length":
            return ExtractedToolCalls(True, [ExtractedToolCall(named or "", c.text)], None)
        if mode == "required":
            calls = parse_required(c.text) if c.finish_reason != "length" else None
            return ExtractedToolCalls(True, calls, None) if calls else None
        if mode == "auto" and self.tool_parser is not None:
            return self.tool_parser.extract_tool_calls(c.text)
        return None

    def _tool_delta(
        self, mode: str, c: CompletionOutput, sent: dict[int, int], reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """A stream's delta in "required"/"auto": plain content as soon as it is surely not a
        call; the calls whole, in the last chunk, once the text is complete."""
        done = c.finish_reason is not None
        if mode == "auto" and self.tool_parser is not None and not done:
            end = self.tool_parser.content_end(c.text)
        else:
            end = 0 if mode == "required" else len(c.text)
        if done:
            extracted = self._extract(mode, None, c)
            if extracted is not None and extracted.tools_called:
                head = sent.get(c.index, 0)
                content = extracted.content or ""
                delta: dict[str, Any] = {"content": content[head:] or None}
                delta["tool_calls"] = [
                    {"index": i, **t.to_openai()} for i, t in enumerate(extracted.tool_calls)
                ]
                return delta, "tool_calls"
            end = len(c.text)
        head = sent.get(c.index, 0)
        end = max(end, head)
        sent[c.index] = end
        return {"content": c.text[head:end]}, reason

    # ------------------------------------------------------------------ the prompt
    def apply_chat_template(
        self,
        messages: list[Any],
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        documents: list[dict[str, str]] | None = None,
        tools: list[Any] | None = None,
    ) -> list[int]:
        if add_generation_prompt and continue_final_message:  # vLLM's rule and wording
            raise OpenAIError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )
        conversation = [_message_dict(m) for m in messages]
        # A template that never reads tools (SmolLM2's) is rendered anyway, and the output is
        # parsed for calls all the same, as vLLM does: the tools then reach the model only through
        # a forced call's grammar, or not at all, which is the template's choice, not the server's.
        kwargs = dict(chat_template_kwargs or {})
        reserved = {
            "conversation", "tokenize", "add_generation_prompt", "continue_final_message", "tools",
            "documents",
        }  # fmt: skip
        clash = sorted(reserved & set(kwargs))
        if clash:
            raise OpenAIError(
                f"chat_template_kwargs must not set {clash[0]!r}: it is a request field or "
                "decided by the server",
                param="chat_template_kwargs",
            )
        if tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
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


def _message_dict(m: Any) -> dict[str, Any]:
    """A message as chat templates read it; a call's arguments as a dict (as vLLM passes them:
    templates write them with `tojson`)."""
    out: dict[str, Any] = {
        **(m.model_extra or {}),  # other fields (reasoning_content, ...) reach the template too
        "role": "system" if m.role == "developer" else m.role,
        "content": m.text(),
    }
    if m.tool_calls:
        calls = []
        for call in m.tool_calls:
            try:
                args: Any = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                args = call.function.arguments
            fn = {"name": call.function.name, "arguments": args}
            calls.append({"id": call.id, "type": "function", "function": fn})
        out["tool_calls"] = calls
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out
