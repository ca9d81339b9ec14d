"""The parts of vLLM's server that are about operating it, not about generating: request ids in
headers, the server load, and the tokenizer's configuration.

- `RequestIdMiddleware` (vLLM's `--enable-request-id-headers`): every response carries an
  `X-Request-Id` header, the client's own when it sent one, so a proxy's logs and the client's
  can be joined.
- `LoadMiddleware` counts the generation requests in flight (completions, chat, responses,
  invocations); `GET /load` reports it as `{"server_load": N}`, which vLLM's router and
  autoscalers poll. minivllm always counts (one integer), so there is no flag to turn it on.
- `tokenizer_info` is vLLM's `GET /tokenizer_info` (behind `--enable-tokenizer-info-endpoint`,
  because it exposes the chat template): the tokenizer's class and its JSON-safe init settings.

All three are pure ASGI middlewares or plain functions: `BaseHTTPMiddleware` would hide client
disconnects from streaming responses, which the abort-on-disconnect path needs.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = b"x-request-id"
# The routes that run the model: what "load" means to vLLM's `/load`.
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations")


class RequestIdMiddleware:
    """Echo the request's `X-Request-Id`, or a fresh one, on the response's headers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(REQUEST_ID_HEADER)
        request_id = given or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0] != REQUEST_ID_HEADER]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER, request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class ServerLoad:
    """The number `GET /load` reports; one writer, the event loop."""

    def __init__(self) -> None:
        self.in_flight = 0


class LoadMiddleware:
    """Count the generation requests being served, from their arrival to their last byte."""

    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].endswith(GENERATION_PATHS):
            await self.app(scope, receive, send)
            return
        self.load.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.in_flight -= 1


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    """vLLM's `/tokenizer_info`: `tokenizer_class` plus every init setting that is JSON."""
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
    for key, value in getattr(tokenizer, "init_kwargs", {}).items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            value = str(value)  # e.g. an AddedToken: its text is what a client can use
        info[key] = value
    template = getattr(tokenizer, "chat_template", None)
    if template is not None:
        info["chat_template"] = template
    return info
