"""The OpenAI-compatible HTTP server: `build_app(engine)` and its routes.

Why FastAPI + uvicorn + pydantic: it is vLLM's own stack (vllm/entrypoints/openai/api_server.py),
so its code maps onto ours line for line; pydantic models are the request schema *and* the
validator (with the field name in every error); uvicorn is a production ASGI server with clean
disconnect signalling, which the abort-on-disconnect path needs; and streaming is Starlette's
`StreamingResponse` over an async generator — no SSE framework needed. The alternatives (aiohttp,
a hand-written asyncio server) would mean writing validation, routing and error mapping ourselves.

Request bodies are validated by hand (`Model.model_validate_json(body)`) instead of through
FastAPI's parameter injection: it lets bad JSON, wrong types and unknown fields all become OpenAI's
400 error object (FastAPI's default is a 422 in its own shape), and it lets the body-size limit
apply before any parsing. The published schema still documents those bodies, from the same
models (`openapi.py`). Two pure-ASGI middlewares (not `BaseHTTPMiddleware`, which would hide
client disconnects from streaming responses) check the API key and the body size.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import minivllm
from minivllm.beam_search import BeamSearchParams
from minivllm.engine import LLMEngine
from minivllm.engine_core_client import AsyncMPClient, EngineCoreClient
from minivllm.entrypoints import protocol as p
from minivllm.entrypoints import response_schemas as rs
from minivllm.entrypoints.async_engine import AsyncLLMEngine
from minivllm.entrypoints.metrics import ServerMetrics
from minivllm.entrypoints.openapi import install_openapi, json_body, responses
from minivllm.entrypoints.protocol import OpenAIError
from minivllm.entrypoints.protocol_responses import (
    ResponsesRequest,
    ResponsesResponse,
    ResponsesStreamEvent,
)
from minivllm.entrypoints.server_extras import (
    GuardMiddleware,
    LoadMiddleware,
    RequestIdMiddleware,
    ServerLoad,
    tokenizer_info,
)
from minivllm.entrypoints.serving import error_response
from minivllm.entrypoints.serving_chat import OpenAIServingChat
from minivllm.entrypoints.serving_completion import OpenAIServingCompletion
from minivllm.entrypoints.serving_responses import OpenAIServingResponses
from minivllm.entrypoints.serving_tokenization import OpenAIServingTokenization
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger("minivllm")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # 4 MiB: ~1M tokens of text, far past any context
DEFAULT_MAX_WAITING_REQUESTS = 1024  # beyond this, new requests get 503 + Retry-After
API_DESCRIPTION = (
    "OpenAI-compatible API of minivllm, the readable vLLM. Every error is OpenAI's error object. "
    "Fields that OpenAI or vLLM define but minivllm cannot honour are refused by name (a 400), "
    "never ignored."
)


# ---------------------------------------------------------------------- the app
def _validation_error(exc: ValidationError) -> OpenAIError:
    err = exc.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    if err["type"] == "json_invalid":
        return OpenAIError(f"the body is not valid JSON: {err['msg']}", param=None)
    if err["type"] == "extra_forbidden":
        return OpenAIError(f"Unrecognized request argument supplied: {loc}", param=loc)
    if err["type"] == "missing":
        return OpenAIError(f"missing required field: {loc}", param=loc)
    # pydantic's own error type closes the message, as in vLLM's 400s ("... [type=
    # greater_than_equal, ...]"): clients match on it, and the field is still named first.
    return OpenAIError(f"{loc}: {err['msg']} [type={err['type']}]", param=loc or None)


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    body = await request.body()
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        raise _validation_error(exc) from None


def build_app(
    engine: LLMEngine | EngineCoreClient,
    served_model_names: list[str] | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
    log_stats_interval_s: float = 5.0,
    on_ready: Callable[[], None] | None = None,
    enable_dashboard: bool = False,
    dashboard_max_steps: int = 256,
    enable_request_id_headers: bool = False,
    enable_tokenizer_info_endpoint: bool = False,
    log_requests: bool = False,
    return_tokens_as_token_ids: bool = False,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """An app serving `engine`: an `LLMEngine` stepped by a thread of this process, or the client
    of an engine-core process (engine_core_client.py); either starts and stops with the app's
    lifespan."""
    names = served_model_names or [engine.source.name]
    cache = engine.config.cache
    cache_info = {
        "block_size": cache.block_size,
        "cache_dtype": cache.cache_dtype,  # vLLM reports the option as given ("auto")
        "enable_prefix_caching": cache.enable_prefix_caching,
        "num_gpu_blocks": engine.get_stats().num_kv_blocks,
    }
    metrics = ServerMetrics(names[0], log_stats_interval_s, engine.max_model_len, cache_info)

    def on_add(request_id: str, params: SamplingParams | BeamSearchParams) -> None:
        metrics.on_add(request_id, params)
        if log_requests:  # vLLM's --enable-log-requests line
            logger.info("Received request %s: params: %s", request_id, params)

    async_engine: AsyncLLMEngine | AsyncMPClient
    if isinstance(engine, EngineCoreClient):
        if enable_dashboard:
            raise ValueError("the dashboard needs the engine in the server's process")
        async_engine = AsyncMPClient(engine, on_step=metrics.on_step, on_add=on_add)
    else:
        async_engine = AsyncLLMEngine(engine, on_step=metrics.on_step, on_add=on_add)
    limits = (names, max_waiting_requests, engine.config.scheduler.max_num_seqs)
    completion = OpenAIServingCompletion(async_engine, *limits, return_tokens_as_token_ids)
    chat = OpenAIServingChat(async_engine, *limits, return_tokens_as_token_ids)
    responses_api = OpenAIServingResponses(chat, async_engine, *limits)
    tokenization = OpenAIServingTokenization(chat)
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    if tool_call_parser is not None:
        from minivllm.entrypoints.tool_parsers import get_tool_parser

        chat.tool_parser = get_tool_parser(tool_call_parser)
    chat.enable_auto_tool_choice = enable_auto_tool_choice

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        if on_ready is not None:
            on_ready()
        yield
        await asyncio.to_thread(async_engine.shutdown)
        await asyncio.to_thread(engine.shutdown)  # tensor-parallel workers stop with the app

    app = FastAPI(
        title="minivllm",
        version=minivllm.__version__,
        description=API_DESCRIPTION,
        lifespan=lifespan,
    )
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
    if enable_request_id_headers:
        app.add_middleware(RequestIdMiddleware)
    server_load = ServerLoad()
    app.add_middleware(LoadMiddleware, load=server_load)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    if enable_dashboard:  # the live trace page at /dashboard (minivllm/entrypoints/dashboard.py)
        from minivllm.entrypoints.dashboard import add_dashboard

        assert isinstance(engine, LLMEngine)
        add_dashboard(app, engine, api_key, dashboard_max_steps)
    install_openapi(app, bearer_auth=api_key is not None)
    v1_errors = (400, 401, 404, 413, 500, 503) if api_key else (400, 404, 413, 500, 503)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_req: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Routing's own errors (an unknown path: 404, a wrong method: 405 with `Allow`), in
        # OpenAI's shape like every other error.
        headers = dict(exc.headers) if exc.headers else None
        return error_response(OpenAIError(str(exc.detail), exc.status_code, headers=headers))

    @app.exception_handler(Exception)
    async def _internal_error(_req: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(OpenAIError(f"internal error: {type(exc).__name__}", 500))

    def disconnect_watcher(request: Request) -> Any:
        async def wait() -> None:  # returns when the client has gone away
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return

        return wait

    @app.get(
        "/health",
        response_class=Response,
        responses={200: {"description": "The engine thread runs"}, **responses(None, (503,))},
    )
    async def health() -> Response:
        if not async_engine.is_running:
            return error_response(OpenAIError("the engine is not running", 503))
        return Response(status_code=200)

    @app.get("/version", response_model=None, responses=responses(rs.VersionResponse, ()))
    async def version() -> dict[str, str]:
        return {"version": minivllm.__version__}

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"description": "Prometheus text format"}},
    )
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    models_errors = (401,) if api_key else ()

    @app.get("/v1/models", response_model=None, responses=responses(rs.ModelList, models_errors))
    async def models() -> dict[str, Any]:
        cards = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "minivllm",
                "root": engine.source.name,
                "max_model_len": engine.max_model_len,
            }
            for name in names
        ]
        return {"object": "list", "data": cards}

    @app.post(
        "/v1/completions",
        response_model=None,
        openapi_extra=json_body(
            p.CompletionRequest,
            {"model": names[0], "prompt": "The capital of France is", "max_tokens": 16},
        ),
        responses=responses(
            rs.CompletionResponse, v1_errors, "A completion", stream=rs.CompletionStreamResponse
        ),
    )
    async def completions(request: Request) -> Any:
        req = await _parse(request, p.CompletionRequest)
        return await completion.create_completion(req, disconnect_watcher(request))

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        openapi_extra=json_body(
            p.ChatCompletionRequest,
            {
                "model": names[0],
                "messages": [{"role": "user", "content": "Hello! Who are you?"}],
                "max_tokens": 32,
            },
        ),
        responses=responses(
            rs.ChatCompletionResponse,
            v1_errors,
            "A chat completion",
            stream=rs.ChatCompletionStreamResponse,
        ),
    )
    async def chat_completions(request: Request) -> Any:
        req = await _parse(request, p.ChatCompletionRequest)
        return await chat.create_chat_completion(req, disconnect_watcher(request))

    @app.post(
        "/v1/responses",
        response_model=None,
        openapi_extra=json_body(
            ResponsesRequest, {"model": names[0], "input": "Say hello.", "max_output_tokens": 32}
        ),
        responses=responses(
            ResponsesResponse,
            v1_errors,
            "A response (text only)",
            stream=ResponsesStreamEvent,
        ),
    )
    async def create_response(request: Request) -> Any:
        req = await _parse(request, ResponsesRequest)
        return await responses_api.create_response(req, disconnect_watcher(request))

    @app.post(
        "/tokenize",
        response_model=None,
        openapi_extra=json_body(p.TokenizeRequest, {"prompt": "Hello, world"}),
        responses=responses(rs.TokenizeResponse, (400, 404, 413)),
    )
    async def tokenize(request: Request) -> dict[str, Any]:
        return tokenization.tokenize(await _parse(request, p.TokenizeRequest))

    @app.post(
        "/detokenize",
        response_model=None,
        openapi_extra=json_body(p.DetokenizeRequest),
        responses=responses(rs.DetokenizeResponse, (400, 404, 413)),
    )
    async def detokenize(request: Request) -> dict[str, Any]:
        return tokenization.detokenize(await _parse(request, p.DetokenizeRequest))

    @app.get("/load", response_model=None, responses=responses(rs.LoadResponse, ()))
    async def get_load() -> dict[str, int]:
        return {"server_load": server_load.in_flight}

    if enable_tokenizer_info_endpoint:  # off by default: it shows the chat template

        @app.get(
            "/tokenizer_info",
            response_model=None,
            responses=responses(rs.TokenizerInfoResponse, ()),
        )
        async def get_tokenizer_info() -> dict[str, Any]:
            return tokenizer_info(engine.tokenizer)

    @app.post(
        "/invocations",
        response_model=None,
        openapi_extra=json_body(p.ChatCompletionRequest),
        responses=responses(
            rs.ChatCompletionResponse,
            v1_errors,
            "A chat completion (or, for a body with `prompt`, a text completion)",
            stream=rs.ChatCompletionStreamResponse,
        ),
    )
    async def invocations(request: Request) -> Any:
        # SageMaker's one route (as vLLM): the body says which API it is meant for.
        body = await request.body()
        try:
            keys = json.loads(body or b"{}")
        except ValueError:
            keys = None
        if isinstance(keys, dict) and "messages" in keys:
            return await chat_completions(request)
        if isinstance(keys, dict) and "prompt" in keys:
            return await completions(request)
        raise OpenAIError(
            "cannot route the request: the body needs 'messages' (chat completions) or "
            "'prompt' (completions)",
            param="messages",
        )

    return app
