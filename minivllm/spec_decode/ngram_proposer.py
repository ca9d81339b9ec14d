"""The n-gram proposer (prompt lookup decoding; vLLM's `vllm/v1/spec_decode/ngram_proposer.py`).

A sequence that copies from its context (a text to repeat, code to edit, a quoted document) often
continues the way it went on the last time its newest tokens appeared. The proposer looks for the
longest suffix of n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`, that occurred
earlier in the sequence (prompt and output), takes its latest occurrence, and drafts the k tokens
that followed it. No model runs, and there are no draft probabilities: the rejection sampler treats
the draft as a point mass, as vLLM does.

The search is bytes.rfind over the token ids packed as 4-byte integers: the scan runs in C, a few
microseconds for a thousand-token sequence, so proposing costs nothing next to a model step.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from minivllm.core.sequence import Sequence as EngineSequence
from minivllm.spec_decode.proposer import Draft


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose_drafts(self, wanted: Sequence[tuple[EngineSequence, int]]) -> list[Draft]:
        """Each sequence looks in its own tokens; the drafts are point masses (no q)."""
        return [Draft(self.propose(seq.token_ids, room)) for seq, room in wanted]

    def free(self, seq_id: int) -> None:
        """Nothing is kept between steps."""

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """At most min(k, max_tokens) tokens to verify after `token_ids`; [] when no n-gram
        of the allowed lengths recurs."""
        k = min(self.k, max_tokens)
        num_tokens = len(token_ids)
        if k <= 0 or num_tokens <= self.min_n:
            return []
        packed = array("i", token_ids).tobytes()  # 4 bytes per token
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            start = _rfind_tokens(packed, packed[-4 * n :], 4 * (num_tokens - 1))
            if start >= 0:  # the match is tokens [start, start + n): draft what followed it
                return list(token_ids[start + n : start + n + k])
        return []


def _rfind_tokens(packed: bytes, pattern: bytes, end: int) -> int:
    """The token index of the latest occurrence of `pattern` inside packed[:end] that starts on a
    token boundary, or -1. (A byte match off the 4-byte grid is no match: keep looking left.)"""
    while True:
        at = packed.rfind(pattern, 0, end)
        if at < 0 or at % 4 == 0:
            return at // 4 if at >= 0 else -1
        end = at + len(pattern) - 1
