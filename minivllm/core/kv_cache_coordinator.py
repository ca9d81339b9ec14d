"""The KV cache manager of a model that mixes windowed and global layers (Gemma 2/3): a block
table per group of layers, over one shared pool (vLLM v1's hybrid allocator,
`HybridKVCacheCoordinator` in vllm/v1/core/kv_cache_coordinator.py).

Each KV cache group (kv_cache_groups.py) has a manager of its kind: a `KVCacheManager` for a
global group, which holds every block of a sequence, and a `SlidingWindowKVCacheManager` for a
windowed one, which frees the blocks out of its window as the sequence grows. They draw on one
`BlockPool`, so a block a windowed group frees can go to any group. The coordinator speaks the
`KVCacheManager` interface the scheduler calls, and makes every decision for all groups at once:

- Admission looks the prompt up once, in every group (`get_computed_blocks`): the hit is the
  longest that every group holds. A global group's hit is every block from the start, so a
  shorter one holds too; a windowed group's is the blocks its first query sees, which a shorter
  bound may not have, so it looks again under the new bound until all agree (vLLM's fixed point).
- Whether blocks are free is asked of the sum over groups (`can_allocate`, `can_append_slots`),
  and a step's windowed blocks are freed before any group takes new ones; one group never takes
  a block another is about to hit (`allocate_slots` pins every hit first).
- Names stay apart: a group's blocks are named with the group folded into the hash
  (`group_extra_keys`), since the same tokens' K/V differ from one group of layers to another.
- Fork, free, trim, commit and rollback go to every group; copy-on-write pairs come from all.

It is a `KVCacheManager` (the scheduler cannot tell) whose own table dict stays empty: what it
keeps of its base is the pool-wide accounting (free blocks, stats and peaks, reset, forks).
Group 0 is a global group: its table is `get_block_table`'s, the others travel in the step's
`ScheduledSequence.group_block_tables`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Sequence as TokenIds
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from minivllm.core.kv_cache_groups import KVCacheGroupSpec, get_kv_cache_groups, group_extra_keys
from minivllm.core.kv_cache_manager import NO_COMPUTED_BLOCKS, KVCacheManager
from minivllm.core.kv_cache_utils import (
    BlockPoolSnapshot,
    ComputedBlocks,
    ExtraKeys,
    HashFn,
    KVCacheRequest,
    SeqId,
    hash_block_tokens,
)
from minivllm.core.sliding_window_manager import SlidingWindowKVCacheManager

if TYPE_CHECKING:
    from minivllm.config import CacheConfig


@dataclass(frozen=True, slots=True)
class HybridComputedBlocks(ComputedBlocks):
    """One admission's prefix-cache hit in every group, of the same length in each."""

    groups: tuple[ComputedBlocks, ...] = ()  # [num_groups]


@dataclass(frozen=True)
class HybridBlockPoolSnapshot(BlockPoolSnapshot):
    """The pool after a step: the first group's tables, where a single table's snapshot has them,
    the other groups' beside them; the ref counts are every group's holds."""

    other_groups: tuple[BlockPoolSnapshot, ...] = ()  # [num_groups - 1]  their tables, skipped


class HybridKVCacheCoordinator(KVCacheManager):
    """Block tables per KV cache group, over one pool, behind `KVCacheManager`'s interface."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        kv_cache_groups: Sequence[KVCacheGroupSpec],
        hash_fn: HashFn = hash_block_tokens,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, hash_fn)
        if not kv_cache_groups or kv_cache_groups[0].sliding_window is not None:
            raise ValueError("the first KV cache group must be a global one")
        self.kv_cache_groups = tuple(kv_cache_groups)
        pool = self.block_pool
        self.managers: list[KVCacheManager] = [
            KVCacheManager(num_blocks, block_size, enable_prefix_caching, hash_fn, pool)
            if group.sliding_window is None
            else SlidingWindowKVCacheManager(
                num_blocks, block_size, enable_prefix_caching, hash_fn, group.sliding_window, pool
            )
            for group in kv_cache_groups
        ]

    @classmethod
    def from_config(
        cls, cache: CacheConfig, num_blocks: int, max_model_len: int
    ) -> HybridKVCacheCoordinator:
        groups = get_kv_cache_groups(cache.layer_sliding_windows)  # the runner's, by the same rule
        return cls(num_blocks, cache.block_size, cache.enable_prefix_caching, groups)

    @classmethod
    def max_num_tokens(cls, cache: CacheConfig, num_blocks: int, token_budget: int) -> int:
        """The longest sequence `num_blocks` hold on their own: a global group holds all of it,
        a windowed group at most the window behind a step's chunk (vLLM's
        `SlidingWindowSpec.max_memory_usage_bytes`). Binary search: blocks grow with length."""
        groups, bs = get_kv_cache_groups(cache.layer_sliding_windows), cache.block_size

        def blocks_for(num_tokens: int) -> int:
            whole = -(-num_tokens // bs)
            return sum(
                whole if g.sliding_window is None
                else min(whole, -(-(g.sliding_window - 1 + token_budget) // bs) + 1)
                for g in groups
            )  # fmt: skip

        lo, hi = 0, num_blocks * bs
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if blocks_for(mid) <= num_blocks else (lo, mid - 1)
        return lo

    # ------------------------------------------------------------------ queries (no side effects)
    def num_blocks_without_sharing(self) -> int:
        return sum(m.num_blocks_without_sharing() for m in self.managers)

    def has_seq(self, seq_id: SeqId) -> bool:
        return self.managers[0].has_seq(seq_id)

    def get_block_table(self, seq_id: SeqId) -> list[int]:
        """The first (global) group's live table."""
        return self.managers[0].get_block_table(seq_id)

    def get_group_block_tables(self, seq_id: SeqId) -> tuple[list[int], ...]:
        return tuple(list(m.get_block_table(seq_id)) for m in self.managers[1:])

    def get_num_slots(self, seq_id: SeqId) -> int:
        return self.managers[0].get_num_slots(seq_id)

    def num_held_blocks(self) -> list[int]:
        """[num_groups] blocks each group's tables hold now (shared blocks once; benches, tests)."""
        return [
            len({b for s in m._seqs for b in m.get_block_table(s)[self._skipped(m, s) :]})
            for m in self.managers
        ]

    def get_computed_blocks(
        self, token_ids: TokenIds[int], extra_keys: ExtraKeys = None
    ) -> ComputedBlocks:
        """The longest hit every group holds: each group answers with its longest hit under a
        bound, and the bound falls to the shortest answer until every group gives the same."""
        if not self.enable_prefix_caching:
            return NO_COMPUTED_BLOCKS
        lookups: list[Callable[[int], ComputedBlocks]] = []
        for group, m in enumerate(self.managers):
            extra = group_extra_keys(group, extra_keys)
            if isinstance(m, SlidingWindowKVCacheManager):  # one hash walk, then searches
                lookups.append(partial(m.longest_window_hit, *m.lookup_blocks(token_ids, extra)))
            else:  # every block from the start: a shorter hit is a cut of it
                lookups.append(partial(_first_blocks, m.get_computed_blocks(token_ids, extra)))
        bound = (len(token_ids) - 1) // self.block_size
        while True:
            hits = [lookup(bound) for lookup in lookups]
            shortest = min(hit.num_computed_tokens for hit in hits) // self.block_size
            if shortest == bound:
                break
            bound = shortest
        if bound == 0:
            return NO_COMPUTED_BLOCKS
        return HybridComputedBlocks(num_computed_tokens=bound * self.block_size, groups=tuple(hits))

    def get_num_blocks_to_allocate(self, computed: ComputedBlocks, num_new_tokens: int) -> int:
        return sum(
            m.get_num_blocks_to_allocate(hit, num_new_tokens)
            for m, hit in zip(self.managers, self._per_group(computed))
        )

    def get_num_blocks_to_append(self, seq_id: SeqId, num_new_tokens: int) -> int:
        return sum(m.get_num_blocks_to_append(seq_id, num_new_tokens) for m in self.managers)

    # ----------------------------------------------------------------------------------- mutations
    def allocate_slots(
        self,
        seq: KVCacheRequest,
        num_new_tokens: int,
        computed: ComputedBlocks = NO_COMPUTED_BLOCKS,
        extra_keys: ExtraKeys = None,
        count_as_query: bool = True,
    ) -> int:
        """Admit `seq` in every group, its hit in each (`computed` from `get_computed_blocks`).
        Raises, changing nothing, if the groups' blocks together are not free."""
        seq_id, num_cached = seq.seq_id, computed.num_computed_tokens
        self._check_allocate_args(seq, num_new_tokens, num_cached)
        hits = self._per_group(computed)
        self._check_free(seq_id, self.get_num_blocks_to_allocate(computed, num_new_tokens))
        # Pin every group's hits before any group takes fresh blocks: those come from the front of
        # the free queue, where another group's hit may wait (free, still named) to be evicted.
        pinned = [block for hit in hits for block in hit.blocks]
        self.block_pool.touch(pinned)
        for group, (m, hit) in enumerate(zip(self.managers, hits)):
            extra = group_extra_keys(group, extra_keys)
            m.allocate_slots(seq, num_new_tokens, hit, extra, count_as_query=False)
        self.block_pool.free_blocks(pinned)  # every group holds its own now
        if count_as_query:  # the hit counts once, not once per group
            self._prefix_cache_queries += len(seq.token_ids)
            self._prefix_cache_hits += num_cached
        self._record_utilization()
        return num_cached

    def append_slots(
        self,
        seq_id: SeqId,
        token_ids: TokenIds[int],
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
    ) -> None:
        """Slots in every group; the windowed groups free what left their window first, so the
        blocks they give back count for the groups that take."""
        num_slots = self._check_append_args(seq_id, token_ids, num_new_tokens)
        total = num_new_tokens + max(0, num_lookahead_tokens)
        self._check_free(seq_id, self.get_num_blocks_to_append(seq_id, total))
        if total > 0:
            for m in self.managers:
                if isinstance(m, SlidingWindowKVCacheManager):  # the next query is at num_slots
                    m.remove_skipped_blocks(seq_id, num_slots)
        for m in self.managers:
            m.append_slots(seq_id, token_ids, num_new_tokens, num_lookahead_tokens)
        self._record_utilization()

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        for m in self.managers:  # the first raises, before any change, for a bad id
            m.fork(parent_id, child_id)

    def free(self, seq_id: SeqId) -> None:
        for m in self.managers:  # the first raises UnknownSequenceError, before any change
            m.free(seq_id)
        self._record_utilization()

    def trim_slots(self, seq_id: SeqId, num_slots: int) -> None:
        for m in self.managers:
            m.trim_slots(seq_id, num_slots)

    def commit_step(self) -> None:
        for m in self.managers:
            m.commit_step()

    def rollback_step(self) -> None:
        for m in self.managers:
            m.rollback_step()

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Every group's copy-on-write pairs: the runner copies a block in every layer slot."""
        return [copy for m in self.managers for copy in m.take_pending_copies()]

    def snapshot(self) -> HybridBlockPoolSnapshot:
        first, *others = (m.snapshot() for m in self.managers)
        return HybridBlockPoolSnapshot(
            first.block_size,
            first.num_blocks,
            first.num_free_blocks,
            first._read_tables,
            lambda: {b: n for g in (first, *others) for b, n in g.ref_counts.items()},
            first._read_cached,
            self.get_stats,
            first._read_skipped,
            other_groups=tuple(others),
        )

    # ------------------------------------------------------------------------------------ helpers
    def _per_group(self, computed: ComputedBlocks) -> tuple[ComputedBlocks, ...]:
        if isinstance(computed, HybridComputedBlocks):
            return computed.groups
        if computed.num_computed_tokens:
            raise ValueError("a hit for a hybrid KV cache comes from its own get_computed_blocks")
        return (NO_COMPUTED_BLOCKS,) * len(self.managers)

    @staticmethod
    def _skipped(m: KVCacheManager, seq_id: SeqId) -> int:
        return m.num_skipped_blocks(seq_id) if isinstance(m, SlidingWindowKVCacheManager) else 0


def _first_blocks(hit: ComputedBlocks, num_blocks: int) -> ComputedBlocks:
    """A global group's hit cut to `num_blocks`: any start of a prefix is a prefix too."""
    if len(hit.blocks) <= num_blocks:
        return hit
    block_size = hit.num_computed_tokens // len(hit.blocks)
    return ComputedBlocks(hit.blocks[:num_blocks], num_blocks * block_size)
