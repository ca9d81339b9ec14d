"""The KV cache is allocated with `torch.empty`, not zero-filled: no kernel may read a slot before
writing it, and what a batched read picks up as padding must not leak into the result.

The cache is filled with NaN before any request runs; a NaN that reached a softmax or a weighted
sum of values would turn the whole row into NaN (0 * NaN is NaN), so greedy outputs equal to
transformers' prove that every never-written slot stayed out of the arithmetic. Prompts of
different lengths share decode steps (the reference backend pads them to the longest), blocks end
part-written, and the cache is small enough that requests are preempted and recomputed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minivllm.llm import LLM
from minivllm.sampling_params import SamplingParams
from tests.utils.engine_utils import assert_no_blocks_held, hf_greedy, save_tiny_llama

PROMPT_LENS = [5, 17, 30, 9, 44, 23]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-nan-cache"))


@pytest.fixture(scope="module")
def oracle(tiny: Path) -> tuple[list[list[int]], list[list[int]]]:
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return prompts, [hf_greedy(hf, p, MAX_TOKENS, None) for p in prompts]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_never_written_slots_do_not_reach_outputs(tiny, oracle, backend):
    prompts, expected = oracle
    # 12 blocks of 16 cannot hold all six requests at once: some are preempted and recomputed.
    llm = LLM(
        str(tiny),
        attention_backend=backend,
        block_size=16,
        num_gpu_blocks_override=12,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        dtype="float32",
    )
    engine = llm.llm_engine
    engine.runner.kv_cache.fill_(float("nan"))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert engine.scheduler.num_preemptions > 0, "the cache was meant to be too small"
    assert_no_blocks_held(llm)
