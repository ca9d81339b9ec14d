"""AsyncLLMEngine (minivllm/engine/async_llm_engine.py): what `start()` does before the engine
thread runs. Requests through the thread are covered end to end by tests/entrypoints/."""

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
