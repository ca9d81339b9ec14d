"""The offline API's contract: seeds, stop conditions, logprobs, aborts, stats and bad input.

One SmolLM2 engine serves the whole module; after every test, no KV block may still be held.
"""

from __future__ import annotations

import math

import pytest

from minivllm.inputs import PromptTooLongError
from minivllm.llm import LLM
from minivllm.sampling_params import SamplingParams
from tests.utils.engine_utils import assert_no_blocks_held

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Roses are red,"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_gpu_blocks_override=256, max_model_len=256, seed=0)


@pytest.fixture(autouse=True)
def _no_leaks(llm: LLM):
    yield
    assert_no_blocks_held(llm)


def _gen(llm: LLM, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def test_outputs_come_back_in_input_order(llm: LLM) -> None:
    outs = _gen(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=3))
    assert [o.prompt for o in outs] == PROMPTS
    assert all(o.finished and len(o.outputs[0].token_ids) == 3 for o in outs)


def test_seeded_sampling_is_independent_of_the_batch(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    alone = _gen(llm, [PROMPTS[0]], params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=20)
    mixed = _gen(llm, [PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others, params, others])
    assert mixed[1].outputs[0].token_ids == alone
    assert _gen(llm, [PROMPTS[0]], params)[0].outputs[0].token_ids == alone


def test_parallel_seeded_samples_differ_and_reproduce(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10)
    first = [o.token_ids for o in _gen(llm, [PROMPTS[3]], params)[0].outputs]
    again = [o.token_ids for o in _gen(llm, [PROMPTS[3]], params)[0].outputs]
    assert first == again
    assert len({tuple(t) for t in first}) > 1


def test_max_tokens_ends_with_length(llm: LLM) -> None:
    out = _gen(llm, [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 5


def test_max_model_len_ends_with_length(llm: LLM) -> None:
    ids = list(range(100, 350))  # 250 tokens, 6 left before max_model_len=256
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    out = _gen(llm, [{"prompt_token_ids": ids}], params)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6


def test_stop_token_ids_end_with_the_token_as_stop_reason(llm: LLM) -> None:
    greedy = _gen(llm, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    target = greedy.token_ids[2]
    params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[target])
    out = _gen(llm, [PROMPTS[0]], params)[0].outputs[0]
    assert out.token_ids == greedy.token_ids[:3]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_stop_string_is_trimmed_or_kept(llm: LLM) -> None:
    greedy = _gen(llm, [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    stop = greedy.text[5:9]
    assert stop.strip()
    out = _gen(llm, [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=20, stop=[stop]))[0]
    assert out.outputs[0].text == greedy.text[: greedy.text.index(stop)]
    assert out.outputs[0].stop_reason == stop and out.outputs[0].finish_reason == "stop"
    kept = SamplingParams(
        temperature=0, max_tokens=20, stop=[stop], include_stop_str_in_output=True
    )
    out = _gen(llm, [PROMPTS[1]], kept)[0]
    assert out.outputs[0].text == greedy.text[: greedy.text.index(stop) + len(stop)]


def test_eos_ends_a_chat_reply_and_min_tokens_delays_it(llm: LLM) -> None:
    msgs = [{"role": "user", "content": "Say only the word yes."}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    eos = llm.get_tokenizer().eos_token_id
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids[-1] == eos and "<|im_end|>" not in out.text
    n = len(out.token_ids)
    longer = SamplingParams(temperature=0, max_tokens=40, min_tokens=n + 2)
    out2 = llm.chat(msgs, longer, use_tqdm=False)[0].outputs[0]
    assert len(out2.token_ids) >= n + 2 and eos not in out2.token_ids[: n + 2]


def test_logprobs_follow_vllm(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3)
    out = _gen(llm, [PROMPTS[2]], params)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy takes the most likely token
        assert 3 <= len(entry) <= 4
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks[:3] == [1, 2, 3]
        assert all(lp.logprob <= 0 for lp in entry.values())
        total += entry[token].logprob
    assert out.cumulative_logprob is not None and math.isclose(out.cumulative_logprob, total)
    plain = _gen(llm, [PROMPTS[2]], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_too_long_prompt_fails_alone(llm: LLM) -> None:
    long = {"prompt_token_ids": list(range(10, 400))}
    outs = _gen(llm, [PROMPTS[0], long, PROMPTS[1]], SamplingParams(temperature=0, max_tokens=4))
    assert outs[1].outputs[0].finish_reason == "error"
    assert "390 tokens" in (outs[1].error or "") and "max_model_len is 256" in (outs[1].error or "")
    assert all(len(outs[i].outputs[0].token_ids) == 4 for i in (0, 2))


def test_engine_add_request_rejects_bad_prompts(llm: LLM) -> None:
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="prompt must not be empty"):
        engine.add_request("a", "")
    with pytest.raises(ValueError, match="prompt must not be empty"):
        engine.add_request("b", {"prompt_token_ids": []})
    with pytest.raises(ValueError, match=r"prompt_token_ids must be in \[0, 49151\]"):
        engine.add_request("c", [1, 2, 49152])
    with pytest.raises(PromptTooLongError, match="max_model_len is 256"):
        engine.add_request("d", list(range(300)))
    engine.add_request("e", "hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("e", "hello again")
    engine.abort_request("e")
    engine.step()


def test_empty_prompt_is_rejected_by_generate(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt must not be empty"):
        _gen(llm, ["fine", ""], SamplingParams(max_tokens=2))


def test_abort_mid_generation_frees_every_block(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("x", PROMPTS[0], SamplingParams(n=2, temperature=1.0, max_tokens=50))
    engine.add_request("y", PROMPTS[1], SamplingParams(temperature=0, max_tokens=50))
    for _ in range(4):
        engine.step()
    assert engine.get_stats().num_free_kv_blocks < engine.get_stats().num_kv_blocks
    engine.abort_request(["x", "y"])
    outs = engine.step()
    assert {o.request_id for o in outs} == {"x", "y"}
    assert all(c.finish_reason == "abort" for o in outs for c in o.outputs)
    assert not engine.has_unfinished_requests()


def test_get_stats_names_are_the_public_interface(llm: LLM) -> None:
    _gen(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=4))
    stats = llm.get_stats()
    for name in (
        "num_kv_blocks",
        "num_free_kv_blocks",
        "num_preemptions",
        "num_prompt_tokens_computed",
        "num_prefix_cache_hit_tokens",
        "num_generated_tokens",
        "peak_kv_slot_utilization",
    ):
        assert hasattr(stats, name)
    assert stats.num_kv_blocks == 256 and stats.num_generated_tokens >= 16
    assert 0.0 < stats.peak_kv_slot_utilization <= 1.0
