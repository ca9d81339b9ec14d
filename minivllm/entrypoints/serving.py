"""What the two generation endpoints share: request checks, SamplingParams, engine plumbing, SSE.

vLLM's `OpenAIServing` (vllm/entrypoints/openai/serving_engine.py), the base of
`OpenAIServingCompletion` (serving_completion.py) and `OpenAIServingChat` (serving_chat.py), which
differ only in how the prompt is made (text or token ids vs. the chat template) and in the names of
the response fields. Every check that can fail runs before the first byte is sent, so a bad request
is a 400 and never a broken stream; a failure after the stream began (the engine failed the step
that carried the request) is sent as an error event followed by `data: [DONE]`, and the same failure
without streaming is a 500 in OpenAI's error shape. See docs/serving.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from minivllm.core.outputs import CompletionOutput, RequestOutput
from minivllm.engine.beam_search import BeamSearchParams
from minivllm.engine.input_processor import verify_n
from minivllm.engine.logprobs_limit import resolve_logprobs
from minivllm.engine.protocol import EngineClient, RequestParamsType, StreamItem
from minivllm.entrypoints.protocol import OpenAIError, StreamOptions, check_stream_options
from minivllm.entrypoints.serving_models import OpenAIServingModels
from minivllm.entrypoints.structured_requests import compile_or_400, request_structured_outputs
from minivllm.inputs import PromptType, process_token_params, truncate_prompt
from minivllm.lora.request import LoRARequest
from minivllm.sampling_params import SamplingParams, verify_truncate_prompt_tokens
from minivllm.structured_output.params import StructuredOutputsParams

logger = logging.getLogger("minivllm")

# Builds one stream event: (prompt index, choice so far, characters sent, tokens sent, first?,
# the request's whole output so far: its prompt logprobs, say).
ChunkFn = Callable[[int, CompletionOutput, int, int, bool, RequestOutput], dict[str, Any]]


class OpenAIServing:
    def __init__(
        self,
        engine_client: EngineClient,
        models: OpenAIServingModels,
        max_waiting_requests: int,
        max_num_seqs: int,
        return_tokens_as_token_ids: bool = False,
    ) -> None:
        self.engine_client = engine_client
        # vLLM's --return-tokens-as-token-ids: logprobs name tokens as "token_id:N" (logprobs.py)
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.models = models  # the served names and the LoRA adapters (serving_models.py)
        self.max_waiting_requests = max_waiting_requests
        self.max_num_seqs = max_num_seqs
        self.max_logprobs = engine_client.config.model.max_logprobs  # --max-logprobs
        self.tokenizer = engine_client.tokenizer
        self.max_model_len = engine_client.max_model_len
        # The model's generation_config.json sampling defaults (vLLM reads them once, too).
        self.default_sampling_params: dict[str, Any] = engine_client.get_diff_sampling_param()

    # ------------------------------------------------------------------ checks
    def check_model(self, model: str | None) -> str:
        """The name to answer with; 404 for a model the server does not serve."""
        return self.models.resolve(model)[0]

    def check_model_lora(self, model: str | None) -> tuple[str, LoRARequest | None]:
        """The name to answer with and the LoRA adapter it names (None: the base model)."""
        return self.models.resolve(model)

    def check_capacity(self) -> None:
        if self.engine_client.num_waiting >= self.max_waiting_requests:
            raise OpenAIError(
                f"the server is overloaded: {self.engine_client.num_waiting} requests are waiting "
                f"(bound: {self.max_waiting_requests}); retry later",
                503,
                headers={"Retry-After": "1"},
            )

    check_stream_options = staticmethod(check_stream_options)

    def with_model_defaults(self, req: Any) -> tuple[Any, set[str]]:
        """`req` as if the client had sent the model's sampling defaults for every field it left
        out (not in `model_fields_set`, the fields the JSON body named) or sent as null, and the
        names of the fields so filled. A value the client sent always wins. Null counts as left
        out, as in vLLM and OpenAI, where null means "the default"."""
        filled = {
            name: value
            for name, value in self.default_sampling_params.items()
            if name in type(req).model_fields
            and (name not in req.model_fields_set or getattr(req, name) is None)
        }
        return (req.model_copy(update=filled) if filled else req), set(filled)

    def max_tokens(self, requested: int | None, num_prompt: int, field: str, cap: bool) -> int:
        """The completion budget; `cap`: `requested` is the model's default, not the client's, so
        it is cut to what the context leaves instead of refused."""
        if num_prompt >= self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {num_prompt} tokens, which leaves no room for the completion.",
                param="messages" if field == "max_completion_tokens" else "prompt",
            )
        room = self.max_model_len - num_prompt
        if requested is None:
            return room
        if cap:
            return min(requested, room)
        if requested >= 1 and requested > room:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt + requested} tokens ({num_prompt} in the prompt, "
                f"{requested} in the completion). Please reduce the prompt or {field}.",
                param=field,
            )
        return requested  # < 1 is refused by SamplingParams, with its own message

    def sampling_params(
        self,
        req: Any,
        max_tokens: int,
        logprobs: int | None,
        structured: tuple[StructuredOutputsParams, str] | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams | BeamSearchParams:
        """`structured`: the request's constraint, from `structured_outputs()`. Every field is
        checked by the params' own types (and the engine's limits by the engine's functions, asked
        here first so that a refusal is a 400): this only turns their errors into the 400."""
        try:
            return self._build_params(req, max_tokens, logprobs, structured, prompt_logprobs)
        except ValueError as exc:
            raise invalid_param(exc, {"beam_width": "n"}) from None

    def _build_params(
        self,
        req: Any,
        max_tokens: int,
        logprobs: int | None,
        structured: tuple[StructuredOutputsParams, str] | None,
        prompt_logprobs: int | None,
    ) -> SamplingParams | BeamSearchParams:
        verify_n(req.n, self.max_num_seqs)
        if req.use_beam_search:
            return BeamSearchParams(
                beam_width=req.best_of if req.best_of is not None else req.n,
                max_tokens=max_tokens,
                ignore_eos=req.ignore_eos,
                temperature=req.temperature if req.temperature is not None else 0.0,
                length_penalty=req.length_penalty,
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
        params = SamplingParams(
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
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            logit_bias=_logit_bias(req.logit_bias),
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words,
            structured_outputs=structured[0] if structured is not None else None,
            **extras,
        )
        # The engine's own checks of what only it knows (max_logprobs, the vocabulary), asked now:
        # a 400 here, not a failure in the engine thread after the response began.
        resolve_logprobs(params, self.engine_client.vocab_size, self.max_logprobs)
        if params.logit_bias or params.allowed_token_ids or params.bad_words:
            client = self.engine_client
            process_token_params(params, client.tokenizer, client.vocab_size)
        return params

    def tokens_as_ids(self, req: Any) -> bool:
        """Whether logprobs name tokens 'token_id:N': the request's say, else the server's."""
        own = req.return_tokens_as_token_ids
        return self.return_tokens_as_token_ids if own is None else bool(own)

    def decode_one(self, token_id: int) -> str:
        """One token's text on its own (what logprobs name a token by)."""
        return str(self.tokenizer.decode([token_id]))

    def truncate(self, req: Any, ids: list[int]) -> list[int]:
        """The prompt as the engine will see it: `truncate_prompt_tokens` cuts it from the left
        before anything (the completion budget first) is computed from its length."""
        try:
            k = verify_truncate_prompt_tokens(req.truncate_prompt_tokens)
        except ValueError as exc:
            raise invalid_param(exc) from None
        return truncate_prompt(ids, k, self.max_model_len)

    async def structured_outputs(
        self, req: Any, forced: tuple[StructuredOutputsParams, str] | None = None
    ) -> tuple[StructuredOutputsParams, str] | None:
        """The request's constraint (`forced`: one the handler made, a forced tool call), compiled
        now, in a worker thread: a bad one is a 400 before anything is queued, and a slow one
        blocks neither the event loop nor the engine's steps. The engine then hits the cache."""
        structured = forced or request_structured_outputs(req)
        if structured is not None:
            if req.use_beam_search:
                raise OpenAIError(
                    "structured outputs are not supported with use_beam_search",
                    param="use_beam_search",
                )
            manager = self.engine_client.structured_output_manager
            await asyncio.to_thread(compile_or_400, manager, *structured)
        return structured

    # ------------------------------------------------------------------ engine plumbing
    def _submit(
        self,
        rid: str,
        prompts: list[PromptType],
        params: Sequence[RequestParamsType],
        lora_request: LoRARequest | None = None,
    ) -> tuple[asyncio.Queue[StreamItem], list[str]]:
        self.models.check_still_loaded(lora_request)  # not unloaded while the handler prepared
        out: asyncio.Queue[StreamItem] = asyncio.Queue()
        rids = [f"{rid}-{i}" for i in range(len(prompts))]
        for sub, prompt, p in zip(rids, prompts, params):
            self.engine_client.add_request(sub, prompt, p, out, lora_request)
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
                if item.error is not None:  # the engine failed a step that carried it
                    raise OpenAIError(f"the request failed: {item.error}", 500)
                if item.finished:
                    pending.discard(item.request_id)
                yield index[item.request_id], item
        finally:
            if pending:
                self.engine_client.abort(sorted(pending))

    async def _collect(
        self,
        rid: str,
        prompts: list[PromptType],
        params: Sequence[RequestParamsType],
        is_disconnected: Any,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(prompts)
        # Submitted now, not at the first iteration: the waiting bound must count this request
        # before the next handler checks it.
        results = self._results(self._submit(rid, prompts, params, lora_request))

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
        params: Sequence[SamplingParams | BeamSearchParams],
        header: dict[str, Any],
        chunk: ChunkFn,
        options: StreamOptions | None,
        role_chunk: Callable[[int], dict[str, Any]] | None = None,
        emit_first: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> StreamingResponse:
        p0 = params[0]
        n = p0.beam_width if isinstance(p0, BeamSearchParams) else p0.n
        include_usage = options is not None and options.include_usage
        continuous_usage = include_usage and options is not None and options.continuous_usage_stats
        num_prompt = [len(prompt_ids(p)) for p in prompts]
        submitted = self._submit(rid, prompts, params, lora_request)  # now, as in _collect

        async def events() -> AsyncIterator[str]:
            # (prompt, sample) -> (characters, tokens) sent so far
            prev: dict[tuple[int, int], tuple[int, int]] = {}
            done: set[tuple[int, int]] = set()
            finals: dict[int, RequestOutput] = {}
            results = self._results(submitted)
            try:
                if role_chunk is not None:
                    for i in range(n):
                        event = role_chunk(i)
                        if continuous_usage:
                            event["usage"] = _usage_of(num_prompt[0], 0)
                        yield _sse(event)
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
                        event = chunk(pi, c, p_text, p_tok, first, out)
                        if continuous_usage:  # vLLM's extra: this choice's usage so far
                            event["usage"] = _usage_of(num_prompt[pi], len(c.token_ids))
                        yield _sse(event)
                        if c.finish_reason is not None:
                            done.add(key)
                if include_usage:
                    total = usage([finals[i] for i in sorted(finals)])
                    yield _sse({**header, "choices": [], "usage": total})
            except OpenAIError as exc:
                yield _sse(exc.to_dict())
            except Exception as exc:  # the stream has begun: report in-band, never a broken stream
                logger.exception("stream failed")
                yield _sse(OpenAIError(f"internal error: {type(exc).__name__}", 500).to_dict())
            finally:
                await results.aclose()  # aborts what still runs (a disconnect lands here)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def invalid_param(exc: ValueError, names: dict[str, str] | None = None) -> OpenAIError:
    """The 400 of a value the typed params refused (`InvalidParamError`): their message, and as
    `param` the field they name, under the request's name for it where `names` renames it."""
    param = getattr(exc, "param", None)
    return OpenAIError(str(exc), param=(names or {}).get(param, param) if param else None)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's map from token ids (JSON keys, so strings) to biases, with int keys."""
    if bias is None:
        return None
    bad = [k for k in bias if not k.lstrip("-").isdigit()]
    if bad:
        raise OpenAIError(f"logit_bias keys must be token ids, got {bad[0]!r}", param="logit_bias")
    return {int(key): value for key, value in bias.items()}


def prompt_ids(prompt: PromptType) -> list[int]:
    assert isinstance(prompt, dict) and "prompt_token_ids" in prompt, "tokenize prompts first"
    return list(prompt["prompt_token_ids"])


def finish_reason(c: CompletionOutput) -> str | None:
    reason = c.finish_reason
    return "length" if reason == "length" else ("stop" if reason is not None else None)


def _usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def usage(outputs: list[RequestOutput]) -> dict[str, int]:
    """OpenAI's `usage` over every prompt and sample of a request."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    return _usage_of(prompt, sum(len(c.token_ids) for o in outputs for c in o.outputs))


def _sse(obj: dict[str, Any]) -> str:
    # allow_nan=False: a NaN would be invalid JSON; raising here becomes an in-band error event.
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False)}\n\n"


def error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.to_dict(), status_code=exc.status_code, headers=exc.headers)
