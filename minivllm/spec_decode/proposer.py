"""What a proposer hands the verification step: a sequence's drafted tokens, with their odds.

vLLM v1's proposers (`vllm/v1/spec_decode/`) return draft token ids, and those that sample their
drafts also return the draft distribution q, which the rejection sampler needs to keep a draft
with probability min(1, p / q). A proposer that drafts deterministically (the n-gram lookup, a
draft model's argmax for a greedy request) has no q: each draft is a point mass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from minivllm.core.sequence import Sequence as EngineSequence

if TYPE_CHECKING:
    import torch


@dataclass
class Draft:
    token_ids: list[int]  # [k']  the tokens to verify, k' <= k
    probs: torch.Tensor | None = None  # float32 [k', V]  q of each draft; None: point masses


NO_DRAFT = Draft([])


class Proposer(Protocol):
    def propose_drafts(self, wanted: Sequence[tuple[EngineSequence, int]]) -> list[Draft]:
        """One draft per (sequence, room) pair, at most `room` tokens long (the tokens the
        request may still make, the bonus token set aside)."""
        ...

    def free(self, seq_id: int) -> None:
        """The sequence ended: drop whatever the proposer keeps for it."""
        ...
