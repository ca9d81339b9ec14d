"""Speculative decoding's counters (vLLM's `SpecDecodingStats`, vllm/v1/spec_decode/metrics.py).

They reach `LLM.get_stats()` (`EngineStats.spec_decode_*`), the server's /metrics
(`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
`..._num_accepted_tokens_per_pos`) and its stats log line, under vLLM's names. A "draft" is one
sequence's drafts in one step; the acceptance rate at position i is
num_accepted_tokens_per_pos[i] / num_drafts, and the mean acceptance length (kept tokens per
verification, the bonus token included) is 1 + num_accepted_tokens / num_drafts.

Tier: engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class SpecDecodingStats:
    """vLLM's `SpecDecodingStats` (vllm/v1/spec_decode/metrics.py), cumulative."""

    num_spec_tokens: int  # k
    num_drafts: int = 0  # verification groups with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)  # [k]

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    def engine_stats_fields(self) -> dict[str, Any]:
        """The `EngineStats.spec_decode_*` fields (`LLM.get_stats()`)."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": tuple(self.num_accepted_tokens_per_pos),
        }
