"""AsyncLLMEngine: the blocking `LLMEngine` driven by one thread, fed and read from asyncio.

One of the two `EngineClient`s (protocol.py); the other runs the engine in a process of its own
(client.py). vLLM's `AsyncLLM` (vllm/v1/engine/async_llm.py) puts the engine core in another process
and talks to it over ZeroMQ; here a thread is enough by default, because `LLMEngine.step()` spends
its time in PyTorch ops, which release the GIL. The design keeps the engine single-threaded all the
same:

- Handlers never touch the engine. `add_request` / `abort` (and utility calls such as
  `add_lora`, whose future the engine thread resolves) put a command on a thread-safe queue;
  the engine thread applies the commands *between* steps, so no step ever sees a half-added request
  or a block table freed under it.
- The engine thread hands each `RequestOutput` to the request's `asyncio.Queue` with
  `loop.call_soon_threadsafe` (an asyncio queue is not thread-safe; only the loop may touch it).
- When nothing is pending the thread blocks on the command queue instead of spinning.
- After each step it publishes an `EngineStats` snapshot, which handlers read (for the
  waiting-queue bound) without reaching into the scheduler from another thread.
- When the engine dies (`EngineDeadError`: a tensor-parallel or pipeline rank was lost) the thread
  fails every open request, and every command still queued; a request added later fails at once,
  so the server answers a 500 instead of a request that waits for a thread that is gone.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from minivllm.core.outputs import RequestOutput
from minivllm.cpu.openmp import release_thread_team
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.protocol import (
    AddHook,
    EngineClientBase,
    RequestParamsType,
    StepHook,
    StreamItem,
)
from minivllm.inputs import PromptType
from minivllm.lora.request import LoRARequest

if TYPE_CHECKING:
    import asyncio

logger = logging.getLogger("minivllm")


def dead_engine_error(exc: BaseException) -> RuntimeError:
    """What a request of a dead engine fails with (the handlers answer it with a 500)."""
    return RuntimeError(f"the engine failed: {exc}")


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: RequestParamsType
    sink: Callable[[StreamItem], None]
    lora_request: LoRARequest | None = None


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Utility:
    method: str  # an LLMEngine method: add_lora, remove_lora
    args: tuple[Any, ...]
    future: concurrent.futures.Future[Any]


Command = _Add | _Abort | _Utility


class AsyncLLMEngine(EngineClientBase):
    """Runs `engine` in a daemon thread; `start()` it from the event loop that will read outputs."""

    thread_name = "minivllm-engine"

    def __init__(
        self,
        engine: LLMEngine,
        on_step: StepHook | None = None,
        idle_wakeup_s: float = 1.0,
        on_add: AddHook | None = None,
    ) -> None:
        super().__init__(engine, on_step, on_add)
        self.engine: LLMEngine = engine
        self.idle_wakeup_s = idle_wakeup_s  # how often an idle thread wakes to call on_step
        self._commands: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        # Counted as applied only when the stats that include them are published, so that
        # `num_waiting` never misses a request that is in neither.
        self._num_adds_unpublished = 0  # engine thread only
        # A command is queued, or refused, whole before the dying engine thread drains the queue.
        self._dead_lock = threading.Lock()

    # ------------------------------------------------------------------ the event-loop side
    def start(self) -> None:
        """Start the engine thread from the event loop's thread, which gives its OpenMP team
        back first: that thread loaded the model, and a second team beside the engine thread's
        would make every barrier of every step sleep (minivllm/cpu/openmp.py)."""
        release_thread_team()
        super().start()

    def shutdown(self) -> None:
        """Stop the engine thread (aborting what runs), then the engine (its TP workers)."""
        if self._thread is not None:
            self._commands.put(None)
            self._thread.join(timeout=30)
            self._thread = None
        self.engine.shutdown()

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: RequestParamsType,
        out: asyncio.Queue[StreamItem],
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; its outputs (and a failure, as an exception) arrive on `out`.

        Several requests may share one queue (a completion with several prompts); outputs carry
        their `request_id`.
        """
        sink = self._sink_for(out)
        with self._dead_lock:
            if self.dead_error is not None:  # no thread left to take it
                out.put_nowait(dead_engine_error(self.dead_error))
                return
            self._num_adds_queued += 1
            self._commands.put(_Add(request_id, prompt, params, sink, lora_request))

    def _call_utility(self, method: str, *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._dead_lock:
            if self.dead_error is not None:
                future.set_exception(dead_engine_error(self.dead_error))
                return future
            self._commands.put(_Utility(method, args, future))
        return future

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests (e.g. the client went away); their KV blocks are freed at the next step."""
        if request_ids:
            self._commands.put(_Abort(list(request_ids)))

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                busy = engine.has_unfinished_requests()
                # Idle: sleep until a command comes (waking now and then to log stats). Busy:
                # take the commands that have arrived, without waiting, and step.
                commands: list[Command | None] = []
                try:
                    commands.append(self._commands.get(block=not busy, timeout=self.idle_wakeup_s))
                    while True:
                        commands.append(self._commands.get_nowait())
                except queue.Empty:
                    pass
                for cmd in commands:
                    if cmd is None:
                        self._abort_all()
                        return
                    self._apply(cmd)
                if not (commands or engine.has_unfinished_requests()):
                    self._publish([])  # idle tick: stats logging stays on schedule
                    continue
                outputs = engine.step()  # also returns the outputs of requests aborted above
                # Stats first, then the outputs (vLLM's output handler records before a request
                # resumes): /metrics read after a response already counts its last step.
                self._publish(outputs)
                self._deliver(outputs)
        except BaseException as exc:  # the engine is broken: fail every open request loudly
            logger.exception("the engine thread died")
            with self._dead_lock:
                self.dead_error = exc
                queued = []
                while True:
                    try:
                        queued.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
            for sink in self._sinks.values():
                sink(dead_engine_error(exc))
            self._sinks.clear()
            for cmd in queued:  # sent before the engine died, never applied
                if isinstance(cmd, _Add):
                    cmd.sink(dead_engine_error(exc))
                elif isinstance(cmd, _Utility):
                    cmd.future.set_exception(dead_engine_error(exc))

    def _apply(self, cmd: Command) -> None:
        if isinstance(cmd, _Abort):
            self.engine.abort_request(cmd.request_ids)
            return
        if isinstance(cmd, _Utility):
            try:
                cmd.future.set_result(getattr(self.engine, cmd.method)(*cmd.args))
            except Exception as exc:  # the caller's error (a bad adapter), not the engine's
                cmd.future.set_exception(exc)
            return
        self._num_adds_unpublished += 1
        try:
            self.engine.add_request(
                cmd.request_id, cmd.prompt, cmd.params, lora_request=cmd.lora_request
            )
        except Exception as exc:  # validated by the handler already; report, don't die
            cmd.sink(exc)
            return
        self._sinks[cmd.request_id] = cmd.sink
        self._call_hook(self.on_add, cmd.request_id, cmd.params)

    def _abort_all(self) -> None:
        ids = list(self._sinks)
        self.engine.abort_request(ids)
        self.engine.step()
        for sink in self._sinks.values():
            sink(RuntimeError("the server is shutting down"))
        self._sinks.clear()

    def _publish(self, outputs: list[RequestOutput]) -> None:
        self.stats = self.engine.get_stats()
        self._num_adds_applied += self._num_adds_unpublished
        self._num_adds_unpublished = 0
        self._call_hook(self.on_step, self.stats, outputs)
