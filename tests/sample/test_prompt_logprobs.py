"""`prompt_logprobs`: each prompt token's logprob under the model, its rank and the top k, as
vLLM reports them (the first token None). Held to transformers' own log-softmax of its logits,
and to itself under chunked prefill, prefix caching (a cached block has no logits, so a request
that wants them recomputes its prompt), n > 1, preemption by recompute and tensor parallelism."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.core.sequence import Logprob
from tests.utils.engine_utils import assert_no_blocks_held, save_tiny_llama
from tests.utils.tp_utils import no_leftover_processes

K = 3
PROMPTS = [
    list(range(1000, 1037)),  # 37 tokens: several blocks and a partial one
    [5, 17, 923, 40, 8812, 77, 4, 301, 2222, 90, 16, 3],
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-prompt-logprobs"))


def reference(model_dir: Path, prompt: list[int]) -> torch.Tensor:  # [P, vocab] logprobs
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def run(llm: LLM, prompts: list[list[int]], **params: object) -> list:
    sp = SamplingParams(prompt_logprobs=K, max_tokens=2, temperature=0, **params)  # type: ignore[arg-type]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.prompt_logprobs for o in outs]


def values(entries: list[dict[int, Logprob] | None]) -> list[list[tuple[int, float, int]]]:
    return [[] if e is None else [(t, lp.logprob, lp.rank) for t, lp in e.items()] for e in entries]


def assert_close_entries(a: list, b: list) -> None:
    """The same tokens, logprobs within 1e-4, the top-K ranks equal; a deep rank (a prompt token
    far down a 32k vocabulary, where neighbours' logprobs lie within float32 rounding of each
    other) within 0.1 %: two summation orders may order near-ties differently."""
    assert len(a) == len(b)
    for x, y in zip(values(a), values(b)):
        assert [t for t, _, _ in x] == [t for t, _, _ in y]
        for (_, _, r1), (_, _, r2) in zip(x, y):
            assert r1 == r2 if min(r1, r2) <= K else abs(r1 - r2) <= max(r1, r2) // 1000
        assert [v for _, v, _ in x] == pytest.approx([v for _, v, _ in y], abs=1e-4)


def test_prompt_logprobs_are_transformers_log_softmax(tiny: Path) -> None:
    llm = LLM(str(tiny), num_gpu_blocks_override=64, block_size=8)
    got = run(llm, PROMPTS)
    for prompt, entries in zip(PROMPTS, got):
        assert entries is not None and len(entries) == len(prompt) and entries[0] is None
        ref = reference(tiny, prompt)
        for i in range(1, len(prompt)):
            entry = entries[i]
            assert entry is not None
            token = prompt[i]
            first = next(iter(entry))
            assert first == token  # the prompt token first, as vLLM
            row = ref[i - 1]
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            # Its rank: 1 + the tokens above it, counting a token within the logprobs' tolerance
            # of it either way (near-ties deep in the vocabulary follow the summation order).
            above = int((row > row[token] + 1e-4).sum()) + 1
            above_or_tied = int((row > row[token] - 1e-4).sum()) + 1
            assert above <= entry[token].rank <= above_or_tied
            top = row.topk(K).indices.tolist()
            # The top k by rank (the prompt token, when among them, is listed once, first).
            assert [
                t for _, t in sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= K)
            ] == top
            for t in top:
                assert entry[t].logprob == pytest.approx(row[t].item(), abs=1e-4)
            assert entry[token].decoded_token == llm.get_tokenizer().decode([token])
    assert_no_blocks_held(llm)


def test_chunked_prefill_and_prefix_cache_give_the_same_prompt_logprobs(tiny: Path) -> None:
    whole = run(LLM(str(tiny), num_gpu_blocks_override=64, block_size=8), PROMPTS)
    chunked = LLM(
        str(tiny),
        num_gpu_blocks_override=64,
        block_size=8,
        max_num_batched_tokens=8,
        max_num_seqs=2,
        enable_prefix_caching=True,
    )
    assert chunked.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=1))
    # The first prompt's blocks are cached now; a request with prompt_logprobs must not take them.
    got = run(chunked, PROMPTS)
    for a, b in zip(got, whole):
        assert_close_entries(a, b)
    stats = chunked.get_stats()
    assert stats.num_prefix_cache_hit_tokens == 0  # looked up without prompt_logprobs, missed
    plain = chunked.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=1))
    assert plain[0].num_cached_tokens > 0  # a request without them still hits


def test_n_samples_share_one_list_and_preemption_scores_each_token_once(tiny: Path) -> None:
    whole = run(LLM(str(tiny), num_gpu_blocks_override=64, block_size=8), PROMPTS)
    tight = LLM(str(tiny), num_gpu_blocks_override=12, block_size=8, max_num_seqs=4)
    outs = tight.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(prompt_logprobs=K, n=2, max_tokens=40, ignore_eos=True, temperature=0),
        use_tqdm=False,
    )
    assert tight.get_stats().num_preemptions > 0
    for out, ref in zip(outs, whole):
        assert len(out.outputs) == 2
        assert_close_entries(out.prompt_logprobs, ref)
    assert_no_blocks_held(tight)


@pytest.fixture
def _no_leftover_processes() -> Iterator[None]:
    yield from no_leftover_processes()


@pytest.mark.usefixtures("_no_leftover_processes")
def test_tensor_parallel_ranks_give_one_device_s_prompt_logprobs(tiny: Path) -> None:
    whole = run(LLM(str(tiny), num_gpu_blocks_override=64, block_size=8), PROMPTS)
    llm = LLM(str(tiny), tensor_parallel_size=2, num_gpu_blocks_override=64, block_size=8)
    try:
        got = run(llm, PROMPTS)
    finally:
        llm.shutdown()
    for a, b in zip(got, whole):
        assert_close_entries(a, b)


def test_prompt_logprobs_range_is_checked_and_minus_one_is_the_vocabulary() -> None:
    from minivllm.engine.logprobs_limit import resolve_logprobs

    with pytest.raises(ValueError, match=r"prompt_logprobs must be non-negative or -1, got -2"):
        SamplingParams(prompt_logprobs=-2)
    # vLLM's processor: neither kind may ask for more than max_logprobs (-1: the vocabulary).
    too_many = "Requested prompt logprobs of 21, which is greater than max allowed: 20"
    with pytest.raises(ValueError, match=too_many):
        resolve_logprobs(SamplingParams(prompt_logprobs=21), 100, 20)
    with pytest.raises(ValueError, match=r"Requested sample logprobs of 100, .* allowed: 99"):
        resolve_logprobs(SamplingParams(logprobs=-1), 100, 99)
    whole = resolve_logprobs(SamplingParams(logprobs=-1, prompt_logprobs=-1), 100, -1)
    assert (whole.logprobs, whole.prompt_logprobs) == (100, 100)
