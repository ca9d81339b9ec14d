"""The encoder-only KV cache manager (minivllm/core/encoder_only_manager.py): sequences are tracked,
no block is ever taken, and a scheduler over it admits whole prompts however many run at once."""

from __future__ import annotations

import pytest

from minivllm.config import SchedulerConfig
from minivllm.core.encoder_only_manager import EncoderOnlyKVCacheManager
from minivllm.core.kv_cache_utils import UnknownSequenceError
from minivllm.core.scheduler import Scheduler
from tests.utils.kv_helpers import allocate, make_seq


def test_sequences_get_slots_but_no_blocks() -> None:
    kv = EncoderOnlyKVCacheManager(block_size=4)
    for i, n in enumerate([1, 4, 9, 300]):
        assert allocate(kv, i, list(range(n)), n) == 0  # no prefix cache: no hit
        assert kv.get_block_table(i) == [] and kv.get_num_slots(i) == n
    stats = kv.get_stats()
    assert (stats.num_total_blocks, stats.num_free_blocks, stats.num_used_blocks) == (0, 0, 0)
    assert kv.usage == 0.0 and kv.take_pending_copies() == []
    for i in range(4):
        kv.free(i)
    assert not kv.has_seq(0)
    with pytest.raises(UnknownSequenceError):
        kv.free(0)
    with pytest.raises(ValueError, match="cannot share blocks"):
        kv.check_forks_allowed()


def test_scheduler_admits_whole_prompts_up_to_the_token_budget_not_blocks() -> None:
    """Unchunked scheduling (an encoder's): every prompt that fits the budget is admitted whole in
    one step; the next waits for the next step, not for a block."""
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=100, enable_chunked_prefill=False
    )
    scheduler = Scheduler(config, EncoderOnlyKVCacheManager())
    for i, n in enumerate([40, 50, 30]):
        scheduler.add_seq(make_seq(i, list(range(n))))
    out = scheduler.schedule()
    assert [(s.seq_id, s.num_new_tokens, s.block_table) for s in out.scheduled] == [
        (0, 40, []),
        (1, 50, []),
    ]
    assert [s.seq_id for s in scheduler.waiting] == [2]
