"""One rank of a tensor-parallel group: build its shard of the model, then run the steps it is sent.

The paper's §4.6 in a loop. Every rank holds 1/N of every layer and a KV cache of the same number
of blocks, each block holding this rank's KV heads; the driver (rank 0) schedules, and each step
it broadcasts the step's plain `SchedulerOutput`. A worker (ranks 1..N-1) receives it and runs
its own `ModelRunner` on it: the same block tables, the same token ids, its own heads. The model's
all-reduces keep the ranks in step inside the forward pass; the worker's logits slice goes to
rank 0 in the LM head's gather, and the worker waits for the next message. No scheduling, no
sampling, no tokenizer: a worker is a model runner and a loop (vLLM's `Worker` and its
`worker_busy_loop`). With pipeline parallelism a worker runs its stage's layers: it receives
the previous stage's hidden states, sends its own to the next one, and the last stage's rank 0
sends the step's logits to the driver (minivllm/distributed/pipeline.py).

A rank is started one of three ways (see "Distributed execution" in the docs, docs/distributed.md,
and the architecture page, docs/architecture.md):

- spawned by the driver's `MultiprocExecutor` (`spawned_worker_main`), or on another node by
  `minivllm serve --headless`: it rendezvouses on a loopback port (or node 0's
  master_addr:master_port), reports a failure's traceback through a pipe before it exits, and
  exits at once when the process that spawned it goes away (its *lifeline* pipe closes, whatever
  killed that process).
- started by `torchrun`, which runs the same program on every rank: on ranks 1..N-1, building the
  engine ends in `run_torchrun_worker`, which serves rank 0's steps and then ends the process.
- in a Ray actor (minivllm/executor/ray_distributed_executor.py), which runs `serve_rank` as a
  Ray task that the driver holds: Ray tells the driver when the actor dies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from minivllm.core.scheduler import SchedulerOutput
from minivllm.distributed.process_group import (
    destroy_distributed,
    init_distributed,
    receive_message,
)
from minivllm.worker.model_runner import ModelRunner
from minivllm.worker.worker import WorkerConfig, build_runner, rank_device


# ---------------------------------------------------------------------------------- messages
# The driver sends these, pickled, over the control group; the worker acts on them in order.
@dataclass
class ExecuteModel:
    sched: SchedulerOutput


@dataclass
class CollectiveRPC:
    """Call `fn(runner)` on every rank and gather the results on rank 0 (vLLM's
    `collective_rpc`); `fn` must be importable by name (a module-level function)."""

    fn: Callable[[ModelRunner], Any]


@dataclass
class Shutdown:
    pass


@dataclass(frozen=True)
class RankReport:
    """One rank's share of the model and of the KV cache, and what it has communicated."""

    rank: int
    weight_bytes: int  # the parameters this rank holds (a tied embedding counted once)
    kv_cache_bytes: int
    num_kv_blocks: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (a replicated one when KV heads < ranks)
    all_reduce_bytes: int  # payload this rank has put into all-reduces so far
    gather_bytes: int  # logits this rank has sent to rank 0 so far


def rank_report(runner: ModelRunner) -> RankReport:
    """A `CollectiveRPC` function: the memory and communication of the rank it runs on."""
    model = runner.model
    tp = model.tp
    return RankReport(
        rank=tp.rank,
        weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        kv_cache_bytes=runner.kv_cache.numel() * runner.kv_cache.element_size(),
        num_kv_blocks=runner.kv_cache.shape[2],
        num_heads=model.config.num_attention_heads // tp.world_size,
        num_kv_heads=model.num_kv_heads,
        all_reduce_bytes=tp.all_reduce_bytes,
        gather_bytes=tp.gather_bytes,
    )


# ---------------------------------------------------------------------------------- the loop
def receive(control: dist.ProcessGroup) -> Any:
    """The driver's next message (a broadcast from rank 0 on the control group)."""
    return receive_message(control)


def worker_loop(runner: ModelRunner, control: dist.ProcessGroup) -> None:
    """Run the driver's messages until it says Shutdown."""
    while True:
        message = receive(control)
        if isinstance(message, Shutdown):
            return
        if isinstance(message, ExecuteModel):
            # With one stage the logits reach rank 0 inside, in the LM head's gather; with a
            # pipeline they are gathered on the last stage's first rank, which sends them on.
            output = runner.execute_model(message.sched)
            if runner.pp.sends_output:
                runner.pp.send_output(output)
        elif isinstance(message, CollectiveRPC):
            dist.gather_object(message.fn(runner), None, dst=0, group=control)
        else:
            raise TypeError(f"unknown message from the driver: {type(message).__name__}")


def _exit_with_the_driver(lifeline: Connection) -> None:
    """Leave the process the moment the driver's end of `lifeline` closes: the driver shut down,
    or died in any way (even SIGKILL: the OS closes its pipes). A worker blocked in a collective
    cannot notice that by itself, so this thread does."""

    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):
            lifeline.recv()  # returns only by EOF: nothing is ever sent
        os._exit(0)

    threading.Thread(target=watch, name="minivllm-lifeline", daemon=True).start()


def spawned_worker_main(
    rank: int, wc: WorkerConfig, init_method: str, report: Connection, lifeline: Connection
) -> None:
    """The entry point of a worker process spawned by `MultiprocExecutor`."""
    # Ctrl-C in a terminal reaches every process of the group; stopping the workers is the
    # driver's decision (it knows whether a step is half done), so a worker ignores it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_the_driver(lifeline)
    try:
        if wc.device_type == "cpu":
            torch.set_num_threads(wc.num_threads)
        report.send("started")  # imports done: the driver may now meet us at the rendezvous
        serve_rank(rank, wc, init_method)
    except BaseException:
        report.send(traceback.format_exc())
        # Not a normal exit: the process group may be in the middle of a collective, and its
        # teardown could wait for peers. Closing our sockets now is what tells the driver.
        os._exit(1)
    destroy_distributed()
    # Done, cleanly: leave without the interpreter's teardown (freeing every module that torch and
    # transformers loaded, slow), which the driver's shutdown would otherwise wait for, as
    # multiprocessing's forked children end. Nothing of ours runs at exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def serve_rank(
    rank: int, wc: WorkerConfig, init_method: str, local_rank: int | None = None
) -> None:
    """Meet rank 0 at `init_method`, build this rank's shard and serve the driver's messages
    until it says Shutdown. Across nodes, take node 0's WorkerConfig first: each node resolved
    the model itself, and every rank must build what node 0 did. `local_rank` picks the device
    (unset: the rank's place among its node's ranks)."""
    local = rank % wc.ranks_per_node if local_rank is None else local_rank
    device = rank_device(wc.device_type, local)
    tp, pp, control = init_distributed(
        rank, wc.tensor_parallel_size, init_method, device, wc.pipeline_parallel_size
    )
    if wc.nnodes > 1:
        wc = receive(control)
    runner = build_runner(wc, tp, control, device, pp=pp)
    worker_loop(runner, control)


def run_torchrun_worker(local: WorkerConfig) -> None:
    """Ranks 1..N-1 under torchrun: join the group, take rank 0's WorkerConfig (so that every rank
    builds the same model whatever it was given), and serve rank 0's steps until it shuts down."""
    rank = int(os.environ["RANK"])
    device = rank_device(local.device_type, int(os.environ.get("LOCAL_RANK", rank)))
    tp, pp, control = init_distributed(
        rank, local.tensor_parallel_size, "env://", device, local.pipeline_parallel_size
    )
    wc = receive(control)
    try:
        runner = build_runner(wc, tp, control, device, pp=pp)
        worker_loop(runner, control)
    finally:
        destroy_distributed(tp, pp, control)
