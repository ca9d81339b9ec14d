"""Test data in GGUF's block formats, and small GGUF files written by the tests themselves.

`gguf` (the library maintained with llama.cpp) quantizes only Q4_0 ... Q8_0; K-quant data is
random blocks in the K layout, with every float16 scale set to a small finite value, so that any
dequantization is checked on every bit pattern of the integer fields (`random_blocks`). A model's
weights are made otherwise (`model_blocks`): zero-mean, of a trained model's size.
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


def model_blocks(qtype: int, rows: int, cols: int, std: float, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes]: a model's weight in `qtype`, zero-mean with standard deviation
    `std`: Gaussian weights quantized by gguf where it can; else random K-quant blocks whose
    offsets centre them (`centred_kquant`), scaled to `std` (`scaled`).

    `random_blocks` alone would make a chaotic model: Q4_K's and Q5_K's d * sc * q - dmin * m
    with dmin < 0 are all positive, and its scales make weights up to tens of times a trained
    model's, so each linear's output is a small difference of large sums, which 8-bit
    activations changed by up to 14 % in the tiny model's second layer."""
    if qtype in QUANTIZABLE:
        weight = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
        return quantized(qtype, weight * std)
    return scaled(centred_kquant(random_blocks(qtype, rows, cols, seed), qtype), qtype, std)


def centred_kquant(data: np.ndarray, qtype: int) -> np.ndarray:
    """K-quant blocks (uint8 [rows, row_bytes]) made zero-mean. Q4_K's and Q5_K's weights
    d * sc_j * q - dmin * m_j become d * sc_j * (q - q_mid): each sub-block's 6-bit min m_j set to
    its scale sc_j, and dmin to q_mid * d (7.5 for Q4_K's 4-bit q, 15.5 for Q5_K's 5-bit). Their
    layout: | d | dmin | s[12] | ...; j < 4: sc_j = s[j] & 63, m_j = s[j + 4] & 63; j >= 4:
    sc_j = s[j + 4] & 15 | (s[j - 4] >> 6) << 4, m_j = s[j + 4] >> 4 | (s[j] >> 6) << 4
    (ggml-quants.c `get_scale_min_k4`). Q6_K's d * sc_j * (q - 32) is centred already."""
    if qtype == Q6_K:
        return data
    assert qtype in (Q4_K, Q5_K)
    q_mid = 7.5 if qtype == Q4_K else 15.5
    flat = data.reshape(-1, BLOCK_LAYOUTS[qtype][1]).copy()  # [blocks, type_size]
    scales = flat[:, 4:16]  # a view: the 12 bytes of 6-bit scales and mins
    scales[:, 4:8] = scales[:, 0:4]
    low = scales[:, 8:12] & 0xF
    scales[:, 8:12] = low | (low << 4)
    d = flat[:, 0:2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
    flat[:, 2:4] = (d * q_mid).astype(np.float16).view(np.uint8)
    return flat.reshape(data.shape)


def scaled(blocks: np.ndarray, qtype: int, std: float) -> np.ndarray:
    """The blocks with every float16 scale (d, and dmin where the type has one) multiplied by
    one factor, so that the weights they encode, each d * q - dmin * m, have standard deviation
    `std`: random weights of a trained model's size keep a random model's output stable enough
    that rounding does not decide its tokens."""
    factor = std / reference_dequantize(blocks, qtype).std().item()
    size = BLOCK_LAYOUTS[qtype][1]
    flat = blocks.reshape(-1, size).copy()  # [blocks, type_size]
    for offset in F16_OFFSETS[qtype]:
        half = flat[:, offset : offset + 2].copy().view(np.float16)  # [blocks, 1]
        flat[:, offset : offset + 2] = (half * factor).astype(np.float16).view(np.uint8)
    return flat.reshape(blocks.shape)


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
    is tied to the embedding unless `output_type` gives it its own tensor.

    Its weights are a trained model's size and shape (`model_blocks`): each linear's zero-mean,
    with standard deviation 1 / sqrt(fan-in), so that every layer keeps its activations' size;
    the embedding's 0.1, so that the residual stream is not the input token's own row and the
    next token depends on the context. Its logits are then as a small trained model's: not
    nearly tied everywhere, not one token dominating, and 8-bit activations change them by far
    less than their gaps (tests/model/test_gguf_native.py holds every instruction-set level to
    vLLM's top-5 rule on it)."""
    h, i, v = 256, 512, 320
    shapes = {
        "attn_q": (h, h), "attn_k": (128, h), "attn_v": (128, h), "attn_output": (h, h),
        "ffn_gate": (i, h), "ffn_up": (i, h), "ffn_down": (h, i),
    }  # fmt: skip
    rng = np.random.default_rng(0)
    norm = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    tensors: dict[str, tuple[np.ndarray, int]] = {
        "token_embd.weight": (model_blocks(embed_type, v, h, 0.1, seed=1), embed_type),
        "output_norm.weight": (norm, 0),
    }
    if output_type is not None:
        tensors["output.weight"] = (model_blocks(output_type, v, h, 0.1, seed=2), output_type)
    for layer, types in enumerate(TINY_TYPES):
        for name, qtype in types.items():
            rows, cols = shapes[name]
            block = model_blocks(qtype, rows, cols, cols**-0.5, seed=10 * layer + len(name))
            tensors[f"blk.{layer}.{name}.weight"] = (block, qtype)
        tensors[f"blk.{layer}.attn_norm.weight"] = (norm, 0)
        tensors[f"blk.{layer}.ffn_norm.weight"] = (norm, 0)
    return write_gguf(path, TINY_FIELDS, tensors)
