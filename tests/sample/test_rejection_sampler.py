"""The rejection sampler keeps the distribution: what it outputs is what plain sampling draws.

Leviathan et al. (2023) prove that speculative sampling's tokens are distributed as the target
model's; these tests hold `rejection_sample` to that on a fixed tiny-vocabulary distribution, with
thousands of draws in one vectorised call (chi-square tests, p > 1e-4: a wrong sampler fails them
by orders of magnitude), for point-mass drafts (the n-gram proposer) and drafts with probabilities,
under temperature, top-k, top-p, min-p and penalties. Greedy verification is exact.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.sample.logits_processors import apply_logits_processors
from minivllm.sample.rejection_sampler import rejection_sample
from minivllm.sample.sampler import SamplingMetadata, SamplingRow, apply_truncation
from minivllm.sampling_params import SamplingParams

VOCAB = 6
LOGITS = torch.tensor(
    [
        [2.0, 1.0, 0.5, 0.0, -0.5, -1.0],  # row 0: the token after the newest one
        [0.0, 1.5, 1.5, 0.2, -1.0, 0.7],  # row 1: the token after draft 1
        [1.0, 0.0, 0.0, 0.0, 0.0, 3.0],  # row 2: the bonus row
    ]
)
DRAFTS = [1, 2]  # draft 1 is not the most likely token of row 0: both paths are taken often
NUM_GROUPS = 6000


def _batch(params: SamplingParams, num_groups: int = NUM_GROUPS):  # type: ignore[no-untyped-def]
    """`num_groups` copies of one sequence verifying DRAFTS, as the engine lays them out."""
    k = len(DRAFTS)
    rows = [SamplingRow(params, [7], DRAFTS[:j]) for _ in range(num_groups) for j in range(k + 1)]
    meta = SamplingMetadata.from_rows(rows, VOCAB, "cpu")
    logits = LOGITS.repeat(num_groups, 1)  # [G * (k + 1), V]
    drafts = torch.tensor([*DRAFTS, -1]).repeat(num_groups)
    groups = torch.arange(num_groups).repeat_interleave(k + 1)
    return logits, meta, drafts, groups


def _target_probs(params: SamplingParams) -> torch.Tensor:  # [k + 1, V]
    rows = [SamplingRow(params, [7], DRAFTS[:j]) for j in range(len(DRAFTS) + 1)]
    meta = SamplingMetadata.from_rows(rows, VOCAB, "cpu")
    return apply_truncation(apply_logits_processors(LOGITS, meta), meta).softmax(dim=-1)


def _chi_square_p(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of `observed` counts [V] under `probs` [V] (cells with probability 0 must be 0)."""
    support = probs > 0
    assert observed[~support].sum() == 0, (observed, probs)
    expected = probs[support] * observed.sum()
    stat = ((observed[support] - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2), stat / 2))


def _outputs(params: SamplingParams, draft_probs=None, seed=0):  # type: ignore[no-untyped-def]
    logits, meta, drafts, groups = _batch(params)
    gen = torch.Generator().manual_seed(seed)
    out = rejection_sample(logits, meta, drafts, groups, NUM_GROUPS, gen, draft_probs)
    tokens = out.token_ids.view(NUM_GROUPS, len(DRAFTS) + 1)
    return tokens, out.num_accepted


SAMPLED = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.2),
    # Row 1 sees draft 1 as output: the penalties must lower it there, as plain sampling would.
    SamplingParams(temperature=1.0, frequency_penalty=1.0, presence_penalty=0.5),
]


@pytest.mark.parametrize("params", SAMPLED, ids=["plain", "top_k", "top_p", "min_p", "penalties"])
def test_point_mass_drafts_keep_the_target_distribution(params: SamplingParams) -> None:
    probs = _target_probs(params)
    tokens, accepted = _outputs(params)
    first = tokens[:, 0]  # output 1 of every group: draft 1 if accepted, else the recovered token
    assert _chi_square_p(torch.bincount(first, minlength=VOCAB).float(), probs[0]) > 1e-4
    kept = accepted >= 1  # output 2 exists where draft 1 was kept; it must follow row 1
    second = tokens[kept, 1]
    assert _chi_square_p(torch.bincount(second, minlength=VOCAB).float(), probs[1]) > 1e-4
    # The acceptance rate of draft 1 is its target probability (a point mass is kept w.p. p).
    rate = kept.float().mean().item()
    assert abs(rate - probs[0, DRAFTS[0]].item()) < 0.03


def test_drafts_with_probabilities_keep_the_target_distribution() -> None:
    """A draft model's tokens are drawn from its q; the kept tokens must still follow p."""
    params = SamplingParams(temperature=1.0)
    probs = _target_probs(params)
    q = torch.tensor([[0.1, 0.5, 0.1, 0.1, 0.1, 0.1], [0.2, 0.2, 0.4, 0.1, 0.05, 0.05]])
    logits, meta, _, groups = _batch(params)
    gen = torch.Generator().manual_seed(1)
    drawn = torch.stack([torch.multinomial(q[j], NUM_GROUPS, True, generator=gen) for j in (0, 1)])
    drafts = torch.cat([drawn.T, torch.full((NUM_GROUPS, 1), -1)], dim=1).flatten()
    draft_probs = torch.cat([q, torch.zeros(1, VOCAB)]).repeat(NUM_GROUPS, 1)
    out = rejection_sample(logits, meta, drafts, groups, NUM_GROUPS, gen, draft_probs)
    tokens = out.token_ids.view(NUM_GROUPS, 3)
    first = tokens[:, 0]
    assert _chi_square_p(torch.bincount(first, minlength=VOCAB).float(), probs[0]) > 1e-4
    second = tokens[out.num_accepted >= 1, 1]
    assert _chi_square_p(torch.bincount(second, minlength=VOCAB).float(), probs[1]) > 1e-4
    # Kept with probability sum_x min(p(x), q(x)) (Leviathan et al., §3.1).
    expected_rate = torch.minimum(probs[0], q[0]).sum().item()
    assert abs((out.num_accepted >= 1).float().mean().item() - expected_rate) < 0.03


def test_a_wrong_sampler_fails_the_chi_square_test() -> None:
    """The test can fail: plain acceptance of every draft is far from the target distribution."""
    probs = _target_probs(SamplingParams(temperature=1.0))
    always_draft = torch.zeros(VOCAB)
    always_draft[DRAFTS[0]] = NUM_GROUPS
    assert _chi_square_p(always_draft, probs[0]) < 1e-10


def test_greedy_keeps_drafts_while_they_are_the_argmax() -> None:
    params = SamplingParams(temperature=0.0)
    logits, meta, drafts, groups = _batch(params, num_groups=1)
    out = rejection_sample(logits, meta, drafts, groups, 1)
    # Row 0's argmax is 0, not draft 1 (= 1): nothing is kept and the argmax comes instead.
    assert out.num_accepted.tolist() == [0] and out.token_ids[0].item() == 0
    drafts = torch.tensor([0, 1, -1])  # argmax of row 0, then argmax of row 1 (ties: the first)
    out = rejection_sample(logits, meta, drafts, groups, 1)
    assert out.num_accepted.tolist() == [2] and out.token_ids.tolist() == [0, 1, 5]


def test_groups_of_different_lengths_stop_at_their_own_first_rejection() -> None:
    """A batch of three sequences: 2 drafts, none (a plain row), 1 draft; greedy."""
    params = SamplingParams(temperature=0.0)
    rows = [SamplingRow(params, [7], []) for _ in range(6)]
    meta = SamplingMetadata.from_rows(rows, VOCAB, "cpu")
    logits = torch.cat([LOGITS, LOGITS[2:], LOGITS[:2]])  # [6, V]
    drafts = torch.tensor([0, 4, -1, -1, 3, -1])
    groups = torch.tensor([0, 0, 0, 1, 2, 2])
    out = rejection_sample(logits, meta, drafts, groups, 3)
    assert out.num_accepted.tolist() == [1, 0, 0]
    assert out.token_ids[[0, 1]].tolist() == [0, 1]  # kept 0, then row 1's argmax
    assert out.token_ids[3].item() == 5 and out.token_ids[4].item() == 0


def test_seeded_rows_draw_from_their_own_generator() -> None:
    params = SamplingParams(temperature=1.0, seed=3)

    def run() -> list[int]:
        gen = torch.Generator().manual_seed(3)
        rows = [SamplingRow(params, [7], DRAFTS[:j], gen) for j in range(3)]
        meta = SamplingMetadata.from_rows(rows, VOCAB, "cpu")
        out = rejection_sample(LOGITS, meta, torch.tensor([*DRAFTS, -1]), torch.zeros(3).long(), 1)
        return out.token_ids.tolist()

    assert run() == run()
