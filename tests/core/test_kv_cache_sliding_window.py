"""The KV cache manager under a sliding window: what no query can see again goes back to the pool.

vLLM v1's `SlidingWindowManager` rule: the next query is at position num_computed_tokens and sees
keys > num_computed_tokens - W, so the blocks before the block of key num_computed_tokens - W + 1
are freed, kept in the prefix cache (evictable), and their block-table entries become
NULL_BLOCK_ID. These tests hold that rule, that nothing still visible is ever freed, and that
every block comes back to the pool (preemption, abort, forks and prefix caching included).
"""

from __future__ import annotations

import random

import pytest

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.core.scheduler import Scheduler
from minivllm.core.sequence import SequenceStatus
from minivllm.core.sliding_window_manager import (
    NULL_BLOCK_ID,
    SlidingWindowKVCacheManager,
    kv_sliding_window,
)
from tests.utils.kv_helpers import allocate, make_seq

BS = 4


def make(
    num_blocks: int = 16, window: int = 6, caching: bool = True
) -> SlidingWindowKVCacheManager:
    return SlidingWindowKVCacheManager(num_blocks, BS, caching, sliding_window=window)


def held_refs(kv: SlidingWindowKVCacheManager) -> dict[int, int]:
    """Each block's holders, counted from the block tables (entries past the skipped ones)."""
    counts: dict[int, int] = {}
    for seq_id, seq in kv._seqs.items():
        for b in seq.block_table[kv.num_skipped_blocks(seq_id) :]:
            counts[b] = counts.get(b, 0) + 1
    return counts


def check_no_leak(kv: SlidingWindowKVCacheManager) -> None:
    """Reference counts are exactly the block tables' holds, and free = not held."""
    counts = held_refs(kv)
    assert {b.block_id: b.ref_cnt for b in kv.block_pool.blocks if b.ref_cnt} == counts
    assert kv.num_free_blocks == kv.num_blocks - len(counts)


def test_sliding_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="sliding_window must be a positive integer, got 0"):
        make(window=0)


def test_blocks_wholly_before_the_next_querys_window_are_freed_and_nulled() -> None:
    kv = make(window=6)
    allocate(kv, 1, list(range(13)), 13)  # blocks 0..3, positions 0..12
    free_before = kv.num_free_blocks
    # The next query is at 13 and sees 8..13: blocks 0 (0..3) and 1 (4..7) are out of reach.
    kv.remove_skipped_blocks(1, 13)
    table = kv.get_block_table(1)
    assert table[:2] == [NULL_BLOCK_ID, NULL_BLOCK_ID]
    assert kv.num_free_blocks == free_before + 2
    check_no_leak(kv)


def test_a_block_with_one_visible_key_is_kept() -> None:
    kv = make(window=6)
    allocate(kv, 1, list(range(12)), 12)
    # The next query is at 12 and sees 7..12: key 7 is the last of block 1, which stays.
    kv.remove_skipped_blocks(1, 12)
    table = kv.get_block_table(1)
    assert table[0] == NULL_BLOCK_ID and table[1] != NULL_BLOCK_ID
    assert kv.num_skipped_blocks(1) == 1


def test_window_of_one_never_frees_the_block_being_written() -> None:
    kv = make(window=1)
    allocate(kv, 1, list(range(6)), 6)  # block 1 holds 4, 5 and has room for 6
    kv.remove_skipped_blocks(1, 6)
    assert kv.num_skipped_blocks(1) == 1  # block 0 only
    kv.append_slots(1, list(range(7)), 1)
    check_no_leak(kv)


def test_a_window_wider_than_the_context_frees_nothing() -> None:
    kv = make(window=100)
    allocate(kv, 1, list(range(13)), 13)
    free_before = kv.num_free_blocks
    kv.remove_skipped_blocks(1, 13)
    assert kv.num_free_blocks == free_before
    assert kv.num_skipped_blocks(1) == 0


def test_the_cache_config_names_the_sliding_window_manager_only_for_paged_windows() -> None:
    cc = CacheConfig(16, False, None, 0.9, 1.0, "paged", "auto")
    assert cc.kv_cache_manager_cls.endswith(".KVCacheManager")
    cc.sliding_window = 8
    assert cc.kv_cache_manager_cls.endswith(".SlidingWindowKVCacheManager")
    cc.kv_allocation = "orca-max"  # a reservation never frees early: correct, if wasteful
    assert cc.kv_cache_manager_cls.endswith(".ReservationKVCacheManager")


def test_freed_blocks_stay_prefix_cache_hits_until_evicted() -> None:
    kv = make(window=6)
    prompt = list(range(100, 113))
    allocate(kv, 1, prompt, 13)
    kv.commit_step()
    first_two = kv.get_block_table(1)[:2]
    kv.remove_skipped_blocks(1, 13)
    stats = kv.get_stats()
    assert stats.num_evictable_blocks == 2  # freed, hash kept
    # A new prompt with the same start hits all three full blocks; its first query (at 12)
    # cannot see block 0, so that hit is not taken, block 1 is.
    hit = allocate(kv, 2, [*prompt, 7], 2)
    assert hit == 12
    table = kv.get_block_table(2)
    assert table[0] == NULL_BLOCK_ID and table[1] == first_two[1]
    assert kv.block_pool.blocks[first_two[0]].ref_cnt == 0
    check_no_leak(kv)
    kv.free(1)
    kv.free(2)
    assert kv.num_free_blocks == kv.num_blocks


def test_forked_sequences_keep_shared_blocks_until_both_move_past_them() -> None:
    kv = make(window=6)
    allocate(kv, 1, list(range(9)), 9)
    kv.fork(1, 2)
    kv.remove_skipped_blocks(1, 13 - 4)  # next query at 9 sees 4..9: nothing to free yet
    kv.append_slots(1, list(range(13)), 4)
    kv.remove_skipped_blocks(1, 13)
    shared = kv._seqs[2].block_table[0]
    assert kv.block_pool.blocks[shared].ref_cnt == 1  # the child still holds block 0
    kv.append_slots(2, list(range(13)), 4)
    kv.remove_skipped_blocks(2, 13)
    assert kv.block_pool.blocks[shared].ref_cnt == 0
    check_no_leak(kv)
    kv.free(1)
    kv.free(2)
    assert kv.num_free_blocks == kv.num_blocks


def test_kv_sliding_window_is_the_largest_when_every_layer_has_one() -> None:
    class Layer:
        def __init__(self, w: int | None) -> None:
            self.sliding_window = w

    class Model:
        def __init__(self, *windows: int | None) -> None:
            self.layers = [Layer(w) for w in windows]

        def modules(self) -> list[object]:
            return [self, *self.layers]

    assert kv_sliding_window(Model(8, 8)) == 8
    assert kv_sliding_window(Model(8, 16)) == 16
    assert kv_sliding_window(Model(8, None)) is None  # Gemma: a global layer reads everything
    assert kv_sliding_window(Model()) is None
    assert kv_sliding_window(object()) is None


# ------------------------------------------------------------------ the scheduler, step by step


def run_scheduler(
    seed: int, window: int, caching: bool, num_blocks: int = 7
) -> tuple[int, int]:  # (preemptions, block-table entries seen skipped)
    """Random requests through the real scheduler on a small pool (preemptions happen), some
    aborted, the rest run to their length. After every step: each running sequence holds every
    block its next query can see, the counts have no leak; at the end the pool is full."""
    rng = random.Random(seed)
    kv = SlidingWindowKVCacheManager(num_blocks, BS, caching, sliding_window=window)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10), kv)
    shared = [rng.randrange(50) for _ in range(9)]  # a common prefix: prefix-cache hits
    lengths = {}
    for i in range(8):
        prompt = (shared if i % 2 else []) + [rng.randrange(50) for _ in range(rng.randint(1, 12))]
        seq = make_seq(i, prompt)
        lengths[i] = len(prompt) + rng.randint(1, 20)
        sched.add_seq(seq)
    num_preemptions = num_freed = 0
    for _ in range(500):
        if not sched.seqs:
            break
        out = sched.schedule()
        num_preemptions += len(out.preempted_seq_ids)
        for item in out.scheduled:
            # The blocks from the one of the step's first visible key on are still held.
            first = max(0, item.num_computed_tokens - window + 1) // BS
            assert kv.num_skipped_blocks(item.seq_id) <= first
            num_freed += kv.num_skipped_blocks(item.seq_id)
        sched.update_after_step(out)
        check_no_leak(kv)
        for item in out.scheduled:
            seq = sched.seqs[item.seq_id]
            if item.sample:
                seq.token_ids.append(rng.randrange(50))
            if seq.num_tokens >= lengths[seq.seq_id]:
                sched.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
            elif rng.random() < 0.03:
                sched.finish_seq(seq, SequenceStatus.FINISHED_ABORTED)
        check_no_leak(kv)
    assert not sched.seqs
    assert kv.num_free_blocks == num_blocks
    return num_preemptions, num_freed


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window", [1, 5, 8])
@pytest.mark.parametrize("caching", [True, False])
def test_scheduler_with_a_window_frees_every_block_by_the_end(
    seed: int, window: int, caching: bool
) -> None:
    run_scheduler(seed, window, caching)


def test_the_scheduler_runs_preempt_and_free_under_a_window() -> None:
    """The runs above do reach what they test: preemptions and freed blocks."""
    totals = [run_scheduler(seed, 5, True) for seed in range(6)]
    assert sum(p for p, _ in totals) > 0 and sum(f for _, f in totals) > 0


def test_a_window_lets_a_long_sequence_run_in_fewer_blocks_than_it_spans() -> None:
    """40 tokens span 10 blocks; with W = 6 a decode needs at most 3 at a time."""
    kv = SlidingWindowKVCacheManager(4, BS, True, sliding_window=6)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8), kv)
    seq = make_seq(0, list(range(6)))
    sched.add_seq(seq)
    while seq.num_tokens < 40:
        out = sched.schedule()
        assert not out.preempted_seq_ids
        sched.update_after_step(out)
        if out.scheduled[0].sample:
            seq.token_ids.append(1)
    sched.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
    assert kv.num_free_blocks == 4


def test_a_fork_after_blocks_were_freed_holds_only_the_live_ones() -> None:
    kv = make(window=6)
    allocate(kv, 1, list(range(13)), 13)
    kv.remove_skipped_blocks(1, 13)
    kv.fork(1, 2)
    assert kv.get_block_table(2)[:2] == [NULL_BLOCK_ID, NULL_BLOCK_ID]
    check_no_leak(kv)
    kv.free(1)
    kv.free(2)
    assert kv.num_free_blocks == kv.num_blocks


def test_a_hit_needs_only_the_blocks_its_first_query_sees() -> None:
    """vLLM's right-to-left search: the prompt's first blocks were evicted, its last two before
    the hit are cached, and that is all the first query (at 20, seeing keys 15..20) reads."""
    kv = make(window=6)
    prompt = list(range(100, 121))  # 5 full blocks, then one token
    allocate(kv, 1, prompt, 21)
    kv.commit_step()
    table = list(kv.get_block_table(1))
    kv.free(1)
    for b in table[:3]:  # the pool needed them
        kv.block_pool.evict(kv.block_pool.blocks[b])
    assert allocate(kv, 2, [*prompt, 7], 2) == 20
    assert kv.get_block_table(2)[:5] == [NULL_BLOCK_ID] * 3 + table[3:5]
    assert kv.num_skipped_blocks(2) == 3
    check_no_leak(kv)
    # Block 4 evicted too: no two cached blocks in a row end a prefix any more, no hit at all.
    kv.free(2)
    kv.block_pool.evict(kv.block_pool.blocks[table[4]])
    assert allocate(kv, 3, [*prompt, 7], 2, count_as_query=False) == 0
    check_no_leak(kv)
