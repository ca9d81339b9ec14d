"""One small run that shows every event the trace knows, for the trace's tests and screenshots.

A tiny random Llama (tests/utils/engine_utils.py) with 4-token blocks and a 24-block pool serves four
requests: two that share a system prompt (the second is admitted a step after the first, so it
hits the first's cached blocks), a long unrelated one, and one with `n = 2` (its samples share the
prompt's blocks until the first write copies the partly filled one). Together they need more
blocks than the pool has, so the newest running sequence is preempted and later recomputed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from minivllm import LLM, SamplingParams

ENGINE_KWARGS: dict[str, Any] = {
    "block_size": 4,
    "num_gpu_blocks_override": 24,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 32,
    "max_model_len": 96,
    "attention_backend": "reference",
}
SYSTEM = "You are a helpful assistant who answers in short sentences."
PROMPTS = [
    SYSTEM + " What is a page?",
    "Once upon a time, in a kingdom by the sea, there lived a cat who collected old maps and "
    "told stories about them",
    SYSTEM + " What is a block?",
    "Why is the sky blue?",
]


def params() -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    forked = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=16, ignore_eos=True)
    return [greedy, greedy, greedy, forked]


def make_llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), **ENGINE_KWARGS)


def run_traced(llm: LLM, out_dir: Path | None = None) -> dict[str, Any]:
    """Run the scenario under `llm.trace()` and return the trace as trace.json holds it (and
    write trace.json and the page into `out_dir`, when given)."""
    with llm.trace() as trace:
        llm.generate(PROMPTS, params(), use_tqdm=False)
    if out_dir is not None:
        trace.save(out_dir)
    return trace.to_dict()
