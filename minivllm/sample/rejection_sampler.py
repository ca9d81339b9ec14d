"""The rejection sampler: keep the longest run of drafted tokens the target model agrees with.

Leviathan et al., "Fast Inference from Transformers via Speculative Decoding" (ICML 2023, §2.3) and
Chen et al., "Accelerating LLM Decoding with Speculative Sampling" (2023); vLLM v1's
`vllm/v1/sample/rejection_sampler.py`. A verification step scored a sequence's newest token and its
k drafts d_1..d_k in one pass, so it has k + 1 rows of target logits: row j is the distribution p_j
of the token after d_1..d_j. Going along the rows:

    accept d_{j+1} with probability min(1, p_j(d) / q_j(d))      q_j: the draft's distribution
    at the first rejection, draw from norm(max(0, p_j - q_j)) instead and stop
    when every draft was accepted, draw a bonus token from p_k

Each kept token is then distributed exactly as plain sampling from p_j would draw it, whatever the
drafts were (the drafts decide only how many tokens a step keeps). For the n-gram proposer the
draft is a point mass (q_j(d) = 1): accept with probability p_j(d); on rejection draw from p_j with
d removed. Greedy rows accept while the draft is the argmax and then take the argmax, so greedy
output with speculation is greedy output without it.

p_j is what plain sampling would draw from: the same logits processors (penalties, min_tokens, bad
words, logit_bias, allowed_token_ids; each row sees the drafts before it as output), then
temperature, min_p, top_k, top_p (`sampler.py`). Everything is a tensor operation over the flat rows
of the whole batch; rows without a draft (a prompt's first token, a sequence that drafted nothing)
are bonus rows, sampled plainly.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from minivllm.sample.logits_processors import apply_logits_processors
from minivllm.sample.sampler import (
    LogprobsTensors,
    SamplingMetadata,
    apply_truncation,
    gather_logprobs,
    random_sample,
)
from minivllm.sampling_params import SAMPLING_EPS


class RejectionSamplerOutput(NamedTuple):
    token_ids: Tensor  # int64 [R]  the token each row outputs (a kept draft, or a sample)
    num_accepted: Tensor  # int64 [G]  drafts kept per group: group g outputs its first a_g + 1 rows
    logprobs: LogprobsTensors | None  # [R] rows, of `token_ids` (raw model logprobs)


def rejection_sample(
    logits: Tensor,  # float32 [R, V]  target logits, each group's rows consecutive
    meta: SamplingMetadata,  # [R] rows: each group's row j sees that group's drafts 1..j
    draft_token_ids: Tensor,  # int64 [R]  the draft row r verifies; -1 on a group's last row
    group_ids: Tensor,  # int64 [R]  which group (sequence) row r belongs to, ascending
    num_groups: int,
    generator: torch.Generator | None = None,
    draft_probs: Tensor | None = None,  # float32 [R, V]  q; None: point masses at the drafts
) -> RejectionSamplerOutput:
    logits = logits.float()
    raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
    processed = apply_logits_processors(logits, meta)
    has_draft = draft_token_ids >= 0  # [R]
    drafts = draft_token_ids.clamp_min(0)[:, None]  # [R, 1]
    greedy_rows = meta.temperature < SAMPLING_EPS  # [R]

    greedy = processed.max(dim=-1).indices  # [R]
    accepted = greedy == drafts[:, 0]
    tokens = greedy
    if not meta.all_greedy:
        probs = apply_truncation(processed, meta).softmax(dim=-1)  # [R, V]  p
        if draft_probs is None:  # a point mass at the draft
            draft_probs = torch.zeros_like(probs).scatter_(1, drafts, 1.0)
        draft_probs = draft_probs * has_draft[:, None]  # bonus rows draw from p itself
        p_d, q_d = probs.gather(1, drafts)[:, 0], draft_probs.gather(1, drafts)[:, 0]
        uniform = _uniforms(meta, probs.shape[0], probs.device, generator)  # [R]
        accepted_random = uniform * q_d < p_d  # u < p / q without dividing by q = 0
        residual = (probs - draft_probs).clamp_min(0)  # [R, V]
        mass = residual.sum(dim=-1, keepdim=True)
        # p <= q everywhere leaves nothing (then the draft is accepted surely): fall back to p.
        residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), probs)
        recovered = random_sample(residual, meta, generator=generator)
        accepted = torch.where(greedy_rows, accepted, accepted_random)
        tokens = torch.where(greedy_rows, greedy, recovered)
    accepted &= has_draft

    # A row is kept as its draft while no rejection came before it or at it, in its group.
    rejected = (~accepted & has_draft).long()
    group_start = torch.zeros(num_groups + 1, dtype=torch.int64, device=logits.device)
    group_start[1:] = torch.bincount(group_ids, minlength=num_groups).cumsum(0)
    rejections_so_far = rejected.cumsum(0)
    before_group = (rejections_so_far - rejected)[group_start[:-1]]  # [G] rejections before
    in_run = accepted & (rejections_so_far - before_group[group_ids] == 0)  # [R]
    num_accepted = torch.zeros(num_groups, dtype=torch.int64, device=logits.device)
    num_accepted.index_add_(0, group_ids, in_run.long())
    token_ids = torch.where(in_run, draft_token_ids, tokens)
    logprobs = None
    if raw_logprobs is not None and meta.max_num_logprobs is not None:
        logprobs = gather_logprobs(raw_logprobs, token_ids, meta.max_num_logprobs)
    return RejectionSamplerOutput(token_ids, num_accepted, logprobs)


def _uniforms(
    meta: SamplingMetadata, num_rows: int, device: torch.device, generator: torch.Generator | None
) -> Tensor:
    """U[0, 1) per row [R]: a seeded row's from its own generator, the others' from `generator`."""
    uniform = torch.rand(num_rows, device=device, generator=generator)
    for i, row_generator in enumerate(meta.generators):
        if row_generator is not None:
            uniform[i] = torch.rand(1, device=device, generator=row_generator)[0]
    return uniform
