"""The server's routes, in groups: `add_*_routes(app, ...)`, each adding one group to the app.

vLLM's routes in vllm/entrypoints/openai/api_server.py; `build_app` (api_server.py) composes the
groups. A route parses its body itself (`parse_body`) so that every schema error is OpenAI's 400,
then calls its handler (`Handlers`: vLLM's `OpenAIServing*` objects), which drives the engine
through its `EngineClient`.
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from minivllm.engine.protocol import EngineClient
from minivllm.entrypoints import protocol as p
from minivllm.entrypoints import response_schemas as rs
from minivllm.entrypoints.metrics import ServerMetrics
from minivllm.entrypoints.middleware import ServerLoad
from minivllm.entrypoints.openapi import json_body, responses
from minivllm.entrypoints.protocol import OpenAIError
from minivllm.entrypoints.protocol_pooling import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from minivllm.entrypoints.protocol_responses import (
    ResponsesRequest,
    ResponsesResponse,
    ResponsesStreamEvent,
)
from minivllm.entrypoints.serving import error_response
from minivllm.entrypoints.serving_chat import OpenAIServingChat
from minivllm.entrypoints.serving_completion import OpenAIServingCompletion
from minivllm.entrypoints.serving_embedding import OpenAIServingEmbedding, refuse_generation
from minivllm.entrypoints.serving_models import OpenAIServingModels
from minivllm.entrypoints.serving_responses import OpenAIServingResponses
from minivllm.entrypoints.serving_score import OpenAIServingScore, refuse_classification
from minivllm.entrypoints.serving_tokenization import OpenAIServingTokenization, tokenizer_info


def server_version() -> str:
    """The installed package's version (pyproject.toml is its one source)."""
    try:
        return importlib.metadata.version("minivllm")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


# ---------------------------------------------------------------------- request bodies
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


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    body = await request.body()
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        raise _validation_error(exc) from None


@dataclass
class Handlers:
    """vLLM's `OpenAIServing*` objects, one per API, all over one `EngineClient`."""

    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    responses: OpenAIServingResponses
    tokenization: OpenAIServingTokenization
    # A pooling model's /v1/embeddings (and, an `OpenAIServingScore`, /score, /rerank, /pooling)
    embedding: OpenAIServingEmbedding | None = None


def disconnect_watcher(request: Request) -> Any:
    async def wait() -> None:  # returns when the client has gone away
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    return wait


# ---------------------------------------------------------------------- the routes
def add_operations_routes(
    app: FastAPI,
    client: EngineClient,
    metrics: ServerMetrics,
    server_load: ServerLoad,
    enable_tokenizer_info_endpoint: bool,
) -> None:
    """What operators poll: /health, /version, /metrics, /load, /tokenizer_info."""

    @app.get(
        "/health",
        response_class=Response,
        responses={200: {"description": "The engine thread runs"}, **responses(None, (503,))},
    )
    async def health() -> Response:
        if not client.is_running:
            return error_response(OpenAIError("the engine is not running", 503))
        return Response(status_code=200)

    @app.get("/version", response_model=None, responses=responses(rs.VersionResponse, ()))
    async def version() -> dict[str, str]:
        return {"version": server_version()}

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"description": "Prometheus text format"}},
    )
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

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
            return tokenizer_info(client.tokenizer)


def add_model_routes(
    app: FastAPI, client: EngineClient, models: OpenAIServingModels, api_key: str | None
) -> None:
    models_errors = (401,) if api_key else ()

    @app.get("/v1/models", response_model=None, responses=responses(rs.ModelList, models_errors))
    async def list_models() -> dict[str, Any]:
        pooler = client.config.pooler
        # generate, or a pooling model's task (embed, classify): what its routes serve
        task = "generate" if pooler is None else pooler.task
        return models.show_available_models(client.max_model_len, task)


def add_lora_routes(app: FastAPI, models: OpenAIServingModels) -> None:
    """vLLM's runtime adapter routes (only with VLLM_ALLOW_RUNTIME_LORA_UPDATING): the answer is
    plain text on success, OpenAI's error object otherwise."""

    @app.post(
        "/v1/load_lora_adapter",
        response_class=PlainTextResponse,
        openapi_extra=json_body(
            p.LoadLoRAAdapterRequest, {"lora_name": "sql", "lora_path": "/adapters/sql"}
        ),
        responses={200: {"description": "Loaded"}, **responses(None, (400, 413))},
    )
    async def load_lora_adapter(request: Request) -> Response:
        req = await parse_body(request, p.LoadLoRAAdapterRequest)
        return PlainTextResponse(await models.load_lora_adapter(req))

    @app.post(
        "/v1/unload_lora_adapter",
        response_class=PlainTextResponse,
        openapi_extra=json_body(p.UnloadLoRAAdapterRequest, {"lora_name": "sql"}),
        responses={200: {"description": "Unloaded"}, **responses(None, (400, 404, 413))},
    )
    async def unload_lora_adapter(request: Request) -> Response:
        req = await parse_body(request, p.UnloadLoRAAdapterRequest)
        return PlainTextResponse(await models.unload_lora_adapter(req))


def add_generation_routes(
    app: FastAPI, handlers: Handlers, model: str, v1_errors: tuple[int, ...]
) -> None:
    """The OpenAI routes that run the model: completions, chat completions, responses.
    `model`: the served name the published examples use."""

    @app.post(
        "/v1/completions",
        response_model=None,
        openapi_extra=json_body(
            p.CompletionRequest,
            {"model": model, "prompt": "The capital of France is", "max_tokens": 16},
        ),
        responses=responses(
            rs.CompletionResponse, v1_errors, "A completion", stream=rs.CompletionStreamResponse
        ),
    )
    async def completions(request: Request) -> Any:
        req = await parse_body(request, p.CompletionRequest)
        return await handlers.completion.create_completion(req, disconnect_watcher(request))

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        openapi_extra=json_body(
            p.ChatCompletionRequest,
            {
                "model": model,
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
        req = await parse_body(request, p.ChatCompletionRequest)
        return await handlers.chat.create_chat_completion(req, disconnect_watcher(request))

    @app.post(
        "/v1/responses",
        response_model=None,
        openapi_extra=json_body(
            ResponsesRequest, {"model": model, "input": "Say hello.", "max_output_tokens": 32}
        ),
        responses=responses(
            ResponsesResponse,
            v1_errors,
            "A response (text only)",
            stream=ResponsesStreamEvent,
        ),
    )
    async def create_response(request: Request) -> Any:
        req = await parse_body(request, ResponsesRequest)
        return await handlers.responses.create_response(req, disconnect_watcher(request))

    @app.get(
        "/v1/responses/{response_id}",
        response_model=None,
        responses=responses(ResponsesResponse, v1_errors, "A stored response"),
    )
    async def retrieve_response(response_id: str) -> Any:
        return await handlers.responses.retrieve_response(response_id)

    @app.post(
        "/v1/responses/{response_id}/cancel",
        response_model=None,
        responses=responses(ResponsesResponse, v1_errors, "The cancelled background response"),
    )
    async def cancel_response(response_id: str) -> Any:
        return await handlers.responses.cancel_response(response_id)


def add_pooling_routes(
    app: FastAPI,
    embedding: OpenAIServingEmbedding,
    task: str,
    model: str,
    v1_errors: tuple[int, ...],
) -> None:
    """A pooling model's routes (minivllm/pooling/): /v1/embeddings; /score, /rerank and
    /v1/rerank (minivllm/entrypoints/serving_score.py) and /pooling; and the generation routes
    answering a 400 that names the model's task."""

    @app.post(
        "/v1/embeddings",
        response_model=None,
        openapi_extra=json_body(EmbeddingRequest, {"model": model, "input": "Hello, world"}),
        responses=responses(rs.EmbeddingResponse, v1_errors, "One embedding per input"),
    )
    async def embeddings(request: Request) -> Any:
        req = await parse_body(request, EmbeddingRequest)
        return await embedding.create_embedding(req, disconnect_watcher(request))

    if isinstance(embedding, OpenAIServingScore):
        add_score_routes(app, embedding, model, v1_errors)

    async def refuse() -> Any:
        raise refuse_generation(task)

    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations"):
        app.post(path, response_model=None, responses=responses(None, (400,)))(refuse)


def add_score_routes(
    app: FastAPI, scoring: OpenAIServingScore, model: str, v1_errors: tuple[int, ...]
) -> None:
    """vLLM's score API: /score (pairs), /rerank and /v1/rerank (a query against documents,
    Jina's and Cohere's shape), /pooling (the pooler's raw output); /classify is
    `add_classify_route`'s."""

    @app.post(
        "/score",
        response_model=None,
        openapi_extra=json_body(ScoreRequest, {"model": model, "text_1": "a", "text_2": ["b"]}),
        responses=responses(rs.ScoreResponse, v1_errors, "One score per pair"),
    )
    async def score(request: Request) -> Any:
        req = await parse_body(request, ScoreRequest)
        return await scoring.create_score(req, disconnect_watcher(request))

    async def rerank(request: Request) -> Any:
        req = await parse_body(request, RerankRequest)
        return await scoring.create_rerank(req, disconnect_watcher(request))

    example = {"model": model, "query": "a", "documents": ["b", "c"]}
    for path in ("/rerank", "/v1/rerank"):
        app.post(
            path,
            response_model=None,
            openapi_extra=json_body(RerankRequest, example),
            responses=responses(rs.RerankResponse, v1_errors, "The documents, best first"),
        )(rerank)

    @app.post(
        "/pooling",
        response_model=None,
        openapi_extra=json_body(PoolingRequest, {"model": model, "input": "Hello, world"}),
        responses=responses(rs.PoolingResponse, v1_errors, "The pooler's output per input"),
    )
    async def pooling(request: Request) -> Any:
        req = await parse_body(request, PoolingRequest)
        return await scoring.create_pooling(req, disconnect_watcher(request))


def add_classify_route(
    app: FastAPI, scoring: OpenAIServingScore | None, model: str, v1_errors: tuple[int, ...]
) -> None:
    """vLLM's `/classify`, on every server: a classifier answers it; any other model (a
    generator: `scoring` None; an embedding model) with a 400 that names its task. A generator's
    schema leaves it out, as it leaves out the pooling routes."""

    @app.post(
        "/classify",
        include_in_schema=scoring is not None,
        response_model=None,
        openapi_extra=json_body(ClassificationRequest, {"model": model, "input": "Hello, world"}),
        responses=responses(rs.ClassificationResponse, v1_errors, "Class probabilities per input"),
    )
    async def classify(request: Request) -> Any:
        req = await parse_body(request, ClassificationRequest)
        if scoring is None:
            raise refuse_classification("generate")
        return await scoring.create_classify(req, disconnect_watcher(request))


def add_invocations_route(app: FastAPI, handlers: Handlers, v1_errors: tuple[int, ...]) -> None:
    """SageMaker's one route (as vLLM): the body says which API it is meant for."""

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
        body = await request.body()
        try:
            keys = json.loads(body or b"{}")
        except ValueError:
            keys = None
        if isinstance(keys, dict) and "messages" in keys:
            chat = await parse_body(request, p.ChatCompletionRequest)
            return await handlers.chat.create_chat_completion(chat, disconnect_watcher(request))
        if isinstance(keys, dict) and "prompt" in keys:
            req = await parse_body(request, p.CompletionRequest)
            return await handlers.completion.create_completion(req, disconnect_watcher(request))
        raise OpenAIError(
            "cannot route the request: the body needs 'messages' (chat completions) or "
            "'prompt' (completions)",
            param="messages",
        )


def add_tokenization_routes(app: FastAPI, tokenization: OpenAIServingTokenization) -> None:
    """vLLM's /tokenize and /detokenize (no model run)."""

    @app.post(
        "/tokenize",
        response_model=None,
        openapi_extra=json_body(p.TokenizeRequest, {"prompt": "Hello, world"}),
        responses=responses(rs.TokenizeResponse, (400, 404, 413)),
    )
    async def tokenize(request: Request) -> dict[str, Any]:
        return tokenization.tokenize(await parse_body(request, p.TokenizeRequest))

    @app.post(
        "/detokenize",
        response_model=None,
        openapi_extra=json_body(p.DetokenizeRequest),
        responses=responses(rs.DetokenizeResponse, (400, 404, 413)),
    )
    async def detokenize(request: Request) -> dict[str, Any]:
        return tokenization.detokenize(await parse_body(request, p.DetokenizeRequest))
