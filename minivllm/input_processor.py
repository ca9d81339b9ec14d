"""From what a caller hands `add_request` to a `Request` the scheduler can take.

vLLM v1's `InputProcessor` (vllm/v1/engine/processor.py): every check that can be made before a
request reaches the scheduler is made here, once, with a message that names what is wrong, so that
the engine's `add_request` only registers the result. In order: the model's sampling defaults fill
the fields a request leaves unset (generation_config.json, as vLLM reads it), `n` is checked
against `max_num_seqs`, the model's extra end-of-turn tokens become stop tokens, the token ids the
request names are checked against the vocabulary (`bad_words` tokenized), and the prompt is
tokenized, truncated and checked against `max_model_len` (minivllm/inputs.py).

Tier: engine. It imports the inputs, the sampling parameters and the request type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from minivllm.inputs import PromptType, prepare_prompt, process_prompt, process_token_params
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Request


class InputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        max_num_seqs: int,
        sampling_defaults: Mapping[str, Any],
        extra_eos_token_ids: Iterable[int],
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len  # after the engine fitted it to the KV cache
        self.max_num_seqs = max_num_seqs
        self.sampling_defaults = dict(sampling_defaults)  # vLLM's `get_diff_sampling_param()`
        # generation_config.json's EOS ids beyond the tokenizer's: each stops generation, reported
        # as a stop token (as vLLM does), for models whose end-of-turn token is not `eos_token`.
        self.extra_eos_token_ids = frozenset(extra_eos_token_ids)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt; see `minivllm.inputs.process_prompt`."""
        return process_prompt(prompt, self.tokenizer, self.vocab_size)

    def default_params(self) -> SamplingParams:
        """What a request that brings no parameters samples with: the model's defaults."""
        return SamplingParams(**self.sampling_defaults)

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None,
        max_num_seqs: int = 0,
        arrival_time: float | None = None,
    ) -> Request:
        """The request, checked; `max_num_seqs`: its sequences at once (0: its n), for hooks
        such as beam search that keep more sequences than they return."""
        params = params or self.default_params()
        if params.n > self.max_num_seqs:
            raise ValueError(
                f"n must be at most max_num_seqs ({self.max_num_seqs}), got {params.n}"
            )
        if self.extra_eos_token_ids and not params.ignore_eos:
            stops = set(params.stop_token_ids or []) | self.extra_eos_token_ids
            params = dataclasses.replace(params, stop_token_ids=sorted(stops))
        bad_words = process_token_params(params, self.tokenizer, self.vocab_size)
        text, ids = prepare_prompt(
            prompt,
            self.tokenizer,
            self.vocab_size,
            self.max_model_len,
            params.truncate_prompt_tokens,
        )
        request = Request(request_id, text, ids, params, max_num_seqs=max_num_seqs)
        request.bad_words_token_ids = bad_words
        if arrival_time is not None:
            request.arrival_time = arrival_time
        return request
