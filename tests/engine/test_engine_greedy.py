"""Greedy outputs are transformers' greedy outputs, token for token, however the engine batches.

The same mixed batch of prompts (different lengths and max_tokens) runs plainly, with a KV cache so
small that sequences are preempted and recomputed, with a token budget so small that prompts are
chunked, with shared prefixes served from the prefix cache, and with n > 1 sharing prompt blocks.
Every variant must reproduce the oracle exactly; each also asserts that its mechanism really ran.
The variants run on the default CPU backend (compiled paged decode); the plain batch also runs on
the reference backend.
"""

from __future__ import annotations

from typing import Any

import pytest

from minivllm.sampling_params import SamplingParams
from tests.utils.engine_utils import checked_llm as _checked_llm
from tests.utils.engine_utils import hf_greedy_batch

SYSTEM = (
    "You are a careful assistant. Answer briefly, in plain English, and never invent facts. "
    "If a question is ambiguous, say which reading you chose. "
)
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What does a CPU do?",
    "Give me a synonym for happy.",
    "What is 12 times 12?",
    "Describe the smell of rain in one sentence.",
    "Who wrote Romeo and Juliet?",
    "What is photosynthesis?",
    "List two uses of copper.",
    "Why do cats purr?",
    "What is the boiling point of water at sea level?",
    "Suggest a name for a pet goldfish.",
    "Explain gravity to a child.",
    "What is a prime number?",
]


def checked_llm(**kwargs: Any) -> Any:
    """The bundled model dequantized at load (quantization="none"): float32 weights, the path
    that is token-exact with transformers by construction (its native Q4_1 blocks are held to it
    as vLLM judges closeness, in tests/model/test_gguf_native.py)."""
    return _checked_llm(quantization="none", **kwargs)


@pytest.fixture(scope="module")
def workload(smollm2_hf_tokenizer, smollm2_hf_model):
    """18 chat prompts of different lengths with their own max_tokens, and the oracle's answers
    (transformers' greedy tokens, the 18 prompts in one batch: the same tokens as `hf_greedy`
    gives one prompt at a time, checked when the oracle was batched)."""
    tok = smollm2_hf_tokenizer
    prompts, max_tokens = [], []
    for i, q in enumerate(QUESTIONS):
        msgs = [{"role": "user", "content": q}]
        if i % 3 == 0:  # every third request carries the long shared system prompt
            msgs.insert(0, {"role": "system", "content": SYSTEM})
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        n = 6 + (i * 7) % 20
        prompts.append(ids)
        max_tokens.append(n)
    expected = hf_greedy_batch(smollm2_hf_model, prompts, max_tokens, tok.eos_token_id)
    return prompts, max_tokens, expected


def _run(llm, prompts, max_tokens, n=1):
    params = [SamplingParams(temperature=0.0, max_tokens=m, n=n) for m in max_tokens]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _assert_matches(outputs, expected, n=1):
    for out, exp in zip(outputs, expected):
        assert len(out.outputs) == n
        for completion in out.outputs:
            assert completion.token_ids == exp, (out.request_id, completion.token_ids, exp)


def test_plain_batch_on_the_reference_backend_matches_transformers(workload):
    """The specification's attention; the plain batch on the default backend (the compiled
    decode kernel) is test_the_default_cpu_path_runs_the_compiled_operators below."""
    prompts, max_tokens, expected = workload
    with checked_llm(num_gpu_blocks_override=256, attention_backend="reference") as llm:
        assert llm.llm_engine.attention_backend == "reference"
        _assert_matches(_run(llm, prompts, max_tokens), expected)


def test_preemption_keeps_outputs_exact(workload):
    prompts, max_tokens, expected = workload
    # 12 blocks of 16 tokens cannot hold 18 requests of ~30-90 tokens: sequences must be preempted.
    with checked_llm(num_gpu_blocks_override=12, max_model_len=192) as llm:
        _assert_matches(_run(llm, prompts, max_tokens), expected)
        assert llm.get_stats().num_preemptions > 0


def test_chunked_prefill_keeps_outputs_exact(workload):
    prompts, max_tokens, expected = workload
    with checked_llm(
        num_gpu_blocks_override=256, max_num_batched_tokens=16, max_num_seqs=16
    ) as llm:
        _assert_matches(_run(llm, prompts, max_tokens), expected)
        # A 16-token budget cannot hold any of these prompts whole: every prompt was chunked.
        assert min(len(p) for p in prompts) > 16


def test_prefix_caching_keeps_outputs_exact(workload):
    prompts, max_tokens, expected = workload
    with checked_llm(num_gpu_blocks_override=256, max_num_seqs=4) as llm:
        _assert_matches(_run(llm, prompts, max_tokens), expected)
        stats = llm.get_stats()
        assert stats.num_prefix_cache_hit_tokens > 0
        # Hits are whole blocks and never the whole prompt.
        assert stats.num_prefix_cache_hit_tokens % 16 == 0
        total = sum(len(p) for p in prompts)
        assert stats.num_prompt_tokens_computed == total - stats.num_prefix_cache_hit_tokens


def test_prefix_caching_off_computes_every_prompt_token(workload):
    prompts, max_tokens, expected = workload
    with checked_llm(num_gpu_blocks_override=256, enable_prefix_caching=False) as llm:
        _assert_matches(_run(llm, prompts, max_tokens), expected)
        stats = llm.get_stats()
        assert stats.num_prefix_cache_hit_tokens == 0
        assert stats.num_prompt_tokens_computed == sum(len(p) for p in prompts)


def test_parallel_samples_share_prompt_blocks(workload):
    prompts, max_tokens, expected = workload
    prompts, max_tokens, expected = prompts[:6], max_tokens[:6], expected[:6]
    with checked_llm(num_gpu_blocks_override=256, enable_prefix_caching=False) as llm:
        _assert_matches(_run(llm, prompts, max_tokens, n=3), expected, n=3)
        shared_peak = llm.get_stats().peak_kv_blocks_used
        # Each prompt was computed once, not three times.
        assert llm.get_stats().num_prompt_tokens_computed == sum(len(p) for p in prompts)
    with checked_llm(num_gpu_blocks_override=256, enable_prefix_caching=False) as llm:
        triple = [p for p in prompts for _ in range(3)]
        _run(llm, triple, [m for m in max_tokens for _ in range(3)])
        separate_peak = llm.get_stats().peak_kv_blocks_used
    assert shared_peak < separate_peak


def test_random_tiny_llama_matches_transformers(tmp_path):
    """A random GQA model loaded from safetensors, under chunking and preemption at once."""
    import torch

    from tests.model.test_model_llama import save_tiny_llama
    from tests.utils.engine_utils import hf_greedy as oracle

    hf, path = save_tiny_llama(tmp_path, dict(num_key_value_heads=2, initializer_range=0.5))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (int(n),), generator=gen).tolist() for n in range(5, 70, 4)]
    max_tokens = [4 + i % 13 for i in range(len(prompts))]
    expected = [oracle(hf, p, m, None) for p, m in zip(prompts, max_tokens)]
    with checked_llm(
        model=str(path),
        skip_tokenizer_init=True,
        num_gpu_blocks_override=10,
        max_model_len=160,
        max_num_batched_tokens=24,
        max_num_seqs=24,  # vLLM's rule: the step's token budget covers a full batch of decodes
    ) as llm:
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        _assert_matches(outs, expected)
        assert llm.get_stats().num_preemptions > 0


def _profiled_op_names(llm, prompts, max_tokens) -> tuple[set[str], list]:
    """The names of every operator the profiler saw during a generate, and its outputs. The names
    come from the profiler's raw events, the ones `key_averages()` groups by name: that grouping
    first builds a Python object for every event and the tree of their calls, most of these
    tests' time, for the same set of names."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        outputs = _run(llm, prompts, max_tokens)
    return {event.name() for event in prof.profiler.kineto_results.events()}, outputs


COMPILED = ("minivllm_cpu::", "mkldnn::")  # our C++ library, and oneDNN's private ops


def test_the_reference_path_runs_no_compiled_operator_and_matches_transformers(workload):
    """attention_backend="reference" with enforce_eager=True is the specification end to end:
    plain PyTorch in every layer (no op of the compiled library, no private oneDNN op), and greedy
    output is transformers' token for token."""
    prompts, max_tokens, expected = (part[:6] for part in workload)
    with checked_llm(
        num_gpu_blocks_override=256, attention_backend="reference", enforce_eager=True
    ) as llm:
        names, outputs = _profiled_op_names(llm, prompts, max_tokens)
    assert "aten::linear" in names and "aten::embedding" in names  # the profiler saw the model
    assert sorted(n for n in names if n.startswith(COMPILED)) == []
    _assert_matches(outputs, expected)


def test_the_default_cpu_path_runs_the_compiled_operators(workload):
    """The plain batch on the default backend gives transformers' tokens, and this is the
    other side of the test above, so that it can fail: here the profiler does see the C++ ops:
    paged attention, the fused layer ops, the skinny GEMM and the decode-layers replay (the last
    two where the kernels have their AVX-512 path)."""
    from minivllm.cpu.ops import skinny_gemm_fast

    prompts, max_tokens, expected = workload
    with checked_llm(num_gpu_blocks_override=256) as llm:
        assert llm.llm_engine.attention_backend == "cpu"
        names, outputs = _profiled_op_names(llm, prompts, max_tokens)
    ours = {n.removeprefix("minivllm_cpu::") for n in names if n.startswith("minivllm_cpu::")}
    wanted = {"paged_decode", "reshape_and_cache", "rms_norm", "fused_add_rms_norm"}
    wanted |= {"silu_and_mul", "rotary_embedding"}
    if skinny_gemm_fast():
        wanted |= {"skinny_gemm", "decode_layers"}
    assert wanted <= ours, wanted - ours
    _assert_matches(outputs, expected)
