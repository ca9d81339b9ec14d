"""The block manager: a pool of KV-cache blocks, block tables, copy-on-write and the prefix cache.

Pure bookkeeping, no tensors: it decides which physical block holds which token of which sequence;
the model runner owns the cache tensors and turns block tables into slot mappings.

- Paged memory (PagedAttention paper §4.2–4.3): a sequence of `t` tokens holds `ceil(t / block_size)`
  blocks, allocated on demand, listed in logical order in its *block table*.
- Sharing and copy-on-write (§4.4, parallel sampling): `fork` makes a child share every block of its
  parent (reference counts go up); the first write into a shared, partly filled block moves the
  writer to a fresh block and records a (src, dst) copy for the model runner.
- Automatic prefix caching, as vLLM v1 does it (`vllm/v1/core/kv_cache_manager.py`, `block_pool.py`,
  `kv_cache_utils.py`): every FULL block is named by a hash of (its parent's hash, its token ids,
  extra keys). A new prompt reuses the longest run of cached blocks from its start. Freed blocks keep
  their hash and stay reusable until the allocator needs them, least recently freed first.
- Everything is O(blocks touched): free blocks live in a doubly-linked queue (vLLM v1's
  `FreeKVCacheBlockQueue`), so a cache hit on a free block unlinks it in O(1), allocation pops the
  front, freeing appends to the back; the filled-slot count is kept incrementally.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field

SeqId = Hashable  # request / sequence ids (str or int)
ExtraKeys = tuple[Hashable, ...] | None  # what else shapes a block's KV (LoRA id, cache salt)


class NoFreeBlocksError(RuntimeError):
    """An allocation could not be satisfied. The manager's state is left exactly as it was."""


class UnknownSequenceError(KeyError):
    """The sequence holds no blocks: it was never allocated, or it was already freed."""

    def __str__(self) -> str:  # KeyError's str() would quote the message
        return str(self.args[0])


# ---------------------------------------------------------------------------------------- hashing


def hash_block_tokens(
    parent_hash: int | None, token_ids: tuple[int, ...], extra_keys: ExtraKeys
) -> int:
    """Python's `hash` of a tuple: fast, and stable within a process, which is all a cache that
    lives in one process needs (vLLM offers sha256 for caches shared across processes). It is only
    the dict's bucket: `BlockHash.__eq__` compares the tokens, so a collision can never serve
    another prefix's KV."""
    return hash((parent_hash, token_ids, extra_keys))


@dataclass(slots=True, eq=False)
class BlockHash:
    """The name of a full block's content: its token ids, after exactly the prefix named by `parent`.

    Equality is exact, not hash-based: two names are equal only if the whole chains of token ids
    (and extra keys) are equal. The walk stops at the first shared object, which for lookups that
    follow the cache's own chain is the parent itself, so comparing is O(1) in practice.
    """

    hash_value: int  # hash_block_tokens(parent.hash_value, token_ids, extra_keys)
    token_ids: tuple[int, ...]  # (block_size,) the block's tokens
    extra_keys: ExtraKeys  # None today; reserved for what else shapes KV
    parent: BlockHash | None  # the previous block's name; None for a sequence's first block

    @staticmethod
    def of(
        parent: BlockHash | None, token_ids: tuple[int, ...], extra: ExtraKeys = None
    ) -> BlockHash:
        value = hash_block_tokens(None if parent is None else parent.hash_value, token_ids, extra)
        return BlockHash(value, token_ids, extra, parent)

    def __hash__(self) -> int:
        return self.hash_value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockHash):
            return NotImplemented
        a: BlockHash | None = self
        b: BlockHash | None = other
        while a is not b:  # iterative: chains can be thousands of blocks deep
            if a is None or b is None:
                return False
            if (a.hash_value, a.token_ids, a.extra_keys) != (
                b.hash_value,
                b.token_ids,
                b.extra_keys,
            ):
                return False
            a, b = a.parent, b.parent
        return True

    def all_token_ids(self) -> tuple[int, ...]:
        """The whole prefix this name stands for (tests and debugging; O(depth))."""
        chunks: list[tuple[int, ...]] = []
        node: BlockHash | None = self
        while node is not None:
            chunks.append(node.token_ids)
            node = node.parent
        return tuple(t for chunk in reversed(chunks) for t in chunk)


# ------------------------------------------------------------------------------ blocks and queue


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical block: `block_size` KV slots in every layer's cache tensors."""

    block_id: int  # index into the cache tensors' first dimension
    ref_cnt: int = 0  # how many block tables hold this block
    num_filled: int = 0  # how many of its slots hold tokens (utilization statistics)
    block_hash: BlockHash | None = None  # set while the block is registered in the prefix cache
    # Links of the free queue; None while the block is held. repr=False: a repr would walk the list.
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeKVCacheBlockQueue:
    """Doubly-linked queue of blocks with ref count 0, front = evicted first (vLLM v1's idea).

    A `collections.deque` cannot remove from its middle in O(1), and a cache hit on a free block
    must take that block out of the queue wherever it is. Sentinel nodes at both ends keep the
    link updates free of special cases.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free, block.prev_free = block, prev
            prev = block
        prev.next_free, self._tail.prev_free = self._tail, prev

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise NoFreeBlocksError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not free"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None and block.prev_free is None, f"block {block.block_id} is free"
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Front to back, O(free blocks): for tests and debugging, never the hot path."""
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free


# ----------------------------------------------------------------------------------- statistics


@dataclass
class BlockManagerStats:
    num_total_blocks: int
    num_free_blocks: int  # blocks no sequence holds, including evictable cached blocks
    num_used_blocks: int  # blocks with ref count > 0 (used + free == total)
    num_cached_blocks: int  # blocks that carry a prefix-cache hash (held or evictable)
    num_evictable_blocks: int  # cached blocks that no sequence holds
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache (at admission)
    prefix_cache_hits: int  # of those, tokens served from the cache
    kv_slot_utilization: float  # filled slots / (used blocks * block_size) now; 1.0 when none used
    min_kv_slot_utilization: float  # lowest seen after any operation while blocks were used
    peak_kv_slot_utilization: float  # the utilization when used blocks were at their peak (latest)


@dataclass(slots=True)
class SeqBlocks:
    """What the manager knows of one sequence (vLLM v1: req_to_blocks + req_to_block_hashes)."""

    block_table: list[int]  # (ceil(num_slots / block_size),) physical block ids, logical order
    num_slots: int  # tokens that have a slot
    block_hashes: list[BlockHash]  # names of its full blocks, in order (canonical when cached)
    extra_keys: ExtraKeys  # folded into every block hash of this sequence


# ---------------------------------------------------------------------------------- the manager


class BlockManager:
    """Block pool + per-sequence block tables + prefix cache. Methods named as vLLM's where it has one."""

    def __init__(
        self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True
    ) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # One physical block per name: the first block registered under a name keeps it.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self._seqs: dict[SeqId, SeqBlocks] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self._num_evictable = 0  # cached blocks with ref count 0
        self._num_filled_slots = 0  # sum of num_filled over used blocks, each block once
        self._prefix_cache_queries = 0
        self._prefix_cache_hits = 0
        self._min_util = 1.0
        self._peak_used = 0
        self._peak_util = 1.0

    # ------------------------------------------------------------------ queries (no side effects)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (vLLM's kv_cache_usage metric)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def has_seq(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def get_block_table(self, seq_id: SeqId) -> list[int]:
        """The LIVE block table (no copy, so reading it each step costs nothing): it grows in place
        and copy-on-write replaces its last entry. Do not mutate it; copy it to keep a snapshot."""
        return self._seq(seq_id).block_table

    def get_num_slots(self, seq_id: SeqId) -> int:
        return self._seq(seq_id).num_slots

    def get_num_cached_tokens(self, token_ids: Sequence[int], extra_keys: ExtraKeys = None) -> int:
        """Tokens at the start of `token_ids` whose KV a new sequence could take from the cache."""
        return len(self._find_cached_blocks(token_ids, extra_keys)) * self.block_size

    def can_allocate(
        self,
        token_ids: Sequence[int],
        num_new_tokens: int,
        extra_keys: ExtraKeys = None,
    ) -> bool:
        hit_blocks = self._find_cached_blocks(token_ids, extra_keys)
        return self._num_blocks_to_take(hit_blocks, num_new_tokens) <= self.num_free_blocks

    def can_append_slots(self, seq_id: SeqId, num_new_tokens: int) -> bool:
        seq = self._seq(seq_id)
        return self._num_blocks_to_append(seq, num_new_tokens) <= self.num_free_blocks

    # ----------------------------------------------------------------------------------- mutations

    def allocate(
        self,
        seq_id: SeqId,
        token_ids: Sequence[int],
        num_new_tokens: int,
        extra_keys: ExtraKeys = None,
    ) -> int:
        """Admit a sequence: take its prefix-cache hit, then fresh blocks for `num_new_tokens` more
        tokens. `token_ids` is everything known (prompt + generated tokens, after a preemption).
        Returns the hit in tokens; the model computes tokens from there on."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already holds blocks; free it before allocating")
        hit_blocks = self._find_cached_blocks(token_ids, extra_keys)
        num_cached_tokens = len(hit_blocks) * self.block_size
        if not 0 <= num_new_tokens <= len(token_ids) - num_cached_tokens:
            raise ValueError(
                f"num_new_tokens must be in [0, {len(token_ids) - num_cached_tokens}] "
                f"(tokens after the {num_cached_tokens} cached ones), got {num_new_tokens}"
            )
        self._check_free(seq_id, self._num_blocks_to_take(hit_blocks, num_new_tokens))
        for block in hit_blocks:  # touch hits first, so the pops below cannot evict them
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                self._num_evictable -= 1
                self._num_filled_slots += block.num_filled
            block.ref_cnt += 1
        seq = SeqBlocks(
            block_table=[b.block_id for b in hit_blocks],
            num_slots=num_cached_tokens,
            block_hashes=[b.block_hash for b in hit_blocks if b.block_hash is not None],
            extra_keys=extra_keys,
        )
        self._seqs[seq_id] = seq
        self._grow(seq, token_ids, num_new_tokens)
        self._prefix_cache_queries += len(token_ids)
        self._prefix_cache_hits += num_cached_tokens
        self._record_utilization()
        return num_cached_tokens

    def append_slots(self, seq_id: SeqId, token_ids: Sequence[int], num_new_tokens: int) -> None:
        """Slots for `num_new_tokens` more tokens of a held sequence (a decode step, or the next
        prompt chunk). `token_ids` is every known token, at least num_slots + num_new_tokens."""
        seq = self._seq(seq_id)
        if num_new_tokens < 0 or len(token_ids) < seq.num_slots + num_new_tokens:
            raise ValueError(
                f"num_new_tokens must be in [0, {len(token_ids) - seq.num_slots}] "
                f"(known tokens without a slot), got {num_new_tokens}"
            )
        self._check_free(seq_id, self._num_blocks_to_append(seq, num_new_tokens))
        if num_new_tokens == 0:
            return
        last = self.blocks[seq.block_table[-1]] if seq.block_table else None
        if last is not None and last.ref_cnt > 1 and seq.num_slots % self.block_size:
            # Copy-on-write (§4.4): the next slot lies in a partly filled block that a forked
            # sibling also reads. Writing there would corrupt the sibling's KV, so this sequence
            # moves to a private copy; the model runner copies the KV before the step runs.
            dst = self._pop_free_block()
            dst.num_filled = last.num_filled
            self._num_filled_slots += dst.num_filled
            last.ref_cnt -= 1  # still >= 1: the sibling keeps it
            seq.block_table[-1] = dst.block_id
            self._pending_copies.append((last.block_id, dst.block_id))
        self._grow(seq, token_ids, num_new_tokens)
        self._record_utilization()

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """The child shares all the parent's blocks (§4.4); writes diverge through copy-on-write."""
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already holds blocks; cannot fork into it")
        for block_id in parent.block_table:
            self.blocks[block_id].ref_cnt += 1
        self._seqs[child_id] = SeqBlocks(
            list(parent.block_table), parent.num_slots, list(parent.block_hashes), parent.extra_keys
        )

    def free(self, seq_id: SeqId) -> None:
        """Release a finished, aborted or preempted sequence's blocks. Tail first: the queue evicts
        from its front, so the ends of a prefix are evicted before its beginning, which other
        prompts are likelier to share (and a block is useless once its parent is evicted)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise UnknownSequenceError(
                f"sequence {seq_id!r} holds no blocks (never allocated, or already freed)"
            )
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:  # a bookkeeping bug: fail loudly rather than double-free
                raise RuntimeError(f"block {block_id} freed by {seq_id!r} but not held")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._num_filled_slots -= block.num_filled
                if block.block_hash is not None:
                    self._num_evictable += 1
                self.free_block_queue.append(block)
        self._record_utilization()

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) block pairs since the last call, for the model runner."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (e.g. after new weights). Refused (False, nothing changed) while
        a cached block is held: its hash could be served again the moment it is freed, and a half
        reset would defeat the guarantee a reset gives."""
        if len(self.cached_block_hash_to_block) != self._num_evictable:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
            block.num_filled = 0
        self.cached_block_hash_to_block.clear()
        self._num_evictable = 0
        return True

    def get_stats(self) -> BlockManagerStats:
        used = self.num_blocks - self.num_free_blocks
        return BlockManagerStats(
            num_total_blocks=self.num_blocks,
            num_free_blocks=self.num_free_blocks,
            num_used_blocks=used,
            num_cached_blocks=len(self.cached_block_hash_to_block),
            num_evictable_blocks=self._num_evictable,
            prefix_cache_queries=self._prefix_cache_queries,
            prefix_cache_hits=self._prefix_cache_hits,
            kv_slot_utilization=self._utilization(),
            min_kv_slot_utilization=self._min_util,
            peak_kv_slot_utilization=self._peak_util,
        )

    # ------------------------------------------------------------------------------------ helpers

    def _seq(self, seq_id: SeqId) -> SeqBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(f"sequence {seq_id!r} holds no blocks")
        return seq

    def _find_cached_blocks(
        self, token_ids: Sequence[int], extra_keys: ExtraKeys
    ) -> list[KVCacheBlock]:
        """The longest run of cached full blocks matching the start of `token_ids`.

        Capped at (len - 1) // block_size blocks: the last token is always computed, because the
        model needs its logits to sample the next token and a cache holds KV, not logits (nano-vllm
        users hit this when a whole prompt was cached and nothing was left to run).
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[KVCacheBlock] = []
        parent: BlockHash | None = None
        for i in range((len(token_ids) - 1) // bs):
            key = BlockHash.of(parent, tuple(token_ids[i * bs : (i + 1) * bs]), extra_keys)
            block = self.cached_block_hash_to_block.get(key)
            if block is None:
                break
            hits.append(block)
            parent = block.block_hash  # the canonical name: later comparisons stop at `is`
        return hits

    def _check_free(self, seq_id: SeqId, num_to_take: int) -> None:
        if num_to_take > self.num_free_blocks:
            msg = f"sequence {seq_id!r} needs {num_to_take} blocks, {self.num_free_blocks} are free"
            raise NoFreeBlocksError(msg)

    def _num_blocks_to_take(self, hit_blocks: list[KVCacheBlock], num_new_tokens: int) -> int:
        """Free-queue blocks an admission consumes: fresh blocks + hits that are now evictable."""
        num_tokens = len(hit_blocks) * self.block_size + num_new_tokens
        fresh = -(-num_tokens // self.block_size) - len(hit_blocks)
        return fresh + sum(1 for b in hit_blocks if b.ref_cnt == 0)

    def _num_blocks_to_append(self, seq: SeqBlocks, num_new_tokens: int) -> int:
        if num_new_tokens <= 0:
            return 0
        fresh = -(-(seq.num_slots + num_new_tokens) // self.block_size) - len(seq.block_table)
        partial = seq.num_slots % self.block_size != 0
        cow = partial and self.blocks[seq.block_table[-1]].ref_cnt > 1
        return fresh + int(cow)

    def _pop_free_block(self) -> KVCacheBlock:
        """The least recently freed block; if it still names cached content, evict that name now,
        since its slots are about to hold other tokens (a stale hash would serve wrong KV)."""
        block = self.free_block_queue.popleft()
        if block.block_hash is not None:
            del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None
            self._num_evictable -= 1
        block.ref_cnt = 1
        block.num_filled = 0
        return block

    def _grow(self, seq: SeqBlocks, token_ids: Sequence[int], num_new_tokens: int) -> None:
        """Give `seq` slots for `num_new_tokens` more tokens (blocks already checked to be free),
        then register every block that just became full."""
        bs = self.block_size
        remaining = num_new_tokens
        if seq.num_slots % bs and remaining:  # finish the partly filled last block first
            last = self.blocks[seq.block_table[-1]]
            n = min(bs - last.num_filled, remaining)
            last.num_filled += n
            self._num_filled_slots += n
            remaining -= n
        while remaining > 0:
            block = self._pop_free_block()
            block.num_filled = min(bs, remaining)
            self._num_filled_slots += block.num_filled
            seq.block_table.append(block.block_id)
            remaining -= block.num_filled
        seq.num_slots += num_new_tokens
        if self.enable_prefix_caching:
            for i in range(len(seq.block_hashes), seq.num_slots // bs):
                self._cache_full_block(seq, i, tuple(token_ids[i * bs : (i + 1) * bs]))

    def _cache_full_block(
        self, seq: SeqBlocks, index: int, block_token_ids: tuple[int, ...]
    ) -> None:
        """Name block `index` of `seq` now that it is full. Registering at allocation time is safe
        because the engine writes the KV of every slot it allocates in the same step, and each
        layer writes all new K/V before any attention of that layer reads: a second request that
        hits this block in the same step reads KV written before its attention runs."""
        parent = seq.block_hashes[index - 1] if index else None
        key = BlockHash.of(parent, block_token_ids, seq.extra_keys)
        cached = self.cached_block_hash_to_block.get(key)
        if cached is not None:  # same content already cached in another block: keep that one
            seq.block_hashes.append(cached.block_hash or key)
            return
        block = self.blocks[seq.block_table[index]]
        block.block_hash = key
        self.cached_block_hash_to_block[key] = block
        seq.block_hashes.append(key)

    def _utilization(self) -> float:
        used = self.num_blocks - self.num_free_blocks
        return self._num_filled_slots / (used * self.block_size) if used else 1.0

    def _record_utilization(self) -> None:
        used = self.num_blocks - self.num_free_blocks
        if used == 0:
            return
        util = self._utilization()
        self._min_util = min(self._min_util, util)
        if (
            used >= self._peak_used
        ):  # the latest moment at the peak: its blocks as filled as they got
            self._peak_used, self._peak_util = used, util
