"""Engine counters: what `LLM.get_stats()` returns and what the server's /metrics exposes.

The names are a public interface (tests, benchmarks and docs read them). Memory numbers follow the
paper's Fig. 2 framing: of the KV slots allocated to requests, how many hold real token states.

`StatsCollector` is a step listener (minivllm/engine/step_listener.py), like the step trace: it counts
the committed steps and the tokens they sampled; the rest is read when asked from the
KV cache manager and the scheduler, which count their own events (`KVCacheManagerStats`, in
core/kv_cache_utils.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.kv_cache_utils import BlockPoolSnapshot
from minivllm.core.scheduler import Scheduler, SchedulerOutput
from minivllm.core.sequence import Sequence
from minivllm.engine.step_listener import StepOutputs
from minivllm.spec_decode.metrics import SpecDecodingStats


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
    num_steps: int  # steps that committed (a failed step publishes nothing)
    peak_kv_blocks_used: int  # the most blocks ever held at once
    kv_slot_utilization: float  # filled slots / allocated slots, now
    peak_kv_slot_utilization: float  # the same, at the step with the most blocks in use
    # How the slots held by requests split (KVCacheManagerStats has each field's meaning).
    num_reserved_kv_slots: int = 0
    num_filled_kv_slots: int = 0
    kv_internal_fragmentation_slots: int = 0
    # Speculative decoding, cumulative (vLLM's spec_decode_* series); per_pos is () when it is off.
    spec_decode_num_drafts: int = 0  # sequences that verified at least one draft, per step
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # [k] kept at draft position i
    # LoRA adapter name -> requests running / waiting under it (vLLM's SchedulerStats fields,
    # behind its vllm:lora_requests_info gauge); empty without adapters.
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)


class StatsCollector:
    """The engine's own step listener, behind `get_stats()`."""

    def __init__(self, scheduler: Scheduler, kv_cache_manager: KVCacheManager) -> None:
        self.scheduler = scheduler
        self.kv_cache_manager = kv_cache_manager
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.spec_decoding: SpecDecodingStats | None = None  # set by the speculator, if any

    def on_step(
        self, scheduler_output: SchedulerOutput, outputs: StepOutputs, blocks: BlockPoolSnapshot
    ) -> None:
        self.num_steps += 1
        self.num_generated_tokens += len(outputs.sampled)

    def get_stats(self) -> EngineStats:
        bm, scheduler = self.kv_cache_manager.get_stats(), self.scheduler
        return EngineStats(
            num_kv_blocks=bm.num_total_blocks,
            num_free_kv_blocks=bm.num_free_blocks,
            num_cached_kv_blocks=bm.num_cached_blocks,
            kv_cache_usage=bm.num_used_blocks / bm.num_total_blocks if bm.num_total_blocks else 0.0,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_preemptions=scheduler.num_preemptions,
            num_prompt_tokens_computed=scheduler.num_prompt_tokens_computed,
            num_prefix_cache_queries=bm.prefix_cache_queries,
            num_prefix_cache_hit_tokens=bm.prefix_cache_hits,
            num_generated_tokens=self.num_generated_tokens,
            num_steps=self.num_steps,
            peak_kv_blocks_used=bm.peak_used_blocks,
            kv_slot_utilization=bm.kv_slot_utilization,
            peak_kv_slot_utilization=bm.peak_kv_slot_utilization,
            num_reserved_kv_slots=bm.num_reserved_slots,
            num_filled_kv_slots=bm.num_filled_slots,
            kv_internal_fragmentation_slots=bm.internal_fragmentation_slots,
            running_lora_adapters=requests_per_lora(scheduler.running),
            waiting_lora_adapters=requests_per_lora(scheduler.waiting),
            **(self.spec_decoding.engine_stats_fields() if self.spec_decoding else {}),
        )


def requests_per_lora(seqs: Iterable[Sequence]) -> dict[str, int]:
    """Adapter name -> how many requests (not sequences: n > 1 forks count once) of `seqs`."""
    requests = {s.request.request_id: s.request.lora_request for s in seqs}
    return dict(Counter(lora.lora_name for lora in requests.values() if lora is not None))
