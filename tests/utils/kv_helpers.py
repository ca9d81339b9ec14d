"""Test helper: drive a KV cache manager the way the scheduler does, from plain token lists.

An admission is one prefix lookup (`get_computed_blocks`), then `allocate_slots` with its result;
the manager reads a `Sequence`, which these helpers build from an id and token ids.
"""

from __future__ import annotations

from collections.abc import Hashable

from minivllm.core.kv_cache_manager import NO_COMPUTED_BLOCKS, ComputedBlocks, KVCacheManager
from minivllm.core.kv_cache_utils import ExtraKeys
from minivllm.core.sequence import Request, Sequence
from minivllm.sampling_params import SamplingParams


def make_seq(seq_id: Hashable, token_ids: list[int], max_tokens: int | None = None) -> Sequence:
    """A sequence whose whole `token_ids` is its prompt; `max_tokens` bounds its output."""
    params = SamplingParams(max_tokens=max_tokens)
    request = Request(str(seq_id), None, list(token_ids), params)
    return Sequence(seq_id, request, 0, list(token_ids), len(token_ids), None, None)  # type: ignore[arg-type]


def lookup(
    kv: KVCacheManager, token_ids: list[int], extra_keys: ExtraKeys = None, use_cache: bool = True
) -> ComputedBlocks:
    return kv.get_computed_blocks(token_ids, extra_keys) if use_cache else NO_COMPUTED_BLOCKS


def num_cached(kv: KVCacheManager, token_ids: list[int], extra_keys: ExtraKeys = None) -> int:
    return kv.get_computed_blocks(token_ids, extra_keys).num_computed_tokens


def can_allocate(
    kv: KVCacheManager,
    token_ids: list[int],
    num_new_tokens: int,
    extra_keys: ExtraKeys = None,
    use_cache: bool = True,
    max_tokens: int | None = None,
) -> bool:
    computed = lookup(kv, token_ids, extra_keys, use_cache)
    return kv.can_allocate(make_seq("?", token_ids, max_tokens), num_new_tokens, computed)


def allocate(
    kv: KVCacheManager,
    seq_id: Hashable,
    token_ids: list[int],
    num_new_tokens: int,
    extra_keys: ExtraKeys = None,
    count_as_query: bool = True,
    use_cache: bool = True,
    max_tokens: int | None = None,
) -> int:
    """One admission: one lookup, then `allocate_slots` with its hit. Returns the hit in tokens."""
    computed = lookup(kv, token_ids, extra_keys, use_cache)
    seq = make_seq(seq_id, token_ids, max_tokens)
    return kv.allocate_slots(seq, num_new_tokens, computed, extra_keys, count_as_query)
