"""The types of the KV cache's bookkeeping: blocks, the free queue that orders their eviction, the
content hashes that name full blocks for prefix caching, and the read-only views listeners get.

vLLM v1 keeps the same set in `vllm/v1/core/kv_cache_utils.py`; `block_pool.py` holds the operations
on them, `kv_cache_manager.py` the per-sequence block tables.

- Physical blocks (PagedAttention paper §4.1): the KV cache is cut into fixed-size blocks of
  `block_size` token slots; `KVCacheBlock` is one of them, with the reference count that lets
  several block tables share it (§4.4) and the hash it carries while it is in the prefix cache.
- The free queue, as vLLM v1 does it (`FreeKVCacheBlockQueue`): a doubly-linked list of blocks no
  sequence holds, front = least recently freed = evicted first. A `collections.deque` could not
  take a block out of its middle, which a prefix-cache hit on a free block needs; the links make
  that removal O(1).
- Block hashing for automatic prefix caching (vLLM v1's `hash_block_tokens` / `BlockHash`): a FULL
  block is named by a hash of (its parent's hash, its token ids, extra keys), so a name stands for
  the whole prefix up to and including the block, and equal prefixes get equal names.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping
from collections.abc import Sequence as TokenIds
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Protocol

ExtraKeys = tuple[Hashable, ...] | None  # what else shapes a block's KV (LoRA id, cache salt)
HashFn = Callable[[int | None, tuple[int, ...], ExtraKeys], int]  # (parent hash, tokens, extra)
SeqId = Hashable  # request / sequence ids (str or int)
NULL_BLOCK_ID = 0  # a window-freed entry: a real id (valid tensors) no backend reads there


class UnknownSequenceError(KeyError):
    """The sequence holds no blocks: it was never allocated, or it was already freed."""

    def __str__(self) -> str:  # KeyError's str() would quote the message
        return str(self.args[0])


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """A prompt's prefix-cache hit (vLLM's `get_computed_blocks` result): the cached blocks that
    match its start, in order. Valid until the pool next changes: look up, decide, allocate."""

    blocks: tuple[KVCacheBlock, ...] = ()  # the blocks taken, after any skipped ones
    num_computed_tokens: int = 0  # (skipped + taken blocks) * block_size: the hit, in tokens
    # A window's hit starts with blocks no query of it sees: named (the next chain on), not taken.
    skipped_hashes: tuple[BlockHash, ...] = ()


NO_COMPUTED_BLOCKS = ComputedBlocks()  # no lookup (prefix caching off, or prompt logprobs wanted)


class NoFreeBlocksError(RuntimeError):
    """An allocation could not be satisfied. The manager's state is left exactly as it was."""


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
        parent: BlockHash | None,
        token_ids: tuple[int, ...],
        extra: ExtraKeys = None,
        hash_fn: HashFn = hash_block_tokens,
    ) -> BlockHash:
        """`hash_fn` is a parameter, as vLLM's hash function is (builtin `hash` or sha256)."""
        value = hash_fn(None if parent is None else parent.hash_value, token_ids, extra)
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


class KVCacheRequest(Protocol):
    """What the manager reads of a sequence it admits (`minivllm.core.sequence.Sequence` has more)."""

    @property
    def seq_id(self) -> SeqId: ...

    @property
    def token_ids(self) -> TokenIds[int]: ...  # every known token: prompt + generated


@dataclass(slots=True)
class SeqBlocks:
    """What the manager knows of one sequence (vLLM v1: req_to_blocks + req_to_block_hashes)."""

    block_table: list[int]  # (ceil(num_slots / block_size),) physical block ids, logical order
    num_slots: int  # tokens that have a slot
    block_hashes: list[BlockHash]  # names of its full blocks, in order (canonical when cached)
    extra_keys: ExtraKeys  # folded into every block hash of this sequence


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


@dataclass(frozen=True)
class BlockPoolSnapshot:
    """The pool as one step left it, read-only (`KVCacheManager.snapshot`): what a step listener
    (the trace, a metrics exporter) reads instead of the KV cache manager's own structures.
    Its mappings are copied when first read: listeners run right after the step's commit, and one
    that reads none (the engine's counters) costs the step nothing. Read them inside `on_step`."""

    block_size: int
    num_blocks: int
    num_free_blocks: int  # held by no sequence (evictable cached blocks count as free)
    _read_tables: Callable[[], dict[Hashable, tuple[int, ...]]] = field(repr=False)
    _read_ref_counts: Callable[[], dict[int, int]] = field(repr=False)
    _read_cached: Callable[[], dict[int, BlockHash]] = field(repr=False)
    _read_stats: Callable[[], KVCacheManagerStats] = field(repr=False)
    _read_skipped: Callable[[], dict[Hashable, int]] = field(repr=False, default=dict)

    @cached_property
    def block_tables(self) -> Mapping[Hashable, tuple[int, ...]]:
        """seq_id -> its blocks, in logical order (after `num_skipped_blocks` placeholders)."""
        return MappingProxyType(self._read_tables())

    @cached_property
    def num_skipped_blocks(self) -> Mapping[Hashable, int]:
        """seq_id -> its leading entries a sliding window freed (absent: none)."""
        return MappingProxyType(self._read_skipped())

    @cached_property
    def ref_counts(self) -> Mapping[int, int]:
        """block id -> its ref count (> 0), for every held block."""
        return MappingProxyType(self._read_ref_counts())

    @cached_property
    def cached_blocks(self) -> Mapping[int, BlockHash]:
        """block id -> its prefix-cache name, for every named block (held or free)."""
        return MappingProxyType(self._read_cached())

    @cached_property
    def stats(self) -> KVCacheManagerStats:
        """The manager's counters and slot accounting (the baselines' `ReservationStats` has more)."""
        return self._read_stats()


@dataclass
class KVCacheManagerStats:
    """The KV cache manager's own view: blocks, prefix-cache lookups and slot utilization."""

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
    peak_used_blocks: int = 0  # the most blocks held at once, after any operation
    # The paper's Fig. 2 split of the held slots: reserved = filled (token states) + internal
    # fragmentation (each last block's unfilled tail); minivllm/experiments/ adds reservations.
    num_reserved_slots: int = 0  # used blocks * block_size
    num_filled_slots: int = 0  # slots holding a token's K/V
    internal_fragmentation_slots: int = 0
