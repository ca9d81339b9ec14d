"""Gemma 2 and Gemma 3 as llama.cpp GGUF files give transformers' tokens, and keep their blocks.

Each file is a random tiny transformers Gemma (`save_gemma`: norms perturbed ~0.5 off 0,
soft-capping and windows that matter) written as llama.cpp's converter writes it
(`llama_cpp_convert.convert`). What the reader (minivllm/model/quantization/gguf/reader.py, gguf_config.py) must undo
or fill in, and what would show here if it did not:

- every norm weight is stored with Gemma's 1 added (a norm read as stored multiplies by 2 + w);
- llama.cpp's `ffn_norm` is Gemma's pre-MLP norm, and the two post-norms have names of their own
  (four norms of different random weights: a swap changes the tokens);
- the metadata holds no query_pre_attn_scalar: llama.cpp takes the head size (32 here, which is
  not hidden / heads = 16), and hard-codes the layer pattern (gemma2: every 2nd layer global;
  gemma3: every 6th, so the Gemma 3 model has 6 layers) and gemma3's local RoPE base (10,000; the
  global one is 1,000,000, stretched 2x linearly).

An F32 file gives transformers' greedy tokens exactly, dequantized at load and on the native
path. A quantized file (K-quants, Q8_0, Q4_0, Q5_1) keeps its blocks, gives the dequantized
model's logits bit for bit on the reference path, and on the CPU path (gguf_linear on the blocks)
is as close to the dequantized model as vLLM judges.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from minivllm.attention.selector import get_attention_backend
from minivllm.llm import LLM
from minivllm.model.config import UnsupportedModelError
from minivllm.model.loader import load_model
from minivllm.model.quantization.gguf.blocks import Q4_0, Q4_K, Q5_1, Q5_K, Q6_K, Q8_0
from minivllm.model.quantization.gguf.config import hf_config
from minivllm.model.quantization.gguf.linear import gguf_parts
from minivllm.model.resolver import resolve_model
from minivllm.sampling_params import SamplingParams
from tests.engine.test_bf16_cpu import check_logprobs_close
from tests.model.test_model_families import greedy
from tests.model.test_model_gemma import engine_prompts, save_gemma
from tests.utils.llama_cpp_convert import convert, qtypes_by_layer, use_own_cache
from tests.utils.paged import paged_logits

S, F = "sliding_attention", "full_attention"
# Overrides of test_model_gemma's shapes: head_dim 32 against hidden / heads = 16, and the layer
# kinds and RoPE bases llama.cpp assumes for each architecture.
GEMMA = {
    "gemma2": dict(head_dim=32, query_pre_attn_scalar=32),
    "gemma3": dict(
        head_dim=32, query_pre_attn_scalar=32, num_hidden_layers=6, layer_types=[S] * 5 + [F],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        },
    ),
}  # fmt: skip
# A Q4_K_M-like mix by tensor kind, layer i taking entry i % 2 (hidden 256: whole K-quant blocks).
TYPES = {
    "attn_q": (Q4_K, Q8_0),
    "attn_k": (Q4_K, Q8_0),
    "attn_v": (Q6_K, Q5_1),
    "attn_output": (Q8_0, Q5_K),
    "ffn_gate": (Q4_0, Q4_K),
    "ffn_up": (Q4_0, Q8_0),
    "ffn_down": (Q6_K, Q8_0),
    "token_embd": (Q8_0,),
}
# initializer_range 0.02, transformers' own default: with larger random weights the tiny model is
# chaotic, and the 8-bit activations of the K-quants' integer dots (the default where the CPU has
# them) move a token outside the dequantized model's top 5 (tests/utils/gguf_utils.py `model_blocks`
# says the same of the tiny Llama).
BIG = dict(
    hidden_size=256,
    intermediate_size=512,
    head_dim=64,
    query_pre_attn_scalar=64,
    initializer_range=0.02,
)


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_own_cache(tmp_path, monkeypatch)


def gemma_file(tmp: Path, arch: str, quantized: bool = False) -> tuple[Any, Path]:
    hf, folder = save_gemma(tmp / "hf", arch, **(GEMMA[arch] | (BIG if quantized else {})))
    qtype_of = None
    if quantized:  # peaked logits (a final norm of ~100x), so that no near-tie decides a token
        with torch.no_grad():
            hf.model.norm.weight.add_(99.0)
        hf.save_pretrained(folder, safe_serialization=True)
        qtype_of = qtypes_by_layer(TYPES)
    return hf, convert(hf.config, folder, tmp / f"{arch}.gguf", arch, qtype_of)


def llm(path: Path, quantization: str) -> LLM:
    return LLM(
        model=str(path), skip_tokenizer_init=True, cpu_kv_cache_space=0.01,
        quantization=quantization, max_model_len=128,
    )  # fmt: skip


@pytest.mark.parametrize("quantization", ["none", "gguf"])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_gemma_gguf_file_gives_transformers_greedy_tokens(
    tmp_path: Path, own_cache: None, arch: str, quantization: str
) -> None:
    hf, path = gemma_file(tmp_path, arch)
    prompts, max_tokens, expected = engine_prompts(hf)
    engine = llm(path, quantization)
    model = engine.llm_engine.runner.model
    assert type(model).__name__ == f"{arch.capitalize()}ForCausalLM"
    assert model.config.layer_types == hf.config.layer_types
    assert greedy(engine, prompts, max_tokens) == expected


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_quantized_gemma_file_runs_on_its_blocks_as_the_dequantized_model(
    tmp_path: Path, own_cache: None, arch: str
) -> None:
    _, path = gemma_file(tmp_path, arch, quantized=True)
    source, backend = resolve_model(path), get_attention_backend("reference")
    native, plain = (
        load_model(source, backend, torch.float32, torch.device("cpu"), quantization=q)
        for q in ("gguf", "none")
    )
    layers = native.model.layers
    assert [q for q, _ in gguf_parts(layers[0].self_attn.qkv_proj)] == [Q4_K, Q6_K]
    assert [q for q, _ in gguf_parts(layers[1].mlp.gate_up_proj)] == [Q4_K, Q8_0]
    assert native.lm_head.qweight_0 is native.model.embed_tokens.qweight_0  # tied, Q8_0
    assert not [p for p in native.parameters() if p.dim() > 1]  # the norms only are floats
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    got, expected = (paged_logits(m, ids, [17, 1, 22]) for m in (native, plain))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)  # the same math, dequantized later
    gen = torch.Generator().manual_seed(3)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 256, (n,), generator=gen).tolist()}
        for n in (5, 14, 30)
    ]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=5, ignore_eos=True)
    outs = {
        q: [
            (list(o.outputs[0].token_ids), list(o.outputs[0].logprobs or []))
            for o in llm(path, q).generate(prompts, params, use_tqdm=False)
        ]
        for q in ("gguf", "none")
    }
    check_logprobs_close(outs["gguf"], outs["none"], "gguf blocks", "dequantized")


def metadata(arch: str, layers: int, **extra: object) -> dict[str, object]:
    keys = {"block_count": layers, "embedding_length": 4608, "vocab_size": 256,
            "attention.head_count": 32, "attention.head_count_kv": 16,
            "attention.key_length": 128, "attention.sliding_window": 4096} | extra  # fmt: skip
    return {"general.architecture": arch} | {f"{arch}.{k}": v for k, v in keys.items() if v}


@pytest.mark.parametrize(
    ("arch", "layers", "scalar"),
    [("gemma2", 46, 144), ("gemma2", 42, 128), ("gemma3", 62, 144), ("gemma3", 48, 128)],
)
def test_query_pre_attn_scalar_is_llama_cpp_s(arch: str, layers: int, scalar: int) -> None:
    """The head size, but hidden / heads for the 27B models, whose layer counts llama.cpp knows
    them by (Gemma 2 27B's config: 4608 / 32 = 144, its head size 128)."""
    assert hf_config(metadata(arch, layers), set())["query_pre_attn_scalar"] == scalar


def test_what_a_gemma_file_leaves_out_takes_llama_cpp_s_defaults() -> None:
    """gemma2: caps 50 and 30, a window of 4,096, every 2nd layer global; gemma3: no score cap,
    every 6th layer global, local base 10,000; a gemma3 file without its window is refused."""
    gemma2 = hf_config(metadata("gemma2", 4, **{"attention.sliding_window": None}), set())
    assert (gemma2["attn_logit_softcapping"], gemma2["final_logit_softcapping"]) == (50.0, 30.0)
    assert gemma2["sliding_window"] == 4096 and gemma2["layer_types"] == [S, F] * 2
    gemma3 = hf_config(metadata("gemma3", 12), set())
    assert (gemma3["attn_logit_softcapping"], gemma3["final_logit_softcapping"]) == (None, None)
    assert gemma3["layer_types"] == ([S] * 5 + [F]) * 2 and gemma3["rope_local_base_freq"] == 1e4
    with pytest.raises(UnsupportedModelError, match=r"without attention\.sliding_window"):
        hf_config(metadata("gemma3", 6, **{"attention.sliding_window": None}), set())


@pytest.mark.parametrize("arch", ["gemma", "gemma3n", "deepseek2"])
def test_an_architecture_minivllm_does_not_run_is_refused_by_name(arch: str) -> None:
    with pytest.raises(UnsupportedModelError, match=f"GGUF architecture '{arch}'"):
        hf_config({"general.architecture": arch}, set())
