"""Test data in GGUF's block formats, and small GGUF files written by the tests themselves.

`gguf` (the library maintained with llama.cpp) quantizes only Q4_0 ... Q8_0; K-quant data is
random blocks in the K layout, with every float16 scale set to a small finite value, so that any
dequantization is checked on every bit pattern of the integer fields.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from minivllm.model.quantization.gguf_blocks import BLOCK_LAYOUTS, Q4_K, Q5_K, Q6_K

QUANTIZABLE = (2, 3, 6, 7, 8)  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: gguf.quants.quantize writes them
# The byte offsets of each type's float16 scales within its block.
_F16_OFFSETS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}


def random_blocks(qtype: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes]: random bytes in `qtype`'s layout with sane float16 scales."""
    block, size = BLOCK_LAYOUTS[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for offset in _F16_OFFSETS[qtype]:
        scale = rng.uniform(0.001, 0.05, size=data.shape[0]).astype(np.float16)
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
    path: Path, fields: dict[str, object], tensors: dict[str, tuple[np.ndarray, int]]
) -> Path:
    """A GGUF file with llama-architecture `fields` and `tensors` (name -> (data, qtype)): data is
    float32 for F32 tensors, or the uint8 blocks of a quantized one."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in fields.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list) and value and isinstance(value[0], str):
            writer.add_array(key, value)
        elif isinstance(value, list):
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
