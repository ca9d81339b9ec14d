"""Iteration-level scheduling under a token budget: decodes first, prompt chunks, preemption.

The paper's §4.5 and vLLM v1's scheduler (vllm/v1/core/sched/scheduler.py). The scheduler is the
only owner of the KV cache manager: admission, slots, forks, preemption and freeing all go through
it. Every step:

1. Running sequences, oldest first, each get what they still need — one token for a decode, the
   rest of the prompt (up to the remaining budget) for a prompt that is being chunked. A sequence
   that cannot get a KV block preempts the most recently admitted running sequence (its blocks
   are freed; it is recomputed later — recompute is cheaper than swapping for short contexts,
   paper §4.5), repeatedly, until it fits or is itself the newest, in which case it is preempted.
2. If nothing was preempted, waiting sequences are admitted first come, first served while the
   token budget, `max_num_seqs` and free blocks last. Admission looks the prompt up in the prefix
   cache once (`get_computed_blocks`), decides with the hit, and hands it to `allocate_slots`, so
   only the uncached suffix counts against the budget and the block pool.

The result is a `SchedulerOutput`: a plain message with everything a model runner needs for the
step (token ids, positions, block tables, copy-on-write copies) and no reference back into
scheduler state, so it can go to another process, into a trace or into a test unchanged (vLLM v1's
`SchedulerOutput`; see the architecture page of the docs). After the step has run, the engine
calls `update_after_step`, the step's commit: only then does progress advance and do the names
the step gave its full blocks become final; a failed step is rolled back instead
(`rollback_step`).

With pipeline parallelism the engine keeps up to `max_concurrent_batches` (= the stages) batches
in flight (vLLM v1's `EngineCore.step_with_batch_queue`): it schedules the next batch while the
previous one is still in the later stages. A sequence in a batch in flight is skipped until that
batch's output is back (vLLM's rule: its progress is not known yet), keeps its KV blocks, and is
never chosen for preemption. With one batch at a time the rule never fires: every step commits
before the next is scheduled.

There is no separate prefill phase: a long prompt is split over steps and shares each step's
batch with the decodes of other requests (chunked prefill), which keeps decode latency flat.
Preempted sequences go back to the *front* of the waiting queue so they keep their turn.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from minivllm.config import SchedulerConfig
from minivllm.config.lora import LoRAConfig
from minivllm.core.kv_cache_manager import NO_COMPUTED_BLOCKS, KVCacheManager
from minivllm.core.sequence import Sequence, SequenceStatus
from minivllm.lora.request import LoRARequest


@dataclass(frozen=True)
class PromptLogprobsSlice:
    """Prompt positions of a step whose next-token logprobs the runner computes (vLLM's
    `prompt_logprobs`): rows `start .. start + len(target_ids) - 1` of the sequence, each row's
    logits scored against the prompt token that follows it."""

    num_logprobs: int  # the top k reported beside each prompt token
    start: int  # the first row's position in the sequence (inside this step's chunk)
    target_ids: list[int]  # [R]  the prompt token each row predicts: token start + 1 + r


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step, as plain data."""

    seq_id: int
    num_computed_tokens: int  # tokens with K/V in the cache before the step: the first position
    new_token_ids: list[int]  # [num_new_tokens]  the tokens whose K/V the step computes
    block_table: list[int]  # [ceil(seq_len / block_size)]  physical blocks, after allocation
    sample: bool  # the new tokens reach the newest known token: a next token is sampled
    prompt_logprobs: PromptLogprobsSlice | None = None  # prompt rows to score, if asked
    num_spec_tokens: int = 0  # the last this many new tokens are drafts to verify (lookahead)
    group_block_tables: tuple[list[int], ...] = ()  # a hybrid model's other KV cache groups'
    lora_request: LoRARequest | None = None  # the adapter its rows run under; None: the base model
    token_type_ids: list[int] | None = None  # [num_new_tokens]  an encoder's (BERT pairs); None: 0

    @property
    def num_new_tokens(self) -> int:
        return len(self.new_token_ids)

    @property
    def seq_len(self) -> int:
        """Tokens in the cache after the step's write."""
        return self.num_computed_tokens + len(self.new_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted_seq_ids: list[int] = field(default_factory=list)
    num_batched_tokens: int = 0
    # Sequences finished (or aborted) since the last step: a runner that keeps per-sequence state
    # across steps (a pooling runner's chunked prompts) drops theirs (vLLM's `finished_req_ids`).
    finished_seq_ids: list[int] = field(default_factory=list)
    batch_id: int = 0  # 1, 2, ... in schedule order (0: nothing scheduled); the trace's "batch"

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.lora_config = lora_config  # its max_loras bounds the distinct adapters running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.seqs: dict[int, Sequence] = {}  # every unfinished sequence, by seq_id
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0  # prompt K/V computed by the model, not cache hits
        self.finished_seq_ids: list[int] = []  # since the last schedule()
        # Sequences whose scheduled step has not come back (committed or rolled back) yet:
        # skipped by `schedule` and never preempted. vLLM v1's `scheduled_req_ids`.
        self.in_flight: set[int] = set()
        self.num_batches = 0  # batches scheduled so far: the last one's batch_id

    # ------------------------------------------------------------------ queue changes
    def add_seq(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.seqs[seq.seq_id] = seq

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (paper §4.4) and runs right after it; the first
        write into a shared, partly filled block gets a copy (copy-on-write)."""
        self.kv_cache_manager.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = SequenceStatus.RUNNING
        self.running.insert(self.running.index(parent) + 1, child)
        self.seqs[child.seq_id] = child

    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take a sequence out of the queues for good and free its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if self.kv_cache_manager.has_seq(seq.seq_id):
            self.kv_cache_manager.free(seq.seq_id)
        self.seqs.pop(seq.seq_id, None)
        self.in_flight.discard(seq.seq_id)  # an abort while in flight: its output is dropped
        self.finished_seq_ids.append(seq.seq_id)
        seq.status = status

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        kv = self.kv_cache_manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            # A beam that has sampled waits for its round's other beams; a sequence in a batch
            # in flight waits for that batch's output (its progress is not known yet).
            if num_new == 0 or seq.seq_id in self.in_flight:
                i += 1
                continue
            while not kv.can_append_slots(seq.seq_id, num_new):
                victim = self._preemption_victim()
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:  # preempted itself: nothing else fits
                break
            # Speculative drafts ride along where budget and free blocks allow: they never
            # preempt anyone. Their slots are lookahead: no block is named for a draft.
            spec = seq.spec_token_ids[: budget - num_new] if num_new == 1 else []
            if spec and not kv.can_append_slots(seq.seq_id, num_new + len(spec)):
                spec = []
            kv.append_slots(seq.seq_id, seq.token_ids, num_new, len(spec))
            out.scheduled.append(self._scheduled(seq, num_new, spec))
            budget -= num_new + len(spec)
            i += 1

        # Admitting while preempting would evict the very blocks a preempted sequence will want.
        num_seqs = sum(self._num_seqs_at_admission(s) for s in self.running)
        chunking = self.config.enable_chunked_prefill
        loras = self.active_lora_ids()
        skipped: list[Sequence] = []  # waiting for a LoRA slot; they keep their place in the queue
        while not out.preempted_seq_ids and self.waiting and budget > 0:
            seq = self.waiting[0]
            if num_seqs + self._num_seqs_at_admission(seq) > self.config.max_num_seqs:
                break
            if not self._lora_fits(seq, loras):
                # vLLM v1 skips it too: requests of adapters already running (or of the base
                # model) may go ahead, since they need no slot; it is first again next step.
                skipped.append(self.waiting.popleft())
                continue
            lookup = not seq.request.needs_prompt_logprobs  # a cache hit has no logits
            extra = seq.request.block_hash_extra_keys  # its adapter: no block shared across them
            # The one prefix lookup of this admission: what it decides on is what it allocates.
            computed = (
                kv.get_computed_blocks(seq.token_ids, extra) if lookup else NO_COMPUTED_BLOCKS
            )
            num_new = min(seq.num_tokens - computed.num_computed_tokens, budget)
            if num_new < seq.num_tokens - computed.num_computed_tokens and not chunking:
                break  # an encoder's prompt runs whole: it waits for a step with room for it
            if not kv.can_allocate(seq, num_new, computed):
                break  # first come, first served: nobody overtakes the head of the queue
            first_admission = seq.num_cached_tokens is None
            num_cached = kv.allocate_slots(
                seq, num_new, computed, extra, count_as_query=first_admission and lookup
            )
            if first_admission:  # vLLM v1 reports the first admission's hit, not a recompute's
                seq.num_cached_tokens = num_cached
            seq.num_computed_tokens = num_cached
            seq.request.scheduled_time = time.monotonic()  # the queue interval's end (metrics)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_seqs += self._num_seqs_at_admission(seq)
            if seq.request.lora_request is not None:
                loras.add(seq.request.lora_int_id)
            out.scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

        out.block_copies = kv.take_pending_copies()
        if out.scheduled:  # an empty step runs nothing: they travel with the next one
            out.finished_seq_ids, self.finished_seq_ids = self.finished_seq_ids, []
            self.num_batches += 1
            out.batch_id = self.num_batches
            self.in_flight.update(item.seq_id for item in out.scheduled)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _scheduled(self, seq: Sequence, num_new: int, spec: Seq[int] = ()) -> ScheduledSequence:
        start = seq.num_computed_tokens
        return ScheduledSequence(
            seq_id=seq.seq_id,
            num_computed_tokens=start,
            new_token_ids=seq.token_ids[start : start + num_new] + list(spec),
            block_table=list(self.kv_cache_manager.get_block_table(seq.seq_id)),
            sample=start + num_new == seq.num_tokens,
            prompt_logprobs=self._prompt_logprobs_slice(seq, start, start + num_new),
            num_spec_tokens=len(spec),
            group_block_tables=self.kv_cache_manager.get_group_block_tables(seq.seq_id),
            lora_request=seq.request.lora_request,
            token_type_ids=_token_types(seq.request.token_type_ids, start, start + num_new),
        )

    # ------------------------------------------------------------------ LoRA slots
    def active_lora_ids(self) -> set[int]:
        """The adapters the running sequences hold slots for: a sequence's reference is its place
        in `running`, so finishing, aborting or preempting it releases the reference."""
        return {s.request.lora_int_id for s in self.running if s.request.lora_request is not None}

    def _lora_fits(self, seq: Sequence, loras: set[int]) -> bool:
        """Whether admitting `seq` keeps the running adapters within `max_loras`: every running
        sequence is scheduled each step it gets budget, so a step never carries more adapters
        than the running set holds, and the worker always finds them a slot."""
        request = seq.request
        if request.lora_request is None or request.lora_int_id in loras:
            return True
        assert self.lora_config is not None, "a LoRA request reached a scheduler without LoRA"
        return len(loras) < self.lora_config.max_loras

    @staticmethod
    def _prompt_logprobs_slice(seq: Sequence, start: int, end: int) -> PromptLogprobsSlice | None:
        """The rows in [start, end) that score a prompt token not scored yet: row p predicts
        token p + 1, and a recompute after preemption skips the tokens already scored."""
        request = seq.request
        if not request.needs_prompt_logprobs:
            return None
        assert request.prompt_logprobs is not None and request.params.prompt_logprobs is not None
        first = max(start, len(request.prompt_logprobs) - 1)
        last = min(end, seq.num_prompt_tokens - 1)  # the last prompt token predicts no prompt token
        if first >= last:
            return None
        targets = seq.token_ids[first + 1 : last + 1]
        return PromptLogprobsSlice(request.params.prompt_logprobs, first, targets)

    @staticmethod
    def _num_seqs_at_admission(seq: Sequence) -> int:
        """The running sequences `seq` stands for: an `n > 1` request (or a beam search) that has
        not sampled yet turns into n (beam_width) at its first sample, so it counts as that many
        against `max_num_seqs`."""
        request = seq.request
        return 1 if request.forked else request.max_num_seqs

    def _preemption_victim(self) -> Sequence:
        """The most recently admitted running sequence that is not in a batch in flight (the
        K/V that batch is writing must stay where its block table says). The sequence asking for
        a block is never in flight, so there always is one."""
        return next(s for s in reversed(self.running) if s.seq_id not in self.in_flight)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Preemption by recompute: free the blocks, forget the progress, wait at the front."""
        self.running.remove(seq)
        self.kv_cache_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted_seq_ids.append(seq.seq_id)

    def update_after_step(self, out: SchedulerOutput, num_rejected: Mapping[int, int] = {}) -> None:
        """The step's commit, called once its K/V is written and its tokens sampled: advance each
        scheduled sequence's progress and make the prefix-cache names of its blocks final. A
        sequence's rejected drafts (`num_rejected`, by seq_id) are not computed: their slots go
        back, and the next step writes over them (vLLM v1 lowers num_computed_tokens the same way).
        A sequence aborted while its batch was in flight is gone: nothing of it is committed.

        With batches in flight the commit makes final every prefix-cache name given so far, the
        later batches' too: only a step whose model ran on every stage (its logits came back) can
        fail without ending the engine, so a name is never final for K/V that was not written
        unless the engine is dead anyway."""
        for item in out.scheduled:
            self.in_flight.discard(item.seq_id)
            seq = self.seqs.get(item.seq_id)
            if seq is None:
                continue
            start = seq.num_computed_tokens
            seq.num_computed_tokens = start + item.num_new_tokens - num_rejected.get(seq.seq_id, 0)
            if item.num_spec_tokens:
                self.kv_cache_manager.trim_slots(seq.seq_id, seq.num_computed_tokens)
            self.num_prompt_tokens_computed += max(
                0, min(seq.num_computed_tokens, seq.num_prompt_tokens) - start
            )
        self.kv_cache_manager.commit_step()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def rollback_step(self) -> None:
        """The step failed before its commit: withdraw the prefix-cache names it gave (the engine
        then fails the requests it carried, which frees their blocks)."""
        self.kv_cache_manager.rollback_step()


def _token_types(types: list[int] | None, start: int, end: int) -> list[int] | None:
    return None if types is None else types[start:end]
