"""`minivllm serve`'s uvicorn server, with a bounded drain on SIGTERM / SIGINT.

vLLM's `--shutdown-timeout` (vllm/entrypoints/openai/api_server.py): the requests in flight get a
drain time to finish, then they are aborted and the server exits. uvicorn alone would wait for
every open connection for ever (its `timeout_graceful_shutdown` is unset by default), and when
given one it cancels the handlers, which cuts each stream with an ASGI traceback; aborting the
requests through the engine first ends each stream as an aborted request's ends.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from minivllm.engine.protocol import EngineClient

logger = logging.getLogger("minivllm")


ABORT_GRACE_S = 2.0  # for the aborted requests' last chunks, before uvicorn cancels what is open


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a bounded drain (vLLM's --shutdown-timeout). On SIGTERM or SIGINT
    uvicorn stops accepting and waits for the open connections, by default for ever: one long
    stream kept the server up. Here the requests in flight run for `drain_s`; then the engine
    aborts them, so that each ends as an aborted request does (finish_reason "abort", its stream
    closed, its KV blocks freed), and uvicorn cancels whatever is still open `ABORT_GRACE_S`
    later. The app's lifespan then stops the engine (the core process too) and the server exits."""

    def __init__(self, config: uvicorn.Config, client: EngineClient, drain_s: float) -> None:
        super().__init__(config)
        self.client, self.drain_s = client, drain_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        abort = asyncio.get_running_loop().call_later(self.drain_s, self.abort_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            abort.cancel()

    def abort_in_flight(self) -> None:
        count = self.client.abort_all()
        if count:
            logger.warning(
                "shutting down: aborted %d requests still running after the %g s drain "
                "(--shutdown-timeout)",
                count,
                self.drain_s,
            )
