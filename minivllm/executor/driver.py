"""Rank 0 of the ranks: send each step to every rank, run its own share, collect.

The scheduler stays centralized (paper §4.6): only the driver schedules, owns the block manager
and samples. Each step `execute_model` broadcasts the step's plain `SchedulerOutput` on the
control group, runs rank 0's own runner on it, and returns the logits that rank 0 gathered in the
LM head; the workers learn nothing else and need no scheduler state at all. vLLM's executors do
the same with their own message queue (vllm/v1/executor/multiproc_executor.py).

With pipeline parallelism rank 0 runs stage 0 only, and the logits come back later from the last
stage's rank 0; `max_concurrent_batches` = the stages (vLLM's), so that every stage can work on a
different batch. The design: `execute_model(sched, non_block=True)` sends the step without
waiting for a rank still busy with an earlier batch (`broadcast_message(block=False)`), runs
stage 0, and returns a `Future` of the output. One thread, the *output receiver*, takes the last
stage's outputs in the order the batches were sent (`PipelineParallelGroup.recv_output`, on a
group of its own, so it never meets the control group's messages) and fulfils the futures. The
engine waits on a future only when its batch queue is full or it has nothing new to schedule.
A stage's sends of hidden states stay blocking: a stage takes the next batch when it has
finished the one before. See
"Distributed execution" in the docs (docs/distributed.md) and the architecture page
(docs/architecture.md).

A step that fails halfway leaves the ranks at different places of the forward pass, and no
message can put them back in step. So any failure inside a distributed step (a worker that died
or raised, an exception on the driver, Ctrl-C) stops every worker, and the engine ends with
`EngineDeadError` (Ctrl-C stays a `KeyboardInterrupt`); every later call raises at once.

`DistributedExecutor` is the protocol; its subclasses start the ranks: `MultiprocExecutor`
(multiproc.py) spawns them, `ExecutorWithExternalLauncher` (here) finds them started by torchrun.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal, TypeVar, overload

import torch.distributed as dist

from minivllm.attention.abstract import AttentionBackend
from minivllm.core.scheduler import SchedulerOutput
from minivllm.distributed.parallel_state import TensorParallelGroup
from minivllm.distributed.pipeline import PipelineParallelGroup
from minivllm.distributed.process_group import (
    broadcast_message,
    destroy_distributed,
    init_distributed,
)
from minivllm.worker.model_runner import ModelRunner, ModelRunnerOutput
from minivllm.worker.worker_proc import (
    CollectiveRPC,
    ExecuteModel,
    Shutdown,
    WorkerConfig,
    build_runner,
    rank_device,
)

logger = logging.getLogger("minivllm")

T = TypeVar("T")
SHUTDOWN_LOCK_TIMEOUT_S = 30.0  # a shutdown waits this long for a step in another thread
RECEIVER_EXIT_S = 10.0  # at shutdown, how long the output receiver may take to leave


class EngineDeadError(BaseException):
    """The tensor-parallel group cannot run another step (vLLM's name).

    A `BaseException`, like `KeyboardInterrupt`: it ends the engine instead of failing one step's
    requests, because no later step could run either. `LLM.generate` raises it; the server's
    engine thread stops and /health turns unhealthy."""


class StageOutput(Future[ModelRunnerOutput]):
    """A batch's output from the last pipeline stage, once the output receiver has it. Its
    `result()` fails as a step does: a failure on the way stops every rank and raises
    `EngineDeadError` naming the rank that died (the receiver thread only records it)."""

    def __init__(self, executor: DistributedExecutor) -> None:
        super().__init__()
        self.executor = executor

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        try:
            return super().result(timeout)
        except BaseException as exc:
            executor = self.executor
            with executor.lock:
                executor.check_alive()  # an earlier failure (or a dead worker) said why already
                raise executor.fail(exc) from exc


class WorkerStartError(RuntimeError):
    """A tensor-parallel worker failed before the engine was built (no worker is left running)."""


class DistributedExecutor:
    """Rank 0 of N: send each message to every rank on the control group, do rank 0's share.

    Subclasses start and stop the other ranks (`start_workers`, `end_workers`) and say what
    happened to them after a failure (`worker_failure`); joining the group, the step, the RPCs and
    the shutdown are here."""

    init_method = "env://"

    def __init__(self, wc: WorkerConfig, backend: AttentionBackend) -> None:
        self.control: dist.ProcessGroup | None = None
        self.tp = TensorParallelGroup()
        self.pp = PipelineParallelGroup()
        self.world_size = wc.world_size  # tensor_parallel_size x pipeline_parallel_size
        self.dead: str | None = None  # why the group cannot run another step
        self.closed = False
        # The server steps in its engine thread while `shutdown` may come from the main thread
        # (at exit): one message at a time on the control group.
        self.lock = threading.Lock()
        # Pipeline parallelism: the futures of the batches in flight, in the order they were
        # sent, for the output receiver thread (None: stop); the control sends not yet taken.
        self.pending: queue.SimpleQueue[StageOutput | None] = queue.SimpleQueue()
        self.receiver: threading.Thread | None = None
        self.unsent: list[dist.Work] = []
        atexit.register(self.shutdown)
        try:
            self.start_workers(wc)
            self.device = device = rank_device(wc.device_type, 0)
            self.tp, self.pp, self.control = init_distributed(
                0, wc.tensor_parallel_size, self.init_method, device, wc.pipeline_parallel_size
            )
            self.send_worker_config(wc)
            self.driver_runner = build_runner(
                wc, self.tp, self.control, device, backend, pp=self.pp
            )
        except BaseException as exc:
            known = isinstance(exc, KeyboardInterrupt | WorkerStartError)
            reason = None if known else self.worker_failure()
            self.closed = True
            atexit.unregister(self.shutdown)
            self.stop_workers(graceful=False)
            if reason is None:
                raise
            raise WorkerStartError(
                f"a tensor-parallel worker failed while starting: {reason}"
            ) from exc
        self.num_blocks = self.driver_runner.kv_cache.shape[2]

    @property
    def max_concurrent_batches(self) -> int:
        """vLLM's name: how many batches the engine keeps in flight, one per pipeline stage."""
        return self.pp.world_size

    # ------------------------------------------------------------------ the ranks (subclasses)
    def start_workers(self, wc: WorkerConfig) -> None:
        """Start ranks 1..N-1 (they then wait for rank 0 at `init_method`)."""

    def send_worker_config(self, wc: WorkerConfig) -> None:
        """Give the workers the config, if they do not have it from their start."""

    def end_workers(self, graceful: bool) -> None:
        """Make sure ranks 1..N-1 are gone (after a Shutdown message if `graceful`)."""

    def worker_failure(self) -> str | None:
        """What went wrong with a worker, or None if none is known to have failed."""
        return None

    def workers_alive(self) -> bool:
        return True

    def elsewhere(self) -> str | None:
        """The ranks that no process of this node watches (other nodes' ranks), named for a
        failure that no rank here explains; None when every rank is watched."""
        return None

    # ------------------------------------------------------------------ the step
    @overload
    def execute_model(
        self, sched: SchedulerOutput, non_block: Literal[False] = False
    ) -> ModelRunnerOutput: ...

    @overload
    def execute_model(
        self, sched: SchedulerOutput, non_block: Literal[True]
    ) -> Future[ModelRunnerOutput]: ...

    def execute_model(
        self, sched: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Run one step on every rank. With pipeline stages and `non_block`, return once stage 0
        has run it: a `Future` of the last stage's output (whose `result()` raises
        `EngineDeadError` if a rank failed on the way)."""
        pipelined = self.pp.world_size > 1
        with self.lock:
            self.check_alive()
            try:
                self.unsent = [w for w in self.unsent if not w.is_completed()]
                # A later stage may still be busy with the batch before: do not wait for it.
                self.unsent += broadcast_message(ExecuteModel(sched), self.control, not pipelined)
                output = self.driver_runner.execute_model(sched)  # stage 0's share
                if not pipelined:  # the logits reached rank 0 in the LM head's gather
                    if not non_block:
                        return output
                    done: Future[ModelRunnerOutput] = Future()
                    done.set_result(output)
                    return done
                future = StageOutput(self)
                self.start_receiver()
                self.pending.put(future)
            except BaseException as exc:
                raise self.fail(exc) from exc
        return future if non_block else future.result()

    def start_receiver(self) -> None:
        if self.receiver is None:
            self.receiver = threading.Thread(
                target=self.receive_outputs, name="minivllm-pp-output-receiver", daemon=True
            )
            self.receiver.start()

    def receive_outputs(self) -> None:
        """The output receiver's loop: each batch's output from the last stage, in order."""
        while (future := self.pending.get()) is not None:
            try:
                future.set_result(self.pp.recv_output(self.device))
            except BaseException as exc:  # a stage died: every later batch fails the same way
                future.set_exception(exc)

    def collective_rpc(self, fn: Callable[[ModelRunner], T]) -> list[T]:
        """`fn(runner)` on every rank, the results in rank order (vLLM's `collective_rpc`)."""
        with self.lock:
            self.check_alive()
            try:
                self.broadcast(CollectiveRPC(fn))
                results: list[Any] = [None] * self.world_size
                dist.gather_object(fn(self.driver_runner), results, dst=0, group=self.control)
                return results
            except BaseException as exc:
                raise self.fail(exc) from exc

    def broadcast(self, message: object) -> None:
        broadcast_message(message, self.control)

    def check_alive(self) -> None:
        if self.closed:
            raise EngineDeadError("the engine was shut down")
        if self.dead is None and not self.workers_alive():
            self.dead = self.worker_failure() or "a worker exited"
            self.stop_workers(graceful=False)
        if self.dead is not None:
            raise EngineDeadError(f"the tensor-parallel group is stopped: {self.dead}")

    def fail(self, exc: BaseException) -> BaseException:
        """The ranks are out of step: stop every worker, remember why, and say it clearly. Ctrl-C
        stays a KeyboardInterrupt; anything else becomes EngineDeadError."""
        reason = None if isinstance(exc, KeyboardInterrupt) else self.worker_failure()
        self.dead = reason or f"a step failed ({type(exc).__name__}: {exc})"
        if reason is None and not isinstance(exc, KeyboardInterrupt) and self.elsewhere():
            self.dead += (
                "; no rank on this node failed, so suspect the ranks it cannot watch, on the "
                f"other nodes: {self.elsewhere()} (see that node's log)"
            )
        logger.error("tensor-parallel step failed, stopping every rank: %s", self.dead)
        self.stop_workers(graceful=False)
        if isinstance(exc, KeyboardInterrupt):
            return exc
        return EngineDeadError(f"the tensor-parallel group is stopped: {self.dead}")

    # ------------------------------------------------------------------ the end
    def shutdown(self) -> None:
        """Stop every worker (idempotent). Called by `LLM.shutdown()`, on deletion and at exit."""
        if self.closed:
            return
        # A step still running in another thread would be cut short: wait a while for it.
        got_lock = self.lock.acquire(timeout=SHUTDOWN_LOCK_TIMEOUT_S)
        try:
            if self.closed:
                return
            self.closed = True
            atexit.unregister(self.shutdown)
            self.stop_workers(graceful=got_lock and self.dead is None)
        finally:
            if got_lock:
                self.lock.release()

    def stop_workers(self, graceful: bool) -> None:
        if graceful:
            try:
                self.broadcast(Shutdown())
            except RuntimeError:  # a worker is gone already: nothing to tell it
                graceful = False
        self.end_workers(graceful)
        self.stop_receiver()
        destroy_distributed(self.tp, self.pp, self.control)

    def stop_receiver(self) -> None:
        """The receiver takes the outputs still due (a graceful stop: the stages finish their
        batches before they read Shutdown), or fails on the closed sockets of stopped workers."""
        if self.receiver is not None:
            self.pending.put(None)
            self.receiver.join(RECEIVER_EXIT_S)
            self.receiver = None
        self.unsent = []


# ---------------------------------------------------------------------------------- torchrun
class ExecutorWithExternalLauncher(DistributedExecutor):
    """Rank 0 under torchrun, which started every rank and watches them (when one dies, torchrun
    stops the others). The workers ran the same program up to here, so they wait in the group
    already; they take rank 0's `WorkerConfig`, so that every rank builds the same model."""

    def send_worker_config(self, wc: WorkerConfig) -> None:
        self.broadcast(wc)

    def elsewhere(self) -> str | None:
        """Over several torchrun nodes, the other nodes' ranks. A rank of node 0 that dies makes
        node 0's torchrun stop rank 0 too, so a failed collective that rank 0 lives to report
        came from another node, whose torchrun saw the rank die but does not tell node 0. torchrun
        names its nodes `GROUP_RANK` 0..`GROUP_WORLD_SIZE`-1, each with `LOCAL_WORLD_SIZE`
        consecutive ranks, node 0 first."""
        nnodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(self.world_size)))
        if nnodes == 1:
            return None
        if local * nnodes == self.world_size:  # the same --nproc-per-node on every node
            return other_nodes(self.world_size, nnodes)
        return "ranks " + ", ".join(str(r) for r in range(local, self.world_size))


def other_nodes(world_size: int, nnodes: int) -> str:
    """Nodes 1..nnodes-1 with their ranks (`node 1 (rank 1)`, `node 1 (ranks 2, 3)`), each node
    running world_size / nnodes consecutive ranks (vLLM's layout, and torchrun's when every node
    has the same --nproc-per-node)."""
    local = world_size // nnodes
    return ", ".join(
        f"node {node} (rank{'s' if local > 1 else ''} "
        f"{', '.join(str(r) for r in range(node * local, (node + 1) * local))})"
        for node in range(1, nnodes)
    )
