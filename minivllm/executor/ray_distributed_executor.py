"""Ranks 1..N-1 as Ray actors, placed over a Ray cluster's nodes (vLLM's `RayDistributedExecutor`,
vllm/executor/ray_distributed_executor.py, and its cluster set-up in vllm/executor/ray_utils.py).

`distributed_executor_backend="ray"` (`--distributed-executor-backend ray`). Ray decides *where*
the ranks run; torch.distributed still carries *what* they say, exactly as with spawned workers:

1. **Placement.** A placement group of one bundle per rank (`{"CPU": 1}`, or `{"GPU": 1}` on
   CUDA), with the `PACK` strategy vLLM uses: as few nodes as the bundles fit on, so that ranks
   share a node (and its fast links) whenever they can, and spill over to the next node when they
   cannot (`STRICT_PACK` would refuse to span nodes, `SPREAD` would span them for nothing).
   Bundle 0 asks for a sliver of `node:<this node's IP>`, so rank 0's share is reserved where the
   engine runs: the driver is rank 0, in this process, not an actor.
2. **Actors.** One `RayWorkerWrapper` (vLLM's name) per other rank, pinned to its bundle. The
   driver calls them through Ray: `ready()` (imports done: its pid and node), then `run(...)`,
   which joins torch.distributed's group at rank 0's address (this node's IP, as Ray reports it,
   and a free port) and serves the driver's steps until Shutdown. Each step then goes by the
   control group's broadcast, as in minivllm/executor/driver.py, not by Ray: one pickled message
   per step, and the model's all-reduces on gloo (CPU) or NCCL (CUDA).
3. **Failures.** Each actor's `run` is a Ray task the driver holds (an `ObjectRef`). A rank that
   raises returns its traceback and then ends its process (so its sockets close and the driver's
   collective fails at once); a rank whose process dies makes its ref raise `RayActorError`. The
   driver turns either into `EngineDeadError` naming the rank, its actor and its node.
4. **The end.** Shutdown kills every actor and removes the placement group; if the engine started
   Ray itself (no cluster to join), it shuts Ray down too. Ray ties an actor's life to its owner's,
   so a driver that dies takes its actors with it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from minivllm.distributed.process_group import destroy_distributed
from minivllm.executor.driver import DistributedExecutor, WorkerStartError
from minivllm.worker.worker_proc import WorkerConfig, serve_rank

PLACEMENT_STRATEGY = "PACK"  # vLLM's: fill a node before the next one
PLACEMENT_TIMEOUT_S = 60.0  # how long the cluster may take to find room for every bundle
STARTUP_TIMEOUT_S = 600.0  # an actor's imports on a loaded machine
FAILURE_REPORT_WAIT_S = 5.0  # after a failed collective, how long to wait for Ray's word on it
GRACEFUL_EXIT_S = 10.0  # after Shutdown, how long an actor may take to return before it is killed
EXIT_AFTER_REPORT_S = 0.5  # a rank that raised: time for its traceback to reach the driver


class RayWorkerWrapper:
    """One rank in a Ray actor: the same `serve_rank` a spawned worker runs."""

    def ready(self) -> tuple[int, str, str]:
        """Called once the actor is up: (pid, node id, node IP)."""
        context = ray.get_runtime_context()
        return os.getpid(), context.get_node_id(), ray.util.get_node_ip_address()

    def run(self, rank: int, wc: WorkerConfig, init_method: str) -> str | None:
        """Serve the driver's steps until Shutdown (then None), or return the traceback of what
        was raised, and end the process a moment later: a rank stuck in a broken collective would
        hold its sockets open, and the driver would wait for it."""
        if wc.device_type == "cpu":
            torch.set_num_threads(wc.num_threads)
        try:
            # On CUDA, Ray shows the actor its one GPU as cuda:0.
            serve_rank(rank, wc, init_method, local_rank=0)
        except BaseException:
            threading.Timer(EXIT_AFTER_REPORT_S, os._exit, args=(1,)).start()
            return traceback.format_exc()
        destroy_distributed()
        return None


@dataclass
class RayWorker:
    rank: int
    actor: Any  # the actor handle (ray.actor.ActorHandle)
    pid: int
    node_id: str
    node_ip: str
    loop: ray.ObjectRef | None = None  # the `run` call: ready when the rank has left

    def describe(self) -> str:
        return f"rank {self.rank} (Ray actor {self.actor._actor_id.hex()[:12]}, pid {self.pid} " + (
            f"on node {self.node_ip} {self.node_id[:12]})"
        )

    def status(self) -> str | None:
        """How this rank failed, or None if it did not (as far as can be seen now)."""
        if self.loop is None or not ray.wait([self.loop], timeout=0)[0]:
            return None
        try:
            raised = ray.get(self.loop)
        except ray.exceptions.RayActorError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"{self.describe()} died ({type(exc).__name__}: {first})"
        except ray.exceptions.RayError as exc:
            return f"{self.describe()} failed ({type(exc).__name__}: {exc})"
        return None if raised is None else f"{self.describe()} raised:\n{raised}"


def free_port(host: str) -> int:
    """A TCP port nobody listens on at `host`, for the actors' rendezvous with rank 0."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RayDistributedExecutor(DistributedExecutor):
    workers: list[RayWorker]  # ranks 1..N-1
    init_method = ""  # set per engine: this node's IP (as Ray sees it) and a free port

    def start_workers(self, wc: WorkerConfig) -> None:
        self.workers = []
        self.pg: PlacementGroup | None = None
        # Join the cluster named by RAY_ADDRESS, or the one `ray start` started on this machine;
        # with neither, Ray starts one here, and the engine stops it again at shutdown.
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
        here_ip = ray.util.get_node_ip_address()
        here = ray.get_runtime_context().get_node_id()
        device = "GPU" if wc.device_type == "cuda" else "CPU"
        bundles: list[dict[str, float]] = [{device: 1.0} for _ in range(wc.world_size)]
        bundles[0][f"node:{here_ip}"] = 0.001  # rank 0 is this process: its share here
        self.pg = placement_group(bundles, strategy=PLACEMENT_STRATEGY)
        try:
            ray.get(self.pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise WorkerStartError(
                f"Ray could not place {wc.world_size} bundles of {{{device!r}: 1}} "
                f"({PLACEMENT_STRATEGY}) in {PLACEMENT_TIMEOUT_S:.0f} s; the cluster has "
                f"{ray.cluster_resources()}"
            ) from None
        # Rank 0 takes a bundle on this node (the IP picks the machine, the node id the raylet,
        # which differ when several raylets share a machine); the others take the rest in order.
        nodes: dict[int, str] = placement_group_table(self.pg)["bundles_to_node_id"]
        mine = [b for b in sorted(nodes) if nodes[b] == here]
        if not mine:
            raise WorkerStartError(
                f"Ray placed no bundle on the engine's node {here_ip} ({here[:12]}): rank 0 runs "
                "in this process, so this node needs one free " + device
            )
        others = [b for b in sorted(nodes) if b != mine[0]]
        self.init_method = f"tcp://{here_ip}:{free_port(here_ip)}"
        actor_cls: Any = ray.remote(RayWorkerWrapper)
        actors: list[Any] = [
            actor_cls.options(
                num_cpus=0 if device == "GPU" else 1,
                num_gpus=1 if device == "GPU" else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=bundle
                ),
            ).remote()
            for bundle in others
        ]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank, actor in enumerate(actors, start=1):
            try:
                pid, node_id, node_ip = ray.get(
                    actor.ready.remote(), timeout=max(1.0, deadline - time.monotonic())
                )
            except ray.exceptions.RayError as exc:
                for a in actors:
                    ray.kill(a)
                raise WorkerStartError(
                    f"tensor-parallel worker rank {rank} (a Ray actor) did not start: "
                    f"{type(exc).__name__}: {exc}"
                ) from None
            self.workers.append(RayWorker(rank, actor, pid, node_id, node_ip))
        for w in self.workers:
            w.loop = w.actor.run.remote(w.rank, wc, self.init_method)

    def workers_alive(self) -> bool:
        loops = [w.loop for w in self.workers if w.loop is not None]
        return not ray.wait(loops, num_returns=len(loops), timeout=0)[0]

    def worker_failure(self) -> str | None:
        """Wait briefly for Ray's word: the driver's collective fails the moment a rank's sockets
        close, a little before Ray has marked its actor dead."""
        deadline = time.monotonic() + FAILURE_REPORT_WAIT_S
        while True:
            failures = [s for w in self.workers if (s := w.status()) is not None]
            if failures or time.monotonic() > deadline:
                return "; ".join(failures) or None
            time.sleep(0.05)

    def end_workers(self, graceful: bool) -> None:
        loops = [w.loop for w in self.workers if w.loop is not None]
        if graceful and loops:
            ray.wait(loops, num_returns=len(loops), timeout=GRACEFUL_EXIT_S)
        for w in self.workers:
            ray.kill(w.actor)
        if self.pg is not None:
            remove_placement_group(self.pg)
        if self.owns_ray:
            ray.shutdown()
