"""The published OpenAPI schema (`/openapi.json`, browsed at `/docs`): request bodies, responses
and errors, all from `protocol.py`'s pydantic models.

The handlers parse their bodies by hand (`routes.parse_body`, so that every invalid body is
OpenAI's 400 and the size limit applies before parsing), which hides the request models from
FastAPI; vLLM, whose handlers take the models as parameters, gets their schemas from FastAPI for
free. This module publishes them anyway, from the very models that validate the bodies: one JSON
schema per model in `components.schemas`, referenced by each route's `requestBody` (FastAPI's
`openapi_extra`, its documented way for a body the handler reads itself), so the schema cannot
drift from the validation. Responses are documented from the response models, stream events
included, and every 4xx/5xx as OpenAI's error object. See docs/serving.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from minivllm.entrypoints import protocol as p
from minivllm.entrypoints import protocol_responses as pr
from minivllm.entrypoints import response_schemas as rs
from minivllm.entrypoints.protocol_pooling import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)

_REQUEST_MODELS: list[type[BaseModel]] = [
    p.CompletionRequest,
    p.ChatCompletionRequest,
    p.TokenizeRequest,
    p.DetokenizeRequest,
    p.LoadLoRAAdapterRequest,
    p.UnloadLoRAAdapterRequest,
    pr.ResponsesRequest,
    EmbeddingRequest,
    ScoreRequest,
    RerankRequest,
    PoolingRequest,
    ClassificationRequest,
]
_RESPONSE_MODELS: list[type[BaseModel]] = [
    rs.ErrorResponse,
    rs.CompletionResponse,
    rs.CompletionStreamResponse,
    rs.ChatCompletionResponse,
    rs.ChatCompletionStreamResponse,
    rs.TokenizeResponse,
    rs.DetokenizeResponse,
    rs.ModelList,
    rs.VersionResponse,
    rs.LoadResponse,
    rs.TokenizerInfoResponse,
    rs.EmbeddingResponse,
    rs.ScoreResponse,
    rs.RerankResponse,
    rs.PoolingResponse,
    rs.ClassificationResponse,
    pr.ResponsesResponse,
    pr.ResponsesStreamEvent,
]
# Requests in pydantic's validation mode (what is accepted), responses in serialization mode.
_KEYS: list[tuple[type[BaseModel], JsonSchemaMode]] = [
    *((m, "validation") for m in _REQUEST_MODELS),
    *((m, "serialization") for m in _RESPONSE_MODELS),
]
_REFS, _DEFS = models_json_schema(_KEYS, ref_template="#/components/schemas/{model}")

ERROR_DESCRIPTIONS = {
    400: "Invalid JSON or field, an unsupported field, or a prompt too long for max_model_len",
    401: "--api-key is set and the bearer token is missing or wrong",
    404: "`model` is neither a served model name nor a loaded LoRA adapter",
    413: "The body is larger than --max-request-body-bytes",
    500: "The engine failed the step that carried the request; other requests are unaffected",
    503: "Too many requests wait (retry after `Retry-After` seconds), or the engine is down",
}


def ref(model: type[BaseModel]) -> dict[str, Any]:
    mode: JsonSchemaMode = "validation" if model in _REQUEST_MODELS else "serialization"
    return dict(_REFS[(model, mode)])


def json_body(model: type[BaseModel], example: dict[str, Any] | None = None) -> dict[str, Any]:
    """`openapi_extra` for a route whose handler validates a JSON body with `model` itself."""
    media: dict[str, Any] = {"schema": ref(model)}
    if example is not None:  # what /docs' "Try it out" starts from
        media["example"] = example
    return {"requestBody": {"required": True, "content": {"application/json": media}}}


def sse_event(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a stream: its `data` is `[DONE]`, or else JSON that is a `chunk`
    or OpenAI's error object. (OpenAPI 3.1, which FastAPI writes, has the media type's `schema`
    describe each event; 3.2 would call it `itemSchema`.)"""
    json_data = {
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [ref(chunk), ref(rs.ErrorResponse)]},
    }
    data = {"type": "string", "if": {"const": "[DONE]"}, "else": json_data}
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def responses(
    ok: type[BaseModel] | None,
    errors: tuple[int, ...],
    ok_description: str = "Successful Response",
    stream: type[BaseModel] | None = None,
) -> dict[int | str, dict[str, Any]]:
    """A route's `responses`: 200 (JSON `ok`, and server-sent events of `stream` chunks) and
    OpenAI's error object for each status in `errors`."""
    content: dict[str, Any] = {}
    if ok is not None:
        content["application/json"] = {"schema": ref(ok)}
    if stream is not None:
        content["text/event-stream"] = {"schema": sse_event(stream)}
        ok_description += (
            f"; with `stream: true`, server-sent events, each `data:` line a {stream.__name__}"
            " (or an error object), ending with `data: [DONE]`"
        )
    out: dict[int | str, dict[str, Any]] = {
        200: {"description": ok_description, "content": content}
    }
    for code in errors:
        error = {"description": ERROR_DESCRIPTIONS[code]}
        out[code] = {**error, "content": {"application/json": {"schema": ref(rs.ErrorResponse)}}}
    return out


def install_openapi(app: FastAPI, bearer_auth: bool) -> Callable[[], dict[str, Any]]:
    """Make `app.openapi()` add the protocol models to FastAPI's schema (and, with an API key,
    a bearer scheme on /v1, so /docs' "Authorize" button sends it)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            components = schema.setdefault("components", {})
            components.setdefault("schemas", {}).update(_DEFS["$defs"])
            if bearer_auth:
                components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
                for path, ops in schema["paths"].items():
                    if path.startswith("/v1"):
                        for op in ops.values():
                            op["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return openapi
