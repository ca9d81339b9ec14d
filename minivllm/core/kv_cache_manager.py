"""The KV cache manager: per-sequence block tables, copy-on-write and prefix caching, over the pool.

vLLM v1's `KVCacheManager` (`vllm/v1/core/kv_cache_manager.py`): it decides which physical block
holds which token of which sequence; the blocks change hands in `block_pool.py`, and the model
runner owns the cache tensors and turns block tables into slot mappings.

- Paged memory (PagedAttention paper §4.2–4.3): a sequence of `t` tokens holds `ceil(t / block_size)`
  blocks, allocated on demand, listed in logical order in its *block table*.
- Sharing and copy-on-write (§4.4, parallel sampling): `fork` makes a child share every block of its
  parent (reference counts go up); the first write into a shared, partly filled block moves the
  writer to a fresh block and records a (src, dst) copy for the model runner.
- Automatic prefix caching, as vLLM v1 does it: admission looks the prompt up ONCE
  (`get_computed_blocks`); the scheduler decides with the hit and hands it to `allocate_slots`,
  which takes it without walking the hash chain again. Every FULL block is registered under its
  `BlockHash` when its slots are allocated, so a request admitted in the same step can already hit
  it (each layer writes all new K/V before any attention reads). Names are provisional until the
  step commits (`commit_step`); a step that fails withdraws the names it gave (`rollback_step`),
  so no block whose K/V was never written is ever served to a later step. Freed blocks keep their
  hash and stay reusable until the pool needs them.
- Policies subclass this one: a sliding window's, a hybrid model's groups of layers (both here,
  in core/), the paper's baselines (experiments/); `supports_forks` says whether forks may share.
"""

from __future__ import annotations

from collections.abc import Sequence as TokenIds
from typing import TYPE_CHECKING, ClassVar

from minivllm.core.block_pool import BlockPool
from minivllm.core.kv_cache_utils import (
    NO_COMPUTED_BLOCKS,
    NULL_BLOCK_ID,
    BlockHash,
    BlockPoolSnapshot,
    ComputedBlocks,
    ExtraKeys,
    HashFn,
    KVCacheBlock,
    KVCacheManagerStats,
    KVCacheRequest,
    NoFreeBlocksError,
    SeqBlocks,
    SeqId,
    UnknownSequenceError,
    hash_block_tokens,
)

if TYPE_CHECKING:
    from minivllm.config import CacheConfig


class KVCacheManager:
    """Block tables + prefix cache over a `BlockPool`. Method names are vLLM's where it has one."""

    supports_forks: ClassVar[bool] = True  # n > 1 and beam search share blocks between sequences

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn = hash_block_tokens,  # vLLM lets users choose it too (builtin or sha256)
        block_pool: BlockPool | None = None,  # a hybrid model's groups share one (coordinator)
    ) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = block_pool or BlockPool(num_blocks, enable_prefix_caching, hash_fn)
        self._seqs: dict[SeqId, SeqBlocks] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self._step_names: list[KVCacheBlock] = []  # named since the last commit (provisional)
        self._prefix_cache_queries = 0
        self._prefix_cache_hits = 0
        self._min_util = 1.0
        self._peak_used = 0
        self._peak_util = 1.0

    @classmethod
    def from_config(cls, cache: CacheConfig, num_blocks: int, max_model_len: int) -> KVCacheManager:
        """The factory the engine calls (`LLMEngine(..., kv_cache_manager_cls=...)`)."""
        return cls(num_blocks, cache.block_size, cache.enable_prefix_caching)

    @classmethod
    def max_num_tokens(cls, cache: CacheConfig, num_blocks: int, token_budget: int) -> int:
        """The longest sequence `num_blocks` hold on their own: what max_model_len may be."""
        return num_blocks * cache.block_size

    def check_forks_allowed(self) -> None:
        """Raise where a request that forks (n > 1, beam search) cannot run on this manager."""
        if not self.supports_forks:
            raise ValueError(f"{type(self).__name__} cannot share blocks between sequences")

    # ------------------------------------------------------------------ queries (no side effects)
    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (vLLM's kv_cache_usage metric)."""
        return self.block_pool.get_usage()

    def num_blocks_without_sharing(self) -> int:
        """The blocks in use if no block were shared: each sequence holding its own copy of every
        block in its table (the baseline of the paper's Fig. 15 memory saving)."""
        return sum(len(seq.block_table) for seq in self._seqs.values())

    def has_seq(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def get_block_table(self, seq_id: SeqId) -> list[int]:
        """The LIVE block table (no copy, so reading it each step costs nothing): it grows in place
        and copy-on-write replaces its last entry. Do not mutate it; copy it to keep a snapshot."""
        return self._seq(seq_id).block_table

    def get_group_block_tables(self, seq_id: SeqId) -> tuple[list[int], ...]:
        """Copies of a hybrid model's other KV cache groups' tables (kv_cache_coordinator.py)."""
        return ()

    def get_num_slots(self, seq_id: SeqId) -> int:
        return self._seq(seq_id).num_slots

    def get_computed_blocks(
        self, token_ids: TokenIds[int], extra_keys: ExtraKeys = None
    ) -> ComputedBlocks:
        """The longest run of cached full blocks matching the start of `token_ids`: the one walk of
        the hash chain an admission makes.

        Capped at (len - 1) // block_size blocks: the last token is always computed, because the
        model needs its logits to sample the next token and a cache holds KV, not logits (nano-vllm
        users hit this when a whole prompt was cached and nothing was left to run).
        """
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits = self.block_pool.find_longest_cache_hit(
            token_ids, max_blocks, extra_keys, self.block_size
        )
        return (
            ComputedBlocks(tuple(hits), len(hits) * self.block_size) if hits else NO_COMPUTED_BLOCKS
        )

    def can_allocate(
        self,
        seq: KVCacheRequest,
        num_new_tokens: int,
        computed: ComputedBlocks = NO_COMPUTED_BLOCKS,
    ) -> bool:
        """Whether `allocate_slots(seq, num_new_tokens, computed)` would find its blocks."""
        return self.get_num_blocks_to_allocate(computed, num_new_tokens) <= self.num_free_blocks

    def can_append_slots(self, seq_id: SeqId, num_new_tokens: int) -> bool:
        return self.get_num_blocks_to_append(seq_id, num_new_tokens) <= self.num_free_blocks

    def get_num_blocks_to_allocate(self, computed: ComputedBlocks, num_new_tokens: int) -> int:
        """Free-queue blocks an admission consumes: fresh blocks + hits that are now evictable."""
        num_tokens = computed.num_computed_tokens + num_new_tokens
        num_hits = len(computed.skipped_hashes) + len(computed.blocks)  # skipped: never taken
        fresh = -(-num_tokens // self.block_size) - num_hits
        return fresh + sum(1 for b in computed.blocks if b.ref_cnt == 0)

    def get_num_blocks_to_append(self, seq_id: SeqId, num_new_tokens: int) -> int:
        """Free-queue blocks `append_slots` takes, net of any it frees first (a window's)."""
        seq = self._seq(seq_id)
        if num_new_tokens <= 0:
            return 0
        fresh = -(-(seq.num_slots + num_new_tokens) // self.block_size) - len(seq.block_table)
        partial = seq.num_slots % self.block_size != 0
        cow = partial and self.block_pool.blocks[seq.block_table[-1]].ref_cnt > 1
        return fresh + int(cow)

    # ----------------------------------------------------------------------------------- mutations
    def allocate_slots(
        self,
        seq: KVCacheRequest,
        num_new_tokens: int,
        computed: ComputedBlocks = NO_COMPUTED_BLOCKS,
        extra_keys: ExtraKeys = None,
        count_as_query: bool = True,
    ) -> int:
        """Admit `seq`: take its prefix-cache hit `computed` (from `get_computed_blocks`, no second
        lookup), then fresh blocks for `num_new_tokens` more tokens. `seq.token_ids` is everything
        known (prompt + generated tokens, after a preemption). Returns the hit in tokens; the model
        computes tokens from there on. `count_as_query=False` keeps a re-admission after preemption
        out of the prompt lookup counters. Raises, changing nothing, if the blocks are not free."""
        seq_id, token_ids = seq.seq_id, seq.token_ids
        num_cached_tokens = computed.num_computed_tokens
        self._check_allocate_args(seq, num_new_tokens, num_cached_tokens)
        self._check_free(seq_id, self.get_num_blocks_to_allocate(computed, num_new_tokens))
        self.block_pool.touch(computed.blocks)  # hits first, so the pops below cannot evict them
        skipped = computed.skipped_hashes
        entry = SeqBlocks(
            block_table=[NULL_BLOCK_ID] * len(skipped) + [b.block_id for b in computed.blocks],
            num_slots=num_cached_tokens,
            block_hashes=[*skipped, *(b.block_hash for b in computed.blocks if b.block_hash)],
            extra_keys=extra_keys,
        )
        self._seqs[seq_id] = entry
        self._grow(entry, token_ids, num_new_tokens)
        if count_as_query:
            self._prefix_cache_queries += len(token_ids)
            self._prefix_cache_hits += num_cached_tokens
        self._record_utilization()
        return num_cached_tokens

    def append_slots(
        self,
        seq_id: SeqId,
        token_ids: TokenIds[int],
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
    ) -> None:
        """Slots for `num_new_tokens` more tokens of a held sequence (a decode step, or the next
        prompt chunk; `token_ids`: every known token), then `num_lookahead_tokens` for speculative
        drafts, whose blocks get no prefix-cache name: only verified tokens may ever be hit."""
        self._check_append_args(seq_id, token_ids, num_new_tokens)
        num_new_tokens += max(0, num_lookahead_tokens)
        self._check_free(seq_id, self.get_num_blocks_to_append(seq_id, num_new_tokens))
        seq = self._seq(seq_id)
        if num_new_tokens == 0:
            return
        pool = self.block_pool
        last = pool.blocks[seq.block_table[-1]] if seq.block_table else None
        if last is not None and last.ref_cnt > 1 and seq.num_slots % self.block_size:
            # Copy-on-write (§4.4): the next slot lies in a partly filled block that a forked
            # sibling also reads. Writing there would corrupt the sibling's KV, so this sequence
            # moves to a private copy; the model runner copies the KV before the step runs.
            (dst,) = pool.get_new_blocks(1)
            pool.fill(dst, last.num_filled)
            pool.free_blocks([last])  # still held: the sibling keeps it
            seq.block_table[-1] = dst.block_id
            self._pending_copies.append((last.block_id, dst.block_id))
        self._grow(seq, token_ids, num_new_tokens)
        self._record_utilization()

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """The child shares all the parent's blocks (§4.4); writes diverge through copy-on-write."""
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already holds blocks; cannot fork into it")
        self.block_pool.touch(self.block_pool.blocks[b] for b in parent.block_table)
        self._seqs[child_id] = SeqBlocks(
            list(parent.block_table), parent.num_slots, list(parent.block_hashes), parent.extra_keys
        )

    def free(self, seq_id: SeqId) -> None:
        """Release a finished, aborted or preempted sequence's blocks. Tail first: the queue evicts
        from its front, so the ends of a prefix are evicted before its beginning, which other
        prompts are likelier to share (and a block is useless once its parent is evicted)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            msg = f"sequence {seq_id!r} holds no blocks (never allocated, or already freed)"
            raise UnknownSequenceError(msg)
        blocks = self.block_pool.blocks
        self.block_pool.free_blocks(blocks[b] for b in reversed(seq.block_table))
        self._record_utilization()

    def trim_slots(self, seq_id: SeqId, num_slots: int) -> None:
        """Keep the first `num_slots` slots (speculative decoding's rollback: the rejected drafts'
        slots go back, and blocks left empty return to the pool; none of them had a name)."""
        seq, bs, pool = self._seq(seq_id), self.block_size, self.block_pool
        if not (lo := len(seq.block_hashes) * bs) <= num_slots <= seq.num_slots:
            raise ValueError(f"num_slots must be in [{lo}, {seq.num_slots}], got {num_slots}")
        keep = -(-num_slots // bs)
        pool.free_blocks(pool.blocks[b] for b in reversed(seq.block_table[keep:]))
        del seq.block_table[keep:]
        if num_slots % bs:
            pool.fill(pool.blocks[seq.block_table[-1]], num_slots % bs)
        seq.num_slots = num_slots

    def commit_step(self) -> None:
        """The step that wrote the K/V of the blocks named since the last commit completed."""
        self._step_names.clear()

    def rollback_step(self) -> None:
        """The step failed: withdraw every name it gave, so a block whose K/V it may not have
        written can never be a prefix-cache hit. Call before freeing the step's sequences."""
        for block in self._step_names:
            self.block_pool.evict(block)
        self._step_names.clear()

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) block pairs since the last call, for the model runner."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while a cached block is held (`BlockPool`)."""
        return self.block_pool.reset_prefix_cache()

    def snapshot(self) -> BlockPoolSnapshot:
        """A read-only copy of the pool now: block tables, ref counts, prefix-cache names."""
        seqs, blocks = self._seqs, self.block_pool.blocks
        cached = self.block_pool.cached_block_hash_to_block
        return BlockPoolSnapshot(
            self.block_size,
            self.num_blocks,
            self.num_free_blocks,
            lambda: {s: tuple(seq.block_table) for s, seq in seqs.items()},
            lambda: {b: blocks[b].ref_cnt for seq in seqs.values() for b in seq.block_table},
            lambda: {block.block_id: key for key, block in cached.items()},
            self.get_stats,
        )

    def get_stats(self) -> KVCacheManagerStats:
        pool = self.block_pool
        used = self.num_blocks - self.num_free_blocks
        return KVCacheManagerStats(
            num_total_blocks=self.num_blocks,
            num_free_blocks=self.num_free_blocks,
            num_used_blocks=used,
            num_cached_blocks=len(pool.cached_block_hash_to_block),
            num_evictable_blocks=pool.num_evictable_blocks,
            prefix_cache_queries=self._prefix_cache_queries,
            prefix_cache_hits=self._prefix_cache_hits,
            kv_slot_utilization=self._utilization(),
            min_kv_slot_utilization=self._min_util,
            peak_kv_slot_utilization=self._peak_util,
            peak_used_blocks=self._peak_used,
            num_reserved_slots=used * self.block_size,
            num_filled_slots=pool.num_filled_slots,
            internal_fragmentation_slots=used * self.block_size - pool.num_filled_slots,
        )

    # ------------------------------------------------------------------------------------ helpers
    def _seq(self, seq_id: SeqId) -> SeqBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(f"sequence {seq_id!r} holds no blocks")
        return seq

    def _check_allocate_args(
        self, seq: KVCacheRequest, num_new_tokens: int, num_cached_tokens: int
    ) -> None:
        """`allocate_slots`' argument checks, shared by every manager (the hybrid coordinator's
        `has_seq` asks its groups); each checks its own free blocks after. Raises, changing nothing."""
        if self.has_seq(seq.seq_id):
            msg = f"sequence {seq.seq_id!r} already holds blocks; free it before allocating"
            raise ValueError(msg)
        if not 0 <= num_new_tokens <= (num_uncached := len(seq.token_ids) - num_cached_tokens):
            raise ValueError(
                f"num_new_tokens must be in [0, {num_uncached}] "
                f"(tokens after the {num_cached_tokens} cached ones), got {num_new_tokens}"
            )

    def _check_append_args(
        self, seq_id: SeqId, token_ids: TokenIds[int], num_new_tokens: int
    ) -> int:
        """`append_slots`' argument checks, shared by every manager; returns the slots `seq_id`
        holds (raises UnknownSequenceError for an unknown id, ValueError for a bad count)."""
        num_slots = self.get_num_slots(seq_id)
        if not 0 <= num_new_tokens <= len(token_ids) - num_slots:
            raise ValueError(
                f"num_new_tokens must be in [0, {len(token_ids) - num_slots}] "
                f"(known tokens without a slot), got {num_new_tokens}"
            )
        return num_slots

    def _check_free(self, seq_id: SeqId, num_to_take: int) -> None:
        if num_to_take > self.num_free_blocks:
            msg = f"sequence {seq_id!r} needs {num_to_take} blocks, {self.num_free_blocks} are free"
            raise NoFreeBlocksError(msg)

    def _grow(self, seq: SeqBlocks, token_ids: TokenIds[int], num_new_tokens: int) -> None:
        """Give `seq` slots for `num_new_tokens` more tokens (blocks already checked to be free),
        then name every block that just became full (provisionally, until the step commits)."""
        bs, pool = self.block_size, self.block_pool
        remaining = num_new_tokens
        if seq.num_slots % bs and remaining:  # finish the partly filled last block first
            last = pool.blocks[seq.block_table[-1]]
            n = min(bs - last.num_filled, remaining)
            pool.fill(last, last.num_filled + n)
            remaining -= n
        for block in pool.get_new_blocks(-(-remaining // bs)):
            pool.fill(block, min(bs, remaining))
            seq.block_table.append(block.block_id)
            remaining -= block.num_filled
        seq.num_slots += num_new_tokens
        if self.enable_prefix_caching:  # lookahead slots past the known tokens stay unnamed
            for i in range(len(seq.block_hashes), min(seq.num_slots, len(token_ids)) // bs):
                self._cache_full_block(seq, i, tuple(token_ids[i * bs : (i + 1) * bs]))

    def _cache_full_block(
        self, seq: SeqBlocks, index: int, block_token_ids: tuple[int, ...]
    ) -> None:
        """Name block `index` of `seq`, full and written, unless its content has a name already."""
        parent = seq.block_hashes[index - 1] if index else None
        key = BlockHash.of(parent, block_token_ids, seq.extra_keys, self.block_pool.hash_fn)
        block = self.block_pool.blocks[seq.block_table[index]]
        canonical = self.block_pool.cache_full_block(block, key)
        seq.block_hashes.append(canonical or key)
        if canonical is None:  # `block` took the name: provisional until the step commits
            self._step_names.append(block)

    def _utilization(self) -> float:
        used = self.num_blocks - self.num_free_blocks
        return self.block_pool.num_filled_slots / (used * self.block_size) if used else 1.0

    def _record_utilization(self) -> None:
        used = self.num_blocks - self.num_free_blocks
        if used == 0:
            return
        util = self._utilization()
        self._min_util = min(self._min_util, util)
        # `>=`: keep the latest moment at the peak, when its blocks are as filled as they got.
        if used >= self._peak_used:
            self._peak_used, self._peak_util = used, util
