"""SamplingParams: vLLM's defaults, normalization, and a ValueError naming the field for every
invalid value."""

from __future__ import annotations

import dataclasses

import pytest

from minivllm.sampling_params import MAX_LOGPROBS, SamplingParams

VLLM_DEFAULTS = {
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "seed": None,
    "stop": [],
    "stop_token_ids": [],
    "ignore_eos": False,
    "max_tokens": 16,
    "min_tokens": 0,
    "logprobs": None,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
    "prompt_logprobs": None,
    "truncate_prompt_tokens": None,
    "logit_bias": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "structured_outputs": None,
}


def test_defaults_are_vllms():
    params = SamplingParams()
    assert {f.name: getattr(params, f.name) for f in dataclasses.fields(params)} == VLLM_DEFAULTS
    assert not params.is_greedy


# (kwargs, exact message). Messages are part of the interface: the server returns them as 400s.
INVALID = [
    ({"n": 0}, "n must be at least 1, got 0."),
    ({"n": True}, "n must be an int, got True."),
    ({"n": 1.5}, "n must be an int, got 1.5."),
    ({"presence_penalty": 3.0}, "presence_penalty must be in [-2, 2], got 3.0."),
    ({"presence_penalty": -2.5}, "presence_penalty must be in [-2, 2], got -2.5."),
    ({"presence_penalty": "x"}, "presence_penalty must be a finite number, got 'x'."),
    ({"frequency_penalty": 2.01}, "frequency_penalty must be in [-2, 2], got 2.01."),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be a finite number, got nan."),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be greater than zero, got 0.0."),
    ({"repetition_penalty": -1}, "repetition_penalty must be greater than zero, got -1.0."),
    ({"repetition_penalty": None}, "repetition_penalty must be a finite number, got None."),
    ({"temperature": -1.0}, "temperature must be non-negative, got -1.0."),
    ({"temperature": "hot"}, "temperature must be a finite number, got 'hot'."),
    ({"temperature": float("inf")}, "temperature must be a finite number, got inf."),
    ({"temperature": True}, "temperature must be a finite number, got True."),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0."),
    ({"top_k": -2}, "top_k must be 0 or -1 (disable), or at least 1, got -2."),
    ({"top_k": 2.0}, "top_k must be an int, got 2.0."),
    ({"min_p": 2.0}, "min_p must be in [0, 1], got 2.0."),
    ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1."),
    ({"seed": 1.0}, "seed must be an int, got 1.0."),
    ({"seed": "7"}, "seed must be an int, got '7'."),
    ({"stop": ""}, "stop cannot contain an empty string."),
    ({"stop": ["a", ""]}, "stop cannot contain an empty string."),
    ({"stop": ["a", 3]}, "stop must be a str or a list of str, got ['a', 3]."),
    ({"stop": 3}, "stop must be a str or a list of str, got 3."),
    ({"stop_token_ids": [-1]}, "stop_token_ids must be a list of non-negative ints, got [-1]."),
    ({"stop_token_ids": [1.0]}, "stop_token_ids must be a list of non-negative ints, got [1.0]."),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list of non-negative ints, got 5."),
    ({"ignore_eos": 1}, "ignore_eos must be a bool, got 1."),
    ({"skip_special_tokens": "no"}, "skip_special_tokens must be a bool, got 'no'."),
    (
        {"spaces_between_special_tokens": None},
        "spaces_between_special_tokens must be a bool, got None.",
    ),
    ({"include_stop_str_in_output": 0}, "include_stop_str_in_output must be a bool, got 0."),
    ({"max_tokens": 0}, "max_tokens must be at least 1, got 0."),
    ({"max_tokens": True}, "max_tokens must be an int, got True."),
    ({"max_tokens": 8.0}, "max_tokens must be an int, got 8.0."),
    ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0, got -1."),
    (
        {"min_tokens": 10, "max_tokens": 5},
        "min_tokens must be less than or equal to max_tokens=5, got 10.",
    ),
    ({"logprobs": -2}, "logprobs must be non-negative or -1, got -2."),
    (
        {"seed": 2**63},
        "seed must be in [-9223372036854775808, 9223372036854775807], got 9223372036854775808.",
    ),
    (
        {"seed": -(2**63) - 1},
        "seed must be in [-9223372036854775808, 9223372036854775807], got -9223372036854775809.",
    ),
    ({"prompt_logprobs": -5}, "prompt_logprobs must be non-negative or -1, got -5."),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be -1 or at least 1, got 0."),
    ({"logit_bias": {1: 101}}, "logit_bias values must be in [-100, 100], got 101.0 for token 1."),
    ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list of token ids, got []."),
    ({"bad_words": "word"}, "bad_words must be a list of non-empty strings, got 'word'."),
    ({"logprobs": False}, "logprobs must be an int, got False."),
    ({"structured_outputs": 3}, "structured_outputs must be a StructuredOutputsParams, got 3."),
    (
        {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
        "structured_outputs must set exactly one of json, regex, choice, grammar, json_object; "
        "got regex, choice",
    ),
]


@pytest.mark.parametrize(("kwargs", "message"), INVALID, ids=[m for _, m in INVALID])
def test_invalid_value_raises_value_error_naming_the_field(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == message


def test_every_field_has_an_invalid_case():
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert {name for kwargs, _ in INVALID for name in kwargs} == fields


VALID_EDGES = [
    {"presence_penalty": -2.0, "frequency_penalty": 2},
    {"top_p": 1e-9, "top_k": -1},
    {"top_k": 1, "min_p": 1.0},
    {"temperature": 0},
    {"max_tokens": None, "min_tokens": 1000},
    {"min_tokens": 5, "max_tokens": 5},
    {"logprobs": 0},
    {"logprobs": MAX_LOGPROBS},
    {"seed": -3},
    {"stop_token_ids": (0, 7)},
]


@pytest.mark.parametrize("kwargs", VALID_EDGES)
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_stop_and_stop_token_ids_are_normalized_to_lists():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_numbers_are_normalized_to_floats():
    params = SamplingParams(temperature=1, top_p=1, presence_penalty=1)
    assert type(params.temperature) is float and params.temperature == 1.0
    assert type(params.top_p) is float and type(params.presence_penalty) is float


def test_is_greedy_below_sampling_eps_and_greedy_resets_truncation():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=9e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    sampled = SamplingParams(temperature=0.7, top_p=0.5, top_k=3, min_p=0.2)
    assert (sampled.top_p, sampled.top_k, sampled.min_p) == (0.5, 3, 0.2)


def test_all_stop_token_ids_adds_eos_unless_ignored():
    assert SamplingParams(stop_token_ids=[5]).all_stop_token_ids(2) == {2, 5}
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).all_stop_token_ids(2) == {5}
    assert SamplingParams().all_stop_token_ids(None) == set()


def test_clone_is_equal_and_does_not_share_lists():
    params = SamplingParams(stop=["x"], stop_token_ids=[1], seed=3)
    clone = params.clone()
    assert clone == params and clone is not params
    assert isinstance(clone.stop, list)
    clone.stop.append("y")
    assert clone.stop_token_ids is not None
    clone.stop_token_ids.append(2)
    assert params.stop == ["x"] and params.stop_token_ids == [1]


def test_truncate_prompt_tokens_keeps_the_last_tokens() -> None:
    from minivllm.inputs import truncate_prompt

    assert truncate_prompt([1, 2, 3, 4], 2, 100) == [3, 4]
    assert truncate_prompt([1, 2, 3, 4], -1, 3) == [2, 3, 4]
    assert truncate_prompt([1, 2, 3, 4], None, 3) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1 or at least 1, got 0"):
        SamplingParams(truncate_prompt_tokens=0)
