"""The hybrid KV cache coordinator's invariants, checked after every step of random programs.

As tests/core/test_kv_cache_manager_stateful.py does for one table, over four KV cache groups of one
pool: layers with windows (4, global, 7, 4) make a global group, two groups with a window of 4
and one with 7 (blocks of 3 slots, 28 blocks, a 3-token vocabulary so that prefixes repeat).
The programs admit (one prefix lookup, then the allocation), append, fork, free, preempt and
readmit, evict free cached blocks (the pool's pressure, which leaves windowed groups with holes
that a right-to-left hit must step over) and reset the cache, while a model of the KV cache
records what each block holds as the runner writes it. After every step: reference counts are
every group's holds and a block is in one group only; each windowed group has freed exactly the
blocks before its last query's window; every cached name describes what its block holds, in the
group that wrote it; a hit is the longest that every group holds (found by brute force over the
names), and hands out blocks that hold the prompt.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minivllm.core.kv_cache_coordinator import HybridKVCacheCoordinator
from minivllm.core.kv_cache_groups import get_kv_cache_groups, group_extra_keys
from minivllm.core.kv_cache_utils import NoFreeBlocksError
from minivllm.core.sliding_window_manager import SlidingWindowKVCacheManager
from tests.utils.kv_helpers import allocate, can_allocate, num_cached

NUM_BLOCKS = 28
BS = 3
GROUPS = get_kv_cache_groups((4, None, 7, 4))  # global (1), window 4 (0), window 4 (3), 7 (2)
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=12)


def skipped(m: object, sid: str) -> int:
    return m.num_skipped_blocks(sid) if isinstance(m, SlidingWindowKVCacheManager) else 0


class CoordinatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = HybridKVCacheCoordinator(NUM_BLOCKS, BS, True, GROUPS)
        self.tokens: dict[str, list[int]] = {}  # every known token of each held sequence
        self.query: dict[str, int] = {}  # the first position its last allocation computes
        self.content: dict[int, list[int | None]] = {i: [None] * BS for i in range(NUM_BLOCKS)}
        self.prefix: dict[int, tuple[int, ...]] = {}  # block -> all tokens up to its end, once full
        self.writer: dict[int, int] = {}  # block -> the group whose layers wrote it
        self.prompts: list[list[int]] = []
        self.next_id = 0

    # ------------------------------------------------------------------------ the KV-cache model

    def _write(self, sid: str, start: int, end: int) -> None:
        """Tokens [start, end) land in their slots of every group's table, as the runner writes."""
        tokens = self.tokens[sid]
        for g, m in enumerate(self.kv.managers):
            table = m.get_block_table(sid)
            for pos in range(start, end):
                block = table[pos // BS]
                self.content[block][pos % BS] = tokens[pos]
                self.writer[block] = g
                if pos % BS == BS - 1:
                    self.prefix[block] = tuple(tokens[: pos + 1])

    def _take_fresh(self, old: dict[int, list[int]], sid: str) -> None:
        """Blocks that entered `sid`'s tables hold nothing yet (a copy-on-write's are copied)."""
        for g, m in enumerate(self.kv.managers):  # placeholders are no block of `sid`'s
            for block in set(m.get_block_table(sid)[skipped(m, sid) :]) - set(old.get(g, [])):
                self.content[block] = [None] * BS
                self.prefix.pop(block, None)

    def _tables(self, sid: str) -> dict[int, list[int]]:
        return {g: list(m.get_block_table(sid)) for g, m in enumerate(self.kv.managers)}

    def _expected_hit(self, tokens: list[int]) -> int:
        """The longest hit every group holds, by brute force over the cache's names."""
        names = {
            (k.extra_keys, k.all_token_ids()) for k in self.kv.block_pool.cached_block_hash_to_block
        }

        def named(g: int, i: int) -> bool:
            return (group_extra_keys(g, None), tuple(tokens[: (i + 1) * BS])) in names

        for k in range((len(tokens) - 1) // BS, 0, -1):
            ok = True
            for g, group in enumerate(GROUPS):
                w = group.sliding_window
                first = 0 if w is None else max(0, k - max(1, -(-(w - 1) // BS)))
                ok = ok and all(named(g, i) for i in range(first, k))
            if ok:
                return k * BS
        return 0

    def _snapshot(self) -> tuple:
        kv = self.kv
        return (
            [b.ref_cnt for b in kv.block_pool.blocks],
            [b.block_id for b in kv.block_pool.free_block_queue],
            {
                k.all_token_ids(): b.block_id
                for k, b in kv.block_pool.cached_block_hash_to_block.items()
            },
            {s: (self._tables(s), kv.get_num_slots(s)) for s in self.tokens},
        )

    def _admit(self, sid: str, tokens: list[int], chunk: int) -> None:
        kv = self.kv
        hit = num_cached(kv, tokens)
        assert hit == self._expected_hit(tokens)
        num_new = min(chunk, len(tokens) - hit)
        can = can_allocate(kv, tokens, num_new)
        before = self._snapshot()
        try:
            assert allocate(kv, sid, tokens, num_new) == hit
        except NoFreeBlocksError:
            assert not can
            assert self._snapshot() == before
            return
        assert can
        for g, m in enumerate(kv.managers):  # a hit hands out blocks holding this prefix
            table = m.get_block_table(sid)
            for i in range(skipped(m, sid), hit // BS):
                assert self.prefix[table[i]] == tuple(tokens[: (i + 1) * BS])
                assert self.writer[table[i]] == g
        self._take_fresh({g: t[: hit // BS] for g, t in self._tables(sid).items()}, sid)
        self.tokens[sid], self.query[sid] = list(tokens), hit
        self._write(sid, hit, hit + num_new)
        self.prompts.append(list(tokens))

    def _held(self, index: int) -> str:
        return sorted(self.tokens)[index % len(self.tokens)]

    def _new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    # ----------------------------------------------------------------------------------- rules

    @rule(tokens=tokens_st, chunk=st.integers(0, 12))
    def allocate_new(self, tokens: list[int], chunk: int) -> None:
        self._admit(self._new_id(), tokens, chunk)

    @precondition(lambda self: self.prompts)
    @rule(
        index=st.integers(0, 1000),
        keep=st.integers(1, 12),
        suffix=st.lists(st.integers(0, 2), max_size=4),
        chunk=st.integers(0, 12),
    )
    def allocate_sharing_a_prefix(
        self, index: int, keep: int, suffix: list[int], chunk: int
    ) -> None:
        base = self.prompts[index % len(self.prompts)]
        self._admit(self._new_id(), base[:keep] + suffix, chunk)

    @precondition(lambda self: self.tokens)
    @rule(
        index=st.integers(0, 1000),
        n=st.integers(1, 4),
        sampled=st.lists(st.integers(0, 2), min_size=4, max_size=4),
    )
    def append(self, index: int, n: int, sampled: list[int]) -> None:
        kv, sid = self.kv, self._held(index)
        tokens, slots = self.tokens[sid], kv.get_num_slots(sid)
        tokens.extend(sampled[: max(0, slots + n - len(tokens))])  # decode: sampled tokens join
        old = self._tables(sid)
        can = kv.can_append_slots(sid, n)
        before = self._snapshot()
        try:
            kv.append_slots(sid, tokens, n)
        except NoFreeBlocksError:
            assert not can
            assert self._snapshot() == before  # checked before any window frees a block
            return
        assert can
        copies = kv.take_pending_copies()
        new = self._tables(sid)
        self._take_fresh(old, sid)
        for src, dst in copies:  # the runner copies a shared block before the step
            assert any(old[g][-1] == src and new[g][len(old[g]) - 1] == dst for g in old)
            self.content[dst] = list(self.content[src])
            self.writer[dst] = self.writer[src]
        self.query[sid] = slots
        self._write(sid, slots, slots + n)

    @precondition(lambda self: self.tokens)
    @rule(index=st.integers(0, 1000))
    def fork(self, index: int) -> None:
        parent, child = self._held(index), self._new_id()
        self.kv.fork(parent, child)
        self.tokens[child], self.query[child] = list(self.tokens[parent]), self.query[parent]
        assert self._tables(child) == self._tables(parent)

    @precondition(lambda self: self.tokens)
    @rule(index=st.integers(0, 1000))
    def free(self, index: int) -> None:
        sid = self._held(index)
        self.kv.free(sid)
        del self.tokens[sid]

    @precondition(lambda self: self.tokens)
    @rule(index=st.integers(0, 1000))
    def preempt_and_readmit(self, index: int) -> None:
        sid = self._held(index)
        tokens = self.tokens.pop(sid)
        self.kv.free(sid)
        self._admit(sid, tokens, len(tokens))

    @rule(index=st.integers(0, 1000))
    def evict_a_free_cached_block(self, index: int) -> None:
        free_named = [b for b in self.kv.block_pool.free_block_queue if b.block_hash is not None]
        if free_named:
            self.kv.block_pool.evict(free_named[index % len(free_named)])

    @rule()
    def reset_prefix_cache(self) -> None:
        pool = self.kv.block_pool
        held_cached = any(b.ref_cnt and b.block_hash is not None for b in pool.blocks)
        assert self.kv.reset_prefix_cache() is (not held_cached)

    @rule()
    def free_everything(self) -> None:
        for sid in list(self.tokens):
            self.kv.free(sid)
            del self.tokens[sid]
        assert self.kv.num_free_blocks == NUM_BLOCKS
        assert self.kv.num_held_blocks() == [0] * len(GROUPS)

    # ------------------------------------------------------------------------------ invariants

    @invariant()
    def ref_counts_are_every_groups_holds_and_a_block_is_in_one_group(self) -> None:
        kv = self.kv
        holders: Counter[int] = Counter()
        group_of: dict[int, int] = {}
        for g, m in enumerate(kv.managers):
            assert set(m._seqs) == set(self.tokens)
            for sid in self.tokens:
                for b in m.get_block_table(sid)[skipped(m, sid) :]:
                    holders[b] += 1
                    assert group_of.setdefault(b, g) == g
        free_ids = [b.block_id for b in kv.block_pool.free_block_queue]
        assert len(free_ids) == len(set(free_ids)) == kv.num_free_blocks
        for block in kv.block_pool.blocks:
            assert block.ref_cnt == holders[block.block_id]
            assert (block.ref_cnt == 0) == (block.block_id in set(free_ids))
        stats = kv.get_stats()
        assert stats.num_used_blocks == len(holders) == NUM_BLOCKS - stats.num_free_blocks

    @invariant()
    def each_windowed_group_freed_exactly_what_left_its_last_querys_window(self) -> None:
        for m, group in zip(self.kv.managers, GROUPS):
            for sid in self.tokens:
                slots = self.kv.get_num_slots(sid)
                assert m.get_num_slots(sid) == slots
                assert len(m.get_block_table(sid)) == -(-slots // BS)
                w = group.sliding_window
                if w is not None:
                    assert skipped(m, sid) == max(0, self.query[sid] - w + 1) // BS

    @invariant()
    def every_cached_name_matches_what_its_group_wrote(self) -> None:
        for key, block in self.kv.block_pool.cached_block_hash_to_block.items():
            assert block.block_hash is key
            assert self.content[block.block_id] == list(key.token_ids)
            assert self.prefix[block.block_id] == key.all_token_ids()
            assert key.extra_keys == group_extra_keys(self.writer[block.block_id], None)


CoordinatorMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCoordinatorInvariants = CoordinatorMachine.TestCase
