"""Qwen2, Qwen3, Phi-3, Gemma 2, Mixtral and Qwen3-MoE over two ranks give transformers' greedy
tokens (paper §4.6).

Each family stresses the parallel layers in its own way: Qwen2's q/k/v bias is split by heads
with the weight (`QKVParallelLinear`), Phi-3's fused checkpoint tensors are cut into parts
before each rank takes its heads of each part, and Qwen3's q/k norms are replicated. A MoE
layer's experts are split, not replicated: every rank holds every expert at I / N of its inner
width (as the dense MLP's columns and rows), routes every token itself (the router is
replicated) and all-reduces the partial sums (minivllm/model/layers/fused_moe.py). Two ranks over gloo
on this CPU, spawned by the engine, as in tests/distributed/test_tensor_parallel.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from minivllm import LLM
from tests.model.test_model_families import greedy, prompts_and_oracle, save_family
from tests.utils.tp_utils import no_leftover_processes

pytestmark = pytest.mark.timeout(600)  # a hang guard for a broken collective; no timing


@pytest.fixture(autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    yield from no_leftover_processes()


@pytest.mark.parametrize("family", ["qwen2-tied", "qwen3-hd32", "phi3", "mixtral", "qwen3-moe"])
def test_two_ranks_give_transformers_greedy_tokens(tmp_path: Path, family: str) -> None:
    hf, path = save_family(tmp_path, family)
    prompts, max_tokens, expected = prompts_and_oracle(hf, count=3)
    llm = LLM(
        str(path),
        tensor_parallel_size=2,
        skip_tokenizer_init=True,
        cpu_kv_cache_space=0.01,
        max_model_len=256,
    )
    try:
        assert greedy(llm, prompts, max_tokens) == expected
    finally:
        llm.shutdown()


def test_gemma_2_on_two_ranks_gives_transformers_greedy_tokens(tmp_path: Path) -> None:
    """Gemma 2's score cap acts on each rank's own heads, its final-logit cap on the logits
    rank 0 gathers, and its tied LM head is the vocab-parallel embedding's shard; both ranks
    keep its KV cache in groups of layers (global; window; window), with the same tables."""
    from tests.model.test_model_gemma import engine_prompts, save_gemma

    hf, path = save_gemma(tmp_path, "gemma2")
    prompts, max_tokens, expected = engine_prompts(hf)
    llm = LLM(
        str(path),
        tensor_parallel_size=2,
        skip_tokenizer_init=True,
        cpu_kv_cache_space=0.01,
        max_model_len=56,
    )
    try:
        engine = llm.llm_engine
        assert type(engine.kv_cache_manager).__name__ == "HybridKVCacheCoordinator"
        assert engine.runner.kv_cache.shape[0] == 1  # one layer slot: a group's size
        assert greedy(llm, prompts, max_tokens) == expected
    finally:
        llm.shutdown()
