"""The KV cache manager's invariants (minivllm/core/), checked after every step of random programs (hypothesis).

The machine drives a small pool (10 blocks of 3 slots, a 3-token vocabulary, so prefixes repeat
and allocation pressure evicts often) through allocate / append / fork / free / preempt-and-readmit
/ prefix-cache hits / reset, while a model of the KV cache records which tokens each physical block
holds, as the model runner would write them (copy-on-write copies applied). After every step:
the free queue, ref counts and block tables agree; every cached name describes exactly what its
block holds (no stale hash can be served); and every hit hands out blocks holding the prompt's tokens.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minivllm.core.kv_cache_manager import KVCacheManager, UnknownSequenceError
from minivllm.core.kv_cache_utils import NoFreeBlocksError
from tests.utils.kv_helpers import allocate, can_allocate, num_cached

NUM_BLOCKS = 10
BS = 3
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=14)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = KVCacheManager(NUM_BLOCKS, block_size=BS)
        self.tokens: dict[str, list[int]] = {}  # every known token of each held sequence
        self.content: dict[int, list[int | None]] = {i: [None] * BS for i in range(NUM_BLOCKS)}
        self.prefix: dict[int, tuple[int, ...]] = {}  # block -> all tokens up to its end, once full
        self.prompts: list[list[int]] = []
        self.freed: list[str] = []
        self.next_id = 0

    # ------------------------------------------------------------------------ the KV-cache model

    def _write(self, sid: str, start: int, end: int) -> None:
        """Tokens [start, end) of `sid` land in their slots, as the model runner writes them."""
        table, tokens = self.bm.get_block_table(sid), self.tokens[sid]
        for pos in range(start, end):
            block = table[pos // BS]
            self.content[block][pos % BS] = tokens[pos]
            if pos % BS == BS - 1:
                self.prefix[block] = tuple(tokens[: pos + 1])

    def _take_fresh(self, blocks: list[int]) -> None:
        for block in blocks:
            self.content[block] = [None] * BS
            self.prefix.pop(block, None)

    def _expected_hit(self, tokens: list[int]) -> int:
        registered = {key.all_token_ids() for key in self.bm.block_pool.cached_block_hash_to_block}
        k = 0
        while (k + 1) * BS <= len(tokens) - 1 and tuple(tokens[: (k + 1) * BS]) in registered:
            k += 1
        return k * BS

    def _snapshot(self) -> tuple:
        bm = self.bm
        return (
            [b.ref_cnt for b in bm.block_pool.blocks],
            [b.block_id for b in bm.block_pool.free_block_queue],
            {
                k.all_token_ids(): b.block_id
                for k, b in bm.block_pool.cached_block_hash_to_block.items()
            },
            {s: (list(bm.get_block_table(s)), bm.get_num_slots(s)) for s in self.tokens},
            bm.get_stats(),
        )

    def _admit(self, sid: str, tokens: list[int], chunk: int) -> None:
        bm = self.bm
        hit = num_cached(bm, tokens)
        assert hit == self._expected_hit(tokens)
        num_new = min(chunk, len(tokens) - hit)
        can = can_allocate(bm, tokens, num_new)
        before = self._snapshot()
        try:
            assert allocate(bm, sid, tokens, num_new) == hit
        except NoFreeBlocksError:
            assert not can
            assert self._snapshot() == before
            return
        assert can
        table = bm.get_block_table(sid)
        for i in range(hit // BS):  # a hit hands out blocks holding exactly this prefix
            assert self.prefix[table[i]] == tuple(tokens[: (i + 1) * BS])
        self._take_fresh(table[hit // BS :])
        self.tokens[sid] = list(tokens)
        self._write(sid, hit, hit + num_new)
        self.prompts.append(list(tokens))

    def _held(self, index: int) -> str:
        return sorted(self.tokens)[index % len(self.tokens)]

    def _new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    # ----------------------------------------------------------------------------------- rules

    @rule(tokens=tokens_st, chunk=st.integers(0, 14))
    def allocate_new(self, tokens: list[int], chunk: int) -> None:
        self._admit(self._new_id(), tokens, chunk)

    @precondition(lambda self: self.prompts)
    @rule(
        index=st.integers(0, 1000),
        keep=st.integers(1, 14),
        suffix=st.lists(st.integers(0, 2), max_size=5),
        chunk=st.integers(0, 14),
    )
    def allocate_sharing_a_prefix(
        self, index: int, keep: int, suffix: list[int], chunk: int
    ) -> None:
        base = self.prompts[index % len(self.prompts)]
        self._admit(self._new_id(), base[:keep] + suffix, chunk)

    @precondition(lambda self: self.tokens)
    @rule(
        index=st.integers(0, 1000),
        n=st.integers(1, 5),
        sampled=st.lists(st.integers(0, 2), min_size=5, max_size=5),
    )
    def append(self, index: int, n: int, sampled: list[int]) -> None:
        bm, sid = self.bm, self._held(index)
        tokens, slots = self.tokens[sid], bm.get_num_slots(sid)
        tokens.extend(sampled[: max(0, slots + n - len(tokens))])  # decode: sampled tokens join
        old_table = list(bm.get_block_table(sid))
        can = bm.can_append_slots(sid, n)
        before = self._snapshot()
        try:
            bm.append_slots(sid, tokens, n)
        except NoFreeBlocksError:
            assert not can
            assert self._snapshot() == before
            return
        assert can
        table = bm.get_block_table(sid)
        copies = bm.take_pending_copies()
        assert len(copies) <= 1
        for src, dst in copies:  # the model runner copies the shared block before the step
            assert (old_table[-1], table[len(old_table) - 1]) == (src, dst)
            self._take_fresh([dst])
            self.content[dst] = list(self.content[src])
        self._take_fresh(table[len(old_table) :])
        self._write(sid, slots, slots + n)

    @precondition(lambda self: self.tokens)
    @rule(index=st.integers(0, 1000))
    def fork(self, index: int) -> None:
        parent, child = self._held(index), self._new_id()
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        assert self.bm.get_block_table(child) == self.bm.get_block_table(parent)

    @precondition(lambda self: self.tokens)
    @rule(index=st.integers(0, 1000))
    def free(self, index: int) -> None:
        sid = self._held(index)
        self.bm.free(sid)
        del self.tokens[sid]
        self.freed.append(sid)

    @precondition(lambda self: self.tokens)
    @rule(index=st.integers(0, 1000))
    def preempt_and_readmit(self, index: int) -> None:
        sid = self._held(index)
        tokens = self.tokens.pop(sid)
        self.bm.free(sid)
        self._admit(sid, tokens, len(tokens))
        if sid not in self.tokens:
            self.freed.append(sid)

    @precondition(lambda self: self.freed)
    @rule(index=st.integers(0, 1000))
    def free_again_raises(self, index: int) -> None:
        sid = self.freed[index % len(self.freed)]
        before = self._snapshot()
        try:
            self.bm.free(sid)
        except UnknownSequenceError:
            pass
        else:
            raise AssertionError(f"freeing {sid} twice did not raise")
        assert self._snapshot() == before

    @rule()
    def reset_prefix_cache(self) -> None:
        held_cached = any(b.ref_cnt and b.block_hash is not None for b in self.bm.block_pool.blocks)
        assert self.bm.reset_prefix_cache() is (not held_cached)
        if not held_cached:
            assert self.bm.block_pool.cached_block_hash_to_block == {}

    @rule()
    def free_everything(self) -> None:
        for sid in list(self.tokens):
            self.bm.free(sid)
            del self.tokens[sid]
            self.freed.append(sid)
        stats = self.bm.get_stats()
        assert stats.num_free_blocks == NUM_BLOCKS
        assert stats.num_evictable_blocks == stats.num_cached_blocks

    # ------------------------------------------------------------------------------ invariants

    @invariant()
    def ref_counts_match_block_tables_and_the_free_queue(self) -> None:
        bm = self.bm
        assert set(bm._seqs) == set(self.tokens)
        holders = Counter(b for sid in self.tokens for b in bm.get_block_table(sid))
        free_ids = [b.block_id for b in bm.block_pool.free_block_queue]
        assert len(free_ids) == len(set(free_ids)) == bm.num_free_blocks
        for block in bm.block_pool.blocks:
            assert block.ref_cnt == holders[block.block_id]
            assert (block.ref_cnt == 0) == (block.block_id in set(free_ids))  # never both
        stats = bm.get_stats()
        assert stats.num_used_blocks + stats.num_free_blocks == stats.num_total_blocks == NUM_BLOCKS
        assert stats.num_used_blocks == len(holders)
        if not self.tokens:
            assert stats.num_free_blocks == NUM_BLOCKS

    @invariant()
    def block_tables_have_ceil_slots_over_block_size_entries(self) -> None:
        for sid in self.tokens:
            slots = self.bm.get_num_slots(sid)
            assert len(self.bm.get_block_table(sid)) == -(-slots // BS)
            assert slots <= len(self.tokens[sid])

    @invariant()
    def every_cached_name_matches_its_blocks_content(self) -> None:
        bm = self.bm
        for key, block in bm.block_pool.cached_block_hash_to_block.items():
            assert block.block_hash is key
            assert self.content[block.block_id] == list(key.token_ids)
            assert self.prefix[block.block_id] == key.all_token_ids()
        named = [b for b in bm.block_pool.blocks if b.block_hash is not None]
        assert len(named) == len(bm.block_pool.cached_block_hash_to_block)
        stats = bm.get_stats()
        assert stats.num_cached_blocks == len(named)
        assert stats.num_evictable_blocks == sum(1 for b in named if b.ref_cnt == 0)

    @invariant()
    def utilization_counts_filled_slots_of_used_blocks(self) -> None:
        fill: dict[int, int] = {}
        for sid in self.tokens:
            slots = self.bm.get_num_slots(sid)
            for i, block in enumerate(self.bm.get_block_table(sid)):
                n = min(BS, slots - i * BS)
                assert fill.setdefault(block, n) == n  # sharers agree on what a block holds
        stats = self.bm.get_stats()
        expected = sum(fill.values()) / (len(fill) * BS) if fill else 1.0
        assert stats.kv_slot_utilization == expected
        assert stats.min_kv_slot_utilization <= expected or not fill


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerInvariants = BlockManagerMachine.TestCase
