"""Reading llama.cpp's GGUF format: metadata into a config, tensor names into HuggingFace's.

Eight of llama.cpp's architectures load (`config.GGUF_ARCHITECTURES`, gguf/config.py): llama (Llama,
Mistral, and Mixtral where the file has experts), qwen2, qwen3, qwen3moe, phi3, gemma2 and gemma3
(text), and the encoder bert (embeddings only, under transformers' `BertModel` names).

GGUF stores one file with key/value metadata and (often quantized) tensors under llama.cpp's
names. The `gguf` library (maintained with llama.cpp) parses the file and dequantizes every
quantization type; `config.py` beside it reads the metadata as a config.json, and this module maps
tensor names (`hf_name`, `hf_tensors`) and undoes llama.cpp's two layout changes
(`to_hf_layout`): its llama converter permutes the rows of Q and K so that RoPE rotates
interleaved pairs (x0, x1), (x2, x3), ..., whereas the HuggingFace layout minivllm uses rotates
(x_i, x_{i+d/2}); its Gemma converters add Gemma's 1 to every RMSNorm weight. A MoE layer's
experts, which llama.cpp stacks into one tensor [E, rows, columns], are read back one by one.

Parsing the vocabulary and building a tokenizer from GGUF metadata is slow, so `convert_gguf`
does it once and leaves a HuggingFace-style folder (config.json, tokenizer files) in a cache keyed
by the file's path, size and mtime. The weights are read from the GGUF file itself, in their
blocks (minivllm/model/quantization/gguf/loader.py); only `quantization="none"` dequantizes them,
once, into that folder's model.safetensors, read then like any local checkpoint.
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
from minivllm.model.config import LlamaConfig, UnsupportedModelError
from minivllm.model.models.registry import config_from_hf_dict
from minivllm.model.quantization.gguf.config import hf_config, sentence_transformers_files
from minivllm.model.quantization.gguf.tokenizer import gguf_tokenizer

# llama.cpp's per-layer tensor names -> HuggingFace names under model.layers.{i}.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3, Qwen3-MoE, Gemma 3
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3 stores q/k/v fused
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a MoE layer's router
    # A MoE layer's experts, stacked [n_expert, rows, columns]: one tensor per expert once read
    # (`hf_tensors`), under the names of Qwen3-MoE's checkpoint, which both MoE models load.
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Gemma's four norms a layer: there llama.cpp's ffn_norm is the MLP's pre-norm, and the two
# post-norms have names of their own.
_GEMMA_LAYER_NAMES = _LAYER_NAMES | {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# llama.cpp's bert tensors -> transformers' `BertModel` names (no "bert." prefix), which
# minivllm/model/models/bert.py loads; per layer under encoder.layer.{i}.
_BERT_GLOBAL_NAMES = {
    "token_embd": "embeddings.word_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "position_embd": "embeddings.position_embeddings",
    "token_embd_norm": "embeddings.LayerNorm",
}
_BERT_LAYER_NAMES = {
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense",
    "layer_output_norm": "output.LayerNorm",
}
# llama.cpp's older Mixtral files store each expert's weight on its own: blk.{i}.ffn_gate.{e}.
_OLD_EXPERT_NAMES = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# The architectures llama.cpp's `llama` converter writes: it permutes their q/k rows.
_PERMUTED_QK = ("LlamaForCausalLM", "MixtralForCausalLM")
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
        if hf_name(t.name, config.architecture) is None:
            continue
        array = dequantize(t.data, t.tensor_type)  # float32, [..., rows, columns] in torch's order
        tensor = torch.from_numpy(np.array(array, dtype=np.float32))  # a writable copy
        parts = hf_tensors(t.name, tensor, config)
        for name, part in parts:  # safetensors stores no two views of one tensor
            state[name] = part.clone() if len(parts) > 1 else part
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
    (e.g. rope_freqs of llama3 scaling). Phi-3's `ffn_up` holds gate and up fused, as its
    HuggingFace checkpoint's `gate_up_proj` does; an expert stack's name has no expert number."""
    parts = gguf_name.split(".")  # e.g. ["blk", "3", "attn_q", "weight"]
    if architecture == "BertModel":
        return _bert_name(parts)
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA_LAYER_NAMES if architecture in _GEMMA else _LAYER_NAMES
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in names:
        name = names[parts[2]]
        if architecture == "Phi3ForCausalLM" and parts[2] == "ffn_up":
            name = "mlp.gate_up_proj"
        return f"model.layers.{parts[1]}.{name}.{parts[3]}"
    if parts[0] == "blk" and len(parts) == 5 and parts[2] in _OLD_EXPERT_NAMES:  # blk.3.ffn_up.7
        return (
            f"model.layers.{parts[1]}.mlp.experts.{parts[3]}.{_OLD_EXPERT_NAMES[parts[2]]}.weight"
        )
    return None


def _bert_name(parts: list[str]) -> str | None:
    if len(parts) == 2 and parts[0] in _BERT_GLOBAL_NAMES:
        return f"{_BERT_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _BERT_LAYER_NAMES:
        return f"encoder.layer.{parts[1]}.{_BERT_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def hf_tensors(
    gguf_name: str, tensor: torch.Tensor, config: LlamaConfig
) -> list[tuple[str, torch.Tensor]]:
    """The HuggingFace tensors one llama.cpp tensor holds, each in HuggingFace's layout
    (`to_hf_layout`), as views where they can be. An expert stack [E, rows, columns] is E
    tensors, one per expert; a Phi-3 file's fused q/k/v and gate/up are their parts, cut by rows:
    GGUF quantizes each row on its own (a block never spans two rows), so quantized blocks are
    cut as they are. Empty for a tensor the model does not load."""
    name = hf_name(gguf_name, config.architecture)
    if name is None:
        return []
    parts = [(name, tensor)]
    if gguf_name.endswith("_exps.weight"):  # [E, rows, columns (or row bytes)]
        parts = [(name.replace(".experts.", f".experts.{e}."), w) for e, w in enumerate(tensor)]
    elif name.endswith(("qkv_proj.weight", "gate_up_proj.weight")):
        d, i = config.head_dim, config.intermediate_size
        q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
        sizes, fused, separate = (
            ([q, kv, kv], "qkv_proj", ["q_proj", "k_proj", "v_proj"])
            if "qkv_proj" in name
            else ([i, i], "gate_up_proj", ["gate_proj", "up_proj"])
        )
        rows = tensor.split(sizes)  # views: [size, columns (or row bytes)] each
        parts = [(name.replace(fused, part), r) for part, r in zip(separate, rows)]
    return [(n, to_hf_layout(n, t, config)) for n, t in parts]


def to_hf_layout(name: str, rows: torch.Tensor, config: LlamaConfig) -> torch.Tensor:
    """A tensor in HuggingFace's layout; most are stored so. Two of llama.cpp's converters change
    one. Its llama converter (Llama, Mistral, Mixtral) permutes the rows of q and k so that RoPE
    rotates interleaved pairs (its qwen2, qwen3, qwen3moe, phi3 and gemma models rotate the halves,
    as HuggingFace does, and are stored as they are): whole rows move back, so this applies to
    quantized blocks (uint8 [rows, row_bytes]) as well. Its Gemma converters store every RMSNorm
    weight with Gemma's 1 added (the norm multiplies by 1 + w); the 1 comes off again here."""
    if config.architecture in _GEMMA and name.endswith("norm.weight"):
        if not rows.is_floating_point():  # 1-D tensors are float in llama.cpp's files
            raise ValueError(f"{name}: a quantized norm weight is not supported")
        return rows.float() - 1.0
    if config.architecture not in _PERMUTED_QK:
        return rows
    if name.endswith("q_proj.weight"):
        return _unpermute(rows, config.num_attention_heads)
    if name.endswith("k_proj.weight"):
        return _unpermute(rows, config.num_key_value_heads)
    return rows


def metadata(reader: Any) -> dict[str, Any]:
    """The file's key/value metadata, vocabulary arrays left out."""
    return {k: f.contents() for k, f in reader.fields.items() if k not in _SKIP_FIELDS}


def gguf_hf_config(reader: Any) -> dict[str, Any]:
    """The file's config.json, from its metadata and tensor names (`config.hf_config`)."""
    fields = metadata(reader)
    names = {t.name for t in reader.tensors}
    if "rope_factors_long.weight" in names:  # Phi-3's long-context variants
        raise UnsupportedModelError("rope_type 'longrope' (rope_factors_long) is not supported")
    cfg = hf_config(fields, names, n_vocab=_token_count(reader))
    if cfg["architectures"] == ["BertModel"]:
        # A variant's tensors (ColBERT's dense_2 projection, a classifier's cls.output) would
        # change the vector: refused, not skipped.
        unknown = sorted(n for n in names if _bert_name(n.split(".")) is None)
        if unknown:
            raise UnsupportedModelError(
                f"bert tensors {unknown[:4]} are not supported (minivllm runs transformers' "
                "BertModel: embeddings, attention, MLP and their LayerNorms)"
            )
    if "rope_freqs.weight" in names:
        # Llama 3.1+: llama.cpp's converter writes the llama3 scaling as one divisor per rotated
        # pair (the tensor), not as parameters; RoPE divides its frequencies by them.
        (tensor,) = [t for t in reader.tensors if t.name == "rope_freqs.weight"]
        factors = np.asarray(tensor.data, dtype=np.float32).reshape(-1)  # [head_dim // 2]
        cfg["rope_scaling"] = {"rope_type": "freq_factors", "freq_factors": factors.tolist()}
    return cfg


def _token_count(reader: Any) -> int:
    """The vocabulary's size as llama.cpp counts it where `{arch}.vocab_size` is missing: the
    tokenizer's tokens (src/llama-model.cpp, `get_arr_n(LLM_KV_TOKENIZER_LIST)`), counted
    without decoding the strings; a file without a tokenizer has one embedding row a token."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)  # one index into `parts` per string
    embedding = [t for t in reader.tensors if t.name == "token_embd.weight"]
    return int(embedding[0].shape[-1]) if embedding else 0  # shape is GGML's: [hidden, vocab]


def config_from_reader(reader: Any) -> LlamaConfig:
    """The typed config of the file's model, read as its config.json would be."""
    return config_from_hf_dict(gguf_hf_config(reader))


# What the converted folder holds changes with this module (Llama 3.1's rope_freqs joined its
# config.json in version 2, an embedding file's sentence-transformers module files in 3): a
# folder converted by an older minivllm is not reused.
CONVERTED_FORMAT = 3


def convert_gguf(path: Path) -> Path:
    """A cached HuggingFace-style folder holding the GGUF file's config and tokenizer (and, for
    a file with `{arch}.pooling_type`, the sentence-transformers module files it stands for:
    `config.sentence_transformers_files`). The float32 weights are added to it only when asked
    for (`dequantized_weights`)."""
    st = path.stat()
    stamp = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{CONVERTED_FORMAT}"
    key = hashlib.sha256(stamp.encode()).hexdigest()
    target = cache_root() / "gguf" / f"{path.stem}-{key[:16]}"
    if (target / "complete").is_file():
        return target
    reader = open_gguf(path)
    cfg = gguf_hf_config(reader)
    config_from_hf_dict(cfg)  # refuses, by name, a model no class here runs exactly
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files = {
        "config.json": cfg,
        **sentence_transformers_files(metadata(reader), cfg["hidden_size"]),
    }
    for name, content in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(json.dumps(content, indent=2))
    if "tokenizer.ggml.model" in reader.fields:  # a file may carry no tokenizer (token ids only)
        gguf_tokenizer(path, reader, tmp).save_pretrained(str(tmp))
    (tmp / "source.txt").write_text(f"converted from {path.resolve()}\n")
    (tmp / "complete").write_text("")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)  # atomic: a concurrent reader sees the old folder or the whole new one
    return target


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
