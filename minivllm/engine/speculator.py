"""The engine's side of speculative decoding: propose before the schedule, verify after the model.

vLLM v1 splits the same work between its scheduler (`vllm/v1/core/sched/scheduler.py`: spec tokens
scheduled as part of `num_scheduled_tokens`, `num_computed_tokens` lowered by the rejected count),
its runner (drafting at the end of a step) and `RejectionSampler`. Here, each step:

1. `propose`: every running sequence that decodes gets up to k drafts (`Sequence.spec_token_ids`),
   never past its `max_tokens` or `max_model_len`, from the n-gram lookup or the draft model (which
   may also give each draft's probabilities q); none for a sequence under a grammar (its matcher
   would have to try the drafts; it runs without speculation), none for a beam search, and none
   while more sequences run than `disable_by_batch_size` (unset: 8). A proposer that fails costs
   its drafts, not the requests: the step runs without them.
2. The scheduler gives such a sequence 1 + k new tokens and their slots (the drafts' slots are
   lookahead: no prefix-cache name is given to a block filled by drafts), the budget permitting.
3. The model scores all 1 + k positions (the multi-token path, as a prompt chunk).
4. `sample`: the rejection sampler keeps a_g drafts and one more token per sequence; the step hands
   the output processor one row per kept token, so stop strings, EOS and max_tokens inside a kept
   run end the sequence there; the scheduler's commit lowers `num_computed_tokens` by the rejected
   count and gives back their slots (the next step overwrites them).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Protocol

import torch

from minivllm.config import EngineConfig
from minivllm.config.speculative import SpeculativeConfig
from minivllm.core.scheduler import Scheduler, SchedulerOutput
from minivllm.core.sequence import Sequence
from minivllm.engine.parallel_sampling import AfterSampling, ParallelSampling
from minivllm.engine.stats import StatsCollector
from minivllm.executor.abstract import Executor
from minivllm.sample.rejection_sampler import RejectionSamplerOutput, rejection_sample
from minivllm.sample.sampler import SamplerOutput, SamplingMetadata, SamplingRow
from minivllm.spec_decode.metrics import SpecDecodingStats
from minivllm.spec_decode.ngram_proposer import NgramProposer
from minivllm.spec_decode.proposer import Proposer

logger = logging.getLogger("minivllm")

# Unset `disable_by_batch_size` (vLLM: never off) is 8 here: on a CPU a batch of decodes already
# reads each weight once for many tokens, and one sequence's drafts move the whole step off the
# compiled decode loop onto the multi-token path (the Performance page has the measurement).
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


class SpeculatingEngine(Protocol):
    """What the speculator reads of the engine (`LLMEngine`, which names this module)."""

    config: EngineConfig
    attention_backend: str
    scheduler: Scheduler
    after_sampling: dict[str, AfterSampling]
    parallel_sampling: ParallelSampling
    generator: torch.Generator
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    stats: StatsCollector
    executor: Executor

    def add_step_listener(self, listener: Any) -> None: ...


class Speculator:
    def __init__(self, config: SpeculativeConfig, engine: SpeculatingEngine) -> None:
        self.config = config
        self.engine = engine
        k = config.num_speculative_tokens
        assert k is not None  # SpeculativeConfig checked it
        self.proposer: Proposer = self._make_proposer(config, engine)
        self.stats = SpecDecodingStats(k, num_accepted_tokens_per_pos=[0] * k)
        engine.stats.spec_decoding = self.stats  # get_stats(), /metrics and the stats log read it
        self._pending: list[tuple[int, int]] = []  # this step's (drafts, kept), until it commits
        self._draft_probs: dict[int, torch.Tensor] = {}  # seq_id -> float32 [k', V]  q, if drawn
        engine.add_step_listener(self)

    @staticmethod
    def _make_proposer(config: SpeculativeConfig, engine: SpeculatingEngine) -> Proposer:
        assert config.num_speculative_tokens is not None
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        draft = engine.config.draft
        if draft is None:
            return NgramProposer(
                config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
            )
        from minivllm.spec_decode.draft_model_proposer import DraftModelProposer

        try:
            return DraftModelProposer(
                config.num_speculative_tokens,
                engine.config,
                draft,
                engine.executor.num_blocks,
                engine.attention_backend,
                engine.generator,
                engine.eos_token_id,
            )
        except BaseException:
            engine.executor.shutdown()  # no tensor-parallel worker outlives the refused engine
            raise

    def free(self, seq: Sequence) -> None:
        """A sequence ended (finished, aborted or failed): the proposer drops what it kept."""
        self.proposer.free(seq.seq_id)

    # ------------------------------------------------------------------ before the schedule
    def propose(self, running: list[Sequence]) -> None:
        limit = self.config.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE
        off = len(running) > limit
        max_model_len, plain = self.engine.max_model_len, self.engine.parallel_sampling
        self._draft_probs.clear()
        wanted: list[tuple[Sequence, int]] = []  # (sequence, the drafts it may take)
        for seq in running:
            seq.spec_token_ids = []
            if off or seq.grammar is not None or seq.num_tokens - seq.num_computed_tokens != 1:
                continue
            if self.engine.after_sampling.get(seq.request.request_id) is not plain:
                continue  # a beam search keeps its own rounds of candidates: no drafts
            params = seq.request.params
            room = max_model_len - seq.num_tokens - 1  # the bonus token must fit too
            if params.max_tokens is not None:
                room = min(room, params.max_tokens - seq.num_output_tokens - 1)
            if room > 0:
                wanted.append((seq, room))
        if not wanted:
            return
        try:
            drafts = self.proposer.propose_drafts(wanted)
        except Exception:  # drafts are an optimisation: the step runs without them
            logger.exception("speculative proposal failed; this step runs without drafts")
            return
        for (seq, _), draft in zip(wanted, drafts):
            seq.spec_token_ids = draft.token_ids
            if draft.probs is not None:
                self._draft_probs[seq.seq_id] = draft.probs

    def on_step(self, scheduler_output: Any, outputs: Any, blocks: Any) -> None:
        """A step committed (a failed one publishes nothing): count its drafts."""
        for num_drafts, num_accepted in self._pending:
            self.stats.observe(num_drafts, num_accepted)
        self._pending.clear()

    # ------------------------------------------------------------------ after the model
    def sample(
        self, sched: SchedulerOutput, logits: torch.Tensor
    ) -> tuple[list[Sequence], SamplerOutput, dict[int, int]]:
        """Verify the step's drafts. Returns the sequences in output order, one per kept token
        (a sequence appears once per token it keeps), the sampler output in the same order, and
        the rejected drafts per seq_id, for the scheduler's commit."""
        engine = self.engine
        self._pending.clear()  # a step that failed after its sampling left its counts here
        seqs: list[Sequence] = []  # one per group
        logits_rows: list[int] = []  # [R]  which logits row each sampler row reads
        rows: list[SamplingRow] = []  # [R]
        drafts: list[int] = []  # [R]
        group_ids: list[int] = []  # [R]
        q_rows: list[tuple[int, torch.Tensor]] = []  # (row, float32 [V]) of drafts drawn from q
        first = 0
        for item in (s for s in sched.scheduled if s.sample):
            seq = engine.scheduler.seqs[item.seq_id]
            k = item.num_spec_tokens
            spec = item.new_token_ids[len(item.new_token_ids) - k :] if k else []
            hook = engine.after_sampling[seq.request.request_id]
            drawn = hook.sequences_to_sample(seq) if not k else [seq]
            q = self._draft_probs.get(seq.seq_id) if k else None
            for s in drawn:  # an n > 1 prompt draws n groups from one row
                base = SamplingRow.of(s, engine.eos_token_id)
                q_rows += [(len(rows) + j, q[j]) for j in range(k)] if q is not None else []
                for j in range(k + 1):
                    out = list(base.output_token_ids) + spec[:j]
                    rows.append(dataclasses.replace(base, output_token_ids=out) if j else base)
                    logits_rows.append(first + j)
                    drafts.append(spec[j] if j < k else -1)
                    group_ids.append(len(seqs))
                seqs.append(s)
            first += k + 1
        dev = logits.device
        meta = SamplingMetadata.from_rows(rows, engine.vocab_size, dev)
        index = torch.tensor(logits_rows, device=dev)
        draft_ids = torch.tensor(drafts, dtype=torch.int64, device=dev)
        result = rejection_sample(
            logits[index],
            meta,
            draft_ids,
            torch.tensor(group_ids, dtype=torch.int64, device=dev),
            len(seqs),
            engine.generator,
            _draft_probs(q_rows, draft_ids, logits.shape[-1]) if q_rows else None,
        )
        return self._kept(seqs, drafts, result)

    def _kept(
        self, seqs: list[Sequence], drafts: list[int], result: RejectionSamplerOutput
    ) -> tuple[list[Sequence], SamplerOutput, dict[int, int]]:
        """The rows each group keeps, as (sequences, sampler output) in output order, and the
        rejected drafts per seq_id; counts the drafts for the metrics."""
        num_accepted = result.num_accepted.tolist()
        keep: list[int] = []
        out_seqs: list[Sequence] = []
        rejected: dict[int, int] = {}
        row = 0
        for g, seq in enumerate(seqs):
            num_rows = _group_size(drafts, row)
            accepted = num_accepted[g]
            keep += range(row, row + accepted + 1)
            out_seqs += [seq] * (accepted + 1)
            if num_rows > 1:
                rejected[seq.seq_id] = num_rows - 1 - accepted
                self._pending.append((num_rows - 1, accepted))
            row += num_rows
        index = torch.tensor(keep, device=result.token_ids.device)
        lp = result.logprobs
        logprobs = None if lp is None else type(lp)(*(t[index] for t in lp))
        return out_seqs, SamplerOutput(result.token_ids[index], logprobs), rejected


def _draft_probs(
    q_rows: list[tuple[int, torch.Tensor]], drafts: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """float32 [R, V] q for the rejection sampler: the drawn rows' own, a point mass at the draft
    on every other draft row (greedy or n-gram drafts), zeros on bonus rows (no draft)."""
    q = torch.zeros(drafts.shape[0], vocab_size, dtype=torch.float32, device=drafts.device)
    has_draft = drafts >= 0
    q[has_draft, drafts[has_draft]] = 1.0
    for row, probs in q_rows:
        q[row] = probs[:vocab_size].to(q.device)
    return q


def _group_size(drafts: list[int], start: int) -> int:
    """Rows of the group that starts at `start`: its drafts and the bonus row (draft -1)."""
    end = start
    while drafts[end] >= 0:
        end += 1
    return end - start + 1
