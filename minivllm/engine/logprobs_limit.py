"""How many logprobs a request may ask for: vLLM's `Processor._validate_logprobs`
(vllm/v1/engine/processor.py at 505805b6).

`logprobs` / `prompt_logprobs` of -1 ask for the whole vocabulary, and neither may ask for more
than the engine's `max_logprobs` (EngineArgs, `--max-logprobs`; -1: the vocabulary; vLLM's
default 20). The engine's input processor and the server both hold a request to it (the server
first, so that the refusal is a 400 before the request reaches the engine).

It imports the sampling parameters only.
"""

from __future__ import annotations

import dataclasses

from minivllm.sampling_params import InvalidParamError, SamplingParams


class LogprobsLimitError(InvalidParamError):
    """A request asks for more logprobs than `max_logprobs`; `param` names its field."""


def resolve_logprobs(params: SamplingParams, vocab_size: int, max_logprobs: int) -> SamplingParams:
    """The parameters with -1 replaced by the vocabulary size (what the sampler and the runner
    take as k); a ValueError in vLLM's words when either kind asks for more than the limit."""
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    asked = {"logprobs": params.logprobs, "prompt_logprobs": params.prompt_logprobs}
    for name, value in list(asked.items()):
        n = vocab_size if value == -1 else value
        if n is not None and n > limit:
            kind = "sample" if name == "logprobs" else "prompt"
            raise LogprobsLimitError(
                f"Requested {kind} logprobs of {n}, which is greater than max allowed: {limit}",
                name,
            )
        asked[name] = n
    if -1 not in (params.logprobs, params.prompt_logprobs):
        return params
    return dataclasses.replace(
        params, logprobs=asked["logprobs"], prompt_logprobs=asked["prompt_logprobs"]
    )
