"""The KV cache manager of an encoder-only model: it holds no blocks at all.

vLLM gives an encoder-only model (BERT and the embedding models built on it, whose attention layers
are `AttentionType.ENCODER_ONLY`) no KV cache spec, so its KV cache config has no groups and the
scheduler allocates no block for its requests. Here the same: an encoder's attention
(`AttentionBackend.attend_encoder`) reads the step's own keys and values and writes no cache,
because each prompt runs whole in one step and nothing reads its K/V again. So this manager tracks
each sequence's slot count (the scheduler's bookkeeping) and hands out empty block tables; no
admission ever waits for a block, and the model runner allocates a cache of zero blocks.

What it cannot do is refused where it is asked: chunked prefill (a chunk would attend without the
rest of its prompt) is turned off for an encoder by the engine's pooler resolution
(`enable_chunked_prefill=False`, the token budget raised to `max_model_len`), the prefix cache
with it; and forks (n > 1, beam search) are no pooling request's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence as TokenIds
from typing import TYPE_CHECKING, ClassVar

from minivllm.core.block_pool import BlockPool
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.kv_cache_utils import ComputedBlocks, SeqBlocks, SeqId

if TYPE_CHECKING:
    from minivllm.config import CacheConfig


class EncoderOnlyKVCacheManager(KVCacheManager):
    """Per-sequence slot counts with empty block tables, over an empty pool."""

    supports_forks: ClassVar[bool] = False  # a pooling request samples nothing to fork on

    def __init__(self, block_size: int = 16) -> None:
        super().__init__(1, block_size, enable_prefix_caching=False, block_pool=BlockPool(0, False))
        self.num_blocks = 0  # the base class's argument check wants one; the pool has none

    @classmethod
    def from_config(
        cls, cache: CacheConfig, num_blocks: int, max_model_len: int
    ) -> EncoderOnlyKVCacheManager:
        return cls(cache.block_size)

    @classmethod
    def max_num_tokens(cls, cache: CacheConfig, num_blocks: int, token_budget: int) -> int:
        """No cache bounds a request: the model's positions (max_model_len) do."""
        return sys.maxsize

    @property
    def usage(self) -> float:
        return 0.0

    def get_num_blocks_to_allocate(self, computed: ComputedBlocks, num_new_tokens: int) -> int:
        return 0

    def get_num_blocks_to_append(self, seq_id: SeqId, num_new_tokens: int) -> int:
        return 0

    def _grow(self, seq: SeqBlocks, token_ids: TokenIds[int], num_new_tokens: int) -> None:
        seq.num_slots += num_new_tokens  # slots without blocks: nothing is stored


__all__ = ["EncoderOnlyKVCacheManager"]
