"""The server's ASGI middlewares: the API key and the body-size limit, request ids in headers,
and the server load (what vLLM's server does around its routes, not in them).

- `GuardMiddleware`: 401 on /v1/* without the API key (compared in constant time); 413 for a
  body over `--max-request-body-bytes`, known from Content-Length or found while reading.
- `RequestIdMiddleware` (vLLM's `--enable-request-id-headers`): every response carries an
  `X-Request-Id` header, the client's own when it sent one, so a proxy's logs and the client's
  can be joined.
- `LoadMiddleware` counts the generation requests in flight (completions, chat, responses,
  invocations); `GET /load` reports it as `{"server_load": N}`, which vLLM's router and
  autoscalers poll. minivllm always counts (one integer), so there is no flag to turn it on.

All three are pure ASGI middlewares: `BaseHTTPMiddleware` would hide client disconnects from
streaming responses, which the abort-on-disconnect path needs. A new one (a root path, say) is
one class here and one line in `api_server.add_middlewares`.
"""

from __future__ import annotations

import hmac
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minivllm.entrypoints.protocol import OpenAIError
from minivllm.entrypoints.serving import error_response

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


class _BodyTooLarge(Exception):
    pass


async def _send_error(send: Send, exc: OpenAIError) -> None:
    resp = error_response(exc)
    await send(
        {"type": "http.response.start", "status": resp.status_code, "headers": resp.raw_headers}
    )
    await send({"type": "http.response.body", "body": resp.body})


def _under_root_path(scope: Scope) -> tuple[Scope, str]:
    """(the scope to route, the path the API sees) behind --root-path. uvicorn puts the root in
    front of every path, so a client that sends the root itself (/llm/v1/..., no proxy to strip
    it) arrives as /llm/llm/v1/...: the doubled root is dropped, and both /v1/... and
    /llm/v1/... are served, as vLLM serves them. The API key is checked on the path without the
    root (vLLM's AuthenticationMiddleware does the same), whichever way it came."""
    path, root = scope["path"], scope.get("root_path", "")
    if not root or not path.startswith(root):
        return scope, path
    if path[len(root) :].startswith(root + "/"):
        scope = {**scope, "path": path[len(root) :]}
        raw = scope.get("raw_path")
        if isinstance(raw, bytes) and raw.startswith(2 * root.encode()):
            scope["raw_path"] = raw[len(root.encode()) :]
        path = scope["path"]
    return scope, path[len(root) :]


class GuardMiddleware:
    """401 on /v1/* without the API key; 413 for a body over `max_body_bytes`, known from
    Content-Length up front or found while reading a chunked body."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        scope, path = _under_root_path(scope)
        if self.expected is not None and path.startswith("/v1"):
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):  # constant time: no timing oracle
                await _send_error(send, OpenAIError("Unauthorized: missing or wrong API key", 401))
                return
        limit = self.max_body_bytes
        too_large = OpenAIError(f"the request body is larger than {limit} bytes", 413)
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            await _send_error(send, too_large)
            return
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await _send_error(send, too_large)
