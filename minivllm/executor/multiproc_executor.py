"""The engine starts its own workers: N-1 spawned processes on this machine (vLLM's
`MultiprocExecutor`, vllm/v1/executor/multiproc_executor.py), or its share of them on each of
several machines.

Each worker is a fresh interpreter (`torch.multiprocessing`'s spawn context: no fork of a process
that may hold CUDA or threads) that runs `spawned_worker_main`, one device each (cuda:r; on a CPU
they share the cores). They meet rank 0 on a free loopback port (`tcp://127.0.0.1:PORT`).

With `nnodes` > 1 (vLLM's `--nnodes`, `--node-rank`, `--master-addr`, `--master-port`) the same
command runs on every machine: node 0 builds the engine and spawns ranks 1..k-1 (k = world_size /
nnodes), and node i > 0 runs `minivllm serve --headless` (`run_headless`), which runs ranks i·k..(i+1)·k-1
(the first in its own process, the others spawned) and nothing else. Every rank meets rank 0 at `tcp://master_addr:master_port`
(torch.distributed's TCPStore, hosted by rank 0) and takes node 0's `WorkerConfig`, so that all
build the same model. Node 0 watches only its own workers' pipes; a rank of another node that dies
shows as a failed collective, and the error names the other nodes' ranks. A headless node's
spawned workers have their lifeline to the headless process, so killing it ends its ranks too.

Every worker has two pipes besides the process group, because a collective cannot say *why* it
failed and cannot wait for a process that died before joining:

- its *report* pipe (worker -> driver): "started" once its imports are done, or the traceback of
  whatever it raised, sent just before it exits. The driver reads it, with the process's exit
  code (a SIGKILL shows as -9), to say which rank failed and how.
- its *lifeline* pipe (driver -> worker): never written. The worker's watchdog thread waits on it
  and ends the process when it closes, which happens when the driver stops the workers and also
  when the driver dies in any way (the OS closes a dead process's pipes): no orphans.

See "Distributed execution" in the docs (docs/distributed.md) and the architecture page
(docs/architecture.md).
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch
import torch.multiprocessing as mp

from minivllm.attention.abstract import AttentionBackend
from minivllm.config import ParallelConfig
from minivllm.distributed.process_group import destroy_distributed, free_loopback_port
from minivllm.executor.driver import DistributedExecutor, WorkerStartError, other_nodes
from minivllm.worker.worker_proc import WorkerConfig, serve_rank, spawned_worker_main

STARTUP_TIMEOUT_S = 600.0  # a worker's imports and model load on a loaded machine
FAILURE_REPORT_WAIT_S = 3.0  # after a failed collective, how long to wait for the culprit's word
logger = logging.getLogger("minivllm")
GRACEFUL_EXIT_S = 10.0  # after Shutdown, how long a worker may take to leave before it is killed


@dataclass
class WorkerProcess:
    rank: int
    process: BaseProcess
    report: Connection  # read end: "started", or the traceback of a failure
    lifeline: Connection  # write end, never written: closing it ends the worker

    def status(self) -> str | None:
        """How this worker failed, or None if it did not (as far as can be seen now)."""
        if self.report.poll():
            try:
                message = self.report.recv()
            except (EOFError, OSError):
                message = None
            if message not in (None, "started"):
                return f"rank {self.rank} (pid {self.process.pid}) raised:\n{message}"
        code = self.process.exitcode
        if code is None or code == 0:
            return None
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited ({code})"
        return f"rank {self.rank} (pid {self.process.pid}) {how}"


def spawn_workers(
    wc: WorkerConfig, ranks: range, init_method: str, workers: list[WorkerProcess]
) -> None:
    """Spawn one worker process per rank in `ranks`, each told to meet rank 0 at `init_method`,
    into `workers` (so that the caller can stop those started if a later one fails), and wait
    until each has said "started"."""
    ctx = mp.get_context("spawn")
    for rank in ranks:
        report_read, report_write = ctx.Pipe(duplex=False)
        lifeline_read, lifeline_write = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=spawned_worker_main,
            args=(rank, wc, init_method, report_write, lifeline_read),
            name=f"minivllm-tp-worker-{rank}",
            daemon=True,
        )
        process.start()
        report_write.close()  # the worker's ends live in the worker now
        lifeline_read.close()
        workers.append(WorkerProcess(rank, process, report_read, lifeline_write))
    wait_until_started(workers)


def wait_until_started(workers: list[WorkerProcess]) -> None:
    """Each worker says "started" once imported; one that dies first is reported, with the usual
    cause of that: a script that builds the LLM outside `if __name__ == "__main__":` (spawn
    re-imports the main module in each worker)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    for w in workers:
        while not w.report.poll(0.1):  # True on a message, and on EOF when the worker died
            if time.monotonic() > deadline:
                raise WorkerStartError(f"tensor-parallel worker rank {w.rank} did not start")
        try:
            message = w.report.recv()
        except EOFError:
            w.process.join(5.0)
            raise WorkerStartError(
                f"tensor-parallel worker rank {w.rank} exited ({w.process.exitcode}) before "
                "it started; see its traceback above. A script that builds an LLM with "
                'tensor_parallel_size > 1 must do so under `if __name__ == "__main__":` '
                "(the workers are spawned, and a spawned process re-imports the main module)"
            ) from None
        if message != "started":
            raise WorkerStartError(f"tensor-parallel worker rank {w.rank} failed:\n{message}")


def end_workers(workers: list[WorkerProcess], graceful: bool) -> None:
    """Make sure every worker is gone: after a Shutdown message, wait for them to leave first."""
    if graceful:
        for w in workers:
            w.process.join(GRACEFUL_EXIT_S)
    for w in workers:
        w.lifeline.close()  # the watchdog of any worker still inside a collective exits
    for w in workers:
        w.process.join(2.0)
        if w.process.is_alive():
            w.process.kill()
            w.process.join()
        w.report.close()


def node_ranks(wc: WorkerConfig, node_rank: int) -> range:
    """The global ranks node `node_rank` runs: a contiguous share of world_size / nnodes (vLLM's
    layout, so a tensor-parallel group stays inside a node whenever it fits in one)."""
    local = wc.ranks_per_node
    return range(node_rank * local, (node_rank + 1) * local)


class MultiprocExecutor(DistributedExecutor):
    workers: list[WorkerProcess]  # this node's ranks but 0: 1..world_size / nnodes - 1
    init_method = ""  # set per engine: a free loopback port, or master_addr:master_port

    def __init__(
        self, wc: WorkerConfig, backend: AttentionBackend, parallel: ParallelConfig | None = None
    ) -> None:
        self.parallel = parallel or ParallelConfig(
            wc.tensor_parallel_size, wc.pipeline_parallel_size
        )
        super().__init__(wc, backend)

    def start_workers(self, wc: WorkerConfig) -> None:
        p = self.parallel
        if p.nnodes > 1:  # the other nodes' ranks dial in here, started by `serve --headless`
            self.init_method = f"tcp://{p.master_addr}:{p.master_port}"
        else:
            self.init_method = f"tcp://127.0.0.1:{free_loopback_port()}"
        self.workers = []
        spawn_workers(wc, node_ranks(wc, 0)[1:], self.init_method, self.workers)

    def send_worker_config(self, wc: WorkerConfig) -> None:
        if self.parallel.nnodes > 1:  # another node's ranks resolved the model on their own
            self.broadcast(wc)

    def workers_alive(self) -> bool:
        return all(w.process.is_alive() for w in self.workers)

    def worker_failure(self) -> str | None:
        """Wait briefly for a failed worker to report or exit: the driver's collective often fails
        a moment before the culprit's traceback arrives."""
        deadline = time.monotonic() + FAILURE_REPORT_WAIT_S
        while True:
            failures = [s for w in self.workers if (s := w.status()) is not None]
            if failures or time.monotonic() > deadline:
                return "; ".join(failures) or None
            time.sleep(0.05)

    def elsewhere(self) -> str | None:
        """The ranks no process of this node watches: those of the other nodes."""
        if self.parallel.nnodes == 1:
            return None
        return other_nodes(self.world_size, self.parallel.nnodes)

    def end_workers(self, graceful: bool) -> None:
        end_workers(self.workers, graceful)


# ---------------------------------------------------------------------------------- headless
def run_headless(wc: WorkerConfig, parallel: ParallelConfig) -> int:
    """Node `parallel.node_rank` > 0 of `nnodes` (vLLM's `vllm serve --headless`): this node's
    first rank runs in this process and the others are spawned, as on node 0, but no engine and
    no server: every rank meets rank 0 at master_addr:master_port, takes node 0's WorkerConfig and
    serves its steps. Returns 0 once node 0 has shut the ranks down; 1, with the reason logged,
    when the group broke (a rank here or elsewhere died, or node 0 went away)."""
    init_method = f"tcp://{parallel.master_addr}:{parallel.master_port}"
    ranks = node_ranks(wc, parallel.node_rank)
    logger.info(
        "headless node %d of %d: ranks %s, meeting rank 0 at %s",
        parallel.node_rank,
        parallel.nnodes,
        ", ".join(map(str, ranks)),
        init_method,
    )
    workers: list[WorkerProcess] = []
    graceful = False
    try:
        spawn_workers(wc, ranks[1:], init_method, workers)
        if wc.device_type == "cpu":
            torch.set_num_threads(wc.num_threads)
        serve_rank(ranks[0], wc, init_method)
        graceful = True  # node 0 said Shutdown: the spawned ranks got it too
        return 0
    except Exception as exc:
        failed = [s for w in workers if (s := w.status()) is not None]
        reason = "; ".join(failed) or f"rank {ranks[0]}: {type(exc).__name__}: {exc}"
        logger.error("headless node %d stops its ranks: %s", parallel.node_rank, reason)
        return 1
    finally:
        end_workers(workers, graceful)
        destroy_distributed()
