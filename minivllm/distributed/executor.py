"""Who runs the model: one runner in this process, or N ranks in lockstep (vLLM's executors).

- `UniProcExecutor` (tensor_parallel_size = 1): the single-device engine, unchanged: one
  `ModelRunner` in this process; no other process, no collective, no cost.
- `MultiprocExecutor` (N > 1 on one machine, multiproc.py): the engine spawns ranks 1..N-1
  itself, as vLLM's multiprocessing executor does; no launcher needed.
- `ExecutorWithExternalLauncher` (N > 1 under `torchrun`, on one machine or several, driver.py):
  the ranks exist already; rank 0 drives, and on the other ranks building the engine turns the
  process into a worker.

The engine calls `make_executor` once and then `execute_model(sched)` every step, whichever it
got. See "Distributed execution" in the docs (docs/distributed.md) and the architecture page
(docs/architecture.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Literal, Protocol, TypeVar

import torch

from minivllm.attention import AttentionBackend
from minivllm.config import EngineConfig
from minivllm.core.scheduler import SchedulerOutput
from minivllm.distributed.driver import (
    EngineDeadError,
    ExecutorWithExternalLauncher,
    WorkerStartError,
)
from minivllm.distributed.multiproc import MultiprocExecutor
from minivllm.distributed.parallel_state import (
    SINGLE_DEVICE,
    check_no_process_group,
    launched_by_torchrun,
)
from minivllm.distributed.worker import WorkerConfig, build_runner, run_torchrun_worker
from minivllm.model.parallel_layers import check_tensor_parallel_size
from minivllm.model_runner import ModelRunner, ModelRunnerOutput

__all__ = [
    "EngineDeadError",
    "Executor",
    "FaultInjector",
    "UniProcExecutor",
    "WorkerStartError",
    "make_executor",
]

T = TypeVar("T")


class Executor(Protocol):
    driver_runner: ModelRunner  # rank 0's runner, in this process
    num_blocks: int  # KV blocks on every rank

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    def collective_rpc(self, fn: Callable[[ModelRunner], T]) -> list[T]: ...

    def shutdown(self) -> None: ...


FaultPoint = Literal["before_model", "after_model"]


class FaultInjector:
    """Makes one step fail on the path users run, for the engine's fault tests.

    A forward hook would be the obvious place, but a hook is Python the C++ decode-layers replay
    cannot run, so registering one switches the replay off, and the default CPU decode path would
    go untested. The executor checks this instead, around the runner's call: `"before_model"`
    (nothing computed yet) or `"after_model"` (every layer wrote its K/V, the step's prefix-cache
    names are given but not final, nothing is sampled). It raises `exc` the first time
    `when(sched)` holds at `point`, once."""

    def __init__(
        self,
        point: FaultPoint,
        exc: BaseException,
        when: Callable[[SchedulerOutput], bool] = lambda sched: True,
    ) -> None:
        self.point, self.exc, self.when = point, exc, when
        self.fired = False

    def check(self, point: FaultPoint, sched: SchedulerOutput) -> None:
        if not self.fired and point == self.point and self.when(sched):
            self.fired = True
            raise self.exc


class UniProcExecutor:
    """tensor_parallel_size = 1: the runner in this process, called directly."""

    def __init__(self, runner: ModelRunner) -> None:
        self.driver_runner = runner
        self.num_blocks = runner.kv_cache.shape[2]
        self.fault_injector: FaultInjector | None = None  # tests only: see FaultInjector

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if self.fault_injector is None:
            return self.driver_runner.execute_model(sched)
        self.fault_injector.check("before_model", sched)
        output = self.driver_runner.execute_model(sched)
        self.fault_injector.check("after_model", sched)
        return output

    def collective_rpc(self, fn: Callable[[ModelRunner], T]) -> list[T]:
        return [fn(self.driver_runner)]

    def shutdown(self) -> None:
        pass


# ---------------------------------------------------------------------------------- the factory
def make_executor(config: EngineConfig, backend: AttentionBackend) -> Executor:
    """The executor for `config.parallel.tensor_parallel_size`. A size that does not split the
    model is refused here, before any process starts."""
    n = config.parallel.tensor_parallel_size
    resolved = config.resolved
    source, model_config, device = resolved.source, resolved.hf_config, resolved.device
    wc = WorkerConfig(
        model_path=str(source.path),
        model_name=source.name,
        dtype=resolved.dtype,
        device_type=device.type,
        attention_backend=backend.name,
        enforce_eager=config.model.enforce_eager,
        max_model_len=resolved.max_model_len,
        cache=config.cache,
        tensor_parallel_size=n,
        num_threads=max(1, torch.get_num_threads() // n),
    )
    if n == 1:
        return UniProcExecutor(build_runner(wc, SINGLE_DEVICE, None, device, backend))
    check_tensor_parallel_size(model_config, n)
    check_no_process_group()  # before any worker starts
    if device.type == "cuda":
        if device.index not in (None, 0):
            raise ValueError(
                f"device must be 'cuda' with tensor_parallel_size > 1 (rank r uses cuda:r), got "
                f"{device}"
            )
        if not launched_by_torchrun() and torch.cuda.device_count() < n:
            raise ValueError(
                f"tensor_parallel_size {n} needs {n} CUDA devices, found "
                f"{torch.cuda.device_count()}"
            )
    if launched_by_torchrun():
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world_size != n:
            raise ValueError(
                f"tensor_parallel_size ({n}) must equal torchrun's number of ranks ({world_size})"
            )
        if rank != 0:
            # Every rank runs the same program; this one serves rank 0's steps, then leaves.
            run_torchrun_worker(wc)
            raise SystemExit(0)
        return ExecutorWithExternalLauncher(wc, backend)
    return MultiprocExecutor(wc, backend)
