"""The hybrid KV cache coordinator: a block table per group of layers, over one pool (Gemma 2/3).

vLLM v1's layout and rules (kv_cache_groups.py, kv_cache_coordinator.py): the layers split by
attention kind into groups of one size; each group has its own manager over the shared pool; a
prefix hit is the longest every group holds (a windowed group needs only what its first query
sees); whether blocks are free is asked of all groups together; and every block returns to the
pool. The random programs of tests/core/test_kv_cache_coordinator_stateful.py check the same
invariants at every step; these tests name the cases.
"""

from __future__ import annotations

import pytest

from minivllm.config import CacheConfig
from minivllm.core.kv_cache_coordinator import HybridComputedBlocks, HybridKVCacheCoordinator
from minivllm.core.kv_cache_groups import (
    KVCacheGroupSpec,
    get_kv_cache_groups,
    group_extra_keys,
    kv_cache_windows,
)
from minivllm.core.kv_cache_utils import NULL_BLOCK_ID, ComputedBlocks, NoFreeBlocksError
from minivllm.core.sliding_window_manager import SlidingWindowKVCacheManager
from tests.utils.kv_helpers import allocate, can_allocate, make_seq

BS = 4
W = 6  # a windowed group's first query sees its last 5 keys: the last 2 blocks before it


def make(
    num_blocks: int = 24, windows: tuple[int | None, ...] = (W, None)
) -> HybridKVCacheCoordinator:
    return HybridKVCacheCoordinator(num_blocks, BS, True, get_kv_cache_groups(windows))


def check_no_leak(kv: HybridKVCacheCoordinator) -> None:
    """Every block is held exactly as often as the groups' tables name it (placeholders not), no
    block is in two groups, and free + held = the pool."""
    holds: dict[int, int] = {}
    owner: dict[int, int] = {}
    for g, m in enumerate(kv.managers):
        for seq_id in m._seqs:
            skipped = (
                m.num_skipped_blocks(seq_id) if isinstance(m, SlidingWindowKVCacheManager) else 0
            )
            for b in m.get_block_table(seq_id)[skipped:]:
                holds[b] = holds.get(b, 0) + 1
                assert owner.setdefault(b, g) == g, f"block {b} is in groups {owner[b]} and {g}"
    assert {b.block_id: b.ref_cnt for b in kv.block_pool.blocks if b.ref_cnt} == holds
    assert kv.num_free_blocks == kv.num_blocks - len(holds)
    assert sum(kv.num_held_blocks()) == len(holds)


def decode(kv: HybridKVCacheCoordinator, seq_id: int, tokens: list[int], upto: int) -> None:
    """Append one token at a time until the sequence has `upto` slots, committing each step."""
    while kv.get_num_slots(seq_id) < upto:
        tokens.append(len(tokens) % 7)
        kv.append_slots(seq_id, tokens, 1)
        kv.commit_step()


# ------------------------------------------------------------------ the groups


def test_layers_group_by_kind_into_groups_of_one_size() -> None:
    gemma2 = ["s" if i % 2 == 0 else None for i in range(26)]  # window, global, window, ...
    groups = get_kv_cache_groups([None if w is None else 512 for w in gemma2])
    assert [(len(g.layer_ids), g.sliding_window) for g in groups] == [(13, None), (13, 512)]
    assert groups[0].layer_ids == tuple(range(1, 26, 2))

    gemma3 = [None if (i + 1) % 6 == 0 else 1024 for i in range(26)]  # 5 windowed : 1 global
    groups = get_kv_cache_groups(gemma3)
    assert groups[0] == KVCacheGroupSpec((5, 11, 17, 23), None)
    assert [len(g.layer_ids) for g in groups[1:]] == [4, 4, 4, 4, 3, 3]  # two padded slots
    assert sorted(i for g in groups for i in g.layer_ids) == list(range(26))

    assert get_kv_cache_groups([8, None, 8]) == [
        KVCacheGroupSpec((1,), None),
        KVCacheGroupSpec((0,), 8),
        KVCacheGroupSpec((2,), 8),
    ]
    # Nearly even kinds pad the smaller one rather than split the larger (vLLM's 1.5 rule).
    nearly_even = get_kv_cache_groups([None] * 12 + [64] * 13)
    assert [len(g.layer_ids) for g in nearly_even] == [12, 13]


def test_the_windows_read_off_the_model_choose_the_manager() -> None:
    class Layer:
        def __init__(self, w: int | None) -> None:
            self.sliding_window = w

    class Model:
        def __init__(self, *windows: int | None) -> None:
            self.layers = [Layer(w) for w in windows]

        def modules(self) -> list[object]:
            return [self, *self.layers]

    assert kv_cache_windows(Model(8, None, 8)) == (None, (8, None, 8))
    assert kv_cache_windows(Model(8, 16)) == (16, ())
    assert kv_cache_windows(Model(None, None)) == (None, ())
    cc = CacheConfig(4, True, None, 0.9, 1.0, "paged", "auto")
    cc.layer_sliding_windows = (8, None, 8)
    assert cc.kv_cache_manager_cls.endswith(".HybridKVCacheCoordinator")
    cc.kv_allocation, cc.enable_prefix_caching = "orca-max", False  # a reservation keeps all
    assert cc.kv_cache_manager_cls.endswith(".ReservationKVCacheManager")


def test_a_group_s_blocks_are_named_apart_from_another_group_s() -> None:
    assert group_extra_keys(0, None) is None  # the first group names blocks as one table does
    assert group_extra_keys(1, None) != group_extra_keys(2, None)
    assert group_extra_keys(1, ("salt",)) == (("kv_cache_group", 1), "salt")


# ------------------------------------------------------------------ blocks per group


def test_the_windowed_group_frees_what_left_its_window_the_global_group_keeps_all() -> None:
    kv = make()
    tokens = list(range(13))
    allocate(kv, 1, tokens, 13)
    kv.commit_step()
    decode(kv, 1, tokens, 41)
    (windowed,) = kv.get_group_block_tables(1)
    global_table = kv.get_block_table(1)
    assert len(set(global_table)) == len(global_table) == 11  # ceil(41 / 4), all held
    # The next query is at 40 and sees keys 35..40: blocks 8, 9 and 10; the 8 before are freed.
    assert kv.managers[1].num_skipped_blocks(1) == 8  # type: ignore[attr-defined]
    assert windowed[:8] == [NULL_BLOCK_ID] * 8 and len(windowed) == 11
    assert kv.num_held_blocks() == [11, 3]
    check_no_leak(kv)
    kv.free(1)
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.get_stats().num_used_blocks == 0


def test_a_full_pool_appends_with_the_blocks_a_windowed_group_gives_back() -> None:
    """Both groups need a block for token 12, and the pool has none: the windowed group (W = 5)
    frees blocks 0 and 1 first, out of sight of the query at 12, so it fits."""
    kv = make(num_blocks=6, windows=(5, None))
    tokens = list(range(12))
    allocate(kv, 1, tokens, 12)  # 3 global + 3 windowed blocks
    kv.commit_step()
    assert kv.num_free_blocks == 0
    assert kv.get_num_blocks_to_append(1, 1) == 0  # 2 taken, 2 given back first
    assert kv.can_append_slots(1, 1)
    kv.append_slots(1, [*tokens, 0], 1)
    assert kv.num_held_blocks() == [4, 2] and kv.num_free_blocks == 0
    check_no_leak(kv)


def test_an_allocation_that_does_not_fit_in_all_groups_changes_nothing() -> None:
    kv = make(num_blocks=5)
    allocate(kv, 1, list(range(8)), 8)  # 2 + 2 blocks
    before = (kv.num_free_blocks, kv.num_held_blocks(), kv.get_block_table(1))
    assert not can_allocate(kv, list(range(20, 28)), 8)  # 2 + 2 more, 1 free
    with pytest.raises(NoFreeBlocksError):
        allocate(kv, 2, list(range(20, 28)), 8)
    assert (kv.num_free_blocks, kv.num_held_blocks(), kv.get_block_table(1)) == before
    assert not kv.has_seq(2)
    check_no_leak(kv)


def test_forks_share_every_group_and_copy_on_write_in_each() -> None:
    kv = make()
    tokens = list(range(10))  # the last block is partly filled in both groups
    allocate(kv, 1, tokens, 10)
    kv.commit_step()
    kv.fork(1, 2)
    kv.append_slots(2, [*tokens, 5], 1)
    copies = kv.take_pending_copies()
    assert len(copies) == 2  # the shared partial block, once per group
    assert {src for src, _ in copies} == {
        kv.get_block_table(1)[2],
        kv.get_group_block_tables(1)[0][2],
    }
    check_no_leak(kv)
    kv.free(1)
    kv.free(2)
    assert kv.num_free_blocks == kv.num_blocks


# ------------------------------------------------------------------ prefix hits


def finished_prompt(kv: HybridKVCacheCoordinator, tokens: list[int]) -> tuple[list[int], list[int]]:
    """Run `tokens` as a sequence to its end and free it: its blocks stay named, evictable.
    Returns its (global, windowed) tables before the free."""
    allocate(kv, 1, tokens, len(tokens))
    kv.commit_step()
    tables = list(kv.get_block_table(1)), list(kv.get_group_block_tables(1)[0])
    kv.free(1)
    return tables


def test_a_hit_needs_only_the_blocks_the_windowed_groups_first_query_sees() -> None:
    """vLLM's right-to-left search: the windowed group's first blocks were evicted, its last
    two before the hit are cached: the whole prefix is still a hit, in both groups."""
    kv = make()
    prompt = list(range(100, 121))  # 5 full blocks, then one token
    global_table, windowed = finished_prompt(kv, prompt)
    for b in windowed[:3]:  # the pool needed them
        kv.block_pool.evict(kv.block_pool.blocks[b])
    hit = allocate(kv, 2, [*prompt, 7, 8], 2)
    assert hit == 20  # 5 blocks: the first query (at 20) sees keys 15..20, in blocks 3 and 4
    assert kv.get_block_table(2)[:5] == global_table[:5]
    assert kv.get_group_block_tables(2)[0][:5] == [NULL_BLOCK_ID] * 3 + windowed[3:5]
    check_no_leak(kv)
    stats = kv.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (21 + 23, 20)  # once each


def test_the_hit_falls_until_every_group_holds_it() -> None:
    kv = make()
    prompt = list(range(100, 121))
    global_table, windowed = finished_prompt(kv, prompt)
    # The windowed group's blocks 3 and 4 are gone: at 5 blocks it has no hit, at 3 it has
    # (blocks 1 and 2), and the global group's hit is cut to the same 3 blocks.
    for b in windowed[3:5]:
        kv.block_pool.evict(kv.block_pool.blocks[b])
    computed = kv.get_computed_blocks([*prompt, 7])
    assert isinstance(computed, HybridComputedBlocks) and computed.num_computed_tokens == 12
    assert [b.block_id for b in computed.groups[0].blocks] == global_table[:3]
    assert [b.block_id for b in computed.groups[1].blocks] == windowed[1:3]
    # The global group's block 1 evicted too: nothing before it is a hit anywhere.
    kv.block_pool.evict(kv.block_pool.blocks[global_table[1]])
    assert kv.get_computed_blocks([*prompt, 7]).num_computed_tokens == 4
    kv.block_pool.evict(kv.block_pool.blocks[global_table[0]])
    assert kv.get_computed_blocks([*prompt, 7]).num_computed_tokens == 0


def test_admission_pins_every_groups_hits_before_any_group_takes_fresh_blocks() -> None:
    """Fresh blocks come from the front of the free queue; put the windowed group's hits there:
    the global group, which allocates first, must not take (and rename) them."""
    kv = make(num_blocks=16)
    prompt = list(range(100, 109))
    _, windowed = finished_prompt(kv, prompt)
    hits = [kv.block_pool.blocks[b] for b in windowed[:2]]
    queue = kv.block_pool.free_block_queue
    for block in [b for b in queue if b not in hits]:  # the hits to the front
        queue.remove(block)
        queue.append(block)
    assert set(list(queue)[:2]) == set(hits)
    tokens = [*prompt[:8], *range(10)]  # a hit of 8 tokens, then 10 more: 3 fresh blocks a group
    assert allocate(kv, 2, tokens, 10) == 8
    assert kv.get_group_block_tables(2)[0][:2] == windowed[:2]
    assert all(h.block_hash is not None for h in hits)
    check_no_leak(kv)


def test_a_hit_made_for_one_table_is_refused() -> None:
    kv = make()
    block = kv.block_pool.blocks[0]
    with pytest.raises(ValueError, match="its own get_computed_blocks"):
        kv.allocate_slots(make_seq(1, list(range(9))), 1, ComputedBlocks((block,), 4))


def test_one_request_s_capacity_counts_each_group_s_need() -> None:
    """max_model_len's bound: a global group holds the whole request, a windowed one its window
    behind a step's chunk (here 5 + 16 keys: 7 blocks)."""
    cc = CacheConfig(BS, True, None, 0.9, 1.0, "paged", "auto")
    cc.layer_sliding_windows = (W, None, W)  # groups: global, window, window
    capacity = HybridKVCacheCoordinator.max_num_tokens(cc, 30, token_budget=16)
    assert capacity == 64  # 16 global blocks + 2 x 7 windowed = 30
    assert HybridKVCacheCoordinator.max_num_tokens(cc, 12, token_budget=16) == 16  # 4 + 2 x 4


def test_trim_gives_back_the_lookahead_slots_in_every_group() -> None:
    """Speculative decoding's rollback, in every group (the engine refuses it on a windowed
    model for now; the coordinator keeps the interface whole)."""
    kv = make()
    tokens = list(range(9))
    allocate(kv, 1, tokens, 9)
    kv.commit_step()
    kv.append_slots(1, [*tokens, 9], 1, num_lookahead_tokens=6)  # slots 9..15: blocks 2 and 3
    assert kv.num_held_blocks() == [4, 3]  # the window's block 0 went back first
    kv.trim_slots(1, 10)
    assert kv.get_num_slots(1) == 10 and kv.num_held_blocks() == [3, 2]
    assert len(kv.get_block_table(1)) == len(kv.get_group_block_tables(1)[0]) == 3
    check_no_leak(kv)
