"""Unit specifications of the KV cache manager (minivllm/core/kv_cache_manager.py, over its
block pool): paging, copy-on-write, prefix caching, errors, stats.

Block size 4 throughout unless a test says otherwise, so block boundaries are easy to count.
"""

from __future__ import annotations

import pytest

from minivllm.config import SchedulerConfig
from minivllm.core.kv_cache_manager import KVCacheManager, UnknownSequenceError
from minivllm.core.kv_cache_utils import BlockHash, ExtraKeys, NoFreeBlocksError, hash_block_tokens
from minivllm.core.scheduler import Scheduler
from tests.utils.kv_helpers import allocate, can_allocate, make_seq, num_cached

BS = 4


def make(
    num_blocks: int = 8, block_size: int = BS, caching: bool = True, **kwargs
) -> KVCacheManager:
    return KVCacheManager(
        num_blocks, block_size=block_size, enable_prefix_caching=caching, **kwargs
    )


def refs(bm: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in bm.block_pool.blocks]


def free_order(bm: KVCacheManager) -> list[int]:
    return [b.block_id for b in bm.block_pool.free_block_queue]


def snapshot(bm: KVCacheManager) -> tuple:
    """Everything observable about the manager's state, to check that a failed call changed nothing."""
    return (
        refs(bm),
        free_order(bm),
        {
            k.all_token_ids(): b.block_id
            for k, b in bm.block_pool.cached_block_hash_to_block.items()
        },
        {s: (list(v.block_table), v.num_slots, len(v.block_hashes)) for s, v in bm._seqs.items()},
        [b.num_filled for b in bm.block_pool.blocks],
        bm.get_stats(),
        list(bm._pending_copies),
    )


# ----------------------------------------------------------------------------- construction


@pytest.mark.parametrize("field", ["num_blocks", "block_size"])
@pytest.mark.parametrize("bad", [0, -3])
def test_constructor_rejects_non_positive_sizes_naming_the_field(field: str, bad: int) -> None:
    kwargs = {"num_blocks": 8, "block_size": 4, field: bad}
    with pytest.raises(ValueError, match=rf"^{field} must be a positive integer, got {bad}$"):
        KVCacheManager(**kwargs)


def test_constructor_rejects_non_integer_block_size() -> None:
    with pytest.raises(ValueError, match=r"^block_size must be a positive integer, got 2.0$"):
        KVCacheManager(8, block_size=2.0)  # type: ignore[arg-type]


def test_block_size_need_not_be_a_power_of_two() -> None:
    bm = make(num_blocks=4, block_size=3)
    assert allocate(bm, "a", list(range(7)), 7) == 0
    assert bm.get_block_table("a") == [0, 1, 2]
    assert bm.get_stats().kv_slot_utilization == 7 / 9


# ---------------------------------------------------------------------------------- paging


@pytest.mark.parametrize(("num_tokens", "num_blocks"), [(0, 0), (1, 1), (4, 1), (5, 2), (9, 3)])
def test_a_sequence_of_t_tokens_holds_ceil_t_over_block_size_blocks(
    num_tokens: int, num_blocks: int
) -> None:
    bm = make()
    allocate(bm, "a", list(range(num_tokens)), num_tokens)
    assert len(bm.get_block_table("a")) == num_blocks
    assert bm.get_num_slots("a") == num_tokens
    assert bm.num_free_blocks == 8 - num_blocks


def test_blocks_are_taken_from_the_front_of_the_free_queue() -> None:
    bm = make()
    allocate(bm, "a", list(range(6)), 6)
    assert bm.get_block_table("a") == [0, 1]
    assert free_order(bm) == [2, 3, 4, 5, 6, 7]


def test_append_slots_takes_a_new_block_only_at_a_block_boundary() -> None:
    bm = make()
    tokens = list(range(3))
    allocate(bm, "a", tokens, 3)
    tokens.append(3)
    bm.append_slots("a", tokens, 1)
    assert bm.get_block_table("a") == [0]
    tokens.append(4)
    bm.append_slots("a", tokens, 1)
    assert bm.get_block_table("a") == [0, 1]
    assert bm.get_num_slots("a") == 5


def test_chunked_prefill_appends_within_known_tokens() -> None:
    bm = make()
    prompt = list(range(10))
    assert allocate(bm, "a", prompt, 3) == 0
    bm.append_slots("a", prompt, 6)
    assert bm.get_num_slots("a") == 9
    assert bm.get_block_table("a") == [0, 1, 2]


def test_append_slots_rejects_more_tokens_than_known() -> None:
    bm = make()
    allocate(bm, "a", [1, 2], 2)
    with pytest.raises(ValueError, match=r"num_new_tokens must be in \[0, 0\]"):
        bm.append_slots("a", [1, 2], 1)


def test_allocate_rejects_more_new_tokens_than_remain_after_the_hit() -> None:
    bm = make()
    with pytest.raises(ValueError, match=r"num_new_tokens must be in \[0, 3\]"):
        allocate(bm, "a", [1, 2, 3], 4)
    assert not bm.has_seq("a")


def test_get_block_table_returns_the_live_list() -> None:
    bm = make()
    tokens = [1, 2, 3, 4]
    allocate(bm, "a", tokens, 4)
    table = bm.get_block_table("a")
    bm.append_slots("a", [*tokens, 5], 1)
    assert table == [0, 1]
    assert table is bm.get_block_table("a")


def test_usage_and_num_free_blocks_count_held_blocks() -> None:
    bm = make(num_blocks=8)
    allocate(bm, "a", list(range(5)), 5)
    assert bm.num_free_blocks == 6
    assert bm.usage == 0.25


# ------------------------------------------------------------------------- copy-on-write


def test_fork_shares_prompt_blocks_until_write() -> None:
    bm = make()
    tokens = list(range(6))
    allocate(bm, "p", tokens, 6)
    bm.fork("p", "c")
    assert bm.get_block_table("c") == [0, 1]
    assert bm.get_num_slots("c") == 6
    assert refs(bm)[:3] == [2, 2, 0]
    assert bm.num_free_blocks == 6
    # The child writes into the shared, partly filled block 1: it moves to a copy (block 2).
    bm.append_slots("c", [*tokens, 100], 1)
    assert bm.get_block_table("c") == [0, 2]
    assert bm.get_block_table("p") == [0, 1]
    assert bm.take_pending_copies() == [(1, 2)]
    assert refs(bm)[:3] == [2, 1, 1]
    # The parent now owns block 1 alone and writes in place.
    bm.append_slots("p", [*tokens, 200], 1)
    assert bm.get_block_table("p") == [0, 1]
    assert bm.take_pending_copies() == []


def test_copy_on_write_block_keeps_the_fill_of_its_source() -> None:
    bm = make()
    tokens = list(range(6))
    allocate(bm, "p", tokens, 6)
    bm.fork("p", "c")
    bm.append_slots("c", [*tokens, 7], 1)
    assert bm.block_pool.blocks[2].num_filled == 3
    assert bm.block_pool.blocks[1].num_filled == 2
    assert bm.get_stats().kv_slot_utilization == (4 + 2 + 3) / 12


def test_fork_at_a_block_boundary_needs_no_copy() -> None:
    bm = make()
    tokens = list(range(4))
    allocate(bm, "p", tokens, 4)
    bm.fork("p", "c")
    bm.append_slots("c", [*tokens, 9], 1)
    assert bm.get_block_table("c") == [0, 1]
    assert bm.take_pending_copies() == []
    assert refs(bm)[:2] == [2, 1]


def test_can_append_slots_counts_the_copy_on_write_block() -> None:
    bm = make(num_blocks=3)
    tokens = list(range(6))
    allocate(bm, "p", tokens, 6)
    bm.fork("p", "c")
    assert bm.can_append_slots("c", 1)  # 1 free block: the copy
    assert not bm.can_append_slots("c", 3)  # the copy + one more block for tokens 8
    allocate(bm, "x", [9], 1)  # takes the last free block
    assert not bm.can_append_slots("c", 1)
    with pytest.raises(NoFreeBlocksError):
        bm.append_slots("c", [*tokens, 7], 1)


def test_take_pending_copies_clears_the_list() -> None:
    bm = make()
    allocate(bm, "p", [1, 2], 2)
    bm.fork("p", "c1")
    bm.fork("p", "c2")
    bm.append_slots("c1", [1, 2, 3], 1)
    bm.append_slots("c2", [1, 2, 4], 1)
    assert bm.take_pending_copies() == [(0, 1), (0, 2)]
    assert bm.take_pending_copies() == []
    assert refs(bm)[:3] == [1, 1, 1]


def test_fork_into_a_held_sequence_raises() -> None:
    bm = make()
    allocate(bm, "p", [1], 1)
    allocate(bm, "c", [2], 1)
    with pytest.raises(ValueError, match="'c' already holds blocks"):
        bm.fork("p", "c")
    assert refs(bm)[:2] == [1, 1]


# --------------------------------------------------------------------------- prefix caching


def test_full_blocks_are_reused_by_a_later_prompt_with_the_same_prefix() -> None:
    bm = make()
    allocate(bm, "a", list(range(10)), 10)  # blocks 0, 1 full; block 2 partial
    prompt = [*range(8), 50, 51, 52]
    assert num_cached(bm, prompt) == 8
    assert allocate(bm, "b", prompt, 3) == 8
    assert bm.get_block_table("b") == [0, 1, 3]
    assert refs(bm)[:4] == [2, 2, 1, 1]


def test_partly_filled_blocks_are_never_cached() -> None:
    bm = make()
    allocate(bm, "a", list(range(7)), 7)
    assert bm.get_stats().num_cached_blocks == 1
    assert num_cached(bm, [*range(7), 99]) == 4


def test_a_block_hits_only_after_the_same_prefix() -> None:
    bm = make()
    allocate(bm, "a", [1, 1, 1, 1, 2, 2, 2, 2, 0], 9)
    # Block 2's tokens match, but after another first block: its KV differs, so no hit.
    assert num_cached(bm, [3, 3, 3, 3, 2, 2, 2, 2, 0]) == 0
    assert num_cached(bm, [1, 1, 1, 1, 3, 3, 3, 3, 0]) == 4


def test_full_prefix_hit_still_computes_last_token() -> None:
    bm = make()
    prompt = list(range(8))
    allocate(bm, "a", prompt, 8)
    bm.free("a")
    # Both blocks are cached, but the hit stops at 4 so the model still runs token 7.
    assert num_cached(bm, prompt) == 4
    assert allocate(bm, "b", prompt, 4) == 4
    assert bm.get_block_table("b")[0] == 0
    assert bm.get_num_slots("b") == 8


def test_a_one_token_prompt_never_hits() -> None:
    bm = make()
    assert num_cached(bm, [5]) == 0
    assert num_cached(bm, []) == 0


def test_recomputed_last_block_of_a_full_hit_is_not_registered_twice() -> None:
    bm = make()
    prompt = list(range(8))
    allocate(bm, "a", prompt, 8)
    allocate(bm, "b", prompt, 4)  # hit block 0, recompute block 1 into fresh block 2
    assert bm.get_block_table("b") == [0, 2]
    stats = bm.get_stats()
    assert stats.num_cached_blocks == 2
    assert [b.block_hash is not None for b in bm.block_pool.blocks[:3]] == [True, True, False]


def test_duplicate_full_block_keeps_the_first_mapping_and_chains_on() -> None:
    bm = make()
    allocate(bm, "a", [1, 2, 3], 3)
    bm.fork("a", "b")
    bm.append_slots("a", [1, 2, 3, 4], 1)  # a copies to block 1, fills and registers it
    bm.append_slots("b", [1, 2, 3, 4], 1)  # b fills block 0 with the same content
    assert (bm.get_block_table("a"), bm.get_block_table("b")) == ([1], [0])
    assert bm.block_pool.cached_block_hash_to_block[BlockHash.of(None, (1, 2, 3, 4))].block_id == 1
    assert bm.block_pool.blocks[0].block_hash is None
    # b's next block chains on the canonical name, so a later prompt can hit through it.
    bm.append_slots("b", [1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert num_cached(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8


def test_freed_cached_blocks_are_evicted_lru_tail_first() -> None:
    bm = make(num_blocks=6)
    allocate(bm, "a", list(range(8)), 8)  # blocks 0, 1
    allocate(bm, "b", list(range(100, 108)), 8)  # blocks 2, 3
    bm.free("a")
    bm.free("b")
    assert free_order(bm) == [4, 5, 1, 0, 3, 2]
    assert bm.get_stats().num_evictable_blocks == 4
    allocate(bm, "c", list(range(200, 212)), 12)  # 4, 5, then evicts a's tail block 1
    assert bm.get_block_table("c") == [4, 5, 1]
    assert num_cached(bm, [*range(8), 0]) == 4  # a's first block survives
    allocate(bm, "d", list(range(300, 304)), 4)  # evicts a's first block next
    assert bm.get_block_table("d") == [0]
    assert num_cached(bm, [*range(8), 0]) == 0
    assert num_cached(bm, [*range(100, 108), 0]) == 8


def test_a_hit_on_an_evictable_block_takes_it_out_of_the_free_queue() -> None:
    bm = make(num_blocks=4)
    allocate(bm, "a", list(range(8)), 8)
    bm.free("a")
    assert free_order(bm) == [2, 3, 1, 0]
    allocate(bm, "b", [0, 1, 2, 3, 9], 1)
    assert free_order(bm) == [3, 1]
    assert bm.get_block_table("b") == [0, 2]
    stats = bm.get_stats()
    assert (stats.num_free_blocks, stats.num_evictable_blocks, stats.num_cached_blocks) == (2, 1, 2)


def test_can_allocate_counts_evictable_hit_blocks_as_taken() -> None:
    bm = make(num_blocks=3)
    allocate(bm, "a", list(range(8)), 8)
    bm.free("a")
    prompt = [*range(8), 9]
    assert num_cached(bm, prompt) == 8
    assert can_allocate(bm, prompt, 1)  # 2 hits + 1 fresh = 3 free-queue blocks
    allocate(bm, "x", [7], 1)  # takes block 2, the only never-cached one
    assert not can_allocate(bm, prompt, 1)
    with pytest.raises(NoFreeBlocksError, match="needs 3 blocks, 2 are free"):
        allocate(bm, "b", prompt, 1)


def test_stale_hash_of_a_reused_block_is_never_served() -> None:
    bm = make(num_blocks=2)
    allocate(bm, "a", list(range(8)), 8)
    bm.free("a")
    allocate(bm, "b", list(range(50, 58)), 8)  # reuses both blocks for other content
    assert num_cached(bm, [*range(8), 0]) == 0
    assert {k.token_ids for k in bm.block_pool.cached_block_hash_to_block} == {
        (50, 51, 52, 53),
        (54, 55, 56, 57),
    }
    assert all(b.block_hash is not None for b in bm.block_pool.blocks)


def test_same_prefix_admitted_in_the_same_step_shares_blocks_with_exact_refcounts() -> None:
    bm = make()
    prompt = list(range(10))
    assert allocate(bm, "a", prompt, 10) == 0
    assert allocate(bm, "b", prompt, 2) == 8  # hits a's blocks registered this very step
    assert bm.get_block_table("a") == [0, 1, 2]
    assert bm.get_block_table("b") == [0, 1, 3]
    assert refs(bm)[:4] == [2, 2, 1, 1]
    bm.free("a")
    assert refs(bm)[:4] == [1, 1, 0, 1]
    bm.free("b")
    assert bm.num_free_blocks == 8
    assert bm.get_stats().num_evictable_blocks == 2


def test_a_preempted_sequence_hits_its_own_blocks_when_readmitted() -> None:
    bm = make()
    tokens = list(range(6))
    allocate(bm, "a", tokens, 6)
    for t in (6, 7, 8):
        tokens.append(t)
        bm.append_slots("a", tokens, 1)
    bm.free("a")  # preempted
    tokens.append(9)  # the token sampled before preemption, still without KV
    assert allocate(bm, "a", tokens, 2) == 8
    assert bm.get_block_table("a") == [0, 1, 3]  # block 2 (one token, uncached) is not reused
    assert bm.get_num_slots("a") == 10


def test_extra_keys_separate_cache_entries() -> None:
    bm = make()
    allocate(bm, "a", list(range(8)), 8, extra_keys=("lora-1",))
    assert num_cached(bm, [*range(8), 0]) == 0
    assert num_cached(bm, [*range(8), 0], extra_keys=("lora-1",)) == 8
    bm.append_slots("a", list(range(12)), 4)
    assert num_cached(bm, [*range(12), 0], extra_keys=("lora-1",)) == 12


def test_hash_collisions_never_serve_another_prefix() -> None:
    bm = make(hash_fn=lambda parent, tokens, extra: 0)
    allocate(bm, "a", [1, 1, 1, 1, 2, 2, 2, 2], 8)
    assert num_cached(bm, [9, 9, 9, 9, 2, 2, 2, 2, 0]) == 0
    assert num_cached(bm, [1, 1, 1, 1, 9, 9, 9, 9, 0]) == 4
    assert num_cached(bm, [1, 1, 1, 1, 2, 2, 2, 2, 0]) == 8
    allocate(bm, "b", [9, 9, 9, 9, 2, 2, 2, 2], 8)
    assert len(bm.block_pool.cached_block_hash_to_block) == 4


def test_block_hash_equality_is_exact_over_the_whole_chain() -> None:
    a = BlockHash.of(BlockHash.of(None, (1, 2)), (3, 4))
    b = BlockHash.of(BlockHash.of(None, (1, 2)), (3, 4))
    c = BlockHash.of(BlockHash.of(None, (1, 5)), (3, 4))
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert a.all_token_ids() == (1, 2, 3, 4)


def test_prefix_caching_disabled_never_hashes_or_hits() -> None:
    bm = make(caching=False)
    prompt = list(range(9))
    allocate(bm, "a", prompt, 9)
    assert num_cached(bm, prompt) == 0
    assert allocate(bm, "b", prompt, 9) == 0
    assert bm.get_block_table("b") == [3, 4, 5]
    assert bm.block_pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in bm.block_pool.blocks)
    stats = bm.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_cached_blocks) == (
        18,
        0,
        0,
    )


def test_reset_prefix_cache_refuses_while_a_cached_block_is_held() -> None:
    bm = make()
    allocate(bm, "a", list(range(8)), 8)
    assert bm.reset_prefix_cache() is False
    assert num_cached(bm, [*range(8), 0]) == 8


def test_reset_prefix_cache_forgets_every_evictable_hash() -> None:
    bm = make()
    allocate(bm, "a", list(range(8)), 8)
    bm.free("a")
    allocate(bm, "b", [7, 7], 2)  # holds a block without a hash: reset is still allowed
    assert bm.reset_prefix_cache() is True
    assert num_cached(bm, [*range(8), 0]) == 0
    stats = bm.get_stats()
    assert (stats.num_cached_blocks, stats.num_evictable_blocks, stats.num_free_blocks) == (0, 0, 7)


# ---------------------------------------------------------------------------------- freeing


def test_free_releases_blocks_tail_first() -> None:
    bm = make(num_blocks=4)
    allocate(bm, "a", list(range(11)), 11)
    bm.free("a")
    assert free_order(bm) == [3, 2, 1, 0]
    assert not bm.has_seq("a")


def test_free_of_a_forked_sequence_keeps_shared_blocks_held() -> None:
    bm = make()
    allocate(bm, "p", list(range(6)), 6)
    bm.fork("p", "c")
    bm.free("p")
    assert refs(bm)[:2] == [1, 1]
    assert bm.get_block_table("c") == [0, 1]
    assert bm.num_free_blocks == 6


def test_double_free_raises_a_key_error_naming_the_sequence() -> None:
    bm = make()
    allocate(bm, "a", [1], 1)
    bm.free("a")
    with pytest.raises(UnknownSequenceError) as info:
        bm.free("a")
    assert isinstance(info.value, KeyError)
    assert str(info.value) == "sequence 'a' holds no blocks (never allocated, or already freed)"
    assert bm.num_free_blocks == 8


def test_free_of_an_unknown_sequence_raises() -> None:
    bm = make()
    with pytest.raises(KeyError, match="sequence 7 holds no blocks"):
        bm.free(7)


def test_queries_on_an_unknown_sequence_raise() -> None:
    bm = make()
    for call in (bm.get_block_table, bm.get_num_slots, lambda s: bm.can_append_slots(s, 1)):
        with pytest.raises(UnknownSequenceError):
            call("nope")
    assert bm.has_seq("nope") is False


def test_freeing_a_block_that_is_not_held_raises() -> None:
    bm = make()
    allocate(bm, "a", [1], 1)
    bm.block_pool.blocks[0].ref_cnt = 0  # simulate corrupted bookkeeping
    with pytest.raises(RuntimeError, match="block 0 freed but not held"):
        bm.free("a")


def test_allocating_an_already_held_sequence_raises_and_changes_nothing() -> None:
    bm = make()
    allocate(bm, "a", [1, 2, 3, 4, 5], 5)
    before = snapshot(bm)
    with pytest.raises(
        ValueError, match=r"^sequence 'a' already holds blocks; free it before allocating$"
    ):
        allocate(bm, "a", [1, 2, 3, 4, 5], 5)
    assert snapshot(bm) == before


# ------------------------------------------------------------------- no partial state on error


def test_no_free_blocks_on_allocate_leaves_state_unchanged() -> None:
    bm = make(num_blocks=3)
    allocate(bm, "a", list(range(8)), 8)
    bm.free("a")  # two evictable cached blocks
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError, match="'b' needs 4 blocks, 3 are free"):
        allocate(bm, "b", [*range(8), *range(20, 25)], 5)  # 2 hits + 2 fresh
    assert snapshot(bm) == before
    assert not bm.has_seq("b")


def test_no_free_blocks_on_append_leaves_state_unchanged() -> None:
    bm = make(num_blocks=3)
    tokens = list(range(6))
    allocate(bm, "p", tokens, 6)
    bm.fork("p", "c")
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError, match="'c' needs 2 blocks, 1 are free"):
        bm.append_slots("c", [*tokens, 6, 7, 8], 3)  # copy + one new block
    assert snapshot(bm) == before


# ------------------------------------------------------------------------------- statistics


def test_stats_count_blocks_and_prefix_cache_tokens() -> None:
    bm = make()
    allocate(bm, "a", list(range(9)), 9)
    allocate(bm, "b", [*range(8), 42, 43], 2)
    stats = bm.get_stats()
    assert stats.num_total_blocks == 8
    assert (stats.num_used_blocks, stats.num_free_blocks) == (4, 4)
    assert (stats.num_cached_blocks, stats.num_evictable_blocks) == (2, 0)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (19, 8)


def test_kv_slot_utilization_tracks_filled_slots_of_used_blocks() -> None:
    bm = make()
    assert bm.get_stats().kv_slot_utilization == 1.0
    allocate(bm, "a", list(range(5)), 5)  # 5 of 8 slots
    assert bm.get_stats().kv_slot_utilization == 5 / 8
    allocate(bm, "b", list(range(5)), 1)  # hits block 0 (already counted) + 1 slot in a new block
    assert bm.get_stats().kv_slot_utilization == 6 / 12
    bm.free("a")
    assert bm.get_stats().kv_slot_utilization == 5 / 8
    bm.free("b")
    assert bm.get_stats().kv_slot_utilization == 1.0


def test_min_and_peak_utilization_are_remembered() -> None:
    bm = make()
    tokens = [1]
    allocate(bm, "a", tokens, 1)  # 1/4
    for t in range(2, 6):
        tokens.append(t)
        bm.append_slots("a", tokens, 1)  # 2/4, 3/4, 4/4, then 5/8
    allocate(bm, "b", [9, 9, 9, 9], 4)  # 3 blocks, 9/12: the peak
    bm.free("b")
    bm.free("a")
    stats = bm.get_stats()
    assert stats.min_kv_slot_utilization == 0.25
    assert stats.peak_kv_slot_utilization == 0.75
    assert stats.kv_slot_utilization == 1.0


def test_utilization_counts_a_hit_on_an_evictable_block_as_full() -> None:
    bm = make()
    allocate(bm, "a", list(range(4)), 4)
    bm.free("a")
    allocate(bm, "b", [0, 1, 2, 3, 4], 1)
    assert bm.get_stats().kv_slot_utilization == 5 / 8


# ------------------------------------------------------------------ commit or roll back a step


def test_a_rolled_back_step_withdraws_the_names_it_gave() -> None:
    bm = make()
    allocate(bm, "a", list(range(10)), 10)  # a step named blocks 0 and 1 ...
    assert num_cached(bm, [*range(8), 99]) == 8  # (a request in the same step may hit)
    bm.rollback_step()  # ... and failed before its K/V was surely written
    assert num_cached(bm, [*range(8), 99]) == 0
    bm.free("a")
    stats = bm.get_stats()
    assert (stats.num_cached_blocks, stats.num_evictable_blocks) == (0, 0)


def test_a_rollback_keeps_the_names_of_committed_steps() -> None:
    bm = make()
    allocate(bm, "a", list(range(8)), 8)
    bm.commit_step()  # step 1 completed: two full blocks, named for good
    bm.append_slots("a", list(range(12)), 4)  # step 2 names block 2 ...
    bm.rollback_step()  # ... and fails
    bm.free("a")
    assert num_cached(bm, [*range(12), 99]) == 8
    assert bm.get_stats().num_evictable_blocks == 2


def test_a_rollback_after_the_blocks_were_freed_keeps_the_counts_exact() -> None:
    bm = make()
    allocate(bm, "a", list(range(8)), 8)
    bm.free("a")  # freed (evictable) before the step was rolled back
    bm.rollback_step()
    stats = bm.get_stats()
    assert (stats.num_cached_blocks, stats.num_evictable_blocks, stats.num_free_blocks) == (0, 0, 8)


def test_readmission_is_not_counted_as_a_prompt_lookup() -> None:
    bm = make()
    allocate(bm, "a", list(range(8)), 8)
    bm.free("a")  # preempted
    allocate(bm, "a", list(range(10)), 2, count_as_query=False)  # prompt + 2 outputs recomputed
    stats = bm.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (8, 0)


def test_snapshot_shows_tables_ref_counts_and_names_read_only() -> None:
    """What step listeners read instead of the manager's own dicts: the pool after the step."""
    bm = KVCacheManager(num_blocks=8, block_size=4)
    allocate(bm, "p", list(range(6)), 6)  # one full block (named), one partly filled
    bm.fork("p", "c")
    snap = bm.snapshot()
    p_table = tuple(bm.get_block_table("p"))
    assert (snap.block_size, snap.num_blocks, snap.num_free_blocks) == (4, 8, 6)
    assert snap.block_tables == {"p": p_table, "c": p_table}
    assert snap.ref_counts == {b: 2 for b in p_table}
    assert set(snap.cached_blocks) == {p_table[0]}
    assert snap.cached_blocks[p_table[0]].all_token_ids() == (0, 1, 2, 3)
    with pytest.raises(TypeError):
        snap.block_tables["x"] = ()  # type: ignore[index]
    bm.free("c")
    assert bm.snapshot().ref_counts == {b: 1 for b in p_table}


# ------------------------------------------------------------------- one lookup per admission


def test_an_admission_walks_the_prefix_chain_once() -> None:
    """The scheduler decides with the hit it looked up and hands it to `allocate_slots`: each
    cached block of the prompt is hashed once (three walks of the chain hashed it three times)."""
    hashed: list[tuple[int, ...]] = []

    def counting_hash(parent: int | None, tokens: tuple[int, ...], extra: ExtraKeys) -> int:
        hashed.append(tokens)
        return hash_block_tokens(parent, tokens, extra)

    bm = KVCacheManager(16, block_size=BS, hash_fn=counting_hash)
    prompt = list(range(3 * BS + 2))  # 3 full blocks, then 2 tokens
    allocate(bm, "warm", prompt, len(prompt))
    bm.commit_step()
    bm.free("warm")
    hashed.clear()
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm)
    seq = make_seq(1, prompt, max_tokens=4)
    scheduler.add_seq(seq)
    out = scheduler.schedule()
    assert [s.seq_id for s in out.scheduled] == [1]
    assert seq.num_computed_tokens == 3 * BS  # the hit was taken
    assert hashed == [tuple(prompt[i * BS : (i + 1) * BS]) for i in range(3)]


def test_allocate_slots_takes_the_hit_it_is_given_without_looking_again() -> None:
    bm = make()
    prompt = [*range(8), 9]
    allocate(bm, "a", prompt, 9)
    bm.free("a")
    computed = bm.get_computed_blocks(prompt)
    assert computed.num_computed_tokens == 8
    assert bm.allocate_slots(make_seq("b", prompt), 1, computed) == 8
    assert bm.get_block_table("b")[:2] == [block.block_id for block in computed.blocks]
    # Handed no hit, it computes the whole prompt, although the cache holds its prefix.
    assert bm.allocate_slots(make_seq("c", prompt), 9) == 0
    assert not set(bm.get_block_table("c")) & set(bm.get_block_table("b"))
