"""Reading llama.cpp's GGUF format: metadata into a `LlamaConfig`, tensor names into HuggingFace's.

Four of llama.cpp's architectures load (`GGUF_ARCHITECTURES`): llama, qwen2, qwen3 and phi3.

GGUF stores one file with key/value metadata and (often quantized) tensors under llama.cpp's
names. The `gguf` library (maintained with llama.cpp) parses the file and dequantizes every
quantization type; this module maps names and undoes one layout change: llama.cpp's converter
permutes the rows of Q and K so that RoPE rotates interleaved pairs (x0, x1), (x2, x3), ...,
whereas the HuggingFace layout minivllm uses rotates (x_i, x_{i+d/2}).

Parsing the vocabulary and building a tokenizer from GGUF metadata is slow, so `convert_gguf`
does it once and leaves a HuggingFace-style folder (config.json, tokenizer files) in a cache keyed
by the file's path, size and mtime. The weights are read from the GGUF file itself, in their
blocks (minivllm/model/quantization/gguf_loader.py); only `quantization="none"` dequantizes them,
once, into that folder's model.safetensors, read then like any local checkpoint.

Tier: model. It imports leaves and core.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from einops import rearrange

from minivllm.envs import cache_root
from minivllm.model.config import ARCHITECTURE_FACTS, LlamaConfig, UnsupportedModelError

# llama.cpp's per-layer tensor names -> HuggingFace names under model.layers.{i}.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3 stores q/k/v fused
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# llama.cpp's `general.architecture` -> the HuggingFace architecture the registry knows it by.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# Vocabulary arrays are large and only the tokenizer needs them (transformers reads them itself).
_SKIP_FIELDS = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"}


class GGUFReadError(ValueError):
    """The file is not a readable GGUF file (truncated, or another format)."""


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: within each head, GGUF stores the rows as
    interleaved pairs (half, pair); HuggingFace stores the two halves one after the other."""
    return rearrange(w, "(heads half pair) ... -> (heads pair half) ...", heads=n_heads, pair=2)


def read_gguf(path: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """The model's config and float32 tensors under HuggingFace's (unfused) names."""
    from gguf.quants import dequantize

    reader = open_gguf(path)
    config = config_from_reader(reader)
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name, config.architecture)
        if name is None:
            continue
        array = dequantize(t.data, t.tensor_type)  # float32, [rows, columns] in torch's order
        tensor = torch.from_numpy(np.array(array, dtype=np.float32))  # a writable copy
        state[name] = unpermute_qk(name, tensor, config)
    return config, state


def open_gguf(path: Path) -> Any:
    """The file's `GGUFReader` (memory-mapped: nothing is read until a tensor is)."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as exc:
        raise GGUFReadError(f"cannot read GGUF file {path} (truncated or corrupt?): {exc}") from exc


def hf_name(gguf_name: str, architecture: str = "LlamaForCausalLM") -> str | None:
    """The HuggingFace name of a llama.cpp tensor name; None for one the model does not load
    (e.g. rope_freqs of llama3 scaling, which the config already describes). Phi-3's `ffn_up`
    holds gate and up fused, as its HuggingFace checkpoint's `gate_up_proj` does."""
    parts = gguf_name.split(".")  # e.g. ["blk", "3", "attn_q", "weight"]
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        name = _LAYER_NAMES[parts[2]]
        if architecture == "Phi3ForCausalLM" and parts[2] == "ffn_up":
            name = "mlp.gate_up_proj"
        return f"model.layers.{parts[1]}.{name}.{parts[3]}"
    return None


def unpermute_qk(name: str, rows: torch.Tensor, config: LlamaConfig) -> torch.Tensor:
    """A q_proj / k_proj tensor's rows in HuggingFace's order; any other tensor as it is. Only
    whole rows move, so it applies to quantized blocks (uint8 [rows, row_bytes]) as well. Only
    llama.cpp's converter for the llama architecture permutes: its qwen2, qwen3 and phi3 models
    rotate the halves as HuggingFace does ("NeoX" RoPE), and their rows are as stored."""
    if config.architecture != "LlamaForCausalLM":
        return rows
    if name.endswith("q_proj.weight"):
        return _unpermute(rows, config.num_attention_heads)
    if name.endswith("k_proj.weight"):
        return _unpermute(rows, config.num_key_value_heads)
    return rows


def config_from_reader(reader: Any) -> LlamaConfig:
    fields = {k: f.contents() for k, f in reader.fields.items() if k not in _SKIP_FIELDS}
    names = {t.name for t in reader.tensors}
    if "rope_factors_long.weight" in names:  # Phi-3's long-context variants
        raise UnsupportedModelError("rope_type 'longrope' (rope_factors_long) is not supported")
    return config_from_gguf_fields(fields, tie_word_embeddings="output.weight" not in names)


def convert_gguf(path: Path) -> Path:
    """A cached HuggingFace-style folder holding the GGUF file's config and tokenizer. The
    float32 weights are added to it only when asked for (`dequantized_weights`)."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    target = cache_root() / "gguf" / f"{path.stem}-{key[:16]}"
    if (target / "complete").is_file():
        return target
    from transformers import AutoTokenizer

    reader = open_gguf(path)
    config = config_from_reader(reader)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(hf_config_dict(config), indent=2))
    if "tokenizer.ggml.model" in reader.fields:  # a file may carry no tokenizer (token ids only)
        tokenizer: Any = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer.save_pretrained(str(tmp))
    (tmp / "source.txt").write_text(f"converted from {path.resolve()}\n")
    (tmp / "complete").write_text("")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)  # atomic: a concurrent reader sees the old folder or the whole new one
    return target


def hf_config_dict(config: LlamaConfig) -> dict[str, Any]:
    """The config in HuggingFace's `config.json` spelling (what `LlamaConfig.from_hf_dict` reads
    back), for the converted folder. Qwen2's q/k/v bias and Qwen3's q/k norms go without saying:
    the reader knows them from the architecture."""
    c = config
    return {
        "architectures": [c.architecture],
        "model_type": c.architecture.removesuffix("ForCausalLM").lower(),
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias,
        "mlp_bias": c.mlp_bias,
        "sliding_window": c.sliding_window,
        "hidden_act": "silu",
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else c.eos_token_ids,
    }


def dequantized_weights(folder: Path, path: Path) -> Path:
    """The converted folder of `path` with its weights dequantized to float32 (model.safetensors),
    written once (`quantization="none"`)."""
    weights = folder / "model.safetensors"
    if not weights.is_file():
        from safetensors.torch import save_file

        _, state = read_gguf(path)
        tmp = weights.with_name(f"model.safetensors.tmp{os.getpid()}")
        save_file(state, str(tmp))
        os.replace(tmp, weights)
    return folder


def config_from_gguf_fields(fields: dict[str, Any], tie_word_embeddings: bool) -> LlamaConfig:
    """Read llama.cpp's GGUF metadata (`general.architecture` one of `GGUF_ARCHITECTURES`; each
    family's keys are prefixed with its name: "qwen2.block_count").

    GGUF does not record tied embeddings; the loader knows from whether `output.weight` exists.
    """
    arch = fields.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; minivllm runs "
            f"{', '.join(GGUF_ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    scaling: dict[str, Any] | None = None
    scaling_type = get("rope.scaling.type")
    if scaling_type not in (None, "none"):
        scaling = {"rope_type": scaling_type, "factor": float(get("rope.scaling.factor", 1.0))}
    vocab = get("vocab_size") or len(fields.get("tokenizer.ggml.tokens", []))
    eos = fields.get("tokenizer.ggml.eos_token_id")
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        # Qwen3's head_dim is not hidden / heads; llama.cpp writes it as the key length.
        head_dim=int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings=tie_word_embeddings,
        sliding_window=get("attention.sliding_window"),  # Phi-3's; refused where it is short
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
        architecture=GGUF_ARCHITECTURES[arch],
        **ARCHITECTURE_FACTS.get(GGUF_ARCHITECTURES[arch], {}),
    )
