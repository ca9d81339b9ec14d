"""The KV cache manager of a layer kind with a sliding window (vLLM v1's `SlidingWindowManager`,
vllm/v1/core/single_type_kv_cache_manager.py): every layer of Mistral, or one group of Gemma's.

A query at position p of a layer with window W sees key j iff p - W < j <= p (HF transformers'
sliding-window mask). Positions only grow, so once a sequence's next query is at position
`num_computed_tokens`, no query of it will see a key before num_computed_tokens - W + 1 again,
and every block wholly before that key's block can go back to the pool. A long sequence then
holds about W / block_size + 1 blocks, however long it gets.

- A freed block keeps its hash: it stays a prefix-cache hit until the pool evicts it, as any free
  cached block does.
- Its block-table entry becomes `NULL_BLOCK_ID`, a placeholder that keeps the tables valid
  tensors for the model runner: every attention backend starts a windowed layer's key range at
  its first visible key's block (minivllm/attention/), so it never reads the entry.
- The entries freed are always a prefix of the table (`num_skipped_blocks`); free, fork and the
  counts skip them. The next query of a running sequence is at `num_slots` when the scheduler asks
  for its next slots (every slot's K/V was computed by the steps that committed), so that is when
  they are freed (`append_slots`), and `get_num_blocks_to_append` counts them as free already.
- A prefix-cache hit needs only what its first query sees (vLLM's right-to-left search): k blocks
  are a hit when their last ceil((W - 1) / block_size) are cached, the ones before need not be
  (they may long have been evicted); those are skipped: named, never taken.

A model that mixes windowed and global layers (Gemma 2/3) has one of these per windowed group of
layers, beside a plain manager per global group, over one pool (kv_cache_coordinator.py).
"""

from __future__ import annotations

from collections.abc import Sequence as TokenIds
from dataclasses import replace
from typing import TYPE_CHECKING

from minivllm.core.block_pool import BlockPool
from minivllm.core.kv_cache_groups import kv_cache_windows
from minivllm.core.kv_cache_manager import (
    NO_COMPUTED_BLOCKS,
    ComputedBlocks,
    KVCacheManager,
    KVCacheRequest,
    SeqBlocks,
    SeqId,
)
from minivllm.core.kv_cache_utils import (
    NULL_BLOCK_ID,
    BlockHash,
    BlockPoolSnapshot,
    ExtraKeys,
    HashFn,
    KVCacheBlock,
    hash_block_tokens,
)

if TYPE_CHECKING:
    from minivllm.config import CacheConfig

__all__ = ["NULL_BLOCK_ID", "SlidingWindowKVCacheManager", "kv_sliding_window"]


def kv_sliding_window(model: object) -> int | None:
    """The window the KV cache manager may free blocks by, read off the model's attention layers:
    the largest when every layer has one, since what it cannot see no layer can; None when a
    layer is global or the model has no attention modules (`kv_cache_windows`)."""
    return kv_cache_windows(model)[0]


class SlidingWindowKVCacheManager(KVCacheManager):
    """`KVCacheManager` that frees the blocks no query can see again under a sliding window."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn = hash_block_tokens,
        sliding_window: int = 4096,  # every layer's window, in tokens
        block_pool: BlockPool | None = None,  # a hybrid model's groups share one (coordinator)
    ) -> None:
        if (
            isinstance(sliding_window, bool)
            or not isinstance(sliding_window, int)
            or sliding_window < 1
        ):
            raise ValueError(f"sliding_window must be a positive integer, got {sliding_window!r}")
        super().__init__(num_blocks, block_size, enable_prefix_caching, hash_fn, block_pool)
        self.sliding_window = sliding_window
        self._num_skipped: dict[SeqId, int] = {}  # leading table entries freed, per sequence

    @classmethod
    def from_config(
        cls, cache: CacheConfig, num_blocks: int, max_model_len: int
    ) -> SlidingWindowKVCacheManager:
        assert cache.sliding_window is not None  # CacheConfig names this class only then
        return cls(
            num_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            sliding_window=cache.sliding_window,
        )

    # ------------------------------------------------------------------ queries (no side effects)

    def num_skipped_blocks(self, seq_id: SeqId) -> int:
        """How many leading entries of the sequence's block table were freed (NULL_BLOCK_ID)."""
        return self._num_skipped.get(seq_id, 0)

    def num_blocks_without_sharing(self) -> int:
        return super().num_blocks_without_sharing() - sum(self._num_skipped.values())

    def snapshot(self) -> BlockPoolSnapshot:
        """As the base's, with the freed entries named (`num_skipped_blocks`) and left out of the
        ref counts: a placeholder entry holds no block (the trace draws it outside the window)."""
        seqs, skipped, blocks = self._seqs, self._num_skipped, self.block_pool.blocks
        return replace(
            super().snapshot(),
            _read_ref_counts=lambda: {
                b: blocks[b].ref_cnt
                for s, seq in seqs.items()
                for b in seq.block_table[skipped.get(s, 0) :]
            },
            _read_skipped=lambda: dict(skipped),
        )

    def get_num_blocks_to_append(self, seq_id: SeqId, num_new_tokens: int) -> int:
        """As the base's, less the blocks `append_slots` frees first (held by this sequence only;
        none once they are freed, so the base's check inside `append_slots` is the same)."""
        seq = self._seq(seq_id)
        if num_new_tokens <= 0:
            return 0
        blocks = self.block_pool.blocks
        releasable = sum(1 for b in self._blocks_to_skip(seq_id, seq) if blocks[b].ref_cnt == 1)
        return super().get_num_blocks_to_append(seq_id, num_new_tokens) - releasable

    def get_computed_blocks(
        self, token_ids: TokenIds[int], extra_keys: ExtraKeys = None
    ) -> ComputedBlocks:
        """The longest prefix-cache hit whose first query finds every key it sees (vLLM's
        `find_longest_cache_hit` for a window); at most (len - 1) // block_size blocks, as the
        base's, since the last token is always computed."""
        names, cached = self.lookup_blocks(token_ids, extra_keys)
        return self.longest_window_hit(names, cached, len(names))

    def lookup_blocks(
        self, token_ids: TokenIds[int], extra_keys: ExtraKeys
    ) -> tuple[list[BlockHash], list[KVCacheBlock | None]]:
        """The names of the prompt's full blocks (the last token's excluded) and the cached block
        holding each, if any. A name found is replaced by the cached one, so that the next name's
        parent is the pool's own object and comparisons stop at `is` (as `BlockPool`'s walk)."""
        pool, bs = self.block_pool, self.block_size
        names: list[BlockHash] = []
        cached: list[KVCacheBlock | None] = []
        if not pool.enable_caching:
            return names, cached
        parent: BlockHash | None = None
        for i in range((len(token_ids) - 1) // bs):
            key = BlockHash.of(
                parent, tuple(token_ids[i * bs : (i + 1) * bs]), extra_keys, pool.hash_fn
            )
            block = pool.get_cached_block(key)
            parent = key if block is None or block.block_hash is None else block.block_hash
            names.append(parent)
            cached.append(block)
        return names, cached

    def longest_window_hit(
        self, names: list[BlockHash], cached: list[KVCacheBlock | None], max_num_blocks: int
    ) -> ComputedBlocks:
        """The longest hit of at most `max_num_blocks` blocks. k blocks are a hit when the keys
        their first query (at k * block_size) can see are cached: the last ceil((W - 1) /
        block_size) blocks, or all k when there are fewer. Searched right to left, the first
        such run wins; the blocks before it are skipped (named, not taken)."""
        # Blocks the first query sees keys in (at least the last: a window of 1 asks for one).
        need = max(1, -(-(self.sliding_window - 1) // self.block_size))
        num_blocks = run = 0
        for i in range(max_num_blocks - 1, -1, -1):
            run = run + 1 if cached[i] is not None else 0
            if run == need:
                num_blocks = i + need
                break
        else:
            num_blocks = run  # blocks 0 .. run - 1, fewer than the window: all their query sees
        if num_blocks == 0:
            return NO_COMPUTED_BLOCKS
        skipped = max(0, num_blocks - need)
        taken = tuple(b for b in cached[skipped:num_blocks] if b is not None)  # all cached
        return ComputedBlocks(taken, num_blocks * self.block_size, tuple(names[:skipped]))

    # ----------------------------------------------------------------------------------- mutations

    def allocate_slots(
        self,
        seq: KVCacheRequest,
        num_new_tokens: int,
        computed: ComputedBlocks = NO_COMPUTED_BLOCKS,
        extra_keys: ExtraKeys = None,
        count_as_query: bool = True,
    ) -> int:
        num_cached = super().allocate_slots(
            seq, num_new_tokens, computed, extra_keys, count_as_query
        )
        if computed.skipped_hashes:  # their entries are placeholders already
            self._num_skipped[seq.seq_id] = len(computed.skipped_hashes)
        self.remove_skipped_blocks(seq.seq_id, num_cached)  # the first query is at num_cached
        return num_cached

    def append_slots(
        self,
        seq_id: SeqId,
        token_ids: TokenIds[int],
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
    ) -> None:
        if num_new_tokens + max(0, num_lookahead_tokens) > 0:
            self.remove_skipped_blocks(seq_id, self._seq(seq_id).num_slots)
        super().append_slots(seq_id, token_ids, num_new_tokens, num_lookahead_tokens)

    def remove_skipped_blocks(self, seq_id: SeqId, num_computed_tokens: int) -> None:
        """Free the blocks no query of `seq_id` at `num_computed_tokens` or later can see
        (vLLM's name); tail first, as `free` does, so the front of a prefix is evicted last."""
        seq = self._seq(seq_id)
        if not 0 <= num_computed_tokens <= seq.num_slots:
            raise ValueError(
                f"num_computed_tokens must be in [0, {seq.num_slots}], got {num_computed_tokens}"
            )
        start = self.num_skipped_blocks(seq_id)
        freed = self._blocks_to_skip(seq_id, seq, num_computed_tokens)
        if not freed:
            return
        self.block_pool.free_blocks(self.block_pool.blocks[b] for b in reversed(freed))
        seq.block_table[start : start + len(freed)] = [NULL_BLOCK_ID] * len(freed)
        self._num_skipped[seq_id] = start + len(freed)
        self._record_utilization()

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """The child shares the parent's held blocks and its placeholders (paper §4.4)."""
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already holds blocks; cannot fork into it")
        skipped = self.num_skipped_blocks(parent_id)
        self.block_pool.touch(self.block_pool.blocks[b] for b in parent.block_table[skipped:])
        self._seqs[child_id] = SeqBlocks(
            list(parent.block_table), parent.num_slots, list(parent.block_hashes), parent.extra_keys
        )
        if skipped:
            self._num_skipped[child_id] = skipped

    def free(self, seq_id: SeqId) -> None:
        seq = self._seq(seq_id)  # raises for an unknown sequence, as the base does
        del seq.block_table[: self._num_skipped.pop(seq_id, 0)]  # placeholders hold nothing
        super().free(seq_id)

    # ------------------------------------------------------------------------------------ helpers

    def _blocks_to_skip(
        self, seq_id: SeqId, seq: SeqBlocks, num_computed_tokens: int | None = None
    ) -> list[int]:
        """The held blocks that a query at `num_computed_tokens` (default: the next slot) cannot
        see: those before the block of its first visible key, num_computed_tokens - W + 1."""
        pos = seq.num_slots if num_computed_tokens is None else num_computed_tokens
        end = max(0, pos - self.sliding_window + 1) // self.block_size
        return seq.block_table[self.num_skipped_blocks(seq_id) : end]
