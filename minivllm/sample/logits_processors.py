"""The logits processors: one ordered pipeline, applied to each row before sampling.

vLLM v1 has the same idea (`vllm/v1/sample/logits_processor/`): every request-level rule that
edits logits — "not EOS yet", "less of what was said", "only what the grammar allows" — is one
step of a pipeline over the batch's [B, V] logits, rather than a branch of the sampler per field.
Each processor is a pure function `(logits, meta) -> logits` of the step's `SamplingMetadata`,
returns its input unchanged (and costs nothing) when no row of the batch uses it, and touches only
the rows that ask for it. The order, each before temperature, min_p, top-k and top-p:

    allowed_token_ids -> bad words -> min_tokens -> logit_bias -> penalties -> grammar bitmask

(vLLM v1's order: the whitelist and the bans first, then the processors that change values.) A
new processor is one function and one entry in `LOGITS_PROCESSORS`; its per-row inputs go into
`SamplingMetadata.from_rows`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from minivllm.sample.metadata import SamplingMetadata


def apply_allowed_token_ids(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """Every token outside a row's `allowed_token_ids` to -inf, on the rows that have them."""
    if meta.allowed_mask is None:
        return logits
    rows = meta.allowed_rows
    logits = logits.clone()
    logits[rows] = logits[rows].masked_fill(~meta.allowed_mask, float("-inf"))
    return logits


def apply_bad_words(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """The token that would complete a bad word to -inf (its only token, or its last one right
    after the rest of it)."""
    if meta.bad_words_rows.numel() == 0:
        return logits
    index = (meta.bad_words_rows, meta.bad_words_token_ids)
    return logits.index_put(index, torch.tensor(float("-inf"), device=logits.device))


def apply_logit_bias(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """OpenAI's `logit_bias`: each (row, token)'s bias added to its logit."""
    if meta.logit_bias_rows.numel() == 0:
        return logits
    index = (meta.logit_bias_rows, meta.logit_bias_token_ids)
    return logits.index_put(index, meta.logit_bias_values.to(logits.dtype), accumulate=True)


def apply_min_tokens(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """EOS and stop_token_ids to -inf while a row's output is shorter than its min_tokens."""
    if meta.min_tokens_rows.numel() == 0:
        return logits
    index = (meta.min_tokens_rows, meta.min_tokens_token_ids)
    return logits.index_put(index, torch.tensor(float("-inf"), device=logits.device))


def apply_penalties(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """vLLM's penalties. Repetition (Keskar et al., CTRL) divides a positive logit by the penalty
    and multiplies a negative one, for tokens seen in prompt or output; frequency and presence
    (OpenAI's definition) subtract per occurrence / once, for tokens seen in the output only."""
    if meta.no_penalties or meta.output_token_counts is None:
        return logits
    counts = meta.output_token_counts  # [B, V]
    in_output = counts > 0
    if meta.prompt_token_mask is not None:
        penalty = meta.repetition_penalty[:, None]
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(meta.prompt_token_mask | in_output, penalized, logits)
    logits = logits - meta.frequency_penalty[:, None] * counts
    return logits - meta.presence_penalty[:, None] * in_output


# BITS[b, k]: bit k of the byte b, for unpacking a bitmask a byte at a time (one lookup per byte
# is cheaper on a CPU than 32 shifts per int32 word).
_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()  # [256, 8]


def bitmask_to_bool(bitmask: Tensor, vocab_size: int) -> Tensor:
    """int32 [G, ceil(V/32)] -> bool [G, V]: bit t % 32 of word t // 32 says token t is allowed
    (xgrammar's layout, and vLLM's). Read as little-endian bytes, that is bit t % 8 of byte t // 8."""
    table = _BITS.to(bitmask.device)
    as_bytes = bitmask.contiguous().view(torch.uint8).long()  # [G, 4 * ceil(V/32)]
    return table[as_bytes].flatten(1)[:, :vocab_size]


def apply_grammar_bitmask(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """Tokens the row's grammar does not allow next to -inf — on the constrained rows only.

    The grammar has the last word: where an earlier processor (min_tokens masking EOS) and the
    grammar (only EOS may come: the structure is complete) leave no token at all, the row keeps
    the grammar's choice, so a constrained row is never without a token to sample.
    """
    if meta.grammar_bitmask is None:
        return logits
    rows = meta.grammar_rows  # int64 [G]
    allowed = bitmask_to_bool(meta.grammar_bitmask.to(logits.device), logits.shape[-1])  # [G, V]
    masked = logits[rows].masked_fill_(~allowed, float("-inf"))  # [G, V], a copy of the rows
    dead = torch.isinf(masked).all(dim=-1) & allowed.any(dim=-1)  # [G]
    if bool(dead.any()):
        masked[dead] = torch.where(allowed[dead], 0.0, float("-inf"))
    logits = logits.clone()
    logits[rows] = masked
    return logits


LogitsProcessor = Callable[[Tensor, SamplingMetadata], Tensor]

# The pipeline, in order. Logprobs are taken before it (they describe the model).
LOGITS_PROCESSORS: tuple[LogitsProcessor, ...] = (
    apply_allowed_token_ids,
    apply_bad_words,
    apply_min_tokens,
    apply_logit_bias,
    apply_penalties,
    apply_grammar_bitmask,
)


def apply_logits_processors(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    for processor in LOGITS_PROCESSORS:
        logits = processor(logits, meta)
    return logits
