"""The frontend's side of the engine-core process (vLLM v1's core_client.py `AsyncMPClient`).

- `EngineCoreClient` starts the core (core.py) in a spawned process, waits for its
  handshake, and stands in for the `LLMEngine` wherever the frontend needs facts about the model
  but not the model itself: the tokenizer (loaded here, in the frontend, where prompts are
  tokenized and chat templates applied), `max_model_len` as the built engine fitted it to the KV
  cache, the vocabulary size, the model's sampling defaults, a structured-output manager that
  validates grammars before a request is queued (the core compiles them again for its matchers).
- `AsyncMPClient` is an `EngineClient` (protocol.py) over the pipe, as `AsyncLLMEngine` is one
  over a thread (the server's handlers cannot tell them apart):
  `add_request` / `abort` / utility calls (`add_lora`) send commands; a reader thread receives
  each step's outputs and hands them to the requests' asyncio queues with `call_soon_threadsafe`,
  resolves the utility calls' futures, and runs the metrics hooks (`on_add`, `on_step`) from the
  stats the core sends.

If the core dies, the reader sees the pipe's EOF: every open request fails with `EngineDeadError`,
so does every later one, and `is_running` turns false (the server's /health says 503).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import threading
from typing import Any

from minivllm.config import EngineConfig
from minivllm.engine.core import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreOutputs,
    CoreReady,
    Shutdown,
    UtilityRequest,
    run_engine_core,
)
from minivllm.engine.protocol import (
    AddHook,
    EngineClientBase,
    RequestParamsType,
    StepHook,
    StreamItem,
)
from minivllm.engine.stats import EngineStats
from minivllm.exceptions import EngineDeadError
from minivllm.inputs import PromptType, process_prompt
from minivllm.lora.request import LoRARequest
from minivllm.model.loader import load_tokenizer
from minivllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("minivllm")

STARTUP_TIMEOUT_S = 600.0  # a model load on a contended machine
SHUTDOWN_TIMEOUT_S = 30.0  # a graceful exit, then SIGKILL


def default_core_threads() -> int:
    """torch's threads for the core: every core but one, which the frontend keeps. Measured on 2
    cores (docs/serving.md): with all of them, the frontend's work between steps preempts one of
    the core's OpenMP threads in the middle of a parallel region, and the other waits at the
    barrier; the core then spent twice the CPU time per token."""
    import torch

    return max(1, torch.get_num_threads() - 1)


class EngineCoreClient:
    """Owns the core process. Build it in the thread that lives as long as the server (the main
    thread): the core's parent-death signal is tied to the thread that started it."""

    max_model_len: int
    vocab_size: int
    structured_output_manager: StructuredOutputManager

    def __init__(
        self,
        config: EngineConfig,
        torch_threads: int | None = None,
        index: int | None = None,
        wait_ready: bool = True,
        visible_devices: str | None = None,
    ) -> None:
        """`index`: the core's data-parallel rank (dp_client.py), named in its errors;
        `wait_ready=False` returns once the process started (call `wait_ready()`), so that
        several cores load their models at once; `visible_devices`: the rank's GPUs."""
        self._load_tokenizer(config)
        ctx = mp.get_context("spawn")  # a fresh interpreter: no fork of our threads or locks
        self.conn, child_conn = ctx.Pipe()
        threads = torch_threads or default_core_threads()
        self.process = ctx.Process(
            target=run_engine_core,
            args=(child_conn, config, os.getpid(), threads, visible_devices),
            name="minivllm-engine-core" if index is None else f"minivllm-engine-core-{index}",
        )
        self.process.start()
        child_conn.close()  # the core's end lives in the core now: its exit is our EOF
        # What errors call the core (the frontend's 5xx say which core died).
        self.name = "the engine core" if index is None else f"engine core {index}"
        if index is not None:
            self.name += f" (pid {self.process.pid})"
        self._send_lock = threading.Lock()
        atexit.register(self.shutdown)  # before multiprocessing's own atexit joins the child
        if wait_ready:
            self.wait_ready()

    def _load_tokenizer(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        self.source = config.resolved.source
        self.tokenizer: Any = (
            None if mc.skip_tokenizer_init else load_tokenizer(self.source, mc.tokenizer)
        )

    def alive(self) -> bool:
        return self.process.is_alive()

    def exit_status(self, timeout: float) -> str:
        """How the core ended, for its errors (after waiting `timeout` s for it to)."""
        self.process.join(timeout)
        return f"exit code {self.process.exitcode}"

    def wait_ready(self) -> None:
        """The core's handshake: the facts only the built engine knows."""
        ready = self._handshake()
        self.pid = ready.pid
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self._diff_sampling_param = ready.diff_sampling_param
        self.startup_stats = ready.stats
        self.structured_output_manager = StructuredOutputManager(
            self.tokenizer, self.vocab_size, ready.stop_token_ids, self.config.structured_outputs
        )

    def _handshake(self) -> CoreReady:
        try:
            if not self.conn.poll(STARTUP_TIMEOUT_S):
                raise RuntimeError(f"{self.name} did not start in {STARTUP_TIMEOUT_S:.0f} s")
            message = self.conn.recv()
        except EOFError:
            message = CoreFailed(f"it ended ({self.exit_status(5.0)}) before it was ready")
        except BaseException:
            self.shutdown()
            raise
        if isinstance(message, CoreFailed):
            self.shutdown()
            if isinstance(message.error, ValueError):  # a configuration error: as in-process
                raise message.error
            raise RuntimeError(f"{self.name} failed to start: {message.message}")
        assert isinstance(message, CoreReady), message
        return message

    # ------------------------------------------------------------------ LLMEngine's facts
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return process_prompt(prompt, self.tokenizer, self.vocab_size)

    def get_diff_sampling_param(self) -> dict[str, Any]:
        return dict(self._diff_sampling_param)

    def get_stats(self) -> EngineStats:
        return self.startup_stats  # the live ones are `AsyncMPClient.stats`

    # ------------------------------------------------------------------ the pipe
    def send(self, message: AddRequest | AbortRequests | UtilityRequest | Shutdown) -> None:
        """Send, or nothing when the core is gone (the reader then fails every open request)."""
        with self._send_lock, contextlib.suppress(OSError):  # loop thread vs. shutdown's
            self.conn.send(message)

    def shutdown(self) -> None:
        """Stop the core and join it (SIGKILL after a grace period); idempotent."""
        if self.process.pid is None or self.process.exitcode is not None:
            return
        self.send(Shutdown())
        self.process.join(SHUTDOWN_TIMEOUT_S)
        if self.process.is_alive():
            logger.warning("%s did not exit in time; killing it", self.name)
            self.process.kill()
            self.process.join()


class AsyncMPClient(EngineClientBase):
    """An `EngineClient` over an `EngineCoreClient`; `start()` it from the event loop that will
    read outputs. `engine` is the client: the model's facts are read there."""

    thread_name = "minivllm-core-reader"

    def __init__(
        self,
        client: EngineCoreClient,
        on_step: StepHook | None = None,
        on_add: AddHook | None = None,
    ) -> None:
        super().__init__(client, on_step, on_add)  # `stats`: the handshake's, until a step's
        self.engine: EngineCoreClient = client
        self._params: dict[str, RequestParamsType] = {}  # sent, not yet taken
        self._lock = threading.Lock()  # sinks vs. the reader failing them all at once
        self._stopping = False
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}  # utility calls sent
        self._call_ids = itertools.count()

    # ------------------------------------------------------------------ the event-loop side
    def shutdown(self) -> None:
        self._stopping = True
        if self._thread is not None and self.dead_error is None:
            self.engine.send(Shutdown())
            self._thread.join(timeout=SHUTDOWN_TIMEOUT_S)
        self._thread = None
        self.engine.shutdown()

    @property
    def is_running(self) -> bool:
        return super().is_running and self.engine.alive()

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: RequestParamsType,
        out: asyncio.Queue[StreamItem],
        lora_request: LoRARequest | None = None,
    ) -> None:
        sink = self._sink_for(out)
        with self._lock:
            if self.dead_error is not None:
                out.put_nowait(self.dead_error)
                return
            self._sinks[request_id] = sink
            self._params[request_id] = params
        self._num_adds_queued += 1
        self.engine.send(AddRequest(request_id, prompt, params, lora_request))

    def _call_utility(self, method: str, *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self.dead_error is not None:  # no reader left to answer it
                future.set_exception(self.dead_error)
                return future
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        self.engine.send(UtilityRequest(call_id, method, args))
        return future

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests (a client went away); the core frees their KV blocks at once."""
        if request_ids and self.dead_error is None:
            self.engine.send(AbortRequests(list(request_ids)))

    # ------------------------------------------------------------------ the reader thread
    def _run(self) -> None:
        conn = self.engine.conn
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                self._die(f"{self.engine.name} process exited")
                return
            if isinstance(message, CoreFailed):
                logger.error("%s died:\n%s", self.engine.name, message.message)
                self._die(f"{self.engine.name} failed: {message.message.strip().splitlines()[-1]}")
                return
            assert isinstance(message, CoreOutputs), message
            self._dispatch(message)
            if message.final:
                self._die("the server is shutting down")
                return

    def _dispatch(self, message: CoreOutputs) -> None:
        for rid, error in message.errors.items():  # refused by the core: only that request fails
            self._params.pop(rid, None)
            sink = self._sinks.pop(rid, None)
            if sink is not None:
                sink(ValueError(error))
        for rid in message.added:
            params = self._params.pop(rid, None)
            if params is not None:
                self._call_hook(self.on_add, rid, params)
        for answer in message.utility_results:
            with self._lock:
                future = self._calls.pop(answer.call_id, None)
            if future is not None and answer.error is not None:
                future.set_exception(answer.error)
            elif future is not None:
                future.set_result(answer.result)
        self.stats = message.stats
        self._num_adds_applied += len(message.added) + len(message.errors)
        self._call_hook(self.on_step, message.stats, message.outputs)
        self._deliver(message.outputs)  # after the stats, as the in-process client does

    def _die(self, why: str) -> None:
        if not self._stopping:
            why = f"{why} ({self.engine.exit_status(1.0)}); restart the server"
            logger.error("engine core dead: %s", why)  # `why` names the core
        error = EngineDeadError(why)
        with self._lock:
            self.dead_error = error
            sinks, self._sinks = self._sinks, {}
            calls, self._calls = self._calls, {}
        for sink in sinks.values():
            sink(error)
        for future in calls.values():
            future.set_exception(error)
