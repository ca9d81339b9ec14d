"""Deciding, after each new token, whether a sequence is finished — and why.

Semantics follow vLLM (`vllm/v1/core/sched/utils.py::check_stop`, and v0's `StopChecker`):

* finish_reason "stop":
  - the new token is EOS (unless `ignore_eos`): stop_reason None;
  - the new token is in `stop_token_ids`: stop_reason = that id;
  - the detokenizer matched a stop string: stop_reason = the string.
  The stopping token stays in the sequence's token ids; its text is left out of the output text
  unless `include_stop_str_in_output` (the detokenizer does that, with `is_stop_token` below).
* finish_reason "length": `max_tokens` output tokens, or prompt + output reached `max_model_len`.

Stops only count from the (min_tokens + 1)-th output token on: the sampler masks EOS and
`stop_token_ids` while the output is shorter than `min_tokens`, so the first token that can stop
the sequence is exactly that one, and stop strings follow the same rule (as vLLM v1's detokenizer).

Order: a stop is reported before a length cap (v0's order), so a sequence whose last allowed token
is EOS finishes with "stop" — the more informative answer, and what OpenAI's API reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from minivllm.sampling_params import SamplingParams

FinishReason = Literal["stop", "length"]
StopReason = int | str | None


def is_stop_token(
    token_id: int, num_output_tokens: int, params: SamplingParams, eos_token_id: int | None
) -> bool:
    """Whether `token_id`, the `num_output_tokens`-th output token, ends the sequence."""
    if not params.stops_allowed(num_output_tokens):
        return False
    return token_id in params.all_stop_token_ids(eos_token_id)


def check_stop(
    output_token_ids: Sequence[int],
    params: SamplingParams,
    eos_token_id: int | None,
    detok_stop_str: str | None,
    num_tokens_total: int,
    max_model_len: int,
) -> tuple[FinishReason, StopReason] | None:
    """(finish_reason, stop_reason) if the sequence is finished after its newest token, else None.

    output_token_ids: the output so far, newest token last (must not be empty).
    detok_stop_str: the stop string the detokenizer matched this step (`stop_string_matched`).
    num_tokens_total: prompt + output tokens.
    """
    num_output = len(output_token_ids)
    if num_output == 0:
        raise ValueError("check_stop needs at least one output token.")
    last = output_token_ids[-1]

    if is_stop_token(last, num_output, params, eos_token_id):
        is_eos = last == eos_token_id and not params.ignore_eos
        # EOS wins over a stop_token_id equal to it: vLLM reports EOS with no stop_reason.
        return "stop", (None if is_eos else last)
    if detok_stop_str is not None:
        return "stop", detok_stop_str

    if num_tokens_total >= max_model_len:
        return "length", None
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return "length", None
    return None
