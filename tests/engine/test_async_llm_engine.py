"""AsyncLLMEngine (minivllm/engine/async_llm_engine.py): what `start()` does before the engine
thread runs, and what its requests get when the engine dies. Requests through the thread are
covered end to end by tests/entrypoints/."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from minivllm.engine import async_llm_engine
from minivllm.engine.async_llm_engine import AsyncLLMEngine


class IdleEngine:
    """The engine calls an `AsyncLLMEngine` makes with nothing to run: stats, idle, shut down."""

    def get_stats(self) -> Any:
        return None

    def has_unfinished_requests(self) -> bool:
        return False

    def abort_request(self, request_ids: list[str]) -> None:
        assert request_ids == []

    def step(self) -> list[Any]:
        return []

    def shutdown(self) -> None:
        pass


def test_start_gives_the_event_loop_threads_openmp_team_back_before_the_engine_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The thread that loaded the model (the event loop's) frees its OpenMP team before the engine
    thread starts its own, so that libgomp's barriers keep spinning (minivllm/cpu/openmp.py)."""
    client = AsyncLLMEngine(IdleEngine())  # type: ignore[arg-type]
    calls: list[tuple[threading.Thread, threading.Thread | None]] = []

    def recording() -> bool:
        calls.append((threading.current_thread(), client._thread))
        return True

    async def run() -> None:
        client.start()
        client.shutdown()

    monkeypatch.setattr(async_llm_engine, "release_thread_team", recording)
    asyncio.run(run())
    assert calls == [(threading.current_thread(), None)]


class RankLost(BaseException):
    """Stands for `EngineDeadError` (a BaseException: it ends the engine, not one step)."""


class DyingEngine(IdleEngine):
    """Takes requests; its first step waits for `release`, then dies as a lost rank does."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.stepping = threading.Event()
        self.release = threading.Event()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request_id: str, *args: Any, **kwargs: Any) -> None:
        self.requests.append(request_id)

    def abort_request(self, request_ids: list[str]) -> None:
        pass

    def step(self) -> list[Any]:
        self.stepping.set()
        assert self.release.wait(timeout=30)
        raise RankLost("rank 1 (pid 4242) was killed by SIGKILL")


def test_a_dead_engine_fails_its_requests_those_queued_and_every_later_one_at_once() -> None:
    """The request in the dying step, one queued behind it (sent while the step ran) and one sent
    after the engine died each get the error naming the rank; none waits for a thread that is
    gone (the server answers each with a 500)."""
    engine = DyingEngine()
    client = AsyncLLMEngine(engine)  # type: ignore[arg-type]

    async def run() -> list[Any]:
        client.start()
        running, queued, later = asyncio.Queue(), asyncio.Queue(), asyncio.Queue()  # type: ignore[var-annotated]
        client.add_request("running", "x", None, running)  # type: ignore[arg-type]
        assert await asyncio.to_thread(engine.stepping.wait, 30)
        client.add_request("queued", "y", None, queued)  # type: ignore[arg-type]
        engine.release.set()
        errors = [await asyncio.wait_for(q.get(), 30) for q in (running, queued)]
        client.add_request("later", "z", None, later)  # type: ignore[arg-type]
        errors.append(later.get_nowait())  # there at once: no thread to wait for
        client.shutdown()
        return errors

    errors = asyncio.run(run())
    assert engine.requests == ["running"]  # the queued one never reached the engine
    for error in errors:
        assert isinstance(error, RuntimeError)
        assert str(error) == "the engine failed: rank 1 (pid 4242) was killed by SIGKILL"
    assert not client.is_running
