"""What the sampler reads for one step: each row's parameters as [B] tensors, built once.

vLLM v1 keeps the same split (`vllm/v1/sample/metadata.py`): the sampler (`sampler.py`) and the
logits processors (`logits_processors.py`) are pure functions of the step's logits and this
metadata, so neither imports the other's module to know what a row asked for. `from_rows` turns
the scheduled sequences' `SamplingParams` into tensors once per step; everything per-token
(penalty counts, the min_tokens mask, the grammar bitmask) is gathered here too.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from minivllm.core.sequence import Sequence as Seq
from minivllm.sampling_params import SamplingParams
from minivllm.structured_output.backend import StructuredOutputGrammar, sync_grammar


@dataclass
class SamplingRow:
    """One sequence to sample the next token for."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None  # on the logits' device; None: the global RNG
    eos_token_id: int | None = None
    grammar: StructuredOutputGrammar | None = None  # structured outputs: the sequence's matcher
    bad_words_token_ids: Sequence[Sequence[int]] = ()  # the request's bad words, tokenized

    @classmethod
    def of(cls, seq: Seq, eos_token_id: int | None) -> SamplingRow:
        """The row of an engine sequence: its request's parameters, its tokens, its own state."""
        return cls(
            seq.request.params,
            seq.prompt_token_ids,
            seq.output_token_ids,
            seq.generator,
            eos_token_id,
            seq.grammar,
            seq.request.bad_words_token_ids,
        )


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs as tensors, built once per step by `from_rows`."""

    temperature: Tensor  # float32 [B]  0.0 on greedy rows
    top_k: Tensor  # int64 [B]          vocab size where disabled
    top_p: Tensor  # float32 [B]
    min_p: Tensor  # float32 [B]
    presence_penalty: Tensor  # float32 [B]
    frequency_penalty: Tensor  # float32 [B]
    repetition_penalty: Tensor  # float32 [B]
    output_token_counts: Tensor | None  # float32 [B, V]  None when no row has a penalty
    prompt_token_mask: Tensor | None  # bool [B, V]  None when no row has a repetition penalty
    # (row, token id) pairs set to -inf: the stop tokens of rows still short of min_tokens.
    min_tokens_rows: Tensor  # int64 [M]
    min_tokens_token_ids: Tensor  # int64 [M]
    # Structured outputs: the rows under a grammar and what each allows next (None: no such row).
    grammar_rows: Tensor  # int64 [G]
    grammar_bitmask: Tensor | None  # int32 [G, ceil(V/32)], on the host (xgrammar fills it there)
    # allowed_token_ids: the rows that have it and, per such row, which tokens may come.
    allowed_rows: Tensor  # int64 [A]
    allowed_mask: Tensor | None  # bool [A, V]  None: no row restricts its tokens
    # (row, token id) pairs set to -inf: bad words' next tokens (one-token words, or a word's
    # last token right after the rest of it).
    bad_words_rows: Tensor  # int64 [W]
    bad_words_token_ids: Tensor  # int64 [W]
    # logit_bias as (row, token id, bias) triples, added to the logits.
    logit_bias_rows: Tensor  # int64 [L]
    logit_bias_token_ids: Tensor  # int64 [L]
    logit_bias_values: Tensor  # float32 [L]
    generators: list[torch.Generator | None]  # [B]  None for greedy rows: they draw nothing
    max_num_logprobs: int | None  # largest `logprobs` in the batch; None when nobody asked
    all_greedy: bool
    all_random: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    no_penalties: bool

    @classmethod
    def from_rows(
        cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str
    ) -> SamplingMetadata:
        params = [row.params for row in rows]

        def floats(values: list[float]) -> Tensor:
            if not values:  # most lists of a plain batch: one shared empty tensor, not a new one
                return _empty(torch.float32, torch.device(device))
            return torch.tensor(values, dtype=torch.float32, device=device)

        def ints(values: list[int]) -> Tensor:
            if not values:
                return _empty(torch.int64, torch.device(device))
            return torch.tensor(values, dtype=torch.int64, device=device)

        greedy = [p.is_greedy for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        presence = [p.presence_penalty for p in params]
        frequency = [p.frequency_penalty for p in params]
        repetition = [p.repetition_penalty for p in params]
        counts, prompt_mask = _penalty_counts(rows, vocab_size, device)
        mask_rows, mask_ids = _min_tokens_mask(rows, vocab_size)
        grammar_rows, bitmask = _grammar_bitmask(rows, vocab_size)
        allowed_rows, allowed_mask = _allowed_mask(params, vocab_size, device)
        bad_rows, bad_ids = _bad_word_tokens(rows)
        bias = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
        requested = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=floats([0.0 if g else p.temperature for g, p in zip(greedy, params)]),
            top_k=ints(top_k),
            top_p=floats([p.top_p for p in params]),
            min_p=floats([p.min_p for p in params]),
            presence_penalty=floats(presence),
            frequency_penalty=floats(frequency),
            repetition_penalty=floats(repetition),
            output_token_counts=counts,
            prompt_token_mask=prompt_mask,
            min_tokens_rows=ints(mask_rows),
            min_tokens_token_ids=ints(mask_ids),
            grammar_rows=ints(grammar_rows),
            grammar_bitmask=bitmask,
            allowed_rows=ints(allowed_rows),
            allowed_mask=allowed_mask,
            bad_words_rows=ints(bad_rows),
            bad_words_token_ids=ints(bad_ids),
            logit_bias_rows=ints([i for i, _, _ in bias]),
            logit_bias_token_ids=ints([t for _, t, _ in bias]),
            logit_bias_values=floats([b for _, _, b in bias]),
            # Greedy rows draw no noise, so a seeded row's stream depends on its own steps only.
            generators=[None if g else row.generator for g, row in zip(greedy, rows)],
            max_num_logprobs=max(requested) if requested else None,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_top_k=all(k == vocab_size for k in top_k),
            no_top_p=all(p.top_p == 1.0 for p in params),
            no_min_p=all(p.min_p == 0.0 for p in params),
            no_penalties=counts is None,
        )


@functools.cache
def _empty(dtype: torch.dtype, device: torch.device) -> Tensor:
    """An empty tensor, made once per dtype and device: having no elements, it is never written,
    so every step's metadata may share it."""
    return torch.empty(0, dtype=dtype, device=device)


def _penalty_counts(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str
) -> tuple[Tensor | None, Tensor | None]:
    """Output-token counts [B, V] where any row has a penalty (None: no row has one), and the
    prompt's tokens [B, V] (bool) where any row has a repetition penalty."""
    params = [row.params for row in rows]
    has_repetition = any(p.repetition_penalty != 1.0 for p in params)
    if not has_repetition and not any(p.presence_penalty or p.frequency_penalty for p in params):
        return None, None
    counts = _token_counts([r.output_token_ids for r in rows], vocab_size, device)
    prompt_mask = None
    if has_repetition:
        prompt_mask = _token_counts([r.prompt_token_ids for r in rows], vocab_size, device) > 0
    return counts, prompt_mask


def _min_tokens_mask(rows: Sequence[SamplingRow], vocab_size: int) -> tuple[list[int], list[int]]:
    """(row, token) pairs to mask: the stop tokens of rows still short of `min_tokens`."""
    mask_rows: list[int] = []
    mask_ids: list[int] = []
    for i, row in enumerate(rows):
        # The next token is output token number len(output) + 1.
        if not row.params.stops_allowed(len(row.output_token_ids) + 1):
            ids = sorted(row.params.all_stop_token_ids(row.eos_token_id))
            ids = [t for t in ids if t < vocab_size]
            mask_rows += [i] * len(ids)
            mask_ids += ids
    return mask_rows, mask_ids


def _grammar_bitmask(
    rows: Sequence[SamplingRow], vocab_size: int
) -> tuple[list[int], Tensor | None]:
    """The rows under a grammar and their allowed tokens, one bit each: int32 [G, ceil(V / 32)]."""
    grammar_rows = [i for i, row in enumerate(rows) if row.grammar is not None]
    if not grammar_rows:
        return [], None
    bitmask = torch.full((len(grammar_rows), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for g, i in enumerate(grammar_rows):
        grammar = rows[i].grammar
        assert grammar is not None
        sync_grammar(grammar, rows[i].output_token_ids)
        grammar.fill_bitmask(bitmask, g)
    return grammar_rows, bitmask


def _allowed_mask(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str
) -> tuple[list[int], Tensor | None]:
    """The rows with `allowed_token_ids` and their tokens: bool [A, V]."""
    allowed_rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not allowed_rows:
        return [], None
    allowed_mask = torch.zeros(len(allowed_rows), vocab_size, dtype=torch.bool)
    for a, i in enumerate(allowed_rows):
        allowed_mask[a, params[i].allowed_token_ids] = True
    return allowed_rows, allowed_mask.to(device)


def _bad_word_tokens(rows: Sequence[SamplingRow]) -> tuple[list[int], list[int]]:
    """(row, token) pairs to ban: each bad word's last token where the output ends with the
    rest of the word (a one-token word: always)."""
    bad_rows: list[int] = []
    bad_ids: list[int] = []
    for i, row in enumerate(rows):
        if not row.bad_words_token_ids:
            continue
        output = list(row.output_token_ids)
        for word in row.bad_words_token_ids:
            *prefix, last = word
            if not prefix or output[len(output) - len(prefix) :] == prefix:
                bad_rows.append(i)
                bad_ids.append(last)
    return bad_rows, bad_ids


def _token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> Tensor:
    """How often each token id occurs in each row: float32 [B, V], by one scatter_add.

    Rows are padded with the id `vocab_size`, which lands in an extra column that is dropped.
    """
    width = max((len(ids) for ids in token_ids), default=0)
    padded = [list(ids) + [vocab_size] * (width - len(ids)) for ids in token_ids]
    index = torch.tensor(padded, dtype=torch.int64, device=device).view(len(token_ids), width)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab_size]
