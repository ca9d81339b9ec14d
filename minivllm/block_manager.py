"""The block manager: per-sequence block tables, copy-on-write and the prefix cache, over the pool.

Pure bookkeeping, no tensors: it decides which physical block holds which token of which sequence;
the model runner owns the cache tensors and turns block tables into slot mappings. The blocks, their
free queue and their hashes are `block_pool.py`'s, as vLLM v1 splits `kv_cache_manager.py`.

- Paged memory (PagedAttention paper §4.2–4.3): a sequence of `t` tokens holds `ceil(t / block_size)`
  blocks, allocated on demand, listed in logical order in its *block table*.
- Sharing and copy-on-write (§4.4, parallel sampling): `fork` makes a child share every block of its
  parent (reference counts go up); the first write into a shared, partly filled block moves the
  writer to a fresh block and records a (src, dst) copy for the model runner.
- Automatic prefix caching, as vLLM v1 does it (`vllm/v1/core/kv_cache_manager.py`): every FULL
  block is registered under its `BlockHash` when its slots are allocated, so a request admitted in
  the same step can already hit it (each layer writes all new K/V before any attention reads).
  Names are provisional until the step commits (`commit_step`); a step that fails or is
  interrupted withdraws the names it gave (`rollback_step`), so no block whose K/V was never
  written is ever served to a later step. A new prompt reuses the longest run of cached blocks
  from its start. Freed blocks keep their hash and stay reusable until the allocator needs them.
- Everything is O(blocks touched): a cache hit on a free block leaves the free queue in O(1),
  allocation pops its front, freeing appends to its back; the filled-slot count is incremental.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from minivllm.block_pool import (
    BlockHash,
    BlockManagerStats,
    BlockPoolSnapshot,
    ExtraKeys,
    FreeKVCacheBlockQueue,
    HashFn,
    KVCacheBlock,
    NoFreeBlocksError,
    hash_block_tokens,
)

SeqId = Hashable  # request / sequence ids (str or int)


class UnknownSequenceError(KeyError):
    """The sequence holds no blocks: it was never allocated, or it was already freed."""

    def __str__(self) -> str:  # KeyError's str() would quote the message
        return str(self.args[0])


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
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn = hash_block_tokens,  # vLLM lets users choose it too (builtin or sha256)
    ) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # One physical block per name: the first block registered under a name keeps it.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self._seqs: dict[SeqId, SeqBlocks] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self._step_names: list[KVCacheBlock] = []  # named since the last commit (provisional)
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
        use_cache: bool = True,
        num_final_tokens: int | None = None,  # what a reservation policy reserves for; unused here
    ) -> bool:
        hit_blocks = self._find_cached_blocks(token_ids, extra_keys) if use_cache else []
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
        count_as_query: bool = True,
        use_cache: bool = True,
        num_final_tokens: int | None = None,  # see can_allocate
    ) -> int:
        """Admit a sequence: take its prefix-cache hit, then fresh blocks for `num_new_tokens` more
        tokens. `token_ids` is everything known (prompt + generated tokens, after a preemption).
        Returns the hit in tokens; the model computes tokens from there on. `count_as_query=False`
        keeps a re-admission after preemption out of the prompt lookup counters; `use_cache=False`
        computes every token (a request that wants its prompt's logprobs: cached blocks have none)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already holds blocks; free it before allocating")
        hit_blocks = self._find_cached_blocks(token_ids, extra_keys) if use_cache else []
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
        if count_as_query:
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

    def commit_step(self) -> None:
        """The step that wrote the K/V of the blocks named since the last commit has completed:
        their names are final."""
        self._step_names.clear()

    def rollback_step(self) -> None:
        """The step failed: withdraw every name it gave, so a block whose K/V it may not have
        written can never be a prefix-cache hit. Call before freeing the step's sequences."""
        for block in self._step_names:
            key = block.block_hash
            if key is not None and self.cached_block_hash_to_block.get(key) is block:
                del self.cached_block_hash_to_block[key]
                block.block_hash = None
                if block.ref_cnt == 0:
                    self._num_evictable -= 1
        self._step_names.clear()

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

    def snapshot(self) -> BlockPoolSnapshot:
        """A read-only copy of the pool now: block tables, ref counts, prefix-cache names."""
        seqs, blocks, cached = self._seqs, self.blocks, self.cached_block_hash_to_block
        return BlockPoolSnapshot(
            self.block_size,
            self.num_blocks,
            self.num_free_blocks,
            lambda: {s: tuple(seq.block_table) for s, seq in seqs.items()},
            lambda: {b: blocks[b].ref_cnt for seq in seqs.values() for b in seq.block_table},
            lambda: {block.block_id: key for key, block in cached.items()},
            self.get_stats,
        )

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
            peak_used_blocks=self._peak_used,
            num_reserved_slots=used * self.block_size,
            num_filled_slots=self._num_filled_slots,
            internal_fragmentation_slots=used * self.block_size - self._num_filled_slots,
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
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            key = BlockHash.of(parent, tokens, extra_keys, hash_fn=self.hash_fn)
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
        then name every block that just became full (provisionally, until the step commits)."""
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
        """Name block `index` of `seq`, full and written, unless its content has a name already."""
        parent = seq.block_hashes[index - 1] if index else None
        key = BlockHash.of(parent, block_token_ids, seq.extra_keys, hash_fn=self.hash_fn)
        cached = self.cached_block_hash_to_block.get(key)
        if cached is not None:  # same content already cached in another block: keep that one
            seq.block_hashes.append(cached.block_hash or key)
            return
        block = self.blocks[seq.block_table[index]]
        block.block_hash = key
        self.cached_block_hash_to_block[key] = block
        seq.block_hashes.append(key)
        self._step_names.append(block)

    def _utilization(self) -> float:
        used = self.num_blocks - self.num_free_blocks
        return self._num_filled_slots / (used * self.block_size) if used else 1.0

    def _record_utilization(self) -> None:
        used = self.num_blocks - self.num_free_blocks
        if used == 0:
            return
        util = self._utilization()
        self._min_util = min(self._min_util, util)
        # `>=`: keep the latest moment at the peak, when its blocks are as filled as they got.
        if used >= self._peak_used:
            self._peak_used, self._peak_util = used, util
