"""The sampler: one batched call turns the step's logits into next tokens (and logprobs).

The order of the phases is vLLM v1's (`vllm/v1/sample/sampler.py`):

    raw logits --log_softmax--> logprobs (what the model thinks, before any processing)
      -> logits processors      (`logits_processors.py`, one ordered pipeline, row by row:)
           min_tokens masking   (EOS and stop_token_ids to -inf while the output is too short)
           penalties            (repetition over prompt+output; frequency, presence over output)
           grammar bitmask      (structured outputs: what the row's grammar allows next)
      -> greedy rows: argmax    (of the processed logits)
      -> temperature -> min_p -> top_k -> top_p
      -> random rows: exponential race, argmax(probs / q) with q ~ Exp(1)

Everything is a tensor operation over the whole batch [B, V]; the only Python loop is over the
rows that carry their own `torch.Generator`, because a generator draws for one row at a time.
That loop is what makes a seeded request reproducible whatever else shares its batch: its noise
comes from its own generator alone, one Exp(1) vector of size V per random step.

Why the exponential race on a GPU: if q_i ~ Exp(1) independently, argmax_i p_i / q_i is
distributed as Categorical(p) (the "Gumbel-max trick" in another guise). It needs no cumulative
sum and no `torch.multinomial`, which synchronizes with the host on CUDA; vLLM uses it for the same
reasons. On a CPU nothing synchronizes, and the B x V exponential draws are the expensive part
(V random numbers a row against multinomial's one), so there `torch.multinomial` is used
instead; both are exact samplers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from minivllm.platforms import platform_for
from minivllm.sample.logits_processors import (
    apply_logits_processors,
    apply_min_tokens,
    apply_penalties,
)
from minivllm.sample.metadata import SamplingMetadata, SamplingRow
from minivllm.sampling_params import SAMPLING_EPS

__all__ = ["Sampler", "SamplingMetadata", "SamplingRow", "apply_min_tokens", "apply_penalties"]

# ----------------------------------------------------------------------------------------------
# Inputs and outputs
# ----------------------------------------------------------------------------------------------


class LogprobsTensors(NamedTuple):
    logprob_token_ids: Tensor  # int64 [B, k]   the k most likely token ids, most likely first
    logprobs: Tensor  # float32 [B, k]            their logprobs
    sampled_logprobs: Tensor  # float32 [B]       logprob of the sampled token
    sampled_token_ranks: Tensor  # int64 [B]      1-based: tokens with logprob >= the sampled one's


@dataclass
class SamplerOutput:
    sampled_token_ids: Tensor  # int64 [B]
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs (k = max_num_logprobs)

    def tolist(self) -> SampledLists:
        """On the host as Python lists: one transfer per tensor, not one per row."""
        lp = self.logprobs
        return SampledLists(
            self.sampled_token_ids.tolist(),
            None if lp is None else lp.logprob_token_ids.tolist(),
            None if lp is None else lp.logprobs.tolist(),
            None if lp is None else lp.sampled_logprobs.tolist(),
            None if lp is None else lp.sampled_token_ranks.tolist(),
        )


class SampledLists(NamedTuple):
    """`SamplerOutput` as lists, row j for the j-th sampled sequence."""

    token_ids: list[int]  # [B]
    top_ids: list[list[int]] | None  # [B, k]  None when no row asked for logprobs
    top_logprobs: list[list[float]] | None  # [B, k]
    sampled_logprobs: list[float] | None  # [B]
    sampled_ranks: list[int] | None  # [B]


# ----------------------------------------------------------------------------------------------
# The phases, each a pure function of [B, V] logits (none modifies its input)
# ----------------------------------------------------------------------------------------------


def apply_temperature(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    # Greedy rows (temperature 0) are divided by 1: they are not sampled from anyway.
    temperature = torch.where(meta.temperature < SAMPLING_EPS, 1.0, meta.temperature)
    return logits / temperature[:, None]


def apply_min_p(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    if meta.no_min_p:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = meta.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """Top-k, then top-p over what top-k kept, with a single sort of the whole batch.

    Top-k keeps every token tied with the k-th (as vLLM). Top-p keeps the smallest set of most
    likely tokens with mass >= p: it drops a token when the mass of it and all less likely tokens
    is <= 1 - p. Summing from the least likely end (vLLM's way) keeps the tail exact in float32: a
    cumulative sum from the top reaches 1.0 early and would cut tokens even at top_p = 1.
    """
    if meta.no_top_k and meta.no_top_p:
        return logits
    sorted_logits, sorted_ids = logits.sort(dim=-1)  # [B, V] each, ascending
    vocab_size = logits.shape[-1]
    if not meta.no_top_k:
        kth = sorted_logits.gather(1, (vocab_size - meta.top_k)[:, None])  # [B, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if not meta.no_top_p:
        mass_up_to = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = mass_up_to <= 1.0 - meta.top_p[:, None]
        drop[:, -1] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def apply_truncation(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """Temperature, min_p, top_k, top_p: the logits random rows are sampled from."""
    logits = apply_temperature(logits, meta)
    logits = apply_min_p(logits, meta)
    return apply_top_k_top_p(logits, meta)


def random_sample(
    probs: Tensor,
    meta: SamplingMetadata,
    method: str = "auto",
    generator: torch.Generator | None = None,
) -> Tensor:
    """One draw from each row's categorical distribution `probs` [B, V] -> int64 [B].

    "exponential": argmax(probs / q), q ~ Exp(1) — no host sync on CUDA, the GPU default.
    "multinomial": inverse-CDF sampling with one uniform per row — on a CPU, drawing B x V
    exponentials costs more than the model's LM head, so this is the CPU default.
    Either way a row with its own generator draws only from it; the other rows draw from
    `generator` (the engine's own, seeded by its `seed`), or torch's global one when None.
    """
    if method == "auto":  # the platform's choice
        method = platform_for(probs.device).sampling_method
    rows_global = [i for i, g in enumerate(meta.generators) if g is None]
    if method == "multinomial":
        out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
        if rows_global:
            idx = torch.tensor(rows_global, device=probs.device)
            out[idx] = torch.multinomial(probs[idx], 1, generator=generator).squeeze(1)
        for i, row_generator in enumerate(meta.generators):
            if row_generator is not None:
                out[i] = torch.multinomial(probs[i], 1, generator=row_generator)[0]
        return out
    q = torch.empty_like(probs)  # [B, V]
    if rows_global:
        q[rows_global] = torch.empty_like(probs[rows_global]).exponential_(generator=generator)
    for i, row_generator in enumerate(meta.generators):
        if row_generator is not None:
            q[i].exponential_(generator=row_generator)
    # q == 0 has probability ~0 but would make 0/0 = NaN, which argmax prefers.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div(q).argmax(dim=-1)


def gather_logprobs(logprobs: Tensor, sampled: Tensor, k: int) -> LogprobsTensors:
    sampled_logprobs = logprobs.gather(1, sampled[:, None])  # [B, 1]
    # vLLM's rank: how many tokens are at least as likely as the sampled one.
    ranks = (logprobs >= sampled_logprobs).sum(dim=-1)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)  # [B, k]; k = 0 gives empty tensors
    return LogprobsTensors(top_ids, top_logprobs, sampled_logprobs.squeeze(1), ranks)


# ----------------------------------------------------------------------------------------------
# The sampler
# ----------------------------------------------------------------------------------------------


class Sampler:
    """logits float32 [B, V] + SamplingMetadata -> SamplerOutput.

    `generator` draws for the rows without a seed of their own. An engine passes its own, so
    that its runs are reproducible without touching torch's global RNG, which the user owns.
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        # Logprobs describe the model, not the sampler: taken before any processing (vLLM's
        # default `logprobs_mode="raw_logprobs"`). Skipped entirely when nobody asked.
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)

        logits = apply_logits_processors(logits, meta)

        # The argmax, as `max(...).indices`: the same index (the first of equal maxima, as
        # documented for both), from a kernel that runs faster on a CPU than `argmax`'s.
        greedy = None if meta.all_random else logits.max(dim=-1).indices
        if meta.all_greedy:
            assert greedy is not None
            sampled = greedy
        else:
            probs = apply_truncation(logits, meta).softmax(dim=-1)
            sampled = random_sample(probs, meta, generator=self.generator)
            if greedy is not None:
                sampled = torch.where(meta.temperature < SAMPLING_EPS, greedy, sampled)

        logprobs = None
        if raw_logprobs is not None and meta.max_num_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)
