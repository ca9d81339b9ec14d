"""Qwen2, Qwen3 and Phi-3 as GGUF files load and give transformers' greedy tokens.

Each file is written here with the `gguf` library, under llama.cpp's architecture name, metadata
keys and tensor names (qwen2: q/k/v biases; qwen3: `attn_q_norm` / `attn_k_norm` and the head
size as `attention.key_length`; phi3: `attn_qkv` and a fused `ffn_up`), from a random tiny
transformers model, in F32 so that the comparison is exact. Unlike llama's, these converters
do not permute q/k rows, so the file's rows are HuggingFace's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_utils import write_gguf
from test_model_families import SHAPE, greedy, prompts_and_oracle, save_family

from minivllm.llm import LLM

# HuggingFace's per-layer names -> llama.cpp's (the inverse of minivllm/model/gguf.py's table)
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # phi3: gate and up in one tensor
    "mlp.down_proj": "ffn_down",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(name: str) -> str:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    _, _, layer, rest = name.split(".", 3)  # model.layers.{i}.{module}.{weight|bias}
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def write_family_gguf(hf: Any, path: Path, arch: str) -> Path:
    c = hf.config
    fields: dict[str, object] = {
        f"{arch}.block_count": c.num_hidden_layers,
        f"{arch}.context_length": c.max_position_embeddings,
        f"{arch}.embedding_length": c.hidden_size,
        f"{arch}.feed_forward_length": c.intermediate_size,
        f"{arch}.attention.head_count": c.num_attention_heads,
        f"{arch}.attention.head_count_kv": c.num_key_value_heads,
        f"{arch}.attention.key_length": getattr(c, "head_dim", None)
        or c.hidden_size // c.num_attention_heads,
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
        f"{arch}.vocab_size": c.vocab_size,
    }
    state = hf.state_dict()
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tensors = {gguf_name(k): (v.float().numpy().astype(np.float32), 0) for k, v in state.items()}
    return write_gguf(path, fields, tensors, arch=arch)


@pytest.mark.parametrize(
    ("family", "arch", "quantization"),
    [
        ("qwen2-tied", "qwen2", "none"),
        ("qwen2-tied", "qwen2", "gguf"),
        ("qwen3-hd32", "qwen3", "none"),
        ("qwen3-hd32", "qwen3", "gguf"),
        ("phi3", "phi3", "none"),
    ],
)
def test_a_family_s_gguf_file_gives_transformers_greedy_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str, arch: str, quantization: str
) -> None:
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    hf, _ = save_family(tmp_path / "hf", family)
    path = write_family_gguf(hf, tmp_path / f"{arch}.gguf", arch)
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


def test_phi3_gguf_blocks_are_refused_by_name_and_run_dequantized(
    tmp_path: Path, monkeypatch
) -> None:
    """The GGUF block loader knows separate q/k/v only; a Phi-3 file says to dequantize."""
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    hf, _ = save_family(tmp_path / "hf", "phi3")
    path = write_family_gguf(hf, tmp_path / "phi3.gguf", "phi3")
    with pytest.raises(ValueError, match="quantization='none'"):
        LLM(model=str(path), skip_tokenizer_init=True, cpu_kv_cache_space=0.01)
