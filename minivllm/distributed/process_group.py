"""Starting, joining and leaving the process groups of tensor and pipeline parallelism.

The two groups of parallel_state.py's docstring: the *device group* (torch's default group, for
the model's collectives: NCCL on CUDA, gloo on CPU) and the *control group* (gloo, for the
driver's messages). Imported by the tensor-parallel executors and workers only, never by the
single-device engine.
"""

from __future__ import annotations

import atexit
import os
import pickle
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from minivllm.distributed.parallel_state import TensorParallelGroup
from minivllm.distributed.pipeline import PipelineParallelGroup
from minivllm.platforms import platform_for

# How long a rank waits for the others in one collective before giving up with an error. A dead
# peer is noticed at once (its sockets close); this only bounds a peer that is alive but stuck.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
# A worker waits for the driver's next step this long: an idle server is not an error.
IDLE_TIMEOUT = timedelta(days=365)


def device_backend(device: torch.device) -> str:
    """The collective library for the model's tensors: NCCL between GPUs, gloo between CPUs."""
    return platform_for(device).dist_backend


def free_loopback_port() -> int:
    """A TCP port nobody listens on, for the spawned workers' rendezvous with the driver."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launched_by_torchrun() -> bool:
    """Did `torchrun` (or another env:// launcher) start this process as one of several ranks?"""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


# Under torchrun: whether an engine of this process holds the launch's group now. Engines take
# turns on it; a second one at once would wait for ranks that are busy serving the first.
_engine_on_launch_group = False


def check_no_process_group() -> None:
    """torch.distributed has one default group per process, so one tensor-parallel engine at a
    time. Under torchrun the default group is the launch's, and engines take turns on it (see
    `init_distributed`)."""
    if dist.is_initialized() and (not launched_by_torchrun() or _engine_on_launch_group):
        raise RuntimeError(
            "torch.distributed is already initialized in this process: one tensor-parallel "
            "engine per process (shut the other one down first: LLM.shutdown())"
        )


def init_distributed(
    rank: int, tp_size: int, init_method: str, device: torch.device, pp_size: int = 1
) -> tuple[TensorParallelGroup, PipelineParallelGroup, dist.ProcessGroup]:
    """Join the group: the device group (torch's default) and the control group, and with
    pipeline parallelism one tensor-parallel group per stage. Every rank calls this; it returns
    when all `tp_size * pp_size` ranks have met at `init_method`. Rank r is tensor-parallel rank
    r % tp_size of stage r // tp_size (vLLM's layout).

    Under torchrun the default group belongs to the launch: the first engine of the program makes
    it and later engines join it (vLLM's external launcher joins a group that exists the same
    way). Making it again cannot work: torchrun's store still holds the first group's addresses,
    and the ranks would dial sockets that are closed. Each engine makes and, at its end
    (`destroy_distributed`), destroys only its own groups over it; the launch's group ends when
    the program does (`end_launch_group`)."""
    global _engine_on_launch_group
    check_no_process_group()
    _engine_on_launch_group = launched_by_torchrun()
    if not dist.is_initialized():
        dist.init_process_group(
            device_backend(device),
            init_method=init_method,
            rank=rank,
            world_size=tp_size * pp_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        if _engine_on_launch_group:
            atexit.register(end_launch_group)
    # The timeout is each process's own: the driver never waits long, a worker waits for work.
    control = dist.new_group(
        backend="gloo", timeout=COLLECTIVE_TIMEOUT if rank == 0 else IDLE_TIMEOUT
    )
    stage, tp_rank = divmod(rank, tp_size)
    group = None  # one stage: the tensor-parallel group is the whole world
    if pp_size > 1 and tp_size > 1:
        for s in range(pp_size):  # every rank creates every group, in the same order
            ranks = list(range(s * tp_size, (s + 1) * tp_size))
            created = dist.new_group(ranks, timeout=COLLECTIVE_TIMEOUT)
            if s == stage:
                group = created
    tp = TensorParallelGroup(tp_rank, tp_size, group=group, first_rank=stage * tp_size)
    pp = PipelineParallelGroup(stage, pp_size, tp_size, rank)
    if pp_size > 1:
        # The last stage's outputs travel to the driver on a group of their own, so that the
        # driver's thread that waits for them never meets the control group's messages.
        pp.output_group = dist.new_group(
            [0, pp.output_rank], backend="gloo", timeout=COLLECTIVE_TIMEOUT
        )
    return tp, pp, control


def end_launch_group() -> None:
    """At the exit of a program torchrun launched (`minivllm serve`'s ranks, a script's): end the
    launch's group, which the engines left for the program's next one, while the interpreter is
    whole. Left to the interpreter's teardown, gloo's group can abort the process ("terminate
    called without an active exception") after a run that went well."""
    if dist.is_initialized():
        dist.destroy_process_group()


def destroy_distributed(
    tp: TensorParallelGroup | None = None,
    pp: PipelineParallelGroup | None = None,
    control: dist.ProcessGroup | None = None,
) -> None:
    """Leave the group. Under torchrun only the engine's own groups go (`tp`, `pp` and `control`,
    as `init_distributed` made them) and torchrun's default group stays for the program's next
    engine; otherwise the engine made the default group, and it goes with every group over it."""
    global _engine_on_launch_group
    _engine_on_launch_group = False
    if not dist.is_initialized():
        return
    if not launched_by_torchrun():
        dist.destroy_process_group()
        return
    own = [control, None if tp is None else tp.group, None if pp is None else pp.output_group]
    for group in own:
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)


def broadcast_message(
    message: object, control: dist.ProcessGroup | None, block: bool = True
) -> list[dist.Work]:
    """Rank 0's pickled `message` to every rank of `control` (`receive_message` takes it):
    its length, then its bytes. With `block=False` it returns as soon as the message is queued,
    with the two sends' handles: a rank still busy with an earlier batch takes it when it is
    ready, while rank 0 goes on (gloo's sends wait for the receiver otherwise)."""
    data = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)  # [n bytes]
    size = torch.tensor([data.numel()], dtype=torch.int64)
    works = [dist.broadcast(t, src=0, group=control, async_op=True) for t in (size, data)]
    if block:
        for work in works:
            work.wait()
        return []
    return [w for w in works if w is not None]


def receive_message(control: dist.ProcessGroup | None) -> Any:
    """The driver's next `broadcast_message` (a worker's side)."""
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=control)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=control)
    # Our own ranks' bytes, as torch's broadcast_object_list would unpickle them.
    return pickle.loads(data.numpy().tobytes())


def min_over_ranks(value: int, control: dist.ProcessGroup) -> int:
    """The smallest `value` any rank holds (the KV blocks every rank can afford)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control)
    return int(t.item())
