"""What a request gives back: vLLM's `RequestOutput` and `CompletionOutput`, field for field.

`LLMEngine.step()` returns one `RequestOutput` per request that progressed, cumulative (the text
and tokens so far), so a streaming caller takes the new suffix and an offline caller the last one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.sequence import Logprob


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str  # released text so far (text that may still turn into a stop string is held back)
    token_ids: list[int]  # every generated token, including a final EOS or stop token
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs; None without logprobs
    logprobs: list[dict[int, Logprob]] | None  # per token: the sampled token and the top-k
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    error: str | None = None  # why the request failed (finish_reason "error")
    metrics: dict[str, float] = field(default_factory=dict)  # arrival, first token, finish times
