"""GGUF's quantized blocks, and the plain-PyTorch dequantization that is their specification.

llama.cpp stores a weight row of K values as K / block_size blocks of `type_size` bytes each; a
quantized tensor of N rows is therefore the bytes `uint8 [N, K / block_size * type_size]`, and
minivllm keeps exactly those bytes in memory (`GGUFLinearMethod` in `gguf.py`). Every kernel that
multiplies by them (minivllm/cpu/csrc/cpu_gguf_gemm.cpp, `triton_gguf.py`) is held to `dequantize`
below, which is held to the `gguf` library's own dequantization (tests/model/test_gguf_blocks.py).

The layouts, byte by byte (d, m, dmin: float16 scales; q: the small integers):

    Q4_0  32 weights, 18 bytes   | d | qs[16] |               w = d * (q - 8)
    Q4_1  32 weights, 20 bytes   | d | m | qs[16] |           w = d * q + m
    Q5_0  32 weights, 22 bytes   | d | qh[4] | qs[16] |       w = d * (q - 16)
    Q5_1  32 weights, 24 bytes   | d | m | qh[4] | qs[16] |   w = d * q + m
    Q8_0  32 weights, 34 bytes   | d | qs[32] (int8) |        w = d * q
      qs[j] holds weight j in its low nibble and weight j + 16 in its high one; for the 5-bit
      types, bit j of the little-endian uint32 qh is weight j's fifth bit.

    Q4_K  256 weights, 144 bytes | d | dmin | scales[12] | qs[128] |
    Q5_K  256 weights, 176 bytes | d | dmin | scales[12] | qh[32] | qs[128] |
      8 sub-blocks of 32, each with a 6-bit scale sc and a 6-bit min mn packed into scales[12]
      (`_k_scale_min`): w = d * sc * q - dmin * mn. qs holds 4 chunks of 64 weights, 32 bytes
      each: the low nibbles are sub-block 2c, the high ones 2c + 1. Q5_K's fifth bit of weight
      l of sub-block s is bit s of qh[l].
    Q6_K  256 weights, 210 bytes | ql[128] | qh[64] | scales[16] (int8) | d |
      16 sub-blocks of 16 with an int8 scale each: w = d * sc * (q - 32), q = 4 low bits from
      ql and 2 high bits from qh, in two halves of 128 weights.

F32, F16 and BF16 tensors are plain weights: the loader reads them as ordinary parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# GGML's type numbers (gguf.GGMLQuantizationType), by name.
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
# qtype -> (weights per block, bytes per block)
BLOCK_LAYOUTS: dict[int, tuple[int, int]] = {
    Q4_0: (32, 18),
    Q4_1: (32, 20),
    Q5_0: (32, 22),
    Q5_1: (32, 24),
    Q8_0: (32, 34),
    Q4_K: (256, 144),
    Q5_K: (256, 176),
    Q6_K: (256, 210),
}
TYPE_NAMES = {
    Q4_0: "Q4_0",
    Q4_1: "Q4_1",
    Q5_0: "Q5_0",
    Q5_1: "Q5_1",
    Q8_0: "Q8_0",
    Q4_K: "Q4_K",
    Q5_K: "Q5_K",
    Q6_K: "Q6_K",
}
PLAIN_TYPES = {0: "F32", 1: "F16", 30: "BF16"}  # read as ordinary weights


def row_bytes(qtype: int, cols: int) -> int:
    """Bytes one row of `cols` weights takes in `qtype`."""
    block, size = BLOCK_LAYOUTS[qtype]
    return cols // block * size


def cols_of(qtype: int, nbytes: int) -> int:
    """Weights in a row of `nbytes` bytes of `qtype`."""
    block, size = BLOCK_LAYOUTS[qtype]
    return nbytes // size * block


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:  # [n, type_size] -> float32 [n, 1]
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:  # uint8 [n, 16 c] -> uint8 [n, 32 c]
    """Low nibbles of each 16 bytes, then their high nibbles: weights j and j + 16 of a block."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, 16)
    return torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, -1)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:  # uint8 [n, 4] -> uint8 [n, 32]
    bits = qh.contiguous().view(torch.int32)  # [n, 1], little-endian
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bits >> shifts) & 1).to(torch.uint8)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:]).to(torch.int8) - 8
    return _f16(b, 0) * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _nibbles(b[:, 4:]).float() + _f16(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(b[:, 6:]) | (_fifth_bits(b[:, 2:6]) << 4)).to(torch.int8) - 16
    return _f16(b, 0) * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:]) | (_fifth_bits(b[:, 4:8]) << 4)
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 sub-blocks' 6-bit scales and mins from 12 bytes: bytes 0-3 hold scales 0-3 in their
    low 6 bits, bytes 4-7 mins 0-3; scales and mins 4-7 have their low 4 bits in bytes 8-11
    (scale low, min high) and their top 2 bits in the top 2 bits of bytes 0-3 and 4-7."""
    n = scales.shape[0]
    d, m, md = scales.reshape(n, 3, 4).unbind(1)  # each uint8 [n, 4]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn  # uint8 [n, 8] each


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * sc.float()).reshape(n, 8, 1)
    dm = (_f16(b, 2) * mn.float()).reshape(n, 8, 1)
    qs = b[:, 16:].reshape(n, 4, 1, 32)  # 4 chunks of 32 bytes: 2 sub-blocks each
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * sc.float()).reshape(n, 8, 1)
    dm = (_f16(b, 2) * mn.float()).reshape(n, 8, 1)
    qh = b[:, 16:48].reshape(n, 1, 32)
    high = (qh >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)) & 1  # [n, 8, 32]
    qs = b[:, 48:].reshape(n, 4, 1, 32)
    low = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32)
    return (d * (low | (high << 4)).float() - dm).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    d = (_f16(b, 208) * scales).reshape(n, 16, 1)
    ql = b[:, :128].reshape(n, 2, 1, 64)  # two halves of 128 weights: 64 bytes of low bits each
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(n, 8, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)  # 32 bytes of high bits per half, 2 bits a weight
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = ((qh >> shifts) & 3).reshape(n, 8, 32)
    q = (low | (high << 4)).to(torch.int8) - 32
    return (d * q.reshape(n, 16, 16).float()).reshape(n, 256)


_DEQUANTIZE_BLOCKS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    Q4_0: _q4_0,
    Q4_1: _q4_1,
    Q5_0: _q5_0,
    Q5_1: _q5_1,
    Q8_0: _q8_0,
    Q4_K: _q4_k,
    Q5_K: _q5_k,
    Q6_K: _q6_k,
}


def dequantize(
    qweight: torch.Tensor,  # uint8 [N, row_bytes]  the rows as GGUF stores them
    qtype: int,
) -> torch.Tensor:  # float32 [N, K]
    """The float32 weights the blocks encode, exactly as llama.cpp's `dequantize_row_*` gives
    them (on any device: the ops are plain tensor ops)."""
    if qtype not in BLOCK_LAYOUTS:
        raise ValueError(f"GGUF type {qtype} is not one of {sorted(TYPE_NAMES.values())}")
    size = BLOCK_LAYOUTS[qtype][1]
    n = qweight.shape[0]
    blocks = qweight.reshape(-1, size)  # [N * K / block, type_size]
    return _DEQUANTIZE_BLOCKS[qtype](blocks).reshape(n, -1)
