"""The paper's Orca baselines: KV cache reserved per request, contiguously, at admission.

The engine is handed its KV cache manager class; `kv_allocation` names one (minivllm/config/__init__.py keeps
the names as qualified class paths, as vLLM's platforms do), so these plug in without the core
knowing them.

The PagedAttention paper's headline (§6.2, Figs. 12-13) compares vLLM against Orca, whose KV cache
is reserved per request, contiguously, at admission: the request's whole possible length gets a
range of slots before it computes its first token. The paper's authors rebuilt Orca inside their
own system so that only memory management differed; `kv_allocation` does the same here. Every
policy runs under the same scheduler, the same kernels and the same token budget:

    paged        blocks on demand, anywhere (§4.2-4.3): `KVCacheManager`, minivllm's default
    orca-max     reserve max_model_len slots for every request
    orca-pow2    reserve the next power of two of the request's final length
    orca-oracle  reserve exactly the final length, prompt + max_tokens (the paper's oracle knows
                 the output length: its workloads ignore EOS and fix it)

A reservation is a contiguous run of physical blocks, found first-fit over a sorted list of free
ranges (the lowest-addressed range that is large enough), so external fragmentation is real: a
request waits when no single free range fits it, however many blocks are free in total. The run
is rounded up to whole blocks (at most block_size - 1 slots more than the policy asks for, against
reservations of hundreds of slots), and its blocks, in order, are the request's block table, so
the model runner and the kernels see an ordinary paged table and run unchanged.

A reservation never grows: a running request always has its next slot, so reservation policies
never preempt. They do not combine with what paging makes possible: prefix caching (a block
shared between requests is not inside one request's range), and `n > 1` / beam search (forked
sequences share blocks by copy-on-write); both are refused with a configuration error
(`supports_forks = False`, which the engine asks when a request is added).

What a reservation reserves for is the request's final length, prompt + max_tokens, which the
manager reads from the sequence it admits: the scheduler and the core manager know nothing of it.
Its stats add the reservation's part of the paper's Fig. 2 split (`ReservationStats`).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence as TokenIds
from dataclasses import dataclass
from typing import ClassVar

from minivllm.config import KV_ALLOCATIONS, CacheConfig
from minivllm.core.kv_cache_manager import (
    NO_COMPUTED_BLOCKS,
    ComputedBlocks,
    KVCacheManager,
    KVCacheRequest,
    SeqBlocks,
    SeqId,
)
from minivllm.core.kv_cache_utils import ExtraKeys, KVCacheManagerStats, NoFreeBlocksError
from minivllm.core.sequence import Sequence

__all__ = [
    "ReservationKVCacheManager",
    "ReservationStats",
    "num_final_tokens",
    "reservation_size",
]


def num_final_tokens(seq: KVCacheRequest) -> int | None:
    """The request's final length, prompt + max_tokens, read from the engine's `Sequence` (None:
    no bound known, so a reservation goes up to max_model_len)."""
    if not isinstance(seq, Sequence):
        return None
    max_tokens = seq.request.params.max_tokens
    return None if max_tokens is None else seq.num_prompt_tokens + max_tokens


def reservation_size(policy: str, num_final_tokens: int, max_model_len: int) -> int:
    """Slots a reservation policy asks for, for a request that ends at `num_final_tokens` tokens."""
    final = min(num_final_tokens, max_model_len)
    if policy == "orca-max":
        return max_model_len
    if policy == "orca-pow2":
        return min(1 << (final - 1).bit_length(), max_model_len)
    if policy == "orca-oracle":
        return final
    raise ValueError(f"kv_allocation must be one of {KV_ALLOCATIONS[1:]} here, got {policy!r}")


@dataclass
class ReservationStats(KVCacheManagerStats):
    """The core stats plus a reservation's part of the paper's Fig. 2 split: reserved = filled +
    future (reserved for tokens still to come) + internal fragmentation (never filled: past the
    request's end, or the unused tail of the run's last block)."""

    kv_allocation: str = "orca-max"
    num_future_slots: int = 0  # reserved for tokens the sequences will still write
    # Free slots outside the longest free contiguous run, as a fraction of the free slots: memory a
    # contiguous reservation cannot use.
    external_fragmentation: float = 0.0
    num_fragmentation_stalls: int = 0  # admissions refused with enough blocks free, none contiguous


@dataclass(slots=True)
class Reservation:
    start: int  # first physical block of the contiguous run
    num_blocks: int  # blocks in the run
    num_final_tokens: int  # the request's final length: slots beyond it are never filled


class ReservationKVCacheManager(KVCacheManager):
    """One contiguous run of blocks per sequence, reserved at admission (Orca-style baselines).

    The same interface as `KVCacheManager`, so the scheduler cannot tell the policies apart; the
    reserved blocks leave the pool's free queue at admission (reference count 1), so `usage`, the
    free count and slot utilization all see the reservation as memory in use, as it is."""

    supports_forks: ClassVar[bool] = False  # a reservation is private to one sequence

    def __init__(self, num_blocks: int, block_size: int, policy: str, max_model_len: int) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)
        reservation_size(policy, 1, max_model_len)  # a bad policy name fails here
        self.policy = policy  # the kv_allocation name: orca-max, orca-pow2 or orca-oracle
        self.max_model_len = max_model_len
        self._free_ranges: list[tuple[int, int]] = [(0, num_blocks)]  # (start, length), by start
        self._reservations: dict[SeqId, Reservation] = {}
        self._num_fragmentation_stalls = 0

    @classmethod
    def from_config(
        cls, cache: CacheConfig, num_blocks: int, max_model_len: int
    ) -> ReservationKVCacheManager:
        return cls(num_blocks, cache.block_size, cache.kv_allocation, max_model_len)

    # ------------------------------------------------------------------ queries
    def blocks_for(self, num_tokens: int, final_tokens: int | None) -> int:
        """Blocks a sequence with `num_tokens` known tokens, ending at `final_tokens`, reserves."""
        final = max(num_tokens, final_tokens or self.max_model_len)
        slots = max(reservation_size(self.policy, final, self.max_model_len), num_tokens)
        return -(-slots // self.block_size)

    def can_allocate(
        self,
        seq: KVCacheRequest,
        num_new_tokens: int,
        computed: ComputedBlocks = NO_COMPUTED_BLOCKS,
    ) -> bool:
        need = self.blocks_for(len(seq.token_ids), num_final_tokens(seq))
        if self._first_fit(need) is not None:
            return True
        if need <= self.num_free_blocks:  # enough blocks, none of the free ranges is long enough
            self._num_fragmentation_stalls += 1
        return False

    def can_append_slots(self, seq_id: SeqId, num_new_tokens: int) -> bool:
        seq = self._seq(seq_id)
        return (
            seq.num_slots + num_new_tokens
            <= self._reservations[seq_id].num_blocks * self.block_size
        )

    def get_reserved_blocks(self, seq_id: SeqId) -> range:
        """The physical blocks reserved for `seq_id`, its block table's superset."""
        r = self._reservations[seq_id]
        return range(r.start, r.start + r.num_blocks)

    def get_free_ranges(self) -> list[tuple[int, int]]:
        """(start block, length) of every free run of blocks, by address."""
        return list(self._free_ranges)

    # ------------------------------------------------------------------ mutations
    def allocate_slots(
        self,
        seq: KVCacheRequest,
        num_new_tokens: int,
        computed: ComputedBlocks = NO_COMPUTED_BLOCKS,  # always empty: no prefix cache here
        extra_keys: ExtraKeys = None,
        count_as_query: bool = True,
    ) -> int:
        seq_id, num_tokens = seq.seq_id, len(seq.token_ids)
        self._check_allocate_args(seq, num_new_tokens, 0)
        final_tokens = num_final_tokens(seq)
        need = self.blocks_for(num_tokens, final_tokens)
        index = self._first_fit(need)
        if index is None:
            raise NoFreeBlocksError(
                f"sequence {seq_id!r} needs {need} contiguous blocks; the longest free run has "
                f"{max((n for _, n in self._free_ranges), default=0)}"
            )
        start, length = self._free_ranges[index]
        if length == need:
            del self._free_ranges[index]
        else:
            self._free_ranges[index] = (start + need, length - need)
        pool = self.block_pool
        run = pool.blocks[start : start + need]
        pool.touch(run)
        for block in run:
            pool.fill(block, 0)
        final = min(final_tokens or self.max_model_len, self.max_model_len)
        self._reservations[seq_id] = Reservation(start, need, max(final, num_tokens))
        self._seqs[seq_id] = SeqBlocks(
            block_table=[], num_slots=0, block_hashes=[], extra_keys=None
        )
        self._fill(seq_id, num_new_tokens)
        if count_as_query:
            self._prefix_cache_queries += num_tokens
        self._record_utilization()
        return 0

    def append_slots(
        self,
        seq_id: SeqId,
        token_ids: TokenIds[int],
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
    ) -> None:
        if num_lookahead_tokens:  # the engine refuses speculative decoding on a reservation
            raise ValueError("a reservation has no lookahead slots (speculative decoding)")
        self._check_append_args(seq_id, token_ids, num_new_tokens)
        if not self.can_append_slots(seq_id, num_new_tokens):
            raise NoFreeBlocksError(
                f"sequence {seq_id!r} would outgrow its reservation of "
                f"{self._reservations[seq_id].num_blocks} blocks"
            )
        self._fill(seq_id, num_new_tokens)
        self._record_utilization()

    def check_forks_allowed(self) -> None:
        raise ValueError(
            f"n > 1 and beam search need kv_allocation='paged' (forked sequences share "
            f"blocks), got kv_allocation={self.policy!r}"
        )

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        raise NotImplementedError(
            f"kv_allocation={self.policy!r} cannot fork a sequence (n > 1, beam search): a "
            "reservation is private to one sequence; use kv_allocation='paged'"
        )

    def free(self, seq_id: SeqId) -> None:
        super().free(seq_id)  # the blocks of its table (raises if it holds none)
        r = self._reservations.pop(seq_id)
        run = self.block_pool.blocks[r.start : r.start + r.num_blocks]
        # Reserved, never written: the table walk did not free them.
        self.block_pool.free_blocks(block for block in run if block.ref_cnt == 1)
        self._release_range(r.start, r.num_blocks)
        self._record_utilization()

    def get_stats(self) -> ReservationStats:
        stats = super().get_stats()
        bs = self.block_size
        future = 0
        for seq_id, r in self._reservations.items():
            future += min(r.num_final_tokens, r.num_blocks * bs) - self._seqs[seq_id].num_slots
        largest = max((n for _, n in self._free_ranges), default=0)
        free = self.num_free_blocks
        core = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
        core["internal_fragmentation_slots"] = (
            stats.num_reserved_slots - stats.num_filled_slots - future
        )
        return ReservationStats(
            **core,
            kv_allocation=self.policy,
            num_future_slots=future,
            external_fragmentation=1.0 - largest / free if free else 0.0,
            num_fragmentation_stalls=self._num_fragmentation_stalls,
        )

    # ------------------------------------------------------------------ helpers
    def _first_fit(self, num_blocks: int) -> int | None:
        """Index of the lowest-addressed free range of at least `num_blocks` blocks."""
        for i, (_, length) in enumerate(self._free_ranges):
            if length >= num_blocks:
                return i
        return None

    def _release_range(self, start: int, num_blocks: int) -> None:
        """Give a run back, merged with the free runs it touches (so they can serve long requests)."""
        ranges = self._free_ranges
        i = bisect.bisect_left(ranges, (start, 0))
        end = start + num_blocks
        if i < len(ranges) and ranges[i][0] == end:  # merge with the run after it
            end += ranges[i][1]
            del ranges[i]
        if i > 0 and ranges[i - 1][0] + ranges[i - 1][1] == start:  # and the run before it
            start = ranges[i - 1][0]
            del ranges[i - 1]
            i -= 1
        ranges.insert(i, (start, end - start))

    def _fill(self, seq_id: SeqId, num_new_tokens: int) -> None:
        """Slots for `num_new_tokens` more tokens, inside the reservation: the block table grows
        over the reserved run, in order (a contiguous table, as Orca's KV layout is)."""
        seq = self._seqs[seq_id]
        start = self._reservations[seq_id].start
        bs = self.block_size
        slots = seq.num_slots + num_new_tokens
        for index in range(len(seq.block_table), -(-slots // bs)):
            seq.block_table.append(start + index)
        first = seq.num_slots // bs
        for index in range(first, len(seq.block_table)):
            self.block_pool.fill(self.block_pool.blocks[start + index], min(bs, slots - index * bs))
        seq.num_slots = slots
