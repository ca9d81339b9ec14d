"""Iteration-level scheduling under a token budget: decodes first, prompt chunks, preemption.

The paper's §4.5 and vLLM v1's scheduler (vllm/v1/core/sched/scheduler.py). Every step:

1. Running sequences, oldest first, each get what they still need — one token for a decode, the
   rest of the prompt (up to the remaining budget) for a prompt that is being chunked. A sequence
   that cannot get a KV block preempts the most recently admitted running sequence (its blocks
   are freed; it is recomputed later — recompute is cheaper than swapping for short contexts,
   paper §4.5), repeatedly, until it fits or is itself the newest, in which case it is preempted.
2. If nothing was preempted, waiting sequences are admitted first come, first served while the
   token budget, `max_num_seqs` and free blocks last. Admission takes prefix-cache hits first, so
   only the uncached suffix counts against the budget and the block pool.

There is no separate prefill phase: a long prompt is split over steps and shares each step's
batch with the decodes of other requests (chunked prefill), which keeps decode latency flat.
Preempted sequences go back to the *front* of the waiting queue so they keep their turn.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minivllm.block_manager import BlockManager
from minivllm.config import SchedulerConfig
from minivllm.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens whose K/V this step computes: seq.token_ids[c : c + n]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue changes
    def add_seq(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running_fork(self, parent: Sequence, child: Sequence) -> None:
        """A child of `parent` that already shares its blocks (n > 1); it runs right after it."""
        child.status = SequenceStatus.RUNNING
        self.running.insert(self.running.index(parent) + 1, child)

    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take a sequence out of the queues for good and free its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if self.block_manager.has_seq(seq.seq_id):
            self.block_manager.free(seq.seq_id)
        seq.status = status

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not bm.can_append_slots(seq.seq_id, num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:  # preempted itself: nothing else fits
                break
            bm.append_slots(seq.seq_id, seq.token_ids, num_new)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
            i += 1

        # Admitting while preempting would evict the very blocks a preempted sequence will want.
        while (
            not out.preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            num_cached = bm.get_num_cached_tokens(seq.token_ids)
            num_new = min(seq.num_tokens - num_cached, budget)
            if not bm.can_allocate(seq.token_ids, num_new):
                break  # first come, first served: nobody overtakes the head of the queue
            seq.num_cached_tokens = bm.allocate(seq.seq_id, seq.token_ids, num_new)
            seq.num_computed_tokens = seq.num_cached_tokens
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new

        out.block_copies = bm.take_pending_copies()
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Preemption by recompute: free the blocks, forget the progress, wait at the front."""
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """The step computed what was scheduled: advance every scheduled sequence's progress."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
