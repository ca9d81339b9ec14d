"""The block pool: owns every physical KV block and hands them out — get, touch, free, evict, cache.

vLLM v1's `BlockPool` (`vllm/v1/core/block_pool.py`): the one place where a block changes hands, so
the counts that depend on who holds what (free blocks, evictable cached blocks, filled slots) are
kept here, next to the changes. Which sequence holds which block is the KV cache manager's
(`kv_cache_manager.py`).

- A block is *held* while its reference count is above 0 (several block tables may share it,
  paper §4.4) and *free* otherwise; free blocks wait in the free queue, least recently freed first.
- Automatic prefix caching: a full block can carry a `BlockHash` (its content's name); the pool
  maps each name to the one block that holds it. A free block keeps its name, so a later prompt
  with the same prefix can take it back (`touch`) until the pool needs its slots (`get_new_blocks`
  evicts the name then: a stale name would serve another prefix's KV).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from minivllm.core.kv_cache_utils import (
    BlockHash,
    ExtraKeys,
    FreeKVCacheBlockQueue,
    HashFn,
    KVCacheBlock,
    NoFreeBlocksError,
    hash_block_tokens,
)


class BlockPool:
    """Blocks, their free queue and the prefix-cache map. Method names are vLLM v1's."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        hash_fn: HashFn = hash_block_tokens,  # vLLM lets users choose it too (builtin or sha256)
    ) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.hash_fn = hash_fn
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # One physical block per name: the first block registered under a name keeps it.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictable_blocks = 0  # cached blocks with ref count 0
        self.num_filled_slots = 0  # sum of num_filled over held blocks, each block once

    # ------------------------------------------------------------------ queries (no side effects)

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def get_usage(self) -> float:
        """Fraction of blocks held by sequences (vLLM's kv_cache_usage metric)."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def find_longest_cache_hit(
        self, token_ids: Sequence[int], max_num_blocks: int, extra_keys: ExtraKeys, block_size: int
    ) -> list[KVCacheBlock]:
        """The longest run of cached full blocks matching the start of `token_ids`, at most
        `max_num_blocks`: one walk of the hash chain, stopping at the first miss."""
        if not self.enable_caching:
            return []
        hits: list[KVCacheBlock] = []
        parent: BlockHash | None = None
        for i in range(max_num_blocks):
            tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
            block = self.get_cached_block(BlockHash.of(parent, tokens, extra_keys, self.hash_fn))
            if block is None:
                break
            hits.append(block)
            parent = block.block_hash  # the canonical name: later comparisons stop at `is`
        return hits

    # ----------------------------------------------------------------------------------- mutations

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """`num_blocks` blocks from the front of the free queue, each held once and empty. A block
        that still names cached content loses the name now: its slots are about to hold other
        tokens. Raises `NoFreeBlocksError`, taking nothing, if too few are free."""
        if num_blocks > self.get_num_free_blocks():
            raise NoFreeBlocksError(
                f"{num_blocks} blocks needed, {self.get_num_free_blocks()} are free"
            )
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
            block.num_filled = 0
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """One more holder for each block (a prefix-cache hit, a fork, a reservation); a free one
        leaves the free queue, in O(1), wherever it sits in it."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                self.num_filled_slots += block.num_filled
                if block.block_hash is not None:
                    self.num_evictable_blocks -= 1
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """One holder fewer for each block; a block nobody holds joins the back of the free queue,
        in the order given (the caller puts first what should be evicted first)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:  # a bookkeeping bug: fail loudly rather than double-free
                raise RuntimeError(f"block {block.block_id} freed but not held")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.num_filled_slots -= block.num_filled
                if block.block_hash is not None:
                    self.num_evictable_blocks += 1
                self.free_block_queue.append(block)

    def fill(self, block: KVCacheBlock, num_filled: int) -> None:
        """`num_filled` of a held block's slots now hold tokens."""
        self.num_filled_slots += num_filled - block.num_filled
        block.num_filled = num_filled

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> BlockHash | None:
        """Register a full, held block under `block_hash`. If another block already holds that
        content, nothing changes and the name it is known by is returned (the canonical name);
        None means `block` took the name."""
        cached = self.cached_block_hash_to_block.get(block_hash)
        if cached is not None:
            return cached.block_hash or block_hash
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        return None

    def evict(self, block: KVCacheBlock) -> None:
        """Withdraw `block`'s name, if it still holds one (a failed step's provisional names)."""
        key = block.block_hash
        if key is not None and self.cached_block_hash_to_block.get(key) is block:
            self._maybe_evict_cached_block(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (e.g. after new weights). Refused (False, nothing changed) while
        a cached block is held: its hash could be served again the moment it is freed, and a half
        reset would defeat the guarantee a reset gives."""
        if len(self.cached_block_hash_to_block) != self.num_evictable_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
            block.num_filled = 0
        self.cached_block_hash_to_block.clear()
        self.num_evictable_blocks = 0
        return True

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        if block.ref_cnt == 0:
            self.num_evictable_blocks -= 1
