"""The OpenAI-compatible HTTP server: `build_app(engine)`, composed of its middlewares and routes.

vLLM's vllm/entrypoints/openai/api_server.py. The handlers drive the engine through one interface,
`EngineClient` (minivllm/engine/protocol.py); `make_engine_client` is the one place that picks
its implementation (the engine in a thread of this process, or in a process of its own).

Why FastAPI + uvicorn + pydantic: it is vLLM's own stack, so its code maps onto ours line for
line; pydantic models are the request schema *and* the validator (with the field name in every
error); uvicorn is a production ASGI server with clean disconnect signalling, which the
abort-on-disconnect path needs; and streaming is Starlette's `StreamingResponse` over an async
generator — no SSE framework needed. The alternatives (aiohttp, a hand-written asyncio server)
would mean writing validation, routing and error mapping ourselves.

Request bodies are validated by hand (`Model.model_validate_json(body)`) instead of through
FastAPI's parameter injection: it lets bad JSON, wrong types and unknown fields all become OpenAI's
400 error object (FastAPI's default is a 422 in its own shape), and it lets the body-size limit
apply before any parsing. The published schema still documents those bodies, from the same
models (`openapi.py`). The routes live in routes.py, the middlewares (middleware.py) are pure ASGI (not `BaseHTTPMiddleware`,
which would hide client disconnects from streaming responses).

`build_app` reads as its phases: the engine client and its metrics, the handlers, then the app
with `add_middlewares`, `add_error_handlers` and one `add_*_routes` per group of routes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm import envs
from minivllm.engine.async_llm_engine import AsyncLLMEngine
from minivllm.engine.core_client import AsyncMPClient, EngineCoreClient
from minivllm.engine.dp_client import DPEngineCoreClient, DPLBAsyncMPClient
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.protocol import EngineClient, EngineFacts, RequestParamsType
from minivllm.entrypoints.cli_args import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_WAITING_REQUESTS,
    LoRAModulePath,
)
from minivllm.entrypoints.dashboard import add_dashboard
from minivllm.entrypoints.metrics import ServerMetrics
from minivllm.entrypoints.middleware import (
    GuardMiddleware,
    LoadMiddleware,
    RequestIdMiddleware,
    ServerLoad,
)
from minivllm.entrypoints.openapi import install_openapi
from minivllm.entrypoints.protocol import OpenAIError
from minivllm.entrypoints.routes import (
    Handlers,
    add_classify_route,
    add_generation_routes,
    add_invocations_route,
    add_lora_routes,
    add_model_routes,
    add_operations_routes,
    add_pooling_routes,
    add_tokenization_routes,
    server_version,
)
from minivllm.entrypoints.serving import error_response
from minivllm.entrypoints.serving_chat import OpenAIServingChat
from minivllm.entrypoints.serving_completion import OpenAIServingCompletion
from minivllm.entrypoints.serving_models import BaseModelPath, OpenAIServingModels
from minivllm.entrypoints.serving_responses import OpenAIServingResponses
from minivllm.entrypoints.serving_score import OpenAIServingScore
from minivllm.entrypoints.serving_tokenization import OpenAIServingTokenization
from minivllm.entrypoints.tool_parsers import get_tool_parser

logger = logging.getLogger("minivllm")

API_DESCRIPTION = (
    "OpenAI-compatible API of minivllm, the readable vLLM. Every error is OpenAI's error object. "
    "Fields that OpenAI or vLLM define but minivllm cannot honour are refused by name (a 400), "
    "never ignored."
)


# ---------------------------------------------------------------------- the engine client
def make_engine_client(
    engine: EngineFacts, metrics: ServerMetrics, log_requests: bool = False
) -> EngineClient:
    """The `EngineClient` for `engine`: the client of an engine-core process is driven over its
    pipe (`AsyncMPClient`), N data-parallel cores over theirs with a load balancer in front
    (`DPLBAsyncMPClient`), an `LLMEngine` by a thread of this process (`AsyncLLMEngine`)."""

    def on_add(request_id: str, params: RequestParamsType, engine: int = 0) -> None:
        metrics.on_add(request_id, params, engine)
        if log_requests:  # vLLM's --enable-log-requests line
            logger.info("Received request %s: params: %s", request_id, params)

    if isinstance(engine, DPEngineCoreClient):
        return DPLBAsyncMPClient(engine, on_step=metrics.on_step, on_add=on_add)
    if isinstance(engine, EngineCoreClient):
        return AsyncMPClient(engine, on_step=metrics.on_step, on_add=on_add)
    assert isinstance(engine, LLMEngine), type(engine)
    return AsyncLLMEngine(engine, on_step=metrics.on_step, on_add=on_add)


def make_metrics(
    engine: EngineFacts,
    model_name: str,
    log_stats_interval_s: float,
    show_hidden_metrics: bool = False,
) -> ServerMetrics:
    cache = engine.config.cache
    # vLLM's CacheConfig.metrics_info() labels; what minivllm has no counterpart of is vLLM's
    # value for "off" (no CPU offload, no swap space, no CPU blocks, no sliding window).
    cache_info = {
        "block_size": cache.block_size,
        "cache_dtype": cache.cache_dtype,  # vLLM reports the option as given ("auto")
        "cpu_offload_gb": 0,
        "enable_prefix_caching": cache.enable_prefix_caching,
        "gpu_memory_utilization": cache.gpu_memory_utilization,
        "num_cpu_blocks": None,
        "num_gpu_blocks": engine.get_stats().num_kv_blocks,
        "num_gpu_blocks_override": cache.num_gpu_blocks_override,
        "sliding_window": None,
        "swap_space_bytes": 0,
    }
    lora = engine.config.lora
    return ServerMetrics(
        model_name,
        log_stats_interval_s,
        engine.max_model_len,
        cache_info,
        show_hidden_metrics,
        engine.config.parallel.data_parallel_size,
        lora.max_loras if lora is not None else None,
    )


def make_handlers(
    client: EngineClient,
    models: OpenAIServingModels,
    max_waiting_requests: int,
    return_tokens_as_token_ids: bool = False,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
) -> Handlers:
    limits = (models, max_waiting_requests, client.config.scheduler.max_num_seqs)
    completion = OpenAIServingCompletion(client, *limits, return_tokens_as_token_ids)
    chat = OpenAIServingChat(client, *limits, return_tokens_as_token_ids)
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    if tool_call_parser is not None:
        chat.tool_parser = get_tool_parser(tool_call_parser)
    chat.enable_auto_tool_choice = enable_auto_tool_choice
    responses_api = OpenAIServingResponses(chat, client, *limits)
    embedding = None
    if client.config.pooler is not None:  # a pooling model: embeddings instead of generation
        embedding = OpenAIServingScore(client, *limits)  # /v1/embeddings, /score, /rerank, /pooling
    return Handlers(completion, chat, responses_api, OpenAIServingTokenization(chat), embedding)


# ---------------------------------------------------------------------- the app
def build_app(
    engine: EngineFacts,
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
    show_hidden_metrics: bool = False,
    model_path: str | None = None,
    lora_modules: list[LoRAModulePath] | None = None,
) -> FastAPI:
    """An app serving `engine`: an `LLMEngine` stepped by a thread of this process, or the client
    of an engine-core process (minivllm/engine/core_client.py); either starts and stops with the
    app's lifespan. `model_path`: the model as the user named it (`/v1/models`' `root`, vLLM's
    `BaseModelPath.model_path`); unset, the checkpoint's name. `lora_modules`: LoRA adapters
    served under their own names (`--lora-modules`, with `enable_lora`), loaded as the app
    starts; with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`, /v1/load_lora_adapter adds more."""
    names = served_model_names or [engine.source.name]
    metrics = make_metrics(engine, names[0], log_stats_interval_s, show_hidden_metrics)
    client = make_engine_client(engine, metrics, log_requests)
    root = model_path or engine.source.name
    models = OpenAIServingModels(client, [BaseModelPath(n, root) for n in names], lora_modules)
    handlers = make_handlers(
        client,
        models,
        max_waiting_requests,
        return_tokens_as_token_ids,
        enable_auto_tool_choice,
        tool_call_parser,
    )
    app = FastAPI(
        title="minivllm",
        version=server_version(),
        description=API_DESCRIPTION,
        lifespan=engine_lifespan(client, models, on_ready),
    )
    app.state.engine_client = client
    app.state.metrics = metrics
    server_load = ServerLoad()
    add_middlewares(app, api_key, max_body_bytes, enable_request_id_headers, server_load)
    if enable_dashboard:  # the live trace page at /dashboard (minivllm/entrypoints/dashboard.py)
        add_dashboard_routes(app, engine, api_key, dashboard_max_steps)
    install_openapi(app, bearer_auth=api_key is not None)
    add_error_handlers(app)
    add_operations_routes(app, client, metrics, server_load, enable_tokenizer_info_endpoint)
    add_model_routes(app, client, models, api_key)
    if envs.allow_runtime_lora_updating():  # vLLM: the routes exist only then
        logger.warning(
            "LoRA dynamic loading & unloading is enabled in the API server. This should ONLY "
            "be used for local development!"
        )
        add_lora_routes(app, models)
    v1_errors = (400, 401, 404, 413, 500, 503) if api_key else (400, 404, 413, 500, 503)
    pooler = client.config.pooler
    if handlers.embedding is not None and pooler is not None:
        add_pooling_routes(app, handlers.embedding, pooler.task, names[0], v1_errors)
    else:
        add_generation_routes(app, handlers, names[0], v1_errors)
        add_invocations_route(app, handlers, v1_errors)
    scoring = handlers.embedding if isinstance(handlers.embedding, OpenAIServingScore) else None
    add_classify_route(app, scoring, names[0], v1_errors)
    add_tokenization_routes(app, handlers.tokenization)
    return app


def engine_lifespan(
    client: EngineClient, models: OpenAIServingModels, on_ready: Callable[[], None] | None
) -> Callable[[FastAPI], Any]:
    """The engine starts with the app and stops with it (tensor-parallel workers, the core);
    the `--lora-modules` adapters are loaded in between, and a bad one stops the start."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        client.start()
        try:
            await models.init_static_loras()
        except BaseException:
            await asyncio.to_thread(client.shutdown)
            raise
        if on_ready is not None:
            on_ready()
        yield
        await asyncio.to_thread(client.shutdown)

    return lifespan


def add_middlewares(
    app: FastAPI,
    api_key: str | None,
    max_body_bytes: int,
    enable_request_id_headers: bool,
    server_load: ServerLoad,
) -> None:
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
    if enable_request_id_headers:
        app.add_middleware(RequestIdMiddleware)
    app.add_middleware(LoadMiddleware, load=server_load)


def add_dashboard_routes(
    app: FastAPI, engine: EngineFacts, api_key: str | None, max_steps: int
) -> None:
    if not isinstance(engine, LLMEngine):
        raise ValueError("the dashboard needs the engine in the server's process")
    add_dashboard(app, engine, api_key, max_steps)


def add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: the handlers' own, routing's, and the unexpected."""

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
