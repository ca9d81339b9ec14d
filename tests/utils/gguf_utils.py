"""Test data in GGUF's block formats, and small GGUF files written by the tests themselves.

`gguf` (the library maintained with llama.cpp) quantizes only Q4_0 ... Q8_0; K-quant data is
random blocks in the K layout, with every float16 scale set to a small finite value, so that any
dequantization is checked on every bit pattern of the integer fields.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minivllm.model.quantization.gguf.blocks import BLOCK_LAYOUTS, Q4_K, Q5_K, Q6_K

QUANTIZABLE = (2, 3, 6, 7, 8)  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: gguf.quants.quantize writes them
# The byte offsets of each type's float16 scales within its block.
F16_OFFSETS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}


def random_blocks(qtype: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes]: random bytes in `qtype`'s layout with sane float16 scales."""
    block, size = BLOCK_LAYOUTS[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for offset in F16_OFFSETS[qtype]:
        # K-quants multiply d by a 6-bit (or int8) sub-block scale: a smaller d keeps weights ~0.1
        high = 0.002 if block == 256 else 0.05
        scale = rng.uniform(high / 50, high, size=data.shape[0]).astype(np.float16)
        if qtype in (3, 7, 12, 13) and offset == 2:
            scale = -scale  # a min below zero, as real Q4_1 / Q5_1 blocks have
        data[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, -1)


def quantized(qtype: int, weight: np.ndarray, seed: int = 0) -> np.ndarray:
    """`weight` (float32 [rows, cols]) in `qtype`: quantized by gguf where it can, else random
    K-layout blocks of the same shape (the values then do not approximate `weight`)."""
    import gguf

    if qtype in QUANTIZABLE:
        return gguf.quants.quantize(weight.astype(np.float32), gguf.GGMLQuantizationType(qtype))
    assert qtype in (Q4_K, Q5_K, Q6_K)
    return random_blocks(qtype, *weight.shape, seed=seed)


def reference_dequantize(data: np.ndarray, qtype: int) -> torch.Tensor:
    """gguf's own dequantization: float32 [rows, cols]."""
    import gguf

    return torch.from_numpy(
        np.array(gguf.quants.dequantize(data, gguf.GGMLQuantizationType(qtype)), np.float32)
    )


def write_gguf(
    path: Path,
    fields: dict[str, object],
    tensors: dict[str, tuple[np.ndarray, int]],
    arch: str = "llama",
    add_more: Callable[[Any], None] | None = None,
) -> Path:
    """A GGUF file of llama.cpp architecture `arch` with `fields` and `tensors` (name -> (data,
    qtype)): data is float32 for F32 tensors (float16 for F16), or the uint8 blocks of a
    quantized one. `add_more(writer)` adds what a gguf writer call of the converter's would
    (`SpecialVocab.add_to_gguf`)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    if add_more is not None:
        add_more(writer)
    for key, value in fields.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif (isinstance(value, list) and value and isinstance(value[0], str)) or isinstance(
            value, list
        ):
            writer.add_array(key, value)
        else:
            raise TypeError(f"{key}: {type(value)}")
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType(qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# A tiny Llama whose every row is whole K-quant super-blocks (hidden 256, MLP 512).
TINY_FIELDS: dict[str, object] = {
    "llama.block_count": 2,
    "llama.context_length": 256,
    "llama.embedding_length": 256,
    "llama.feed_forward_length": 512,
    "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 2,
    "llama.rope.freq_base": 10000.0,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.vocab_size": 320,
}
# Per layer, a type for each tensor: layer 0 mixes types inside qkv (Q4_K q/k, Q6_K v: two parts,
# as a Q4_K_M file does) and gate/up; layer 1 covers the rest.
TINY_TYPES = (
    {
        "attn_q": 12,
        "attn_k": 12,
        "attn_v": 14,
        "attn_output": 13,
        "ffn_gate": 2,
        "ffn_up": 3,
        "ffn_down": 6,
    },
    {
        "attn_q": 8,
        "attn_k": 8,
        "attn_v": 8,
        "attn_output": 7,
        "ffn_gate": 12,
        "ffn_up": 12,
        "ffn_down": 14,
    },
)


def tiny_llama_gguf(path: Path, embed_type: int = 8, output_type: int | None = None) -> Path:
    """A random tiny Llama as a GGUF file with no tokenizer (prompts are token ids). The LM head
    is tied to the embedding unless `output_type` gives it its own tensor."""
    h, i, v = 256, 512, 320
    shapes = {
        "attn_q": (h, h), "attn_k": (128, h), "attn_v": (128, h), "attn_output": (h, h),
        "ffn_gate": (i, h), "ffn_up": (i, h), "ffn_down": (h, i),
    }  # fmt: skip
    rng = np.random.default_rng(0)
    norm = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    tensors: dict[str, tuple[np.ndarray, int]] = {
        "token_embd.weight": (random_blocks(embed_type, v, h, seed=1), embed_type),
        "output_norm.weight": (norm, 0),
    }
    if output_type is not None:
        tensors["output.weight"] = (random_blocks(output_type, v, h, seed=2), output_type)
    for layer, types in enumerate(TINY_TYPES):
        for name, qtype in types.items():
            block = random_blocks(qtype, *shapes[name], seed=10 * layer + len(name))
            tensors[f"blk.{layer}.{name}.weight"] = (block, qtype)
        tensors[f"blk.{layer}.attn_norm.weight"] = (norm, 0)
        tensors[f"blk.{layer}.ffn_norm.weight"] = (norm, 0)
    return write_gguf(path, TINY_FIELDS, tensors)
