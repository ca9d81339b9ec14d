"""The engine starts its own workers: N-1 spawned processes on this machine (vLLM's
`MultiprocExecutor`, vllm/v1/executor/multiproc_executor.py).

Each worker is a fresh interpreter (`torch.multiprocessing`'s spawn context: no fork of a process
that may hold CUDA or threads) that runs `spawned_worker_main`, one device each (cuda:r; on a CPU
they share the cores). They meet rank 0 on a free loopback port (`tcp://127.0.0.1:PORT`).

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

import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch.multiprocessing as mp

from minivllm.distributed.process_group import free_loopback_port
from minivllm.executor.driver import DistributedExecutor, WorkerStartError
from minivllm.worker.worker_proc import WorkerConfig, spawned_worker_main

STARTUP_TIMEOUT_S = 600.0  # a worker's imports and model load on a loaded machine
FAILURE_REPORT_WAIT_S = 3.0  # after a failed collective, how long to wait for the culprit's word
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


class MultiprocExecutor(DistributedExecutor):
    workers: list[WorkerProcess]  # ranks 1..N-1
    init_method = ""  # set per engine: a free loopback port

    def start_workers(self, wc: WorkerConfig) -> None:
        self.workers: list[WorkerProcess] = []
        self.init_method = f"tcp://127.0.0.1:{free_loopback_port()}"
        ctx = mp.get_context("spawn")
        for rank in range(1, wc.world_size):
            report_read, report_write = ctx.Pipe(duplex=False)
            lifeline_read, lifeline_write = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=spawned_worker_main,
                args=(rank, wc, self.init_method, report_write, lifeline_read),
                name=f"minivllm-tp-worker-{rank}",
                daemon=True,
            )
            process.start()
            report_write.close()  # the worker's ends live in the worker now
            lifeline_read.close()
            self.workers.append(WorkerProcess(rank, process, report_read, lifeline_write))
        self.wait_until_started()

    def wait_until_started(self) -> None:
        """Each worker says "started" once imported; one that dies first is reported, with the
        usual cause of that: a script that builds the LLM outside `if __name__ == "__main__":`
        (spawn re-imports the main module in each worker)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for w in self.workers:
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

    def end_workers(self, graceful: bool) -> None:
        if graceful:
            for w in self.workers:
                w.process.join(GRACEFUL_EXIT_S)
        for w in self.workers:
            w.lifeline.close()  # the watchdog of any worker still inside a collective exits
        for w in self.workers:
            w.process.join(2.0)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.report.close()
