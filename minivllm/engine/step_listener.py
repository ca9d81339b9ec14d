"""The step as a message: what the engine publishes after every step that committed.

vLLM's engine core hands each step's `SchedulerOutput` and `EngineCoreOutputs` to whoever
subscribed (its stat loggers, its KV-events publisher); minivllm does the same, in-process. After
a step's commit (progress advanced, prefix-cache names final, forks made, finished sequences
freed) the engine calls `on_step` of every listener with three read-only things:

- the step's `SchedulerOutput`: which sequences ran, how many tokens each, their block tables,
  the copy-on-write copies and the preemptions;
- `StepOutputs`: the sequences it sampled for, the `RequestOutput`s it returns, and the
  scheduler's sequences and queue lengths after the commit;
- a `BlockPoolSnapshot` from the block manager: every block table, reference count and
  prefix-cache name as they are now (`KVCacheManager.snapshot`).

The engine's own counters (`stats.StatsCollector`) and the step trace
(`minivllm/trace/recorder.py`) are listeners; the engine names neither. A step that fails
publishes nothing: its requests are failed and its blocks freed instead (`LLMEngine._fail_step`).
Listeners run on the engine's thread, inside `step()`: they must be quick and must not change
what they are given.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from minivllm.core.kv_cache_utils import BlockPoolSnapshot
from minivllm.core.outputs import RequestOutput
from minivllm.core.scheduler import Scheduler, SchedulerOutput
from minivllm.core.sequence import Sequence

__all__ = ["BlockPoolSnapshot", "StepListener", "StepOutputs"]


@dataclass(frozen=True)
class StepOutputs:
    """What a committed step produced, beside its `SchedulerOutput`."""

    # The sequences it sampled a token for, n > 1 children included; one that kept several
    # tokens (speculative decoding) once per token.
    sampled: list[Sequence]
    request_outputs: list[RequestOutput]  # what `step()` returns for it
    seqs: Mapping[int, Sequence]  # seq_id -> every sequence the scheduler holds after the commit
    num_running: int  # sequences holding blocks
    num_waiting: int  # sequences queued (new or preempted)
    waiting: tuple[int, ...] = ()  # their seq ids in queue order, the next admitted first
    # The batches still in flight when this one committed, oldest first (`batch_id`s): with
    # pipeline stages, launched after it and not back from the last stage yet; else ().
    in_flight: tuple[int, ...] = ()

    @classmethod
    def after_commit(
        cls,
        sampled: list[Sequence],
        outputs: list[RequestOutput],
        scheduler: Scheduler,
        in_flight: tuple[int, ...] = (),
    ) -> StepOutputs:
        """The step's outputs, with the scheduler's sequences and queues as the commit left them."""
        waiting = tuple(seq.seq_id for seq in scheduler.waiting)
        running = len(scheduler.running)
        return cls(sampled, outputs, scheduler.seqs, running, len(waiting), waiting, in_flight)


class StepListener(Protocol):
    def on_step(
        self,
        scheduler_output: SchedulerOutput,
        outputs: StepOutputs,
        blocks: BlockPoolSnapshot,
    ) -> None:
        """One committed step (engine thread; read, do not change)."""
        ...
