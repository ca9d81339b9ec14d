"""Speculative decoding's counters (vLLM's `SpecDecodingStats`, vllm/v1/spec_decode/metrics.py).

They reach `LLM.get_stats()` (`EngineStats.spec_decode_*`), the server's /metrics
(`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
`..._num_accepted_tokens_per_pos`) and its stats log line, under vLLM's names. A "draft" is one
sequence's drafts in one step; the acceptance rate at position i is
num_accepted_tokens_per_pos[i] / num_drafts, and the mean acceptance length (kept tokens per
verification, the bonus token included) is 1 + num_accepted_tokens / num_drafts.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

logger = logging.getLogger("minivllm")


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


def log_spec_decode(stats: Any, prev: Any, elapsed: float) -> None:
    """vLLM's "SpecDecoding metrics" line, over the interval since `prev` (two `EngineStats`:
    minivllm.engine.stats imports this module, so the type is not named here)."""
    drafts = stats.spec_decode_num_drafts - prev.spec_decode_num_drafts
    if drafts <= 0:
        return
    drafted = stats.spec_decode_num_draft_tokens - prev.spec_decode_num_draft_tokens
    accepted = stats.spec_decode_num_accepted_tokens - prev.spec_decode_num_accepted_tokens
    before = prev.spec_decode_num_accepted_tokens_per_pos or (0,) * len(
        stats.spec_decode_num_accepted_tokens_per_pos
    )
    rates = [
        (now - then) / drafts
        for now, then in zip(stats.spec_decode_num_accepted_tokens_per_pos, before)
    ]
    logger.info(
        "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
        "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
        "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
        1 + accepted / drafts,
        accepted / elapsed,
        drafted / elapsed,
        accepted,
        drafted,
        ", ".join(f"{r:.3f}" for r in rates),
        100 * accepted / drafted if drafted else float("nan"),
    )
