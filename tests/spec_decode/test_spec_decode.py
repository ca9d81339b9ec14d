"""Speculative decoding in the engine: greedy output is unchanged, and no block is ever leaked.

The n-gram proposer rarely fires on a random tiny model (its outputs seldom repeat), so most tests
plug in an oracle proposer that knows the non-speculative greedy continuation and spoils some of
its drafts: every step then verifies drafts that are partly kept and partly rejected. Greedy
output with speculation must equal greedy output without it, token for token and logprob for
logprob, under preemption (a tiny KV pool), chunked prefill, prefix caching and n > 1; stops,
max_tokens and aborts inside a kept run end the request with no block held; prefix-cache names
are given to verified tokens only; a failed verification step leaves nothing behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config.speculative import SpeculativeConfig
from minivllm.engine.arg_utils import EngineArgs
from minivllm.spec_decode.ngram_proposer import NgramProposer
from tests.utils.engine_utils import assert_no_blocks_held, save_tiny_llama

K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3}
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 30, 31],  # shares 16 tokens
    [40, 41, 42, 43, 44],
    [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)


class OracleProposer(NgramProposer):
    """Drafts the true greedy continuation, spoiling one draft in three positions: the
    rejection sampler must keep exactly the right prefix of every draft."""

    def __init__(self, continuations: list[list[int]]) -> None:
        super().__init__(K, 1, 1)
        self.full = continuations
        self.calls = 0

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        self.calls += 1
        for full in self.full:
            if list(full[: len(token_ids)]) == list(token_ids):
                drafts = list(full[len(token_ids) : len(token_ids) + min(K, max_tokens)])
                spoil = len(token_ids) % 3
                if spoil < len(drafts):
                    drafts[spoil] = (drafts[spoil] + 1) % 1000
                return drafts
        return []


def _llm(model: Path, **kwargs: Any) -> LLM:
    defaults = {"skip_tokenizer_init": True, "cpu_kv_cache_space": 0.05}
    return LLM(str(model), **(defaults | kwargs))


def _outputs(llm: LLM, params: SamplingParams = GREEDY, prompts: list[list[int]] = PROMPTS):  # type: ignore[no-untyped-def]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _assert_same_tokens_and_logprobs(got: Any, want: Any) -> None:
    """Tokens and the tokens named in each position's logprobs are exact; their values may move
    in the last float32 bits, because a verify step runs the rows in another batch shape (and
    so another summation order) than a plain decode step."""
    got_c = [c for o in got for c in o.outputs]
    want_c = [c for o in want for c in o.outputs]
    assert [list(c.token_ids) for c in got_c] == [list(c.token_ids) for c in want_c]
    for g, w in zip(got_c, want_c):
        assert len(g.logprobs or []) == len(w.logprobs or [])
        for dg, dw in zip(g.logprobs or [], w.logprobs or []):
            assert list(dg) == list(dw)
            for t in dg:
                assert dg[t].logprob == pytest.approx(dw[t].logprob, abs=1e-4)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-spec"))


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Any:
    """Greedy outputs without speculation: the oracle's continuations and the expected result."""
    return _outputs(_llm(tiny_model))


def _speculative(
    tiny_model: Path, reference: Any, spec: dict[str, Any] = NGRAM, **kwargs: Any
) -> tuple[LLM, OracleProposer]:
    llm = _llm(tiny_model, speculative_config=spec, **kwargs)
    oracle = OracleProposer([p + list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, reference)])
    assert llm.llm_engine.speculator is not None
    llm.llm_engine.speculator.proposer = oracle
    return llm, oracle


# ---------------------------------------------------------------------------- greedy is exact
@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {},
        {"num_gpu_blocks_override": 14, "block_size": 4, "max_num_seqs": 4},  # preempts
        {"max_num_batched_tokens": 8, "max_num_seqs": 4, "block_size": 4},  # chunks, cuts drafts
    ],
    ids=["default", "preemption", "chunked-prefill"],
)
def test_greedy_output_with_speculation_equals_greedy_output_without(
    tiny_model: Path, reference: Any, engine_kwargs: dict[str, Any]
) -> None:
    llm, _ = _speculative(tiny_model, reference, **engine_kwargs)
    got = _outputs(llm)
    _assert_same_tokens_and_logprobs(got, reference)
    stats = llm.get_stats()
    assert stats.spec_decode_num_drafts > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == (
        stats.spec_decode_num_accepted_tokens
    )
    if "num_gpu_blocks_override" in engine_kwargs:
        assert llm.get_stats().num_preemptions > 0
    assert_no_blocks_held(llm)


def test_parallel_samples_speculate_each_on_their_own(tiny_model: Path, reference: Any) -> None:
    llm, _ = _speculative(tiny_model, reference, NGRAM | {"disable_by_batch_size": 12})
    params = SamplingParams(n=3, temperature=0.0, max_tokens=24, ignore_eos=True)
    got = _outputs(llm, params)
    for out, ref in zip(got, reference):
        assert [list(c.token_ids) for c in out.outputs] == [list(ref.outputs[0].token_ids)] * 3
    assert llm.llm_engine.speculator.stats.num_accepted_tokens > 0  # type: ignore[union-attr]
    assert_no_blocks_held(llm)


def test_no_drafts_while_more_sequences_run_than_disable_by_batch_size(
    tiny_model: Path, reference: Any
) -> None:
    """The rule for big batches: 4 requests of one length run side by side to the end, so with a
    limit of 3 the proposer is never asked (unset, the limit is 8)."""
    llm, oracle = _speculative(tiny_model, reference, NGRAM | {"disable_by_batch_size": 3})
    _assert_same_tokens_and_logprobs(_outputs(llm), reference)
    assert oracle.calls == 0 and llm.get_stats().spec_decode_num_drafts == 0
    assert_no_blocks_held(llm)


def test_the_trace_records_drafts_kept_and_rejected(
    tiny_model: Path, reference: Any, tmp_path: Path
) -> None:
    llm, _ = _speculative(tiny_model, reference)
    with llm.trace() as trace:
        _outputs(llm, GREEDY, PROMPTS[:2])
    items = [item for step in trace.steps for item in step["scheduled"] if item["num_spec_tokens"]]
    assert items and all(0 <= i["num_accepted_tokens"] <= i["num_spec_tokens"] for i in items)
    stats = llm.get_stats()
    assert sum(i["num_accepted_tokens"] for i in items) == stats.spec_decode_num_accepted_tokens
    assert sum(i["num_spec_tokens"] for i in items) == stats.spec_decode_num_draft_tokens
    trace.save(tmp_path)
    assert "num_accepted_tokens" in (tmp_path / "trace.json").read_text()


# ---------------------------------------------------------------------------- ends of requests
def test_stops_and_max_tokens_inside_a_kept_run_end_the_request_there(
    tiny_model: Path, reference: Any
) -> None:
    llm, _ = _speculative(tiny_model, reference)
    want = list(reference[0].outputs[0].token_ids)
    stop = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[want[9]])
    short = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    got_stop, got_short = (_outputs(llm, p, PROMPTS[:1])[0].outputs[0] for p in (stop, short))
    assert list(got_stop.token_ids) == want[: want.index(want[9]) + 1]
    assert got_stop.finish_reason == "stop" and got_stop.stop_reason == want[9]
    assert list(got_short.token_ids) == want[:7] and got_short.finish_reason == "length"
    assert_no_blocks_held(llm)


def test_an_abort_mid_run_frees_every_block(tiny_model: Path, reference: Any) -> None:
    llm, _ = _speculative(tiny_model, reference)
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
    for _ in range(3):
        engine.step()
    engine.abort_request(["0", "2"])
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_blocks_held(llm)


def test_a_failed_verification_step_leaves_nothing_behind(
    tiny_model: Path, reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm, _ = _speculative(tiny_model, reference)
    engine = llm.llm_engine
    run = engine.executor.execute_model

    def fail_when_verifying(sched: Any) -> Any:
        if any(s.num_spec_tokens for s in sched.scheduled):
            raise RuntimeError("injected")
        return run(sched)

    monkeypatch.setattr(engine.executor, "execute_model", fail_when_verifying)
    out = _outputs(llm, GREEDY, PROMPTS[:2])
    assert all(o.outputs[0].finish_reason == "error" for o in out)
    assert_no_blocks_held(llm)
    assert llm.get_stats().spec_decode_num_drafts == 0  # a failed step counts nothing
    cached = llm.get_stats().num_cached_kv_blocks
    monkeypatch.undo()
    _assert_same_tokens_and_logprobs(_outputs(llm), reference)
    assert cached <= llm.get_stats().num_cached_kv_blocks


def test_prefix_cache_names_only_verified_tokens(tiny_model: Path) -> None:
    """Drafts that are always wrong fill blocks; none of those blocks may be a prefix-cache hit."""

    class Wrong(NgramProposer):
        def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
            return [7] * min(K, max_tokens)

    llm = _llm(tiny_model, speculative_config=NGRAM, block_size=4)
    llm.llm_engine.speculator.proposer = Wrong(K, 1, 1)  # type: ignore[union-attr]
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    first = _outputs(llm, params, PROMPTS[2:3])[0]
    assert 7 not in first.outputs[0].token_ids
    known = PROMPTS[2] + list(first.outputs[0].token_ids)
    # A prompt whose blocks are the drafted tokens after each verified prefix: no hit past the
    # verified tokens (7 never followed in the real sequence).
    for cut in range(len(PROMPTS[2]), len(known)):
        probe = known[:cut] + [7] * 8
        hit = _outputs(llm, SamplingParams(max_tokens=1), [probe])[0].num_cached_tokens
        assert hit <= cut, (cut, hit)
    assert_no_blocks_held(llm)


# ---------------------------------------------------------------------------- the n-gram proposer
def test_ngram_proposer_drafts_what_followed_the_latest_longest_match() -> None:
    proposer = NgramProposer(3, 1, 3)
    # [2, 3] recurs twice; the longer [9, 2, 3] once: the longest match wins.
    assert proposer.propose([9, 2, 3, 4, 5, 2, 3, 7, 8, 9, 2, 3], 10) == [4, 5, 2]
    assert proposer.propose([1, 2, 3, 1, 2, 3, 6, 1, 2, 3], 10) == [6, 1, 2]  # latest occurrence
    assert proposer.propose([1, 2, 3, 4], 10) == []  # nothing recurs
    assert proposer.propose([1, 2, 1, 2], 1) == [1]  # capped by what the request may still make
    assert proposer.propose([5, 6, 5], 10) == [6, 5]  # only what is known follows
    assert NgramProposer(3, 2, 2).propose([1, 2, 1, 2], 10) == [1, 2]
    # Token ids whose bytes overlap off the 4-byte grid do not match.
    # (The last token's bytes, 00 00 01 00, occur at byte 1 of the packed context.)
    assert proposer.propose([0x01000005, 0, 0x00010000], 4) == []


def test_ngram_speculation_on_a_repeating_output_keeps_greedy(tmp_path: Path) -> None:
    """An 8-token vocabulary: the random model's output repeats, so the n-gram proposer fires."""
    model = save_tiny_llama(tmp_path / "v8", vocab_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    prompts = [[1, 2, 3, 1, 2, 3], [4, 5, 6, 7]]
    plain = _outputs(_llm(model), params, prompts)
    llm = _llm(model, speculative_config=NGRAM)
    _assert_same_tokens_and_logprobs(_outputs(llm, params, prompts), plain)
    stats = llm.llm_engine.speculator.stats  # type: ignore[union-attr]
    assert stats.num_accepted_tokens > 0
    assert stats.num_accepted_tokens_per_pos[0] >= stats.num_accepted_tokens_per_pos[-1]
    assert_no_blocks_held(llm)


def test_sampling_with_speculation_follows_the_same_distribution(tmp_path: Path) -> None:
    """Engine level, small: the 3rd output token of 300 seeded samples, with and without n-gram
    speculation, compared by a two-sample chi-square test (8 tokens: 7 degrees of freedom). The
    n-gram of one token (prompt_lookup_min 1) drafts at nearly every step, and the 3rd token is
    one the drafts cover (a request's last token never is: it is a bonus). A sampler that keeps a
    point-mass draft with probability 2 p(d) instead of p(d) fails it (p ~ 1e-7)."""
    model = save_tiny_llama(tmp_path / "v8", vocab_size=8, initializer_range=0.15)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2]] * 300
    params = [
        SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=i) for i in range(300)
    ]
    counts = []
    for spec in (None, NGRAM):
        if spec is not None:
            spec = spec | {"disable_by_batch_size": 300, "prompt_lookup_min": 1}
        llm = _llm(model, speculative_config=spec, max_num_seqs=300, max_num_batched_tokens=4096)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        counts.append(
            torch.bincount(
                torch.tensor([o.outputs[0].token_ids[2] for o in outs]), minlength=8
            ).float()
        )
        if spec is not None:
            assert llm.llm_engine.speculator.stats.num_accepted_tokens > 100  # type: ignore[union-attr]
    a, b = counts
    keep = (a + b) > 0
    stat = (((a - b) ** 2) / (a + b))[keep].sum()  # two-sample chi-square, equal sample sizes
    p = float(torch.special.gammaincc(torch.tensor((int(keep.sum()) - 1) / 2), stat / 2))
    assert p > 1e-4, (a, b, p)


# ---------------------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"num_speculative_tokens": 0},
            "speculative_config.num_speculative_tokens must be an integer in [1, 16], got 0",
        ),
        ({}, "speculative_config.num_speculative_tokens must be an integer in [1, 16], got None"),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "speculative_config.prompt_lookup_min (4) must be <= prompt_lookup_max (2)",
        ),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_max": 65},
            "speculative_config.prompt_lookup_max must be an integer in [1, 64], got 65",
        ),
        (
            {"method": "eagle", "num_speculative_tokens": 2},
            "speculative_config.method must be one of ['ngram', 'draft_model'], got 'eagle'",
        ),
        (
            {"num_speculative_tokens": 2, "disable_by_batch_size": 1},
            "speculative_config.disable_by_batch_size must be an integer >= 2, got 1",
        ),
        ({"num_speculative_tokens": 2, "k": 3}, "speculative_config has no field 'k'"),
        ("{not json", "speculative_config is not valid JSON"),
    ],
)
def test_invalid_speculative_config_is_refused_naming_the_field(config: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SpeculativeConfig.parse(config)
    assert str(info.value).startswith(message)


def test_cli_flag_and_defaults() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--speculative-config", '{"num_speculative_tokens": 3}'])
    config = SpeculativeConfig.parse(EngineArgs.from_cli_args(args).speculative_config)
    assert config == SpeculativeConfig("ngram", 3, 5, 5)  # vLLM's defaults: n-grams of 5


def test_paged_allocation_is_required() -> None:
    args = EngineArgs(speculative_config=NGRAM, kv_allocation="orca-max")
    with pytest.raises(ValueError, match="speculative_config needs kv_allocation='paged'"):
        args.create_engine_config()  # before any weight loads


# ---------------------------------------------------------------------------- metrics
def test_server_metrics_and_log_line_use_vllm_s_names(caplog: pytest.LogCaptureFixture) -> None:
    from prometheus_client import generate_latest

    from minivllm.engine.stats import EngineStats
    from minivllm.entrypoints.metrics import ServerMetrics

    zero = EngineStats(
        **{
            f.name: () if f.name.endswith("_per_pos") else 0
            for f in dataclasses.fields(EngineStats)
        }
    )
    metrics = ServerMetrics("m", log_interval_s=0.0)
    metrics.on_step(zero, [])
    assert b"spec_decode" not in generate_latest(metrics.registry)  # off: no series
    step = dataclasses.replace(
        zero,
        num_generated_tokens=9,
        spec_decode_num_drafts=3,
        spec_decode_num_draft_tokens=12,
        spec_decode_num_accepted_tokens=6,
        spec_decode_num_accepted_tokens_per_pos=(3, 2, 1, 0),
    )
    with caplog.at_level(logging.INFO, logger="minivllm"):
        metrics.on_step(step, [])
    text = generate_latest(metrics.registry).decode()
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 3.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 12.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 6.0' in text
    assert (
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0'
        in text
    )
    line = next(r.getMessage() for r in caplog.records if "SpecDecoding" in r.getMessage())
    assert "Mean acceptance length: 3.00" in line
    assert "Per-position acceptance rate: 1.000, 0.667, 0.333, 0.000" in line
    assert "Avg Draft acceptance rate: 50.0%" in line
