"""What a request gives back: vLLM's `RequestOutput` and `CompletionOutput`, field for field.

`LLMEngine.step()` returns one `RequestOutput` per request that progressed, cumulative (the text
and tokens so far), so a streaming caller takes the new suffix and an offline caller the last one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.core.sequence import Logprob, Request


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
    # With `prompt_logprobs`: per prompt token, None for the first, else the prompt token's and the
    # top-k's logprobs (vLLM's shape).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # why the request failed (finish_reason "error")
    metrics: dict[str, float] = field(default_factory=dict)  # arrival, first token, finish times
    pooled: list[float] | None = None  # a pooling request's vector (minivllm/pooling/), once done


def make_request_output(req: Request) -> RequestOutput:
    """A snapshot of a request's progress: released text, tokens, logprobs and finish reasons."""
    outs = []
    for seq in req.seqs:
        detok = seq.detokenizer
        with_logprobs = seq.logprobs is not None
        outs.append(
            CompletionOutput(
                index=seq.index,
                text=detok.output_text if detok is not None else "",
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if with_logprobs else None,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
        )
    metrics = {"arrival_time": req.arrival_time}
    for name in ("scheduled_time", "first_token_time", "last_token_time", "finished_time"):
        value = getattr(req, name)
        if value is not None:
            metrics[name] = value
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=list(req.prompt_token_ids),
        outputs=outs,
        finished=req.is_finished,
        num_cached_tokens=(req.seqs[0].num_cached_tokens or 0) if req.seqs else 0,
        prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
        error=req.error,
        metrics=metrics,
        pooled=req.pooled,
    )
