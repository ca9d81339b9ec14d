"""The one handle the model's layers talk through: a rank's place in the tensor-parallel group.

Megatron-LM's tensor parallelism as vLLM runs it (paper §4.6): N ranks, one per device, each hold
1/N of every layer. Inside a step they meet twice per layer in an all-reduce (after the attention
output projection and after the MLP's down projection), once in the embedding's all-reduce and
once at the end in a gather of the logits to rank 0; between steps the driver (rank 0) sends the
step's `SchedulerOutput` to the others. See "Distributed execution" in the docs
(docs/distributed.md) and the architecture page (docs/architecture.md).

Two process groups carry two kinds of traffic:

- the *device group* (torch's default group) carries the model's collectives, on the tensors'
  device: NCCL on CUDA, gloo on CPU. Its timeout bounds how long a rank waits for the others
  inside a step.
- the *control group* (always gloo, on CPU) carries the driver's pickled messages: steps, RPCs,
  shutdown. A worker waits there between steps for as long as the engine is idle, so on a worker's
  side it has no practical deadline; on the driver's side it has the bounded one.

`TensorParallelGroup` is all the layers see: the rank, the size, and `all_reduce` / `gather`,
which return at once when the size is 1. The single-device model is the same code with no
collective call. The group is handed to the model explicitly (not read from a global, as
nano-vllm's layers read `dist.get_rank()`), so a rank's shard can also be built, for a test or a
memory estimate, without any process group.

Starting and joining the process groups is `process_group.py`, which only tensor parallelism
imports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TensorParallelGroup:
    """A rank's place in the tensor-parallel group, and the collectives of the model's layers."""

    rank: int = 0  # within the group: 0 .. world_size - 1
    world_size: int = 1
    # With pipeline parallelism each stage is a tensor-parallel group of its own: its process
    # group, and the global rank of its rank 0 (where `gather` collects). None: the whole world.
    group: dist.ProcessGroup | None = None
    first_rank: int = 0
    # Payload bytes this rank put into collectives (what the tutorial and the bench report as the
    # communication per token). Counted only when world_size > 1.
    all_reduce_bytes: int = 0
    gather_bytes: int = 0

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, on every rank (in place when the size is above 1)."""
        if self.world_size == 1:
            return x
        if x.dim() == 2 and not x.is_contiguous() and x.t().is_contiguous():
            # A CPU `linear` returns a transposed view of a contiguous tensor. A sum does not
            # care how the elements lie, so reduce that tensor in place instead of copying rows.
            dist.all_reduce(x.t(), group=self.group)
        else:
            x = x.contiguous()  # collectives need one contiguous run
            dist.all_reduce(x, group=self.group)
        self.all_reduce_bytes += x.numel() * x.element_size()
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:  # [N, n] -> [N, n * world_size]
        """Every rank's `x`, side by side along the last axis, on the group's rank 0; None on the
        others."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_driver else None
        dist.gather(x, parts, dst=self.first_rank, group=self.group)
        self.gather_bytes += x.numel() * x.element_size()
        return torch.cat(parts, dim=-1) if parts is not None else None


SINGLE_DEVICE = TensorParallelGroup()
