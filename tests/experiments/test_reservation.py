"""KV allocation policies (minivllm/experiments/reservation.py against the core's paged manager):
what each reserves, where, and what fragmentation it leaves.

The reservation policies (the paper's Orca baselines, §6.2) hold one contiguous run of blocks per
request from admission to the end; paged allocation holds at most one partly filled block per
sequence. Random programs (hypothesis) check after every operation that no reserved block is ever
in two hands and that the accounting adds up.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.kv_cache_utils import NoFreeBlocksError
from minivllm.engine.arg_utils import EngineArgs
from minivllm.experiments.reservation import (
    ReservationKVCacheManager,
    num_final_tokens,
    reservation_size,
)
from tests.utils.kv_helpers import allocate, can_allocate, make_seq

ORCA = ("orca-max", "orca-pow2", "orca-oracle")


def test_reservation_size_follows_each_policy():
    assert reservation_size("orca-max", 100, 2048) == 2048
    assert reservation_size("orca-pow2", 100, 2048) == 128
    assert reservation_size("orca-pow2", 128, 2048) == 128
    assert reservation_size("orca-pow2", 1500, 2048) == 2048
    assert reservation_size("orca-pow2", 1500, 1600) == 1600  # never past max_model_len
    assert reservation_size("orca-oracle", 100, 2048) == 100
    assert reservation_size("orca-oracle", 3000, 2048) == 2048
    with pytest.raises(ValueError, match="kv_allocation"):
        reservation_size("paged", 100, 2048)


@pytest.mark.parametrize("policy", ORCA)
def test_admission_reserves_a_contiguous_run_and_the_table_walks_it(policy):
    bm = ReservationKVCacheManager(64, 4, policy, max_model_len=64)
    allocate(bm, "a", [1] * 6, 6, max_tokens=14)
    need = bm.blocks_for(6, 20)  # 16 blocks (max), 8 (pow2: 32 slots), 5 (oracle: 20 slots)
    assert need == {"orca-max": 16, "orca-pow2": 8, "orca-oracle": 5}[policy]
    assert bm.get_reserved_blocks("a") == range(0, need)
    assert bm.get_block_table("a") == [0, 1]  # only the blocks that hold tokens so far
    assert bm.num_free_blocks == 64 - need  # the whole reservation is memory in use
    for n in range(7, 21):  # it grows inside its reservation, never asking the pool again
        assert bm.can_append_slots("a", 1)
        bm.append_slots("a", [1] * n, 1)
    assert bm.get_block_table("a") == list(range(5))
    if policy == "orca-oracle":  # the reservation is exactly full: nothing more fits
        assert not bm.can_append_slots("a", 1)
        with pytest.raises(NoFreeBlocksError, match="outgrow its reservation"):
            bm.append_slots("a", [1] * 21, 1)
    bm.free("a")
    assert bm.num_free_blocks == 64 and bm.get_free_ranges() == [(0, 64)]


def test_external_fragmentation_blocks_an_admission_that_total_free_memory_would_allow():
    bm = ReservationKVCacheManager(12, 4, "orca-oracle", max_model_len=48)
    for name in "abc":
        allocate(bm, name, [1] * 4, 4, max_tokens=12)  # 4 blocks each, 0-3, 4-7, 8-11
    bm.free("a")
    bm.free("c")
    assert bm.get_free_ranges() == [(0, 4), (8, 4)] and bm.num_free_blocks == 8
    # 8 blocks are free, but no run of 5: a 20-token reservation waits.
    assert not can_allocate(bm, [1] * 4, 4, max_tokens=16)
    stats = bm.get_stats()
    assert stats.num_fragmentation_stalls == 1
    assert stats.external_fragmentation == pytest.approx(0.5)  # half the free slots unusable
    assert can_allocate(bm, [1] * 4, 4, max_tokens=12)  # first fit: the lowest run
    allocate(bm, "d", [1] * 4, 4, max_tokens=12)
    assert bm.get_reserved_blocks("d") == range(0, 4)
    bm.free("b")  # its run merges with the free run after it
    assert bm.get_free_ranges() == [(4, 8)]


def test_stats_split_reserved_slots_into_filled_future_and_internal_fragmentation():
    bm = ReservationKVCacheManager(64, 4, "orca-pow2", max_model_len=64)
    allocate(bm, "a", [1] * 5, 5, max_tokens=15)  # pow2: 32 slots = 8 blocks
    stats = bm.get_stats()
    assert stats.kv_allocation == "orca-pow2"
    assert stats.num_reserved_slots == 32
    assert stats.num_filled_slots == 5
    assert stats.num_future_slots == 15  # tokens 6..20 will still be written
    assert stats.internal_fragmentation_slots == 12  # slots 21..32: never used
    paged = KVCacheManager(16, 4, enable_prefix_caching=False)
    allocate(paged, "a", [1] * 5, 5)
    p = paged.get_stats()
    assert (p.num_reserved_slots, p.num_filled_slots, p.internal_fragmentation_slots) == (8, 5, 3)
    # The core's stats carry no reservation fields: nothing is held ahead, nothing is contiguous.
    assert not hasattr(p, "num_future_slots") and not hasattr(p, "external_fragmentation")


def test_reservation_policies_refuse_what_needs_shared_blocks():
    with pytest.raises(
        ValueError, match="enable_prefix_caching is not supported with kv_allocation=orca-max"
    ):
        EngineArgs(kv_allocation="orca-max").create_engine_config()
    with pytest.raises(ValueError, match="kv_allocation must be one of"):
        EngineArgs(kv_allocation="orca", enable_prefix_caching=False).create_engine_config()
    config = EngineArgs(
        kv_allocation="orca-oracle", enable_prefix_caching=False
    ).create_engine_config()
    assert config.cache.kv_allocation == "orca-oracle"
    bm = ReservationKVCacheManager(8, 4, "orca-max", max_model_len=16)
    allocate(bm, "a", [1] * 3, 3)
    with pytest.raises(NotImplementedError, match="cannot fork"):
        bm.fork("a", "b")


# ---------------------------------------------------------------------------------- properties
class ReservationMachine(RuleBasedStateMachine):
    """Random admissions, growth and frees under one reservation policy."""

    def __init__(self) -> None:
        super().__init__()
        self.bm: ReservationKVCacheManager | None = None
        self.final: dict[int, int] = {}
        self.next_id = 0

    @precondition(lambda self: self.bm is None)
    @rule(
        policy=st.sampled_from(ORCA), num_blocks=st.integers(4, 40), bs=st.sampled_from([1, 2, 4])
    )
    def start(self, policy: str, num_blocks: int, bs: int) -> None:
        self.bm = ReservationKVCacheManager(
            num_blocks, bs, policy, max_model_len=num_blocks * bs // 2
        )

    @precondition(lambda self: self.bm is not None)
    @rule(prompt=st.integers(1, 40), out=st.integers(1, 40))
    def admit(self, prompt: int, out: int) -> None:
        bm = self.bm
        assert bm is not None
        prompt = min(prompt, bm.max_model_len - 1)
        tokens = [1] * prompt
        if can_allocate(bm, tokens, prompt, max_tokens=out):
            allocate(bm, self.next_id, tokens, prompt, max_tokens=out)
            self.final[self.next_id] = min(prompt + out, bm.max_model_len)
            self.next_id += 1

    @precondition(lambda self: self.bm is not None and self.final)
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        bm = self.bm
        assert bm is not None
        seq = data.draw(st.sampled_from(sorted(self.final)))
        n = bm.get_num_slots(seq)
        if n < self.final[seq]:  # a reservation always has room for its request's next token
            assert bm.can_append_slots(seq, 1)
            bm.append_slots(seq, [1] * (n + 1), 1)

    @precondition(lambda self: self.bm is not None and self.final)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        assert self.bm is not None
        seq = data.draw(st.sampled_from(sorted(self.final)))
        self.bm.free(seq)
        del self.final[seq]

    @invariant()
    def no_block_is_in_two_hands(self) -> None:
        bm = self.bm
        if bm is None:
            return
        owner: dict[int, object] = {}
        for seq in self.final:
            reserved = bm.get_reserved_blocks(seq)
            table = bm.get_block_table(seq)
            assert table == list(reserved)[: len(table)]  # the table walks its own run, in order
            for block in reserved:
                assert block not in owner, f"block {block} reserved by {owner[block]} and {seq}"
                owner[block] = seq
                assert bm.block_pool.blocks[block].ref_cnt == 1
        free = [b for start, n in bm.get_free_ranges() for b in range(start, start + n)]
        assert not set(free) & set(owner), "a reserved block is also free"
        assert len(free) + len(owner) == bm.num_blocks == len(free) + len(set(owner))
        assert bm.num_free_blocks == len(free)
        ranges = bm.get_free_ranges()
        for (s1, n1), (s2, _) in itertools.pairwise(ranges):
            assert s1 + n1 < s2  # sorted, and touching runs were merged
        stats = bm.get_stats()
        assert stats.num_reserved_slots == len(owner) * bm.block_size
        parts = stats.num_filled_slots + stats.num_future_slots + stats.internal_fragmentation_slots
        assert parts == stats.num_reserved_slots
        assert min(stats.num_future_slots, stats.internal_fragmentation_slots) >= 0


class PagedMachine(RuleBasedStateMachine):
    """Paged allocation holds, per sequence, at most one block that is not full."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = KVCacheManager(24, 4, enable_prefix_caching=False)
        self.seqs: list[int] = []
        self.next_id = 0

    @rule(prompt=st.integers(1, 30))
    def admit(self, prompt: int) -> None:
        if can_allocate(self.bm, [1] * prompt, prompt):
            allocate(self.bm, self.next_id, [1] * prompt, prompt)
            self.seqs.append(self.next_id)
            self.next_id += 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(1, 6))
    def grow(self, data: st.DataObject, n: int) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        if self.bm.can_append_slots(seq, n):
            self.bm.append_slots(seq, [1] * (self.bm.get_num_slots(seq) + n), n)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        self.bm.free(seq)
        self.seqs.remove(seq)

    @invariant()
    def at_most_one_unfilled_block_per_sequence(self) -> None:
        bs = self.bm.block_size
        for seq in self.seqs:
            unused = len(self.bm.get_block_table(seq)) * bs - self.bm.get_num_slots(seq)
            assert 0 <= unused < bs
        stats = self.bm.get_stats()
        assert stats.internal_fragmentation_slots < max(1, len(self.seqs)) * bs


TestReservationMachine = ReservationMachine.TestCase
TestReservationMachine.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
TestPagedMachine = PagedMachine.TestCase
TestPagedMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


def test_the_trace_records_each_steps_kv_split():
    from minivllm.trace.recorder import _kv_slots

    bm = ReservationKVCacheManager(16, 4, "orca-oracle", max_model_len=32)
    allocate(bm, "a", [1] * 5, 5, max_tokens=4)
    assert _kv_slots(bm.get_stats()) == {
        "reserved": 12, "filled": 5, "future": 4, "internal_fragmentation": 3,
    }  # fmt: skip


def test_a_reservation_reads_the_final_length_from_the_sequence_it_admits():
    # Nobody hands it the length: prompt + max_tokens, from the sequence (None: up to the model).
    assert num_final_tokens(make_seq("a", [1] * 5, max_tokens=4)) == 9
    assert num_final_tokens(make_seq("a", [1] * 5, max_tokens=None)) is None
    bm = ReservationKVCacheManager(16, 4, "orca-oracle", max_model_len=32)
    bm.allocate_slots(make_seq("a", [1] * 5, max_tokens=None), 5)
    assert bm.get_reserved_blocks("a") == range(0, 8)  # max_model_len: 32 slots


def test_the_engine_asks_the_manager_whether_forks_may_share_blocks():
    assert KVCacheManager.supports_forks
    assert not ReservationKVCacheManager.supports_forks
