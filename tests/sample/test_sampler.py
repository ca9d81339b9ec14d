"""The sampler against slow, obviously-correct per-row Python references.

Each phase is compared on processed logits / probabilities over seeded random grids of logits and
parameters (not only on samples); sampling itself is checked for reproducibility under seeds,
independence from batch composition, and empirical frequencies.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from minivllm.sample.sampler import (
    Sampler,
    SamplingMetadata,
    SamplingRow,
    apply_min_tokens,
    apply_penalties,
    apply_truncation,
)
from minivllm.sampling_params import SamplingParams

V = 48
EOS = 0
NEG_INF = float("-inf")


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def meta_for(rows: list[SamplingRow], vocab_size: int = V) -> SamplingMetadata:
    return SamplingMetadata.from_rows(rows, vocab_size, "cpu")


def row(params: SamplingParams, prompt=(1, 2, 3), output=(), generator=None, eos=EOS):
    return SamplingRow(params, list(prompt), list(output), generator, eos)


# ----------------------------------------------------------------------------------------------
# The slow references: one row, plain Python floats, a loop over the vocabulary
# ----------------------------------------------------------------------------------------------


def ref_min_tokens_and_penalties(logits: list[float], r: SamplingRow) -> list[float]:
    p = r.params
    out = list(logits)
    if len(r.output_token_ids) < p.min_tokens:
        for t in p.all_stop_token_ids(r.eos_token_id):
            out[t] = NEG_INF
    counts = Counter(r.output_token_ids)
    seen = set(r.prompt_token_ids) | set(r.output_token_ids)
    for t in range(len(out)):
        if t in seen:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        out[t] -= p.frequency_penalty * counts[t]
        out[t] -= p.presence_penalty * (1.0 if counts[t] else 0.0)
    return out


def softmax(xs: list[float]) -> list[float]:
    top = max(xs)
    exps = [math.exp(x - top) if x != NEG_INF else 0.0 for x in xs]
    total = sum(exps)
    return [e / total for e in exps]


def ref_truncated_probs(logits: list[float], p: SamplingParams) -> list[float]:
    """temperature -> min_p -> top_k (ties with the k-th kept) -> top_p, then probabilities."""
    xs = [x / p.temperature for x in logits]
    if p.min_p > 0:
        probs = softmax(xs)
        xs = [NEG_INF if q < p.min_p * max(probs) else x for x, q in zip(xs, probs)]
    if p.top_k > 0:
        kth = sorted(xs, reverse=True)[min(p.top_k, len(xs)) - 1]
        xs = [x if x >= kth else NEG_INF for x in xs]
    if p.top_p < 1:
        probs = softmax(xs)
        mass, kept = 0.0, set()
        for t in sorted(range(len(xs)), key=lambda t: -probs[t]):
            if mass < p.top_p:
                kept.add(t)
            mass += probs[t]
        xs = [x if t in kept else NEG_INF for t, x in enumerate(xs)]
    return softmax(xs)


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.3, 0.7, 1.0, 1.8]),
        top_k=rng.choice([0, -1, 1, 3, 10, V - 1, V + 5]),
        top_p=rng.choice([1.0, 0.95, 0.6, 0.2, 0.01]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        presence_penalty=rng.choice([0.0, 0.5, -1.0, 2.0]),
        frequency_penalty=rng.choice([0.0, 0.3, -0.4, 1.5]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.7, 2.0]),
        min_tokens=rng.choice([0, 0, 3]),
        stop_token_ids=rng.choice([[], [5], [5, 7]]),
        ignore_eos=rng.random() < 0.2,
        max_tokens=None,
    )


def random_batch(seed: int, batch: int) -> tuple[torch.Tensor, list[SamplingRow]]:
    rng = random.Random(seed)
    rows = [
        row(
            random_params(rng),
            prompt=[rng.randrange(V) for _ in range(rng.randrange(0, 12))],
            output=[rng.randrange(V) for _ in range(rng.randrange(0, 8))],
        )
        for _ in range(batch)
    ]
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, V, generator=gen) * 3
    return logits, rows


def assert_rows_close(actual: torch.Tensor, expected: list[list[float]]) -> None:
    expected_t = torch.tensor(expected, dtype=torch.float32)
    assert torch.equal(torch.isinf(actual), torch.isinf(expected_t))
    torch.testing.assert_close(actual, expected_t, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Processed logits and probabilities against the references
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_min_tokens_and_penalties_match_the_reference(seed):
    logits, rows = random_batch(seed, batch=9)
    meta = meta_for(rows)
    actual = apply_penalties(apply_min_tokens(logits, meta), meta)
    expected = [ref_min_tokens_and_penalties(logits[i].tolist(), r) for i, r in enumerate(rows)]
    assert_rows_close(actual, expected)


@pytest.mark.parametrize("seed", range(12))
def test_truncated_probabilities_match_the_reference(seed):
    logits, rows = random_batch(100 + seed, batch=9)
    meta = meta_for(rows)
    processed = apply_penalties(apply_min_tokens(logits, meta), meta)
    actual = apply_truncation(processed, meta).softmax(dim=-1)
    expected = [
        ref_truncated_probs(processed[i].tolist(), r.params) if not r.params.is_greedy else None
        for i, r in enumerate(rows)
    ]
    for i, probs in enumerate(expected):
        assert probs is not None  # random_params never draws a greedy temperature
        torch.testing.assert_close(actual[i], torch.tensor(probs), rtol=1e-5, atol=1e-6)
        assert torch.equal(actual[i] == 0, torch.tensor(probs) == 0), i


def test_phases_do_not_modify_their_input():
    logits, rows = random_batch(7, batch=6)
    before = logits.clone()
    meta = meta_for(rows)
    apply_truncation(apply_penalties(apply_min_tokens(logits, meta), meta), meta)
    Sampler()(logits, meta)
    assert torch.equal(logits, before)


def test_top_k_keeps_ties_with_the_kth_token():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.5]])
    meta = meta_for([row(SamplingParams(top_k=2))], vocab_size=5)
    kept = torch.isfinite(apply_truncation(logits, meta))
    assert kept.tolist() == [[False, True, True, True, False]]


def test_top_p_keeps_the_smallest_set_reaching_p_and_always_the_top_token():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = lambda p: torch.isfinite(  # noqa: E731
        apply_truncation(logits, meta_for([row(SamplingParams(top_p=p))], vocab_size=4))
    ).tolist()[0]
    assert kept(0.79) == [True, True, False, False]
    assert kept(0.81) == [True, True, True, False]
    assert kept(0.01) == [True, False, False, False]


def test_min_p_is_relative_to_the_most_likely_token():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    meta = meta_for([row(SamplingParams(min_p=0.4))], vocab_size=4)
    assert torch.isfinite(apply_truncation(logits, meta)).tolist() == [[True, True, False, False]]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    r = row(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])
    penalized = apply_penalties(logits, meta_for([r], vocab_size=4))
    assert penalized.tolist() == [[1.0, -4.0, 2.0, -2.0]]


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 4)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    penalized = apply_penalties(logits, meta_for([row(params, prompt=[3], output=[1, 1, 2])], 4))
    assert penalized.tolist() == [[0.0, -2.0, -1.5, 0.0]]


# ----------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------


def test_greedy_is_argmax_of_the_penalized_logits():
    logits, _ = random_batch(3, batch=6)
    rows = [row(SamplingParams(temperature=0.0)) for _ in range(6)]
    out = Sampler()(logits, meta_for(rows))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None

    # A repetition penalty can move the argmax away from an already used token.
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0]])
    penalized = row(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[0])
    assert Sampler()(logits, meta_for([penalized], 4)).sampled_token_ids.tolist() == [1]


def test_greedy_takes_the_first_of_tied_maxima_as_argmax_and_transformers_do():
    # Ties at the maximum, at the front, middle and end of a long row (the vectorised kernel's
    # chunks), so the first index must win wherever the copies lie.
    logits = torch.zeros(3, 49152)
    for i, positions in enumerate([(0, 7, 49151), (4095, 4096, 30000), (17, 49150, 49151)]):
        logits[i, list(positions)] = 5.0
    rows = [row(SamplingParams(temperature=0.0)) for _ in range(3)]
    sampled = Sampler()(logits, meta_for(rows, 49152)).sampled_token_ids
    assert sampled.tolist() == [0, 4095, 17] == logits.argmax(dim=-1).tolist()


def test_greedy_rows_in_a_mixed_batch_take_the_argmax():
    logits, _ = random_batch(4, batch=8)
    rows = [
        row(SamplingParams(temperature=0.0 if i % 2 else 1.0), generator=_generator(i))
        for i in range(8)
    ]
    sampled = Sampler()(logits, meta_for(rows)).sampled_token_ids
    assert torch.equal(sampled[1::2], logits[1::2].argmax(dim=-1))


def test_top_k_1_samples_the_argmax_at_any_temperature():
    logits, _ = random_batch(5, batch=16)
    rows = [row(SamplingParams(temperature=5.0, top_k=1)) for _ in range(16)]
    assert torch.equal(Sampler()(logits, meta_for(rows)).sampled_token_ids, logits.argmax(-1))


def run_seeded_row(seed: int, neighbours: list[SamplingRow], position: int) -> list[int]:
    """Sample 30 steps for one seeded row placed among `neighbours`; its logits depend only on
    the step, the neighbours' logits are fresh noise."""
    params = SamplingParams(temperature=1.3, top_p=0.9, seed=seed)
    target = row(params, generator=_generator(seed))
    step_logits = torch.Generator().manual_seed(99)
    noise = torch.Generator().manual_seed(1000 + len(neighbours))
    tokens = []
    for _ in range(30):
        own = torch.randn(1, V, generator=step_logits)
        others = torch.randn(len(neighbours), V, generator=noise)
        logits = torch.cat([others[:position], own, others[position:]])
        rows = [*neighbours[:position], target, *neighbours[position:]]
        sampled = Sampler()(logits, meta_for(rows)).sampled_token_ids
        tokens.append(int(sampled[position]))
        target.output_token_ids.append(tokens[-1])
    return tokens


def test_seeded_row_is_reproducible_whatever_the_batch():
    alone = run_seeded_row(1234, [], 0)
    assert len(set(alone)) > 5  # it is really sampling, not stuck on one token
    mixed = [
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=0.8, seed=1), generator=_generator(1)),
        row(SamplingParams(temperature=1.0, top_k=5)),
        row(SamplingParams(temperature=0.5, logprobs=3, repetition_penalty=1.2)),
    ]
    assert run_seeded_row(1234, mixed, 2) == alone
    assert run_seeded_row(1234, mixed[:1], 1) == alone
    assert run_seeded_row(4321, [], 0) != alone


@pytest.mark.parametrize("seeded", [False, True])
def test_empirical_frequencies_match_tempered_softmax(seeded):
    n, vocab = 20000, 6
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -3.0])
    params = SamplingParams(temperature=0.7)
    if seeded:
        # One generator per row, as the engine makes one per sequence.
        rows = [row(params, generator=_generator(i)) for i in range(n)]
    else:
        torch.manual_seed(0)
        rows = [row(params)] * n
    sampled = Sampler()(base.expand(n, vocab), meta_for(rows, vocab)).sampled_token_ids
    freq = torch.bincount(sampled, minlength=vocab).double() / n
    expected = (base / 0.7).double().softmax(-1)
    sigma = (expected * (1 - expected) / n).sqrt()
    assert torch.all((freq - expected).abs() <= 5 * sigma + 1e-9), (freq, expected)


@pytest.mark.parametrize("method", ["exponential", "multinomial"])
@pytest.mark.parametrize("seeded", [False, True])
def test_both_sampling_methods_draw_from_the_distribution(method, seeded):
    """The GPU's exponential race and the CPU's multinomial are both exact samplers."""
    from minivllm.sample.sampler import random_sample

    n, vocab = 20000, 6
    probs = torch.tensor([0.1, 0.3, 0.05, 0.25, 0.2, 0.1])
    params = SamplingParams(temperature=1.0)
    if seeded:
        rows = [row(params, generator=_generator(i)) for i in range(n)]
    else:
        torch.manual_seed(0)
        rows = [row(params)] * n
    sampled = random_sample(probs.expand(n, vocab).clone(), meta_for(rows, vocab), method)
    freq = torch.bincount(sampled, minlength=vocab).double() / n
    sigma = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert torch.all((freq - probs.double()).abs() <= 5 * sigma), (freq, probs)


def test_truncated_tokens_are_never_sampled():
    n, vocab = 4000, 6
    base = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6, 0.5])
    torch.manual_seed(0)
    sampled = Sampler()(
        base.expand(n, vocab), meta_for([row(SamplingParams(top_k=3))] * n, vocab)
    ).sampled_token_ids
    assert set(sampled.tolist()) == {0, 1, 2}


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros(4, 8)
    logits[:, EOS] = 10.0
    logits[:, 5] = 9.0
    logits[:, 6] = 8.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5])
    rows = [
        row(params, output=[3]),  # next is the 2nd token: EOS and 5 masked
        row(params, output=[3, 3]),  # next is the 3rd: free
        row(SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True), output=[]),
        row(SamplingParams(temperature=0.0), output=[]),
    ]
    meta = meta_for(rows, 8)
    masked = apply_min_tokens(logits, meta)
    assert torch.isinf(masked).nonzero().tolist() == [[0, EOS], [0, 5]]
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [6, EOS, EOS, EOS]


def test_logprobs_are_raw_log_softmax_with_ranks_and_top_k():
    logits, _ = random_batch(8, batch=5)
    rows = [
        row(SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5), prompt=[1]),
        row(SamplingParams(logprobs=0, top_k=4), generator=_generator(0)),
        row(SamplingParams(temperature=2.0), generator=_generator(1)),
        row(SamplingParams(logprobs=1, presence_penalty=2.0), output=[2, 3]),
        row(SamplingParams(temperature=0.0)),
    ]
    out = Sampler()(logits, meta_for(rows))
    assert out.logprobs is not None
    ids, lps, sampled_lps, ranks = out.logprobs
    assert ids.shape == lps.shape == (5, 3)  # k = the largest request in the batch
    assert ids.dtype == ranks.dtype == out.sampled_token_ids.dtype == torch.int64
    for i in range(5):
        raw = [float(x) for x in torch.log_softmax(logits[i].double(), dim=-1)]
        order = sorted(range(V), key=lambda t: -raw[t])
        assert ids[i].tolist() == order[:3]
        torch.testing.assert_close(
            lps[i].double(), torch.tensor([raw[t] for t in order[:3]], dtype=torch.float64)
        )
        token = int(out.sampled_token_ids[i])
        assert math.isclose(float(sampled_lps[i]), raw[token], rel_tol=1e-5, abs_tol=1e-5)
        assert int(ranks[i]) == order.index(token) + 1


def test_logprobs_0_gives_only_the_sampled_token():
    logits, _ = random_batch(9, batch=2)
    out = Sampler()(logits, meta_for([row(SamplingParams(temperature=0.0, logprobs=0))] * 2))
    assert out.logprobs is not None
    assert out.logprobs.logprob_token_ids.shape == (2, 0)
    assert out.logprobs.sampled_token_ranks.tolist() == [1, 1]


def test_metadata_fast_path_flags():
    greedy = row(SamplingParams(temperature=0.0))
    plain = row(SamplingParams())
    meta = meta_for([greedy, plain])
    assert (meta.all_greedy, meta.all_random) == (False, False)
    assert meta.no_top_k and meta.no_top_p and meta.no_min_p and meta.no_penalties
    assert meta.output_token_counts is None and meta.prompt_token_mask is None
    assert meta.max_num_logprobs is None
    assert meta_for([greedy]).all_greedy and meta_for([plain]).all_random
    assert meta.top_k.tolist() == [V, V] and meta.temperature.tolist() == [0.0, 1.0]
    penalized = meta_for([row(SamplingParams(frequency_penalty=0.1), output=[4, 4, 1])])
    assert penalized.prompt_token_mask is None
    assert penalized.output_token_counts is not None
    assert penalized.output_token_counts.shape == (1, V)
    assert penalized.output_token_counts[0, [4, 1, 0]].tolist() == [2.0, 1.0, 0.0]
