"""From what a caller hands `add_request` to a `Request` the scheduler can take.

vLLM v1's `InputProcessor` (vllm/v1/engine/processor.py): every check that can be made before a
request reaches the scheduler is made here, once, with a message that names what is wrong, so that
the engine's `add_request` only registers the result. In order: the model's sampling defaults fill
the fields a request leaves unset (generation_config.json, as vLLM reads it), `n` is checked
against `max_num_seqs` and logprobs against `max_logprobs`, the model's extra end-of-turn tokens
become stop tokens, the token ids the request names are checked against the vocabulary, and the
prompt is tokenized, truncated and checked against `max_model_len` (minivllm/inputs.py).

It imports the inputs, the sampling parameters and the request type.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from minivllm.config import EngineConfig
from minivllm.core.sequence import Request
from minivllm.engine.logprobs_limit import resolve_logprobs  # -1 and max_logprobs, as vLLM's
from minivllm.inputs import (
    PromptTooLongError,
    PromptType,
    prepare_prompt,
    process_prompt,
    process_token_params,
    truncate_prompt,
)
from minivllm.model.source import GenerationDefaults
from minivllm.pooling.config import PoolerConfig
from minivllm.pooling.pooling_params import PoolingParams
from minivllm.sampling_params import InvalidParamError, SamplingParams


def verify_n(n: int, max_num_seqs: int) -> None:
    """A request's `n` samples run at once, so n is at most the scheduler's `max_num_seqs`. The
    server asks this too, before it queues a request (the engine's refusal would come back on the
    stream, after the 200): one check, made at both doors."""
    if n > max_num_seqs:
        raise InvalidParamError(f"n must be at most max_num_seqs ({max_num_seqs}), got {n}", "n")


class InputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        config: EngineConfig,
        generation: GenerationDefaults,
        eos_token_id: int | None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len  # after the engine fitted it to the KV cache
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_logprobs = config.model.max_logprobs
        # generation_config.json, as vLLM reads it by default: its sampling defaults fill the
        # fields a request leaves unset (vLLM's `get_diff_sampling_param()`), and each of its EOS
        # ids beyond the tokenizer's stops generation, reported as a stop token (as vLLM does),
        # for models whose end-of-turn token is not `eos_token`.
        self.sampling_defaults: dict[str, Any] = dict(generation.sampling_defaults)
        self.extra_eos_token_ids = frozenset(generation.eos_token_ids) - {eos_token_id}
        # Every token that ends a sequence (what a grammar may end on, beam search stops at).
        self.eos_token_ids = frozenset(
            t for t in (eos_token_id, *self.extra_eos_token_ids) if t is not None
        )

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt; see `minivllm.inputs.process_prompt`."""
        return process_prompt(prompt, self.tokenizer, self.vocab_size)

    def default_params(self) -> SamplingParams:
        """What a request that brings no parameters samples with: the model's defaults."""
        return SamplingParams(**self.sampling_defaults)

    def process_pooling_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: PoolingParams,
        pooler: PoolerConfig,
        arrival_time: float | None = None,
    ) -> Request:
        """A prefill-only request: its prompt may fill max_model_len (nothing is generated),
        and its parameters must suit the model's pooler."""
        params.verify(pooler)
        text, ids = process_prompt(prompt, self.tokenizer, self.vocab_size)
        types = token_type_ids(prompt, len(ids), pooler.causal)
        kept = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)
        if len(kept) < len(ids):
            text, ids = None, kept
            types = None if types is None else types[len(types) - len(kept) :]
        if len(ids) > self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}: "
                "it must be at most that long (or set truncate_prompt_tokens)"
            )
        # The placeholder sampling parameters of a request that samples nothing.
        request = Request(request_id, text, ids, SamplingParams(max_tokens=1))
        request.pooling_params = params
        request.token_type_ids = types
        if arrival_time is not None:
            request.arrival_time = arrival_time
        return request

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
        verify_n(params.n, self.max_num_seqs)
        params = resolve_logprobs(params, self.vocab_size, self.max_logprobs)
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


def token_type_ids(prompt: PromptType, num_tokens: int, causal: bool) -> list[int] | None:
    """A tokenized pair's token types (vLLM's `TokensPrompt.token_type_ids`): one 0 or 1 per
    prompt token, for an encoder only (a decoder has no token type embedding)."""
    types = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
    if types is None:
        return None
    if causal:
        raise ValueError("token_type_ids are for an encoder (BERT); this model is a decoder")
    if (
        not isinstance(types, list | tuple)
        or len(types) != num_tokens
        or any(not isinstance(t, int) or isinstance(t, bool) or t not in (0, 1) for t in types)
    ):
        raise ValueError(f"token_type_ids must be {num_tokens} values, each 0 or 1 (one a token)")
    return list(types)
