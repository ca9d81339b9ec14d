"""Data parallelism: N engine cores behind one frontend (vLLM v1's `DPLBAsyncMPClient`).

vLLM serves `--data-parallel-size N` with N engine-core processes, each a whole engine (its own
copy of the weights, its own KV cache and scheduler), and one API server whose client picks a
core for each request (vllm/v1/engine/core_client.py `DPLBAsyncMPClient`). The cores never talk
to each other for a dense model: data parallelism multiplies throughput by running independent
batches, where tensor and pipeline parallelism cut one model across devices.

- `DPEngineCoreClient` starts this host's cores (core.py, one `EngineCoreClient` each), all at
  once so that their models load in parallel, takes the other hosts' cores as they dial in
  (`data_parallel_size_local` < N: dp_remote.py), and answers the model's facts from core 0 (the
  cores serve one model, so they agree). A core with tensor_parallel_size x
  pipeline_parallel_size > 1 spawns its own workers, as a lone engine does; on CUDA each local
  core sees only its own run of devices (`visible_devices_per_core`).
- `DPLBAsyncMPClient` is an `EngineClient` (protocol.py) over one `AsyncMPClient` per core: each
  core keeps its own pipe, reader thread and request sinks, so a request's outputs stream back
  from whichever core runs it; this class only chooses the core (`choose_engine`) and remembers
  it, so that an abort goes to that core.

The balancing rule (`choose_engine`). vLLM's: the core with the fewest waiting + running
requests, a tie broken by the lower index, counted from the cores' published stats plus the
requests sent since (vLLM's coordinator adds the same local correction). minivllm adds prefix
affinity, so that prefix caching still pays across cores: a prompt with at least one full KV
block has a *home* core, its first block's tokens hashed modulo N, and goes there unless the home
core is much more loaded than the least-loaded one -- more than twice its load plus
`PREFIX_AFFINITY_SLACK` requests. Prompts that share a system prompt or a document then share
their cached blocks on one core, and a popular prefix still cannot starve the other cores. A
prompt shorter than a block has no cacheable block to share and goes to the least-loaded core.

A dead core fails the whole client, as vLLM's does: the requests it ran fail with its name
(`EngineDeadError`, a 500 from the server), every later request too, `is_running` turns false
(/health says 503); the other cores finish what they hold and stop with the server.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
from collections import Counter
from typing import Any

import torch

from minivllm.config import EngineConfig
from minivllm.core.outputs import RequestOutput
from minivllm.engine.core import Shutdown
from minivllm.engine.core_client import AsyncMPClient, EngineCoreClient
from minivllm.engine.dp_remote import accept_remote_cores, listen_for_cores
from minivllm.engine.protocol import (
    AddHook,
    EngineFactsFromEngine,
    RequestParamsType,
    StepHook,
    StreamItem,
)
from minivllm.engine.stats import EngineStats
from minivllm.inputs import PromptType
from minivllm.lora.request import LoRARequest
from minivllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("minivllm")

# A home core keeps its prefix's requests while its load <= 2 x the least load + this: an idle
# server still groups a small burst that shares a prefix on one core.
PREFIX_AFFINITY_SLACK = 4


def prefix_home(token_ids: list[int], block_size: int, num_engines: int) -> int | None:
    """The core that holds this prompt's first KV block when prefix caching is on: a stable hash
    of the block's tokens (the same in every process, unlike Python's `hash` of a str), or None
    when the prompt does not fill one block."""
    if len(token_ids) < block_size:
        return None
    first_block = ",".join(map(str, token_ids[:block_size])).encode()
    return int.from_bytes(hashlib.sha256(first_block).digest()[:8], "little") % num_engines


def choose_engine(loads: list[int], home: int | None) -> int:
    """The core for a request, given each core's waiting + running requests (module docstring):
    the home core unless it is much more loaded, else the least loaded, ties to the lower index."""
    least = min(range(len(loads)), key=lambda i: (loads[i], i))
    if home is not None and loads[home] <= 2 * loads[least] + PREFIX_AFFINITY_SLACK:
        return home
    return least


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """The cores' counters added up; fractions (KV usage, slot utilisation) averaged."""
    first = stats[0]
    fields: dict[str, Any] = {}
    for name, value in vars(first).items():
        values = [getattr(s, name) for s in stats]
        if isinstance(value, dict):  # requests per LoRA adapter
            fields[name] = dict(sum((Counter(v) for v in values), Counter()))
        elif isinstance(value, tuple):
            width = max(len(v) for v in values)
            fields[name] = tuple(sum(v[i] for v in values if i < len(v)) for i in range(width))
        elif isinstance(value, float):
            fields[name] = sum(values) / len(values)
        else:
            fields[name] = sum(values)
    return EngineStats(**fields)


def default_dp_core_threads(num_engines: int) -> int:
    """torch's threads per core: the cores share every CPU core but one (the frontend's)."""
    return max(1, (torch.get_num_threads() - 1) // num_engines)


def visible_devices_per_core(config: EngineConfig, local: int) -> list[str | None]:
    """Each local core's GPUs (its `CUDA_VISIBLE_DEVICES`): core i takes the i-th run of
    tensor_parallel_size x pipeline_parallel_size devices of this host's, as vLLM gives each DP
    rank its own; its workers see them as cuda:0.. . None on a CPU, where every core shares it."""
    if config.resolved.device.type != "cuda":
        return [None] * local
    world = config.parallel.world_size
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = env.split(",") if env else [str(i) for i in range(torch.cuda.device_count())]
    if local * world > len(devices):
        raise ValueError(
            f"data_parallel_size_local={local} cores of tensor_parallel_size x "
            f"pipeline_parallel_size={world} ranks each need {local * world} CUDA devices on this "
            f"host, found {len(devices)}"
        )
    return [",".join(devices[i * world : (i + 1) * world]) for i in range(local)]


class DPEngineCoreClient:
    """Owns the N core processes; the model's facts are core 0's (`EngineFacts`)."""

    def __init__(self, config: EngineConfig, torch_threads: int | None = None) -> None:
        parallel = config.parallel
        n = parallel.data_parallel_size
        local = parallel.data_parallel_size_local
        assert local is not None
        threads = torch_threads or default_dp_core_threads(max(local, 1))
        devices = visible_devices_per_core(config, local)
        self.config = config
        self.cores: list[EngineCoreClient] = []
        server = listen_for_cores(config) if local < n else None  # before the loads: no wait
        try:
            for i in range(local):  # all started before any is waited for: the loads overlap
                self.cores.append(
                    EngineCoreClient(
                        config, threads, i, wait_ready=False, visible_devices=devices[i]
                    )
                )
            if server is not None:  # the other hosts' ranks, local..n-1
                local_cores = list(self.cores)
                self.cores += accept_remote_cores(
                    config, server, lambda: not all(c.alive() for c in local_cores)
                )
            for core in self.cores:
                core.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        finally:
            if server is not None:
                server.close()
        first = self.cores[0]
        for core in self.cores:  # every host read its own model files: they must agree
            if core.vocab_size != first.vocab_size:
                self.shutdown()
                raise ValueError(
                    f"{core.name} has vocab_size {core.vocab_size}, {first.name} "
                    f"{first.vocab_size}: every host must serve the same model"
                )
        self.source = first.source
        self.tokenizer = first.tokenizer
        self.max_model_len = min(c.max_model_len for c in self.cores)
        self.vocab_size = first.vocab_size
        logger.info(
            "data parallel: %d engine cores (pids %s), %d torch threads each",
            n,
            ", ".join(str(c.pid) for c in self.cores),
            threads,
        )

    @property
    def structured_output_manager(self) -> StructuredOutputManager:
        return self.cores[0].structured_output_manager

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self.cores[0].tokenize_prompt(prompt)

    def get_diff_sampling_param(self) -> dict[str, Any]:
        return self.cores[0].get_diff_sampling_param()

    def get_stats(self) -> EngineStats:
        return self.cores[0].get_stats()  # one core's: `make_metrics` reads its block count

    def shutdown(self) -> None:
        for core in self.cores:  # all told at once, then each joined
            if core.alive():
                core.send(Shutdown())
        for core in self.cores:
            core.shutdown()


class DPLBAsyncMPClient(EngineFactsFromEngine):
    """An `EngineClient` over N `AsyncMPClient`s that balances requests across them. The hooks
    get the core's index as a keyword (`engine=i`): the metrics label each core's series."""

    def __init__(
        self,
        client: DPEngineCoreClient,
        on_step: StepHook | None = None,
        on_add: AddHook | None = None,
    ) -> None:
        self.engine = client
        self.on_step, self.on_add = on_step, on_add
        self.clients = [
            AsyncMPClient(core, self._step_hook(i), _for_engine(on_add, i))
            for i, core in enumerate(client.cores)
        ]
        self.block_size = client.config.cache.block_size
        self.prefix_affinity = client.config.cache.enable_prefix_caching
        self._engine_of: dict[str, int] = {}  # request id -> its core, until it finishes
        self._lock = threading.Lock()  # the event loop adds, the readers' sinks drop

    # ------------------------------------------------------------------ live state
    @property
    def stats(self) -> EngineStats:
        return sum_stats([c.stats for c in self.clients])

    @property
    def dead_error(self) -> BaseException | None:
        return next((c.dead_error for c in self.clients if c.dead_error is not None), None)

    @property
    def is_running(self) -> bool:
        return all(c.is_running for c in self.clients)

    @property
    def num_waiting(self) -> int:
        return sum(c.num_waiting for c in self.clients)

    def loads(self) -> list[int]:
        """Each core's waiting + running requests, sends not yet applied included."""
        return [c.stats.num_running + c.num_waiting for c in self.clients]

    # ------------------------------------------------------------------ lifecycle and requests
    def start(self) -> None:
        for c in self.clients:
            c.start()

    def shutdown(self) -> None:
        for c in self.clients:
            c.shutdown()
        self.engine.shutdown()

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: RequestParamsType,
        out: asyncio.Queue[StreamItem],
        lora_request: LoRARequest | None = None,
    ) -> None:
        dead = self.dead_error
        if dead is not None:  # one dead core fails the server (module docstring)
            out.put_nowait(dead)
            return
        home = None
        if self.prefix_affinity and isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            home = prefix_home(list(prompt["prompt_token_ids"]), self.block_size, len(self.clients))
        engine = choose_engine(self.loads(), home)
        with self._lock:
            self._engine_of[request_id] = engine
        self.clients[engine].add_request(request_id, prompt, params, out, lora_request)

    def abort(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                engine = self._engine_of.pop(rid, None)
                if engine is not None:
                    by_engine.setdefault(engine, []).append(rid)
        for engine, rids in by_engine.items():
            self.clients[engine].abort(rids)

    def abort_all(self) -> int:
        return sum(c.abort_all() for c in self.clients)

    # ------------------------------------------------------------------ LoRA adapters
    # Every core holds every adapter: a request under one may be sent to any core.
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        results = await asyncio.gather(*(c.add_lora(lora_request) for c in self.clients))
        return all(results)

    async def remove_lora(self, lora_int_id: int) -> bool:
        results = await asyncio.gather(*(c.remove_lora(lora_int_id) for c in self.clients))
        return all(results)

    def _step_hook(self, engine: int) -> StepHook:
        """Core `engine`'s step, in its reader thread: the finished requests leave the map of
        cores, then the server's hook (metrics) sees the step with the core's index."""
        hook = _for_engine(self.on_step, engine)

        def on_step(stats: EngineStats, outputs: list[RequestOutput]) -> None:
            with self._lock:
                for out in outputs:
                    if out.finished:
                        self._engine_of.pop(out.request_id, None)
            if hook is not None:
                hook(stats, outputs)

        return on_step


def _for_engine(hook: Any, engine: int) -> Any:
    """`hook` with the core's index as its `engine` keyword (None stays None)."""
    if hook is None:
        return None

    def with_engine(*args: Any) -> None:
        hook(*args, engine=engine)

    with_engine.__name__ = getattr(hook, "__name__", "hook")
    return with_engine
