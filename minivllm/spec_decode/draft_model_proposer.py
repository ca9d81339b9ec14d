"""The draft-model proposer: a smaller model of the same vocabulary drafts k tokens, one at a time.

Leviathan et al. (2023) and Chen et al. (2023) with a separate draft model; vLLM's `draft_model`
method (`{"model": ..., "num_speculative_tokens": k}`). The draft has its own paged KV cache: its
own block pool (a `KVCacheManager` without prefix caching) and its own K/V tensors in its own
`ModelRunner`, with as many blocks as the target's cache (so it holds as many tokens; a smaller
model's blocks are smaller, and untouched blocks cost no memory on a CPU). Each proposal runs:

    catch up     the sequence's tokens the draft has no K/V for: the whole prompt the first time,
                 then what the last verification kept past the draft's own drafts (at least the
                 newest token), in chunks of at most max_num_batched_tokens; its last row's
                 logits give the draft's distribution q_1 for the first draft
    draft 2..k   one token per step: d_{j-1} goes in, q_j comes out

every step batched over the sequences that speculate. Rejected drafts need no undo: the proposer
remembers which tokens the draft's cache holds (`cached`), and at the next proposal the common
prefix with the sequence is what stays valid; `trim_slots` gives back the rest of the slots and
the catch-up writes over them (the target's rollback, on the draft's blocks).

A greedy request drafts the draft's argmax: a point mass, no probabilities. A sampled request
draws d_j from q_j, the draft's logits through the request's own sampling pipeline (penalties,
temperature, min-p, top-k, top-p; `sampler.py`), and q_j travels with the draft: the rejection
sampler keeps d_j with probability min(1, p_j(d_j) / q_j(d_j)), so the output is distributed as
the target's plain sampling whatever the draft is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minivllm.config import EngineConfig, ResolvedConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.scheduler import ScheduledSequence, SchedulerOutput
from minivllm.core.sequence import Sequence as EngineSequence
from minivllm.distributed.parallel_state import SINGLE_DEVICE
from minivllm.sample.logits_processors import apply_logits_processors
from minivllm.sample.sampler import SamplingMetadata, SamplingRow, apply_truncation, random_sample
from minivllm.spec_decode.proposer import NO_DRAFT, Draft
from minivllm.worker.worker import WorkerConfig, build_runner


@dataclass
class _Drafting:
    """One sequence's proposal in progress."""

    seq: EngineSequence
    k: int  # drafts to make
    num_computed: int  # tokens of the sequence (then drafts) with K/V in the draft's cache
    token_ids: list[int] = dataclasses.field(default_factory=list)  # [<= k]  the drafts so far
    probs: list[torch.Tensor] = dataclasses.field(default_factory=list)  # [<= k] of float32 [V]


class DraftModelProposer:
    def __init__(
        self,
        k: int,
        config: EngineConfig,
        draft: ResolvedConfig,
        num_blocks: int,  # the target's KV blocks: the draft's cache holds as many tokens
        attention_backend: str,  # the target's, resolved
        generator: torch.Generator,  # the engine's, for rows without a seed of their own
        eos_token_id: int | None,
    ) -> None:
        self.k = k
        cache = dataclasses.replace(
            config.cache, enable_prefix_caching=False, num_gpu_blocks_override=num_blocks
        )
        wc = WorkerConfig(
            model_path=str(draft.source.path),
            model_name=draft.source.name,
            dtype=draft.dtype,
            device_type=draft.device.type,
            attention_backend=attention_backend,
            enforce_eager=config.model.enforce_eager,
            quantization=draft.quantization,
            gguf_file=None if draft.source.gguf_file is None else str(draft.source.gguf_file),
            max_model_len=draft.max_model_len,
            cache=cache,
            tensor_parallel_size=1,
            num_threads=torch.get_num_threads(),
        )
        self.runner = build_runner(wc, SINGLE_DEVICE, None, draft.device)
        windowed = [m for m in self.runner.model.modules() if getattr(m, "sliding_window", None)]
        if windowed:  # its cache would need the target's groups of layers: one block table here
            raise ValueError(
                f"speculative_config.model ({draft.source.name}): a draft model with "
                "sliding-window layers is not supported (the target may have them)"
            )
        self.kv = KVCacheManager(num_blocks, cache.block_size, enable_prefix_caching=False)
        self.max_chunk = config.scheduler.max_num_batched_tokens
        self.vocab_size = draft.hf_config.vocab_size
        self.generator = generator
        self.eos_token_id = eos_token_id
        # seq_id -> the tokens whose K/V the draft's cache holds, by position (insertion order:
        # least recently proposed for first, which is what makes room when the pool is full)
        self.cached: dict[int, list[int]] = {}

    # ------------------------------------------------------------------ the proposer's interface
    def free(self, seq_id: int) -> None:
        if self.cached.pop(seq_id, None) is not None:
            self.kv.free(seq_id)

    @torch.inference_mode()
    def propose_drafts(self, wanted: Sequence[tuple[EngineSequence, int]]) -> list[Draft]:
        protect = {seq.seq_id for seq, _ in wanted}
        batch: list[_Drafting] = []
        for seq, room in wanted:
            k = min(self.k, room)
            start = self._reserve(seq, k, protect) if k > 0 else None
            if start is not None:
                batch.append(_Drafting(seq, k, start))
        if batch:
            try:
                self._catch_up(batch)
                for _ in range(1, max(d.k for d in batch)):
                    self._draft_one([d for d in batch if len(d.token_ids) < d.k])
            except BaseException:
                for d in batch:  # the draft's cache may be half written: start these over
                    self.free(d.seq.seq_id)
                raise
        drafts = {d.seq.seq_id: d for d in batch}
        return [_as_draft(drafts.get(seq.seq_id)) for seq, _ in wanted]

    # ------------------------------------------------------------------ the draft's cache
    def _reserve(self, seq: EngineSequence, k: int, protect: set[int]) -> int | None:
        """Slots for the tokens to catch up and the k - 1 drafts fed back; returns how many of
        the sequence's tokens the draft's cache already holds, or None when the pool has no room
        even after dropping the sequences not drafting this step (least recently first)."""
        tokens, seq_id = seq.token_ids, seq.seq_id
        held = self.cached.pop(seq_id, None)
        if held is None:
            self.kv.allocate_slots(seq, 0)
            valid = 0
        else:
            valid = min(_common_prefix(held, tokens), len(tokens) - 1)  # the newest always runs
            self.kv.trim_slots(seq_id, valid)
        self.cached[seq_id] = tokens[:valid]  # re-inserted: the most recently used
        need = len(tokens) - valid + k - 1
        for other in [s for s in self.cached if s not in protect]:
            if self.kv.can_append_slots(seq_id, need):
                break
            self.free(other)
        if not self.kv.can_append_slots(seq_id, need):
            self.free(seq_id)
            return None
        self.kv.append_slots(seq_id, tokens, len(tokens) - valid, k - 1)
        return valid

    def _scheduled(self, d: _Drafting, new_token_ids: list[int], sample: bool) -> ScheduledSequence:
        seq_id, bs = d.seq.seq_id, self.kv.block_size
        seq_len = d.num_computed + len(new_token_ids)
        table = self.kv.get_block_table(seq_id)[: -(-seq_len // bs)]
        return ScheduledSequence(seq_id, d.num_computed, new_token_ids, list(table), sample)

    def _run(self, items: list[tuple[_Drafting, list[int], bool]]) -> torch.Tensor | None:
        """One forward of the draft over `items` (what each computes, whether it samples);
        the draft's cache now holds their tokens. Logits [S, V] of the sampling ones."""
        sched = SchedulerOutput([self._scheduled(d, new, sample) for d, new, sample in items])
        logits = self.runner.execute_model(sched).logits
        for d, new, _ in items:
            d.num_computed += len(new)
            self.cached[d.seq.seq_id] += new
        return logits

    # ------------------------------------------------------------------ drafting
    def _catch_up(self, batch: list[_Drafting]) -> None:
        """The tokens the draft has not seen, in chunks; the last chunk's logits draft d_1."""
        behind = batch
        while behind:
            items = []
            for d in behind:
                tokens = d.seq.token_ids
                new = tokens[d.num_computed : d.num_computed + self.max_chunk]
                items.append((d, new, d.num_computed + len(new) == len(tokens)))
            logits = self._run(items)
            done = [d for d, _, sample in items if sample]
            if done:
                assert logits is not None
                self._sample(done, logits)
            behind = [d for d, _, sample in items if not sample]

    def _draft_one(self, batch: list[_Drafting]) -> None:
        """Feed each sequence's newest draft back and draft the next one."""
        logits = self._run([(d, d.token_ids[-1:], True) for d in batch])
        assert logits is not None
        self._sample(batch, logits)

    def _sample(self, batch: list[_Drafting], logits: torch.Tensor) -> None:
        """Each row's next draft: the argmax for greedy requests, else a draw from q (kept)."""
        rows = []
        for d in batch:
            row = SamplingRow.of(d.seq, self.eos_token_id)
            out = list(row.output_token_ids) + d.token_ids  # penalties see the drafts so far
            rows.append(dataclasses.replace(row, output_token_ids=out))
        meta = SamplingMetadata.from_rows(rows, self.vocab_size, logits.device)
        processed = apply_logits_processors(logits.float(), meta)  # [S, V]
        tokens = processed.max(dim=-1).indices  # [S]
        probs = None
        if not meta.all_greedy:
            probs = apply_truncation(processed, meta).softmax(dim=-1)  # [S, V]  q
            sampled = random_sample(probs, meta, generator=self.generator)
            tokens = torch.where(meta.temperature > 0, sampled, tokens)
        for i, (d, token) in enumerate(zip(batch, tokens.tolist())):
            d.token_ids.append(token)
            if probs is not None and not d.seq.request.params.is_greedy:
                d.probs.append(probs[i])


def _as_draft(d: _Drafting | None) -> Draft:
    if d is None:
        return NO_DRAFT
    return Draft(d.token_ids, torch.stack(d.probs) if d.probs else None)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two lists share. Tokens only ever append, so the lists part in
    their last few (the drafts): compare the head in one C-speed slice test, then walk the tail."""
    n = min(len(a), len(b))
    lo = max(0, n - 64)
    if a[:lo] != b[:lo]:
        lo = 0
    for i in range(lo, n):
        if a[i] != b[i]:
            return i
    return n
