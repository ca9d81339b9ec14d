"""`EngineClient`: the one interface the server's handlers drive an engine through.

vLLM's `EngineClient` (vllm/engine/protocol.py), which `AsyncLLM` and the engine-core clients
implement, so that the OpenAI handlers never ask which one they hold. Here two implementations:

- `AsyncLLMEngine` (async_engine.py): the `LLMEngine` stepped by a thread of the server's process.
- `AsyncMPClient` (client.py): the `LLMEngine` in a process of its own (core.py), over a pipe.

Both share `EngineClientBase` below: the model's facts (read from the engine, or from the core's
handshake), the per-request sinks, the waiting count, and the metrics hooks that must never take
the server down. Each adds only its transport: a command queue and a thread, or a pipe and a
reader thread.

Besides requests, a client makes *utility calls* (vLLM's `call_utility_async`): an engine method
run between two steps, in the engine's thread or process, whose result or exception comes back to
the awaiting handler. `add_lora` / `remove_lora` are two: the server's /v1/load_lora_adapter reads
and checks an adapter where the model is, and answers with what the engine found wrong.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from minivllm.config import EngineConfig
from minivllm.core.outputs import RequestOutput
from minivllm.engine.beam_search import BeamSearchParams
from minivllm.engine.stats import EngineStats
from minivllm.inputs import PromptType
from minivllm.lora.request import LoRARequest
from minivllm.model.source import ModelSource
from minivllm.pooling.pooling_params import PoolingParams
from minivllm.sampling_params import SamplingParams
from minivllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("minivllm")

# What a request's queue receives: cumulative outputs, or the exception that ended it.
StreamItem = RequestOutput | BaseException
StepHook = Callable[[EngineStats, list[RequestOutput]], None]  # after each step: metrics, logs
# What a request may carry: sampling, a beam search, or (a pooling model's) pooling parameters.
RequestParamsType = SamplingParams | BeamSearchParams | PoolingParams
AddHook = Callable[[str, RequestParamsType], None]  # each request the engine took


def threadsafe_sink(
    loop: asyncio.AbstractEventLoop, out: asyncio.Queue[StreamItem]
) -> Callable[[StreamItem], None]:
    """A callable another thread may call to put an item on `out`: an asyncio queue is not
    thread-safe, so the put runs in `loop`, the only thread that may touch it."""

    def sink(item: StreamItem) -> None:
        loop.call_soon_threadsafe(out.put_nowait, item)

    return sink


class EngineFacts(Protocol):
    """What the frontend reads about the model without running it: an `LLMEngine`, or the
    `EngineCoreClient` that learned it from the core's handshake."""

    config: EngineConfig
    source: ModelSource
    tokenizer: Any
    max_model_len: int
    vocab_size: int

    @property
    def structured_output_manager(self) -> StructuredOutputManager: ...

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]: ...
    def get_diff_sampling_param(self) -> dict[str, Any]: ...
    def get_stats(self) -> EngineStats: ...
    def shutdown(self) -> None: ...


class EngineClient(Protocol):
    """The server's view of an engine (vLLM's `EngineClient`)."""

    # ---- the model's facts (fixed once the engine is built)
    @property
    def config(self) -> EngineConfig: ...
    @property
    def model_name(self) -> str: ...  # the checkpoint's name: the served name by default
    @property
    def tokenizer(self) -> Any: ...
    @property
    def max_model_len(self) -> int: ...  # after the engine fitted it to the KV cache
    @property
    def vocab_size(self) -> int: ...
    @property
    def structured_output_manager(self) -> StructuredOutputManager: ...
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]: ...
    def get_diff_sampling_param(self) -> dict[str, Any]: ...  # generation_config.json defaults

    # ---- live state
    @property
    def stats(self) -> EngineStats: ...  # published after each step
    @property
    def dead_error(self) -> BaseException | None: ...  # set once the engine died: all then fail

    @property
    def is_running(self) -> bool: ...  # /health
    @property
    def num_waiting(self) -> int: ...  # the waiting-queue bound's count

    # ---- lifecycle and requests
    def start(self) -> None: ...  # from the event loop that will read outputs
    def shutdown(self) -> None: ...  # stops the engine too (tensor-parallel workers, the core)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: RequestParamsType,
        out: asyncio.Queue[StreamItem],
        lora_request: LoRARequest | None = None,  # the adapter it runs under; None: the base
    ) -> None: ...
    def abort(self, request_ids: list[str]) -> None: ...
    def abort_all(self) -> int: ...  # the shutdown drain ran out

    # ---- LoRA adapters (utility calls: run between steps, where the model is)
    async def add_lora(self, lora_request: LoRARequest) -> bool: ...  # raises a LoRAError
    async def remove_lora(self, lora_int_id: int) -> bool: ...


class EngineFactsFromEngine:
    """The model's facts an `EngineClient` answers, read from the `EngineFacts` it holds as
    `self.engine` (the in-thread and core clients, and data parallelism's client of N cores)."""

    engine: EngineFacts

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def model_name(self) -> str:
        return self.engine.source.name

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def structured_output_manager(self) -> StructuredOutputManager:
        return self.engine.structured_output_manager

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids), here in the frontend: the engine gets the ids."""
        return self.engine.tokenize_prompt(prompt)

    def get_diff_sampling_param(self) -> dict[str, Any]:
        return self.engine.get_diff_sampling_param()


class EngineClientBase(EngineFactsFromEngine):
    """The code both clients share. A subclass sets `thread_name` and implements `_run` (its
    thread), `add_request`, `abort` and `shutdown`."""

    thread_name = "minivllm-engine"

    def __init__(
        self, engine: EngineFacts, on_step: StepHook | None, on_add: AddHook | None
    ) -> None:
        self.engine = engine
        self.on_step = on_step  # runs in the client's thread
        self.on_add = on_add
        self.stats: EngineStats = engine.get_stats()
        self._sinks: dict[str, Callable[[StreamItem], None]] = {}
        # Adds queued but not yet counted in `stats` = queued - applied; each counter has one
        # writer thread (queued: the event loop; applied: the client's thread).
        self._num_adds_queued = 0
        self._num_adds_applied = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead_error: BaseException | None = None

    # ------------------------------------------------------------------ live state
    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    @property
    def num_waiting(self) -> int:
        """Sequences waiting in the scheduler, plus requests sent but not yet taken."""
        return self.stats.num_waiting + self._num_adds_queued - self._num_adds_applied

    # ------------------------------------------------------------------ the event-loop side
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def _sink_for(self, out: asyncio.Queue[StreamItem]) -> Callable[[StreamItem], None]:
        assert self._loop is not None, "start() the engine first"
        return threadsafe_sink(self._loop, out)

    # ------------------------------------------------------------------ the client's thread
    def abort(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def abort_all(self) -> int:
        """Abort every request the engine holds (the server's shutdown drain ran out): each ends
        as an aborted request does, its stream closed and its KV blocks freed. How many."""
        ids = list(self._sinks.copy())  # the client thread's dict: a copy is one atomic step
        self.abort(ids)
        return len(ids)

    def _run(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ utility calls
    def _call_utility(self, method: str, *args: Any) -> concurrent.futures.Future[Any]:
        """Have the engine run `method(*args)` between two steps; the future holds its result
        or its exception. A subclass sends it through its transport."""
        raise NotImplementedError

    async def call_utility(self, method: str, *args: Any) -> Any:
        if self.dead_error is not None:
            raise self.dead_error
        return await asyncio.wrap_future(self._call_utility(method, *args))

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter into the engine (`LLMEngine.add_lora`): a `LoRAError`
        names what is wrong."""
        return bool(await self.call_utility("add_lora", lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; requests running under it finish on it (`LLMEngine.remove_lora`)."""
        return bool(await self.call_utility("remove_lora", lora_int_id))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Each output to its request's queue; a finished request's sink is dropped."""
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                sink(out)
            if out.finished:
                self._sinks.pop(out.request_id, None)

    def _call_hook(self, hook: Callable[..., None] | None, *args: Any) -> None:
        if hook is None:
            return
        try:
            hook(*args)
        except Exception:  # metrics must never take the engine down
            logger.exception("%s hook failed", getattr(hook, "__name__", "a"))
