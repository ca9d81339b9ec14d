"""Qwen2, Qwen3 and Phi-3 as GGUF files load and give transformers' greedy tokens, and a Phi-3
file's fused blocks run as stored.

Each file is written by `llama_cpp_convert.convert` under llama.cpp's architecture name, metadata
keys and tensor names (qwen2: q/k/v biases; qwen3: `attn_q_norm` / `attn_k_norm` and the head size
as `attention.key_length`; phi3: `attn_qkv` and a fused `ffn_up`), from a random tiny transformers
model, in F32 so that the comparison is exact. Unlike llama's, these converters do not permute q/k
rows, so the file's rows are HuggingFace's. Phi-3's fused q/k/v and gate/up are cut into their
parts by rows, blocks and all (GGUF quantizes each row on its own). Gemma and the MoE families:
tests/model/test_model_gguf_gemma.py and tests/model/test_model_gguf_moe.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minivllm.llm import LLM
from minivllm.model.quantization.gguf.blocks import Q4_K, Q5_0, Q6_K, Q8_0
from minivllm.model.quantization.gguf.linear import gguf_parts
from minivllm.sampling_params import SamplingParams
from tests.conftest import SMOLLM2_GGUF_NAME, smollm2_dir
from tests.engine.test_bf16_cpu import check_logprobs_close
from tests.model.test_model_families import SHAPE, greedy, prompts_and_oracle, save_family
from tests.utils.llama_cpp_convert import convert, metadata, qtypes_by_layer, use_own_cache


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_own_cache(tmp_path, monkeypatch)


@pytest.mark.parametrize(
    ("family", "arch", "quantization"),
    [
        ("qwen2-tied", "qwen2", "none"),
        ("qwen2-tied", "qwen2", "gguf"),
        ("qwen3-hd32", "qwen3", "none"),
        ("qwen3-hd32", "qwen3", "gguf"),
        ("phi3", "phi3", "none"),
        ("phi3", "phi3", "gguf"),
    ],
)
def test_a_family_s_gguf_file_gives_transformers_greedy_tokens(
    tmp_path: Path, own_cache: None, family: str, arch: str, quantization: str
) -> None:
    hf, folder = save_family(tmp_path / "hf", family)
    path = convert(hf.config, folder, tmp_path / f"{arch}.gguf", arch)
    prompts, max_tokens, expected = prompts_and_oracle(hf, count=3)
    llm = LLM(
        model=str(path),
        skip_tokenizer_init=True,
        cpu_kv_cache_space=0.01,
        quantization=quantization,
        max_model_len=SHAPE["max_position_embeddings"],
    )
    assert type(llm.llm_engine.runner.model).__name__.lower().startswith(arch)
    assert greedy(llm, prompts, max_tokens) == expected


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_llama_3_1_s_rope_freqs_give_transformers_tokens(
    tmp_path: Path, own_cache: None, quantization: str
) -> None:
    """Llama 3.1's llama3 RoPE scaling reaches a GGUF file only as `rope_freqs` (one divisor per
    frequency): read, it gives transformers' tokens; ignored, other tokens (checked here: the
    unscaled model's differ), which is what a file gave before it was read."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0}
    rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    config = LlamaConfig(**(SHAPE | {"head_dim": 32, "rope_parameters": rope}))
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).float().eval()
    hf.save_pretrained(tmp_path / "hf")
    path = convert(hf.config, tmp_path / "hf", tmp_path / "llama31.gguf", "llama")
    prompts, max_tokens, expected = prompts_and_oracle(hf, count=3)
    plain = LlamaForCausalLM(LlamaConfig(**(SHAPE | {"head_dim": 32}))).float().eval()
    plain.load_state_dict(hf.state_dict())
    assert prompts_and_oracle(plain, count=3)[2] != expected  # the scaling matters here
    llm = LLM(
        model=str(path),
        skip_tokenizer_init=True,
        cpu_kv_cache_space=0.01,
        quantization=quantization,
        max_model_len=SHAPE["max_position_embeddings"],
    )
    assert llm.llm_engine.config.resolved.hf_config.rope_scaling["rope_type"] == "freq_factors"
    assert greedy(llm, prompts, max_tokens) == expected


def test_a_file_without_vocab_size_counts_its_tokenizer_s_tokens(
    tmp_path: Path, own_cache: None
) -> None:
    """Older converters wrote no `{arch}.vocab_size`: llama.cpp then counts the tokenizer's
    tokens (`tokenizer.ggml.tokens`), and so does minivllm, which read 0 (the vocabulary arrays
    are left out of the metadata it parses) and refused the file. A tiny Llama over SmolLM2's
    tokenizer (49,152 tokens) loads with its tokenizer and gives transformers' tokens."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    reader = gguf.GGUFReader(str(smollm2_dir() / SMOLLM2_GGUF_NAME))
    tokenizer = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    vocab = len(tokenizer["tokenizer.ggml.tokens"])
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**(SHAPE | {"vocab_size": vocab}))).float().eval()
    hf.save_pretrained(tmp_path / "hf")
    fields = metadata(hf.config, "llama") | tokenizer
    del fields["llama.vocab_size"]
    path = convert(hf.config, tmp_path / "hf", tmp_path / "old.gguf", "llama", fields=fields)
    prompts, max_tokens, expected = prompts_and_oracle(hf, count=3)
    llm = LLM(model=str(path), cpu_kv_cache_space=0.01, max_model_len=64)
    assert llm.llm_engine.config.resolved.hf_config.vocab_size == vocab
    assert len(llm.get_tokenizer()) == vocab
    assert greedy(llm, prompts, max_tokens) == expected


# llama.cpp's fused Phi-3 tensors, one type each (q/k/v of one type cut into one part), a
# K-quant and Q8_0 (real blocks of the weights) in layer 0, others in layer 1.
PHI3_TYPES = {
    "attn_qkv": (Q4_K, Q5_0),
    "attn_output": (Q8_0, Q6_K),
    "ffn_up": (Q8_0, Q4_K),
    "ffn_down": (Q6_K, Q8_0),
    "token_embd": (Q8_0,),
    "output": (Q6_K,),
}


def test_a_phi3_file_s_fused_blocks_run_as_stored(tmp_path: Path, own_cache: None) -> None:
    """q/k/v and gate/up cut by rows stay blocks (the C++ decode loop runs them too), and the
    default CPU path is as close to the dequantized model as vLLM asks: each greedy token within
    the other's top-5 logprobs until the first divergence."""
    hf, folder = save_family(tmp_path / "hf", "phi3", hidden_size=256, intermediate_size=512)
    path = convert(hf.config, folder, tmp_path / "phi3.gguf", "phi3", qtypes_by_layer(PHI3_TYPES))
    prompts = [{"prompt_token_ids": p} for p in prompts_and_oracle(hf, count=3)[0]]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True)
    outs = {}
    for quantization in ("gguf", "none"):
        llm = LLM(
            model=str(path), skip_tokenizer_init=True, cpu_kv_cache_space=0.01,
            quantization=quantization, max_model_len=SHAPE["max_position_embeddings"],
        )  # fmt: skip
        if quantization == "gguf":
            runner = llm.llm_engine.runner
            layers = runner.model.model.layers
            assert [q for q, _ in gguf_parts(layers[0].self_attn.qkv_proj)] == [Q4_K]
            assert [q for q, _ in gguf_parts(layers[1].mlp.gate_up_proj)] == [Q4_K]
            assert all(t.dtype == torch.uint8 for _, t in gguf_parts(layers[0].mlp.gate_up_proj))
            assert not [p for p in runner.model.parameters() if p.dim() > 1]  # only the norms
            assert runner.decode_loop is not None
        outs[quantization] = [
            (list(o.outputs[0].token_ids), list(o.outputs[0].logprobs or []))
            for o in llm.generate(prompts, params, use_tqdm=False)
        ]
    check_logprobs_close(outs["gguf"], outs["none"], "gguf blocks", "dequantized")
