"""Tensor parallelism over NCCL, one rank per CUDA device (`make test-gpu`, 2 or more GPUs).

The CPU tests (tests/test_tensor_parallel*.py, gloo) hold the engine's logic; these check the
CUDA path they cannot reach: NCCL all-reduces and the logits gather between devices, rank r on
cuda:r, the Triton attention kernels on each rank's KV heads, and the KV cache sized from each
device's free memory (the smallest wins). With fewer than two CUDA devices they are skipped, also
under `-m gpu`: a one-GPU machine runs the kernel checks of `make test-gpu` and has nothing to
split a model over.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from minivllm import LLM, SamplingParams
from tests.utils.engine_utils import hf_greedy, save_tiny_llama
from tests.utils.tp_utils import no_leftover_processes

# A hang guard (a broken collective would otherwise wait COLLECTIVE_TIMEOUT); no timing.
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
PROMPTS = [[11 + i, 300 + 7 * i, 77, 5000 + i, *range(100, 100 + 9 * i)] for i in range(6)]


@pytest.fixture(autouse=True)
def _two_gpus_and_no_leftover_processes() -> Iterator[None]:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices (tensor parallelism over NCCL)")
    yield from no_leftover_processes()


def greedy(llm: LLM, max_tokens: int = 16) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("size", [2, 4])
def test_nccl_ranks_give_transformers_and_one_device_greedy_tokens(
    tmp_path: Path, size: int
) -> None:
    if torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} CUDA devices")
    from transformers import LlamaForCausalLM

    path = save_tiny_llama(tmp_path, tie_word_embeddings=False)
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, 16, None) for p in PROMPTS]
    kwargs = dict(device="cuda", dtype="float32", gpu_memory_utilization=0.3)
    one = LLM(str(path), **kwargs)
    assert greedy(one) == expected
    del one
    llm = LLM(str(path), tensor_parallel_size=size, **kwargs)
    try:
        assert greedy(llm) == expected
        seeded = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": PROMPTS[2]}, seeded, use_tqdm=False)
        assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1
    finally:
        llm.shutdown()
