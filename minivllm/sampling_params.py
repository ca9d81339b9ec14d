"""SamplingParams: how one request is sampled and when it stops.

The field names, defaults and error messages follow vLLM's `vllm/sampling_params.py`, so that code
written for vLLM runs unchanged and the server's 400 errors read the same. Every check lives in
`__post_init__`: a `SamplingParams` that exists is valid, and the sampler, the detokenizer and the
stop checker never re-validate. A refusal is an `InvalidParamError`, whose `param` names the field:
the server returns it as its 400 and checks none of these fields itself.

`structured_outputs` constrains the output with a grammar (a JSON schema, a regex, a choice, an
EBNF grammar or any JSON object): see `minivllm/structured_output/`.

`logit_bias`, `allowed_token_ids` and `bad_words` are logits processors
(`minivllm/sample/logits_processors.py`); token ids beyond the vocabulary are refused by the engine,
which knows its size.

Deviations from vLLM, on purpose: no `best_of` or `output_kind` (out of scope); non-finite floats
are rejected; `logit_bias` values outside OpenAI's [-100, 100] are refused, not clamped. Logprobs
of -1 (the vocabulary) and the engine's `max_logprobs`: minivllm/engine/logprobs_limit.py.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

from minivllm.structured_output.params import StructuredOutputsParams

__all__ = ["InvalidParamError", "SamplingParams", "StructuredOutputsParams"]

# Temperatures below this are greedy; vLLM's `_SAMPLING_EPS`.
SAMPLING_EPS = 1e-5
# The most top logprobs a request may ask for per token unless the engine says (`max_logprobs`).
MAX_LOGPROBS = 20


class InvalidParamError(ValueError):
    """A request parameter out of its type or range. `param` names the field, and the message
    names the field and the range in vLLM's words; the server returns both as its 400 (its
    `param` and `message`), so no check is written twice (minivllm/entrypoints/serving.py)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def verify_truncate_prompt_tokens(k: Any) -> int | None:
    """`truncate_prompt_tokens`: None, -1 (`max_model_len`) or at least 1. Its own function, as the
    server truncates a prompt (beam search's too) before any parameters are made from it."""
    if k is None:
        return None
    k = _check_int("truncate_prompt_tokens", k)
    if k < 1 and k != -1:
        raise InvalidParamError(
            f"truncate_prompt_tokens must be -1 or at least 1, got {k}.", "truncate_prompt_tokens"
        )
    return k


def _is_int(value: Any) -> bool:
    # bool is a subclass of int, but `n=True` is a bug, not a request for one sample.
    return isinstance(value, int) and not isinstance(value, bool)


# `name` is the field, or the field and a part of it ("logit_bias value"): `param` is the field.
def _check_int(name: str, value: Any) -> int:
    if not _is_int(value):
        raise InvalidParamError(f"{name} must be an int, got {value!r}.", name.split(" ")[0])
    return int(value)


def _check_float(name: str, value: Any) -> float:
    if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
        raise InvalidParamError(
            f"{name} must be a finite number, got {value!r}.", name.split(" ")[0]
        )
    return float(value)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidParamError(f"{name} must be a bool, got {value!r}.", name)
    return value


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request (vLLM's names and defaults)."""

    n: int = 1  # completions returned for the prompt
    presence_penalty: float = 0.0  # subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence of a token in the output
    repetition_penalty: float = 1.0  # >1 discourages tokens of prompt+output (CTRL's formula)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus: smallest set of tokens with this much probability mass
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = all
    min_p: float = 0.0  # drop tokens with probability < min_p * max probability
    seed: int | None = None  # per-request RNG seed: reproducible whatever the batch
    stop: str | list[str] | None = None  # stop strings (normalized to a list)
    stop_token_ids: list[int] | None = None  # token ids that end the sequence (kept in token_ids)
    ignore_eos: bool = False  # keep generating after EOS
    max_tokens: int | None = 16  # None = until the model's context is full
    min_tokens: int = 0  # output tokens before EOS / stop_token_ids / stop strings may end it
    logprobs: int | None = None  # top logprobs per output token (the sampled one is always given)
    prompt_logprobs: int | None = None  # top logprobs per prompt token (the prompt's own given too)
    skip_special_tokens: bool = True  # drop special tokens from the text
    spaces_between_special_tokens: bool = True  # slow tokenizers only, as in transformers
    include_stop_str_in_output: bool = False  # keep the matched stop string (and token) in text
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: max_model_len
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # words that must not be generated (any of their tokens)
    # A grammar the output must follow (vLLM's field; a dict is read as its keywords).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # Each check names the field and its allowed range, so the server's 400s read as vLLM's.
        self._verify_sampling()
        self._verify_lengths()
        self._verify_stops()
        self._verify_logprobs()
        self._verify_token_constraints()
        self._verify_structured_outputs()
        if self.is_greedy:
            # As vLLM does: greedy ignores truncation, so reset it rather than carry dead values
            # into the sampler (which could then take a slower path for nothing).
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify_sampling(self) -> None:
        """n, the penalties, temperature and the truncations (top-p, top-k, min-p), and the seed."""
        self.n = _check_int("n", self.n)
        if self.n < 1:
            raise InvalidParamError(f"n must be at least 1, got {self.n}.", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise InvalidParamError(f"{name} must be in [-2, 2], got {value}.", name)
            setattr(self, name, value)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise InvalidParamError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.",
                "repetition_penalty",
            )
        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0.0:
            raise InvalidParamError(
                f"temperature must be non-negative, got {self.temperature}.", "temperature"
            )
        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParamError(f"top_p must be in (0, 1], got {self.top_p}.", "top_p")
        self.top_k = _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise InvalidParamError(
                f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.", "top_k"
            )
        self.min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParamError(f"min_p must be in [0, 1], got {self.min_p}.", "min_p")
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed)
            # vLLM's bound (torch.long): what a generator's seed and the server's field can hold.
            if not -(2**63) <= self.seed < 2**63:
                raise InvalidParamError(
                    f"seed must be in [{-(2**63)}, {2**63 - 1}], got {self.seed}.", "seed"
                )

    def _verify_lengths(self) -> None:
        """How much of the prompt is kept and how many tokens the output has."""
        self.truncate_prompt_tokens = verify_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.max_tokens is not None:
            self.max_tokens = _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise InvalidParamError(
                    f"max_tokens must be at least 1, got {self.max_tokens}.", "max_tokens"
                )
        self.min_tokens = _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise InvalidParamError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.",
                "min_tokens",
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParamError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}.",
                "min_tokens",
            )

    def _verify_stops(self) -> None:
        """Stop strings and token ids, normalised to lists, and the flags that shape the text."""
        self.stop = self._normalize_stop(self.stop)
        self.stop_token_ids = self._normalize_stop_token_ids(self.stop_token_ids)
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
        ):
            _check_bool(name, getattr(self, name))

    def _verify_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and _check_int(name, value) < -1:
                raise InvalidParamError(f"{name} must be non-negative or -1, got {value}.", name)

    def _verify_token_constraints(self) -> None:
        """What the sampler's logits processors read: `logit_bias`, `allowed_token_ids`,
        `bad_words` (minivllm/sample/logits_processors.py)."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidParamError(
                    f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}.",
                    "logit_bias",
                )
            bias = {}
            for token, value in self.logit_bias.items():
                token = _check_int("logit_bias token id", token)
                value = _check_float("logit_bias value", value)
                if not -100.0 <= value <= 100.0:
                    raise InvalidParamError(
                        f"logit_bias values must be in [-100, 100], got {value} for token {token}.",
                        "logit_bias",
                    )
                bias[token] = value
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list | tuple) or not self.allowed_token_ids:
                raise InvalidParamError(
                    f"allowed_token_ids must be a non-empty list of token ids, got "
                    f"{self.allowed_token_ids!r}.",
                    "allowed_token_ids",
                )
            ids = self.allowed_token_ids
            self.allowed_token_ids = [_check_int("allowed_token_ids", t) for t in ids]
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list | tuple) or not all(
                isinstance(w, str) and w.strip() for w in self.bad_words
            ):
                raise InvalidParamError(
                    f"bad_words must be a list of non-empty strings, got {self.bad_words!r}.",
                    "bad_words",
                )
            self.bad_words = list(self.bad_words)

    def _verify_structured_outputs(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            got = self.structured_outputs
            raise InvalidParamError(
                f"structured_outputs must be a StructuredOutputsParams, got {got!r}.",
                "structured_outputs",
            )

    @staticmethod
    def _normalize_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise InvalidParamError(f"stop must be a str or a list of str, got {stop!r}.", "stop")
        if "" in stop:
            raise InvalidParamError("stop cannot contain an empty string.", "stop")
        return list(stop)

    @staticmethod
    def _normalize_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise InvalidParamError(
                f"stop_token_ids must be a list of non-negative ints, got {ids!r}.",
                "stop_token_ids",
            )
        return list(ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def all_stop_token_ids(self, eos_token_id: int | None) -> set[int]:
        """Token ids that end the sequence: `stop_token_ids`, plus EOS unless `ignore_eos`.

        These are what `min_tokens` masks in the sampler and what the stop checker tests.
        """
        ids = set(self.stop_token_ids or ())
        if eos_token_id is not None and not self.ignore_eos:
            ids.add(eos_token_id)
        return ids

    def stops_allowed(self, num_output_tokens: int) -> bool:
        """Whether the `num_output_tokens`-th output token may end the sequence: stops count only
        after `min_tokens` (the sampler masks stop tokens before then, the detokenizer holds stop
        strings back, and the stop checker applies the same rule)."""
        return num_output_tokens > self.min_tokens

    def clone(self) -> SamplingParams:
        """A deep copy (the stop lists are not shared), as vLLM's `SamplingParams.clone`."""
        return copy.deepcopy(self)
