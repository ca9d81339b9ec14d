"""check_stop: vLLM's finish reasons after each new token."""

from __future__ import annotations

import pytest

from minivllm.engine.stop_checker import check_stop, is_stop_token
from minivllm.sampling_params import SamplingParams

EOS = 2
MAX_LEN = 100


def check(output, params, stop_str=None, prompt_len=10, max_model_len=MAX_LEN):
    return check_stop(output, params, EOS, stop_str, prompt_len + len(output), max_model_len)


def test_running_sequence_is_not_finished():
    assert check([5, 6], SamplingParams(max_tokens=3)) is None


def test_eos_stops_with_no_stop_reason():
    assert check([5, EOS], SamplingParams()) == ("stop", None)


def test_eos_in_the_middle_does_not_count_only_the_newest_token():
    assert check([EOS, 5], SamplingParams()) is None


def test_ignore_eos_keeps_going():
    assert check([5, EOS], SamplingParams(ignore_eos=True)) is None


def test_stop_token_id_is_the_stop_reason():
    assert check([5, 9], SamplingParams(stop_token_ids=[9])) == ("stop", 9)
    # Even with ignore_eos, which concerns EOS only.
    assert check([9], SamplingParams(stop_token_ids=[9], ignore_eos=True)) == ("stop", 9)


def test_eos_listed_in_stop_token_ids_is_reported_as_eos():
    assert check([EOS], SamplingParams(stop_token_ids=[EOS])) == ("stop", None)
    assert check([EOS], SamplingParams(stop_token_ids=[EOS], ignore_eos=True)) == ("stop", EOS)


def test_stop_string_is_the_stop_reason():
    assert check([5], SamplingParams(stop=["###"]), stop_str="###") == ("stop", "###")


def test_max_tokens_gives_length():
    params = SamplingParams(max_tokens=3)
    assert check([5, 6], params) is None
    assert check([5, 6, 7], params) == ("length", None)


def test_max_tokens_none_runs_until_max_model_len():
    params = SamplingParams(max_tokens=None)
    assert check([5] * 89, params) is None
    assert check([5] * 90, params) == ("length", None)  # 10 prompt + 90 output = max_model_len


def test_max_model_len_caps_before_max_tokens():
    assert check([5, 6], SamplingParams(max_tokens=50), prompt_len=98) == ("length", None)


def test_stop_wins_over_length_on_the_last_allowed_token():
    assert check([5, EOS], SamplingParams(max_tokens=2)) == ("stop", None)
    assert check([5, 6], SamplingParams(max_tokens=2), stop_str="x") == ("stop", "x")


@pytest.mark.parametrize("kind", ["eos", "stop_token_id"])
def test_stop_tokens_only_count_after_min_tokens(kind):
    token = EOS if kind == "eos" else 9
    params = SamplingParams(min_tokens=3, stop_token_ids=[9])
    assert check([5, 5, token], params) is None  # 3rd token: still inside min_tokens
    assert check([5, 5, 5, token], params) is not None  # 4th: the first that may stop


def test_length_applies_even_inside_min_tokens():
    params = SamplingParams(min_tokens=10, max_tokens=None)
    assert check([5, 5], params, prompt_len=98) == ("length", None)


def test_is_stop_token_matches_check_stop():
    params = SamplingParams(min_tokens=1, stop_token_ids=[9])
    assert not is_stop_token(EOS, 1, params, EOS)
    assert is_stop_token(EOS, 2, params, EOS)
    assert is_stop_token(9, 2, params, EOS)
    assert not is_stop_token(5, 2, params, EOS)
    assert not is_stop_token(EOS, 2, SamplingParams(ignore_eos=True), EOS)


def test_empty_output_is_an_error():
    with pytest.raises(ValueError, match="at least one output token"):
        check_stop([], SamplingParams(), EOS, None, 10, MAX_LEN)
