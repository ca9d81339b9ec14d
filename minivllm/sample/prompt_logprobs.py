"""Prompt logprobs, scored on the runner: each prompt row's logprob of the prompt token that
follows it, its rank and the top k (vLLM's `prompt_logprobs`, what evaluation harnesses score;
vLLM computes them in its runner too).

The model runner finds the rows (`ModelInput.prompt_rows`, chunk by chunk) and calls this only
in a step where a request asked, so a step without one never loads this module. A [rows, vocab]
float32 tensor never leaves the runner, and is made a slice of rows at a time.

It imports the model, the sampler's logprob helpers and leaves.
"""

from __future__ import annotations

import torch

from minivllm.model.models.llama import LlamaForCausalLM
from minivllm.sample.sampler import LogprobsTensors, gather_logprobs

# Prompt rows scored at once: [rows, vocab] float32 logits (about 100 MB for a 49k vocabulary).
PROMPT_LOGPROBS_ROWS = 512
PromptRows = dict[int, tuple[torch.Tensor, torch.Tensor, int]]  # seq_id -> (rows, targets, k)


def score_prompt_logprobs(
    model: LlamaForCausalLM, hidden: torch.Tensor, prompt_rows: PromptRows
) -> dict[int, LogprobsTensors]:
    """seq_id -> its scored rows (row r: the token at start + 1 + r), for every sequence of
    `prompt_rows` (rows of `hidden` [T, hidden_size], int64 [R]; the prompt tokens they predict,
    int64 [R]; k). Empty off rank 0."""
    scored = {}
    for seq_id, (rows, targets, k) in prompt_rows.items():
        tensors = score_prompt_rows(model, hidden, rows, targets, k)
        if tensors is not None:
            scored[seq_id] = tensors
    return scored


def score_prompt_rows(
    model: LlamaForCausalLM,
    hidden: torch.Tensor,  # [T, hidden_size]
    rows: torch.Tensor,  # int64 [R]
    targets: torch.Tensor,  # int64 [R]
    k: int,
) -> LogprobsTensors | None:
    """Each row's logprob of the prompt token that follows it, its rank and the top k, from
    the raw logits (as the sampler's logprobs: what the model thinks). None off rank 0. Every
    rank runs this: with tensor parallelism the LM head gathers the vocabulary across ranks."""
    parts = []
    for lo in range(0, rows.numel(), PROMPT_LOGPROBS_ROWS):
        chunk = rows[lo : lo + PROMPT_LOGPROBS_ROWS]
        logits = model.compute_logits(hidden[chunk])  # [rows, vocab] on rank 0
        if logits is None:
            continue
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        parts.append(gather_logprobs(logprobs, targets[lo : lo + chunk.numel()], k))
    if not parts:
        return None
    return LogprobsTensors(*(torch.cat(t) for t in zip(*parts)))
