"""The executors of tensor parallelism: N ranks in lockstep on one machine or several.

- `MultiprocExecutor` (N > 1, multiproc_executor.py): the engine spawns ranks 1..N-1 itself, as
  vLLM's multiprocessing executor does; no launcher needed. With `nnodes` > 1 it spawns its own
  node's share, and each other node's share is spawned by a `--headless` invocation there.
- `RayDistributedExecutor` (`distributed_executor_backend="ray"`, ray_distributed_executor.py):
  ranks 1..N-1 are Ray actors, placed over a Ray cluster's nodes by a placement group.
- `ExecutorWithExternalLauncher` (N > 1 under `torchrun`, on one machine or several, driver.py):
  the ranks exist already; rank 0 drives, and on the other ranks building the engine turns the
  process into a worker.

minivllm/executor/abstract.py calls `make_distributed_executor` when `tensor_parallel_size` is above 1;
the single-device engine never imports this package.
"""

from __future__ import annotations

import os

import torch

from minivllm.attention.abstract import AttentionBackend
from minivllm.config import ParallelConfig
from minivllm.distributed.process_group import check_no_process_group, launched_by_torchrun
from minivllm.executor.driver import (
    DistributedExecutor,
    EngineDeadError,
    ExecutorWithExternalLauncher,
    WorkerStartError,
)
from minivllm.executor.multiproc_executor import MultiprocExecutor
from minivllm.model.config import LlamaConfig
from minivllm.model.layers.linear import check_tensor_parallel_size
from minivllm.worker.worker import WorkerConfig
from minivllm.worker.worker_proc import run_torchrun_worker

__all__ = ["EngineDeadError", "WorkerStartError", "make_distributed_executor"]


def make_distributed_executor(
    wc: WorkerConfig,
    model_config: LlamaConfig,
    device: torch.device,
    backend: AttentionBackend,
    parallel: ParallelConfig,
) -> DistributedExecutor:
    """The executor of `wc.tensor_parallel_size` x `wc.pipeline_parallel_size` ranks, started by
    `parallel.distributed_executor_backend` (or by torchrun). A size that does not split the model
    is refused here, before any process starts."""
    check_tensor_parallel_size(model_config, wc.tensor_parallel_size)
    n = wc.world_size
    check_no_process_group()  # before any worker starts
    if device.type == "cuda":
        if device.index not in (None, 0):
            raise ValueError(
                "device must be 'cuda' with more than one rank (tensor_parallel_size x "
                f"pipeline_parallel_size > 1; rank r uses cuda:r), got {device}"
            )
        local = wc.ranks_per_node
        spawned = not launched_by_torchrun() and parallel.distributed_executor_backend == "mp"
        if spawned and torch.cuda.device_count() < local:
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size / nnodes = {local} ranks on this "
                f"machine need {local} CUDA devices, found {torch.cuda.device_count()}"
            )
    if launched_by_torchrun():
        if parallel.nnodes > 1 or parallel.distributed_executor_backend != "mp":
            raise ValueError(
                "under torchrun, torchrun starts every rank: leave distributed_executor_backend "
                "'mp' and nnodes 1 (torchrun's own --nnodes and --node-rank say where), got "
                f"distributed_executor_backend={parallel.distributed_executor_backend!r}, "
                f"nnodes={parallel.nnodes}"
            )
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world_size != n:
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size ({n}) must equal torchrun's "
                f"number of ranks ({world_size})"
            )
        if rank != 0:
            # Every rank runs the same program; this one serves rank 0's steps, then leaves.
            run_torchrun_worker(wc)
            raise SystemExit(0)
        return ExecutorWithExternalLauncher(wc, backend)
    if parallel.distributed_executor_backend == "ray":
        from minivllm.executor.ray_distributed_executor import RayDistributedExecutor

        return RayDistributedExecutor(wc, backend)
    return MultiprocExecutor(wc, backend, parallel)
