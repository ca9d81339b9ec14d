"""Who runs the model: one runner in this process, or N ranks in lockstep (vLLM's executors).

- `UniProcExecutor` (tensor_parallel_size = pipeline_parallel_size = 1): the single-device
  engine: one `ModelRunner` in this process; no other process, no collective, no cost.
- With N = tensor_parallel_size x pipeline_parallel_size > 1 ranks, `make_executor` hands over to minivllm/distributed/ (imported only then): the
  engine spawns ranks 1..N-1 itself (`MultiprocExecutor`), or, under `torchrun`, the ranks exist
  already and rank 0 drives (`ExecutorWithExternalLauncher`).

The engine takes an executor (or calls `make_executor` once) and then calls `execute_model(sched)`
every step, whichever it got; the simulated-time executor of the paper's experiment
(minivllm/experiments/) plugs in the same way. See "Distributed execution" in the docs
(docs/distributed.md) and the architecture page (docs/architecture.md).

It imports the runner and the worker; tensor parallelism's executors
(tensor_parallel.py) only inside `make_executor`, when its size asks for them.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Literal, Protocol, TypeVar, overload

import torch

from minivllm.attention.abstract import AttentionBackend
from minivllm.config import EngineConfig
from minivllm.core.scheduler import SchedulerOutput
from minivllm.distributed.parallel_state import SINGLE_DEVICE
from minivllm.distributed.pipeline import stage_sizes
from minivllm.envs import pp_layer_partition
from minivllm.worker.model_runner import ModelRunner, ModelRunnerOutput
from minivllm.worker.worker import WorkerConfig, build_runner

__all__ = ["Executor", "PipelinedExecutor", "UniProcExecutor", "make_executor"]

T = TypeVar("T")


class Executor(Protocol):
    driver_runner: ModelRunner  # rank 0's runner, in this process
    num_blocks: int  # KV blocks on every rank

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    def collective_rpc(self, fn: Callable[[ModelRunner], T]) -> list[T]: ...

    def shutdown(self) -> None: ...


class PipelinedExecutor(Executor, Protocol):
    """An executor of pipeline stages (executor/driver.py): `max_concurrent_batches` (vLLM's
    name) batches may be in flight at once; `non_block=True` returns once stage 0 has run the
    batch, with a future of the last stage's output. An executor without the attribute runs one
    batch at a time."""

    max_concurrent_batches: int

    @overload
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    @overload
    def execute_model(
        self, sched: SchedulerOutput, non_block: Literal[True]
    ) -> Future[ModelRunnerOutput]: ...


class UniProcExecutor:
    """tensor_parallel_size = 1: the runner in this process, called directly."""

    max_concurrent_batches = 1  # vLLM's name: one stage, one batch at a time

    def __init__(self, runner: ModelRunner) -> None:
        self.driver_runner = runner
        self.num_blocks = runner.kv_cache.shape[2]

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver_runner.execute_model(sched)

    def collective_rpc(self, fn: Callable[[ModelRunner], T]) -> list[T]:
        return [fn(self.driver_runner)]

    def shutdown(self) -> None:
        pass


def pipeline_layer_sizes(num_layers: int, pp_size: int) -> tuple[int, ...]:
    """Decoder layers per pipeline stage: VLLM_PP_LAYER_PARTITION, or the even split; checked
    against the model here, on the driver, before any process starts. () with one stage."""
    if pp_size == 1:
        return ()
    return tuple(stage_sizes(num_layers, pp_size, pp_layer_partition()))


def worker_config(config: EngineConfig, backend_name: str) -> WorkerConfig:
    """What every rank builds its shard from, resolved once from the engine's config."""
    parallel, resolved = config.parallel, config.resolved
    n, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    source = resolved.source
    return WorkerConfig(
        model_path=str(source.path),
        model_name=source.name,
        dtype=resolved.dtype,
        device_type=resolved.device.type,
        attention_backend=backend_name,
        enforce_eager=config.model.enforce_eager,
        quantization=resolved.quantization,
        gguf_file=None if source.gguf_file is None else str(source.gguf_file),
        hf_overrides=source.hf_overrides,
        max_model_len=resolved.max_model_len,
        cache=config.cache,
        tensor_parallel_size=n,
        # the cores of one machine, shared by the ranks that run on it
        num_threads=max(1, torch.get_num_threads() * parallel.nnodes // (n * pp)),
        pooler=config.pooler,
        lora=config.lora,
        pipeline_parallel_size=pp,
        pp_layer_sizes=pipeline_layer_sizes(resolved.hf_config.num_hidden_layers, pp),
        nnodes=parallel.nnodes,
    )


def make_executor(config: EngineConfig, backend: AttentionBackend) -> Executor:
    """The executor for `config.parallel`'s sizes. A size that does not split the model is
    refused here, before any process starts."""
    parallel = config.parallel
    if parallel.node_rank > 0:
        raise ValueError(
            f"node_rank {parallel.node_rank} runs only its ranks, no engine: start it with "
            "`minivllm serve MODEL ... --headless` (node 0 runs the engine)"
        )
    wc = worker_config(config, backend.name)
    device = config.resolved.device
    if wc.world_size == 1:
        return UniProcExecutor(build_runner(wc, SINGLE_DEVICE, None, device, backend))
    from minivllm.executor.tensor_parallel import make_distributed_executor

    return make_distributed_executor(wc, config.resolved.hf_config, device, backend, parallel)
