"""The whole engine on the Triton kernels gives the reference backend's greedy tokens.

On a CPU machine the kernels run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before Triton is imported), which is slow, so the runs are short; the batches
still mix prompt chunks, decodes and preemption so that every kernel path is crossed. The
`gpu`-marked test runs the same engine on CUDA with the kernels compiled (`make test-gpu`), with
contexts long enough that the backend's own split count splits the decodes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minivllm.sampling_params import SamplingParams
from tests.attention.test_attention_gpu import require_compiled_cuda
from tests.model.test_model_llama import save_tiny_llama
from tests.utils.engine_utils import checked_llm

pytest.importorskip("triton")


def _greedy(llm, prompts, max_tokens):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_tiny_llama_on_triton_matches_reference(tmp_path: Path) -> None:
    _, path = save_tiny_llama(tmp_path, dict(num_key_value_heads=2, initializer_range=0.5))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (3, 5, 7, 20)]
    # Short prompts that all fit at first and then grow past their first block: preemption.
    max_tokens = [30, 25, 20, 10]
    results = {}
    for backend in ("reference", "triton"):
        with checked_llm(
            model=str(path),
            skip_tokenizer_init=True,
            attention_backend=backend,
            num_gpu_blocks_override=5,
            block_size=16,
            max_model_len=48,
            max_num_batched_tokens=20,
            max_num_seqs=20,  # vLLM's rule: the token budget covers a full batch of decodes
        ) as llm:
            assert llm.llm_engine.attention_backend == backend
            results[backend] = _greedy(llm, prompts, max_tokens)
            assert llm.get_stats().num_preemptions > 0
    assert results["triton"] == results["reference"]


def test_smollm2_on_triton_matches_reference() -> None:
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646], [1, 4093, 198, 1780, 314, 260, 3575]]
    results = {}
    for backend in ("reference", "triton"):
        with checked_llm(attention_backend=backend, num_gpu_blocks_override=16) as llm:
            results[backend] = _greedy(llm, prompts, [3, 2])
    assert results["triton"] == results["reference"]


@pytest.mark.gpu
def test_tiny_llama_on_compiled_triton_matches_reference_on_cuda(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """float32, so that greedy tokens may be compared exactly: prompts of up to 450 tokens in
    64-token chunks next to decodes (long enough contexts that the default split count splits),
    then the CPU test's short prompts in 5 blocks, which preempts."""
    require_compiled_cuda(request.config)
    _, path = save_tiny_llama(tmp_path, dict(num_key_value_heads=2, initializer_range=0.5))
    gen = torch.Generator().manual_seed(1)
    runs = [
        ((3, 40, 200, 450), [40, 30, 30, 40], dict(max_num_batched_tokens=64, max_model_len=512)),
        ((3, 5, 7, 20), [30, 25, 20, 10],
         dict(num_gpu_blocks_override=5, max_model_len=48, max_num_batched_tokens=20)),
    ]  # fmt: skip
    for lengths, max_tokens, overrides in runs:
        prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]
        results = {}
        for backend in ("reference", "triton"):
            with checked_llm(
                model=str(path), skip_tokenizer_init=True, attention_backend=backend,
                device="cuda", dtype="float32", block_size=16, **overrides,
            ) as llm:  # fmt: skip
                results[backend] = _greedy(llm, prompts, max_tokens)
                preempted = llm.get_stats().num_preemptions > 0
                assert preempted == ("num_gpu_blocks_override" in overrides), overrides
        assert results["triton"] == results["reference"], overrides
