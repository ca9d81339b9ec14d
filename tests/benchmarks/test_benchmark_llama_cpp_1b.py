"""The 1B comparison's two scripts (benchmarks/make_llama_1b_gguf.py, benchmarks/llama_cpp_1b.py),
without llama.cpp and without writing 2.5 GB: the generator's shapes are Llama-3.2-1B's, a file it
writes at a tiny shape carries SmolLM2's tokenizer padded to the vocabulary and loads in minivllm,
and the floor is the arithmetic the Performance page states. Never timing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.utils.engine_utils import import_benchmark

make = import_benchmark("make_llama_1b_gguf")
bench = import_benchmark("llama_cpp_1b")


def test_the_generated_model_has_llama_3_2_1b_parameter_count() -> None:
    shapes = make.tensor_shapes(make.LlamaShape(), with_rope_freqs=False)
    params = sum(math.prod(s) for s in shapes.values())
    assert params == 1_235_814_400  # Llama-3.2-1B's, the tied head counted once
    assert "output.weight" not in shapes and shapes["token_embd.weight"] == (128256, 2048)
    assert shapes["blk.15.attn_k.weight"] == (512, 2048)


def test_the_llama3_rope_divisors_are_1_at_high_and_32_at_low_frequencies() -> None:
    f = make.rope_freqs(make.LlamaShape())
    assert f.shape == (32,) and f[0] == 1.0 and f[-1] == 32.0
    assert list(f) == sorted(f)  # a smooth blend between


@pytest.mark.slow  # transformers reads the 49k-token vocabulary out of the file (~20 s)
def test_a_small_file_written_as_the_1b_one_loads_in_minivllm_with_the_padded_tokenizer(
    tmp_path: Path,
) -> None:
    from minivllm.llm import LLM
    from minivllm.sampling_params import SamplingParams

    vocab = 49152 + 64  # SmolLM2's tokens and 64 reserved ones
    shape = make.LlamaShape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128,
                            vocab=vocab, context=256)  # fmt: skip
    path = tmp_path / "tiny.gguf"
    make.write_f16(path, shape, with_rope_freqs=True, seed=0)
    facts = bench.GgufFacts.read(path)
    assert (facts.layers, facts.kv_heads, facts.head_dim) == (2, 2, 16)
    assert facts.tensor_bytes == sum(
        4 * math.prod(s) // (1 if len(s) == 1 else 2)
        for s in make.tensor_shapes(shape, with_rope_freqs=True).values()
    )
    llm = LLM(str(path), cpu_kv_cache_space=0.01, max_model_len=64)
    assert len(llm.get_tokenizer()) == vocab
    assert llm.get_tokenizer().convert_ids_to_tokens(vocab - 1) == "<|reserved_63|>"
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    (out,) = llm.generate(["Hello"], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_the_floor_reads_every_tensor_once_and_each_sequences_kv() -> None:
    facts = bench.GgufFacts(Path("x.gguf"), tensor_bytes=1000, layers=2, kv_heads=2, head_dim=4)
    assert facts.kv_bytes_per_token(2) == 2 * 2 * 2 * 4 * 2  # layers x (K, V) x heads x dim x f16
    floor = bench.decode_floor(facts, batch=4, context=10, kv_element_bytes=2, bandwidth=2000.0)
    assert floor["step_bytes"] == 1000 + 4 * 10 * 64
    assert floor["floor_tok_s"] == pytest.approx(4 * 2000.0 / 3560)
