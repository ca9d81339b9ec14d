"""Tensor parallelism gives the single-device engine's tokens, and transformers' (paper §4.6).

Every test runs N ranks on this CPU over gloo (spawned by the engine itself) on tiny random Llamas
whose heads split in the ways that matter: GQA with untied embeddings at N = 2 (each rank one KV
head), and KV heads fewer than ranks with tied embeddings at N = 4 (each KV head replicated on two
ranks); then the real SmolLM2 (9 heads, 3 KV heads) at N = 3. The engine is configured so that
one workload exercises chunked prefill, preemption and prefix caching at once, and each test
checks that those mechanisms really ran. Sampling happens on the driver only, so `n > 1` with
copy-on-write and seeded sampling must match N = 1 too; and a copy-on-write copy must happen on
every rank, which is checked on the ranks' own KV caches.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.core.scheduler import ScheduledSequence, SchedulerOutput
from minivllm.worker.model_runner import ModelRunnerOutput
from tests.utils.engine_utils import (
    assert_no_blocks_held,
    hf_greedy,
    hf_greedy_batch,
    save_tiny_llama,
)
from tests.utils.tp_utils import kv_blocks, no_leftover_processes

# Small enough that the workload below is chunked (prompts of up to 102 tokens, 32 per step),
# preempted (it needs ~26 blocks at once) and shares a cached 32-token prefix.
ENGINE = dict(num_gpu_blocks_override=16, max_num_batched_tokens=32, max_num_seqs=8)
MAX_TOKENS = 16
MODELS = {
    # name: (tensor_parallel_size, overrides of save_tiny_llama's 4 heads / 2 KV heads, tied)
    "gqa-untied-2-ranks": (2, dict(tie_word_embeddings=False)),
    "kv-heads-fewer-than-ranks-tied-4-ranks": (4, dict()),
}

# A hang guard (a broken collective would otherwise wait COLLECTIVE_TIMEOUT); no timing.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    yield from no_leftover_processes()


@contextmanager
def tp_llm(model: Path | None, tensor_parallel_size: int, **kwargs: Any) -> Iterator[LLM]:
    """An LLM whose blocks must all be free at the end, shut down whatever happens."""
    llm = LLM(
        None if model is None else str(model), tensor_parallel_size=tensor_parallel_size, **kwargs
    )
    try:
        yield llm
        assert_no_blocks_held(llm)
    finally:
        llm.shutdown()


def workload(seed: int = 0) -> list[list[int]]:
    """Six prompts of 12-102 tokens; every other one starts with the same two full blocks."""
    rng = random.Random(seed)
    prefix = [rng.randrange(5, 49152) for _ in range(32)]
    prompts = []
    for i, length in enumerate([45, 20, 70, 33, 58, 12]):
        body = [rng.randrange(5, 49152) for _ in range(length)]
        prompts.append(prefix + body if i % 2 == 0 else body)
    return prompts


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module", params=list(MODELS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(tensor_parallel_size, model folder, transformers' greedy tokens for `workload()`)."""
    from transformers import LlamaForCausalLM

    size, overrides = MODELS[request.param]
    path = save_tiny_llama(tmp_path_factory.mktemp(request.param), **overrides)
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, MAX_TOKENS, None) for p in workload()]
    return size, path, expected


def test_greedy_tokens_equal_transformers_and_one_rank_under_chunking_preemption_and_prefix_hits(
    tiny: tuple[int, Path, list[list[int]]],
) -> None:
    size, path, expected = tiny
    with tp_llm(path, 1, **ENGINE) as one:
        assert greedy(one, workload()) == expected
    with tp_llm(path, size, **ENGINE) as llm:
        executor = llm.llm_engine.executor
        execute, chunks = executor.execute_model, []

        def recording(sched: SchedulerOutput) -> ModelRunnerOutput:
            chunks.extend(item for item in sched.scheduled if not item.sample)
            return execute(sched)

        executor.execute_model = recording  # type: ignore[method-assign]
        assert greedy(llm, workload()) == expected
        stats = llm.get_stats()
    assert chunks  # prompt chunks that did not reach the end of their prompt
    assert stats.num_preemptions > 0
    assert stats.num_prefix_cache_hit_tokens >= 32


def test_forks_seeds_and_copy_on_write_give_one_rank_s_samples(tmp_path: Path) -> None:
    """n = 3 seeded random samples per prompt: the fork shares the prompt's partial last block and
    the first write into it copies the block (on every rank, or the ranks' heads would disagree).
    Then two hand-made steps make the copy explicit and read it back from each rank's cache."""
    path = save_tiny_llama(tmp_path, tie_word_embeddings=False)
    prompts = [{"prompt_token_ids": p} for p in workload(seed=1)[:3]]
    params = SamplingParams(
        n=3, temperature=0.8, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True
    )
    steps = [  # block 3 gets 10 tokens; sequence 2 continues them in its copy, block 5
        SchedulerOutput([ScheduledSequence(1, 0, list(range(100, 110)), [3], sample=False)]),
        SchedulerOutput([ScheduledSequence(2, 10, [110], [5], sample=True)], block_copies=[(3, 5)]),
    ]

    def run(llm: LLM) -> tuple[list[list[list[int]]], torch.Tensor | None, int]:
        engine = llm.llm_engine
        copies: list[tuple[int, int]] = []
        execute = engine.executor.execute_model

        def recording(sched: SchedulerOutput) -> ModelRunnerOutput:
            copies.extend(sched.block_copies)
            return execute(sched)

        engine.executor.execute_model = recording  # type: ignore[method-assign]
        samples = [
            [list(c.token_ids) for c in o.outputs]
            for o in llm.generate(prompts, params, use_tqdm=False)
        ]
        engine.executor.execute_model = execute  # type: ignore[method-assign]
        assert llm.reset_prefix_cache()  # the hand-made steps overwrite blocks: nothing cached
        logits = [engine.executor.execute_model(s) for s in steps][-1].logits
        return samples, logits, len(copies)

    with tp_llm(path, 1, num_gpu_blocks_override=64) as one:
        expected, expected_logits, _ = run(one)
    with tp_llm(path, 2, num_gpu_blocks_override=64) as llm:
        samples, logits, num_copies = run(llm)
        ranks_kv = llm.llm_engine.executor.collective_rpc(partial(kv_blocks, blocks=[3, 5]))
    assert num_copies > 0
    assert samples == expected
    assert all(len(set(map(tuple, s))) > 1 for s in samples)  # the n samples differ: real sampling
    assert logits is not None and expected_logits is not None
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
    assert len(ranks_kv) == 2
    for kv in ranks_kv:  # [layers, 2, 2 blocks, block_size, kv_heads, head_dim] of one rank
        assert kv[:, :, 0, :10].abs().sum() > 0
        assert torch.equal(kv[:, :, 1, :10], kv[:, :, 0, :10])  # the copy, on this rank


def test_speculative_decoding_at_two_ranks_gives_transformers_greedy_tokens(
    tmp_path: Path,
) -> None:
    """A verification step carries 1 + k tokens per sequence to every rank; the rejection
    sampler runs on the driver, and the draft model (the target itself: every draft is kept,
    so every step verifies) runs on the driver alone. Under chunking and preemption too."""
    from transformers import LlamaForCausalLM

    path = save_tiny_llama(tmp_path / "m", tie_word_embeddings=False)
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, MAX_TOKENS, None) for p in workload()]
    spec = {"model": str(path), "num_speculative_tokens": 3}
    with tp_llm(
        path, 2, speculative_config=spec, **(ENGINE | {"num_gpu_blocks_override": 12})
    ) as llm:
        assert greedy(llm, workload()) == expected
        stats = llm.get_stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert stats.num_preemptions > 0


@pytest.mark.slow
def test_smollm2_at_three_ranks_gives_transformers_greedy_tokens(smollm2_hf_model) -> None:
    """The real model: 9 query heads and 3 KV heads, so each of 3 ranks holds 3 and 1."""
    with tp_llm(None, 3, num_gpu_blocks_override=64, max_model_len=512, quantization="none") as llm:
        tok = llm.get_tokenizer()
        texts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
        prompts = [tok.encode(t) for t in texts]
        got = greedy(llm, prompts)
    # transformers' tokens for the three prompts in one batch: equal to hf_greedy's one prompt at
    # a time (checked when the oracle was batched).
    assert got == hf_greedy_batch(smollm2_hf_model, prompts, [MAX_TOKENS] * len(prompts), None)


def test_throughput_bench_reports_each_rank_s_memory_and_communication_per_token(
    tmp_path: Path,
) -> None:
    """`minivllm bench throughput --tensor-parallel-size 2`: every rank holds half the layers'
    weights and half the vocabulary, and puts exactly (2 x layers + 1) x hidden x 4 bytes per
    token into all-reduces (no preemption here, so no recomputation) and its vocabulary slice of
    float32 logits per sampled token into the gather."""
    import argparse
    import json

    from minivllm.benchmarks import throughput

    model = save_tiny_llama(tmp_path / "model", tie_word_embeddings=False)
    out = tmp_path / "throughput.json"
    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    argv = ["--model", str(model), "--num-prompts", "4", "--input-len", "8-24"]
    argv += ["--output-len", "3-6", "--matmul-size", "256", "--num-gpu-blocks-override", "64"]
    argv += ["--tensor-parallel-size", "2", "--json", str(out)]
    assert throughput.main(parser.parse_args(argv)) == 0
    ranks = json.loads(out.read_text())["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    hidden, layers, vocab = 64, 2, 49152
    for r in ranks:
        assert r["heads"] == 2 and r["kv_heads"] == 1 and r["kv_blocks"] == 64
        assert r["all_reduce_bytes_per_token"] == (2 * layers + 1) * hidden * 4
        assert r["gather_bytes_per_sampled_token"] == vocab // 2 * 4
    # Untied: embedding and LM head, vocab/2 rows each; per layer 2 of 4 query heads and 1 of 2
    # KV heads (head_dim 16), half the MLP's width (64 of 128); norms whole.
    q, kv = 2 * 16, 16
    per_layer = (q + 2 * kv) * hidden + hidden * q + 3 * hidden * 64 + 2 * hidden
    expected = (2 * vocab // 2 * hidden + layers * per_layer + hidden) * 4
    assert all(r["weight_bytes"] == expected for r in ranks)
