"""Engine counters: what `LLM.get_stats()` returns and what the server's /metrics exposes.

The names are a public interface (tests, benchmarks and docs read them). Memory numbers follow the
paper's Fig. 2 framing: of the KV slots allocated to requests, how many hold real token states.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    num_kv_blocks: int  # blocks in the KV cache
    num_free_kv_blocks: int  # held by no request (evictable prefix-cache blocks count as free)
    num_cached_kv_blocks: int  # blocks that carry a prefix-cache hash
    kv_cache_usage: float  # fraction of blocks held by requests
    num_running: int  # sequences holding blocks
    num_waiting: int  # sequences queued (new or preempted)
    num_preemptions: int
    num_prompt_tokens_computed: int  # prompt tokens whose K/V was computed (not cache hits)
    num_prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    num_prefix_cache_hit_tokens: int  # of those, served from the cache
    num_generated_tokens: int
    num_steps: int
    peak_kv_blocks_used: int  # the most blocks ever held at once
    kv_slot_utilization: float  # filled slots / allocated slots, now
    peak_kv_slot_utilization: float  # the same, at the step with the most blocks in use
    # How the slots held by requests split (BlockManagerStats has each field's meaning).
    num_reserved_kv_slots: int = 0
    num_filled_kv_slots: int = 0
    kv_internal_fragmentation_slots: int = 0
    kv_external_fragmentation: float = 0.0


@dataclass
class BlockManagerStats:
    """The block manager's own view: blocks, prefix-cache lookups and slot utilization."""

    num_total_blocks: int
    num_free_blocks: int  # blocks no sequence holds, including evictable cached blocks
    num_used_blocks: int  # blocks with ref count > 0 (used + free == total)
    num_cached_blocks: int  # blocks that carry a prefix-cache hash (held or evictable)
    num_evictable_blocks: int  # cached blocks that no sequence holds
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache (at admission)
    prefix_cache_hits: int  # of those, tokens served from the cache
    kv_slot_utilization: float  # filled slots / (used blocks * block_size) now; 1.0 when none used
    min_kv_slot_utilization: float  # lowest seen after any operation while blocks were used
    peak_kv_slot_utilization: float  # the utilization when used blocks were at their peak (latest)
    # The paper's Fig. 2 split of the slots held by sequences (minivllm/kv_allocation.py):
    # reserved = filled (token states) + future (reserved for tokens still to come) + internal
    # fragmentation (never filled: past the request's end, or the unfilled tail of a paged block).
    kv_allocation: str = "paged"
    num_reserved_slots: int = 0  # used blocks * block_size
    num_filled_slots: int = 0  # slots holding a token's K/V
    num_future_slots: int = 0  # reserved for tokens the sequences will still write (reservations)
    internal_fragmentation_slots: int = 0
    # Free slots outside the longest free contiguous run, as a fraction of the free slots: memory a
    # contiguous reservation cannot use. Always 0 for paged blocks, which need no contiguity.
    external_fragmentation: float = 0.0
    num_fragmentation_stalls: int = 0  # admissions refused with enough blocks free, none contiguous
