"""The live dashboard: `minivllm serve --enable-dashboard` shows the trace page at /dashboard.

The page is the offline trace page (minivllm/trace/page.py) started in live mode: it polls
`/dashboard/api/steps?after=K` for the steps newer than the last one it has, and follows the
newest step while requests are served. Polling rather than a stream keeps the server side to one
plain JSON route, and a page that falls behind just asks for more.

- Cost: the engine thread records each step into a `StepRecorder` with a window of
  `max_steps` steps, so memory stays bounded however long the server runs; with the dashboard
  off there is no recorder and the engine pays one `is None` check per step.
- Threads: the engine thread appends records; request handlers read them. Each record is built
  once and never changed, and the recorder copies its list under a lock, so a handler never sees
  half a step (see minivllm/trace/recorder.py).
- Access: when the server has an API key, the data route wants the same
  `Authorization: Bearer KEY` header as /v1; the HTML page itself holds no data, asks for the key
  and keeps it in the tab's sessionStorage.

See the docs' architecture page (docs/architecture.md) for the step the recorder subscribes to.
"""

from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse

from minivllm.engine.llm_engine import LLMEngine
from minivllm.trace.page import render_page
from minivllm.trace.recorder import StepRecorder

logger = logging.getLogger("minivllm")

DASHBOARD_PATH = "/dashboard"
STEPS_PATH = "/dashboard/api/steps"
POLL_MS = 500  # how often the page asks for new steps
LARGE_POOL = 4096  # blocks: beyond this the page's grid is too dense to read


def add_dashboard(
    app: FastAPI, engine: LLMEngine, api_key: str | None = None, max_steps: int = 256
) -> StepRecorder:
    """Attach a windowed recorder to `engine` and add the dashboard's routes to `app`. Call it
    before the engine thread starts (from `build_app`), so that no step runs while attaching."""
    if max_steps < 1:
        raise ValueError(f"dashboard max_steps must be a positive integer, got {max_steps}")
    recorder = StepRecorder(max_steps=max_steps)
    recorder.attach(engine)
    if engine.kv_cache_manager.num_blocks > LARGE_POOL:
        logger.warning(
            "the dashboard draws every KV block; %d blocks make a dense page and a costlier "
            "record per step: --num-gpu-blocks-override sets a smaller pool",
            engine.kv_cache_manager.num_blocks,
        )
    expected = f"Bearer {api_key}".encode() if api_key else None
    page = render_page(
        live={"endpoint": STEPS_PATH, "poll_ms": POLL_MS}, title="minivllm dashboard"
    )

    @app.get(DASHBOARD_PATH, response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get(STEPS_PATH)
    def steps(request: Request, after: int = 0) -> JSONResponse:
        # A plain `def`: FastAPI runs it in its thread pool, so copying and serializing a window
        # never blocks the event loop that streams tokens.
        if expected is not None:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return JSONResponse(
                    {"error": {"message": "Unauthorized: missing or wrong API key", "code": 401}},
                    status_code=401,
                )
        return JSONResponse(recorder.snapshot(after_step=after))

    app.state.step_recorder = recorder
    return recorder
