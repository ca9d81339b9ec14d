"""A request's state as the scheduler sees it: token ids, progress, status, and what it produced.

vLLM v1 folds all of this into one `Request`; we keep vLLM v0's split because parallel sampling
(`n > 1`) is clearest that way: a `Request` owns `n` `Sequence`s that share the prompt's KV blocks
by copy-on-write after the prompt is computed once (paper §4.4). Each `Sequence` is scheduled,
preempted and finished on its own; the request is done when all of its sequences are.

The one number that drives scheduling is `num_computed_tokens`: how many of the sequence's tokens
have their K/V in the cache. A step computes `num_tokens - num_computed_tokens` or fewer of them
(a prompt chunk, or the one newest token of a decode); preemption by recompute resets it to 0.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence as TokenIds
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from minivllm.lora.request import LoRARequest
from minivllm.pooling.pooling_params import PoolingParams
from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:  # a type only: the grammar module needs torch, which the core does not load
    from minivllm.structured_output.backend import StructuredOutputGrammar


class Detokenizer(Protocol):
    """What a sequence holds of its text: the engine makes one per sequence
    (`IncrementalDetokenizer`, minivllm/engine/detokenizer.py) and feeds it each new token; the
    core only carries it, so it names the interface rather than importing the engine."""

    finished: bool
    stop_string_matched: str | None  # the stop string that ended the text, once one did

    @property
    def output_text(self) -> str: ...

    def append(self, token_ids: TokenIds[int]) -> str: ...

    def finish(self) -> str: ...


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not holding KV blocks: new, or preempted
    RUNNING = "running"  # holding KV blocks, scheduled every step
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"  # the caller gave up (abort_request, a client disconnect)
    FINISHED_ERROR = "error"  # the request could not be served (e.g. prompt too long)

    @property
    def is_finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)


@dataclass
class Logprob:
    """One candidate token's log-probability, as vLLM reports it."""

    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str | None = None


@dataclass(eq=False)
class Sequence:
    seq_id: int  # unique in the engine; the KV cache manager's key
    request: Request
    index: int  # which of the request's n samples
    token_ids: list[int]  # prompt + output, grows by one per decode step
    num_prompt_tokens: int
    detokenizer: Detokenizer | None
    # This sequence's own RNG, a torch.Generator (None for greedy). Typed Any: the core imports no
    # torch; only the sampler draws from it.
    generator: Any
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    # Of the prompt, served by the prefix cache at the FIRST admission (None until then); a
    # re-admission after preemption does not change it, as in vLLM v1.
    num_cached_tokens: int | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Structured outputs: this sequence's grammar matcher, advanced by each committed token
    # (None when unconstrained, and once finished).
    grammar: StructuredOutputGrammar | None = None
    # Speculative decoding: drafted tokens the next step verifies (set before each schedule).
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(eq=False)
class Request:
    """One call of `add_request`: a prompt, its parameters and its `n` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    error: str | None = None  # why the request failed, when it did
    # Timestamps for latency metrics (time to first token, inter-token latency, end to end).
    scheduled_time: float | None = None  # the latest admission to the running batch
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    # With `params.prompt_logprobs`: one entry per prompt token so far, the first None (nothing
    # predicts it); filled chunk by chunk as the prompt is computed (`ScheduledSequence.prompt_logprobs`).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # `params.bad_words` as token-id sequences (each word alone and after a space), set by the
    # engine, which has the tokenizer; the sampler bans a word's last token after its prefix.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    # The most sequences it runs at once: n samples, or a beam search's beam_width (0: n).
    max_num_seqs: int = 0
    # n > 1 (or beams): the first sequence computes the prompt; at its first sample it is forked.
    forked: bool = False
    # A pooling request (minivllm/pooling/): prefill-only, its prompt pooled instead of sampled
    # (`params` is then a placeholder of one token); `pooled` is the result, once its prompt ran.
    pooling_params: PoolingParams | None = None
    pooled: list[float] | None = None
    # The LoRA adapter its every sequence runs under (minivllm/lora/); None: the base model.
    lora_request: LoRARequest | None = None

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id, 0 for the base model (vLLM's convention)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def block_hash_extra_keys(self) -> tuple[tuple[str, int], ...] | None:
        """What else than its tokens shapes its K/V (vLLM's extra keys): the adapter, whose
        q/k/v deltas change every layer's K/V, so that two adapters never share a cached block."""
        return (("lora", self.lora_int_id),) if self.lora_request is not None else None

    # An encoder's segment of each prompt token (BERT's token types: 0, then 1 for the second
    # text of a pair), as the tokenizer gave them; None: all 0.
    token_type_ids: list[int] | None = None

    def __post_init__(self) -> None:
        self.max_num_seqs = self.max_num_seqs or self.params.n
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt tokens still lack their logprobs: its prompt must be computed, not taken from
        the prefix cache (a cached block has K/V but no logits; vLLM v1 skips the lookup too)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(
            self.prompt_token_ids
        )

    @property
    def is_finished(self) -> bool:
        # Forking happens before the first token is sampled, so before it only an abort or an
        # error can finish the first sequence, and then the request is over too.
        return all(s.status.is_finished for s in self.seqs)
