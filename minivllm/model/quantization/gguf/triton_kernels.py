"""A Triton GEMM over GGUF's quantized blocks, `x @ dequant(qweight)^T`, dequantized per tile.

vLLM serves GGUF checkpoints without expanding them (vllm/model_executor/layers/quantization/
gguf.py and csrc/quantization/gguf/): the weight stays in memory as llama.cpp's blocks, and the
matmul kernel turns the bytes of one tile into floats in registers just before it multiplies
them. This is the same idea in Triton. The weight is read from memory once, at its packed size
(4.5 to 8.5 bits a weight instead of 16 or 32), and a dequantized copy of it never exists.

The weight is a torch.uint8 tensor `[N, row_bytes]`, the bytes GGUF stores for N rows of K
weights: `row_bytes = K // block_size * type_size`. Each row is a run of blocks; the layouts below
are llama.cpp's structs (ggml-common.h), drawn as byte offsets inside one block. `d`, `m`, `dmin`
are little-endian float16, assembled from their two bytes and bitcast inside the kernel; `q` is a
weight's unsigned integer code.

    Q4_0  32 weights, 18 bytes           w = d * (q - 8)
          [0:2) d   [2:18) qs: byte i = weight i (low nibble), weight i + 16 (high nibble)
    Q4_1  32 weights, 20 bytes           w = d * q + m
          [0:2) d   [2:4) m   [4:20) qs as in Q4_0
    Q5_0  32 weights, 22 bytes           w = d * (q - 16),  q = nibble | fifth bit << 4
          [0:2) d   [2:6) qh: bit i (of the little-endian uint32) = weight i's fifth bit
          [6:22) qs as in Q4_0
    Q5_1  32 weights, 24 bytes           w = d * q + m
          [0:2) d   [2:4) m   [4:8) qh as in Q5_0   [8:24) qs as in Q4_0
    Q8_0  32 weights, 34 bytes           w = d * q,  q an int8
          [0:2) d   [2:34) qs: byte i = weight i

The K-quants group 256 weights in a super-block of sub-blocks, each with a 6- or 8-bit scale that
multiplies the super-block's float16 `d`:

    Q4_K  256 weights, 144 bytes, 8 sub-blocks of 32 (s = j // 32 for weight j)
          w = d * sc[s] * q - dmin * mn[s]
          [0:2) d   [2:4) dmin
          [4:16) scales: eight 6-bit (sc, mn) pairs in 12 bytes; for t = s % 4:
                 byte t      bits 0-5 sc[t],        bits 6-7: bits 4-5 of sc[t + 4]
                 byte 4 + t  bits 0-5 mn[t],        bits 6-7: bits 4-5 of mn[t + 4]
                 byte 8 + t  bits 0-3 of sc[t + 4], bits 4-7: bits 0-3 of mn[t + 4]
          [16:144) qs: byte 32c + i = weight 64c + i (low nibble), weight 64c + 32 + i (high)
    Q5_K  256 weights, 176 bytes         as Q4_K,  q = nibble | fifth bit << 4
          [0:2) d   [2:4) dmin   [4:16) scales as in Q4_K
          [16:48) qh: bit s of byte i = fifth bit of weight 32s + i
          [48:176) qs as in Q4_K
    Q6_K  256 weights, 210 bytes, 16 sub-blocks of 16 (s = j // 16)
          w = d * sc[s] * (q - 32),  q = 4 low bits | 2 high bits << 4
          [0:128) ql: in half h (weights 128h ..), byte 64h + i = weight 128h + i (low nibble),
                  weight 128h + 64 + i (high nibble)
          [128:192) qh: byte 128 + 32h + i, bits 2t..2t+1 = high bits of weight 128h + 32t + i
          [192:208) sc: int8, one per sub-block   [208:210) d

Tiling. One program computes a `[BLOCK_M, BLOCK_N]` tile of the output and walks K in steps of
`BLOCK_K` weights, as any Triton GEMM does; the only new step is that each `[BLOCK_K, BLOCK_N]`
tile of W^T is built from bytes rather than loaded as floats. Every weight of the tile finds its
own bytes by address arithmetic (its block `k // block_size`, its index `j` in the block, then the
offsets drawn above), which is the GPTQ Triton kernels' trick of loading a packed word once per
weight and shifting it: a byte shared by two nibbles, or a scale shared by 32 weights, is loaded
by each of them, and the repeated addresses of one tile are served by the L1 cache, not by memory.
That keeps each type's dequantization a few lines that read against its picture, and gives
`tl.dot` a plain 2-D tile. Since every weight finds its block itself, a tile need not line up with
the blocks; `BLOCK_K` is a multiple of 32 all the same, so that a tile holds whole blocks and no
block's scale is fetched by two tiles. The tile sizes for a GPU follow M (`gguf_tiles`): a decode
step (M of a few rows) is bound by reading the weight and wants many programs along N, while a
prefill (M in the hundreds) reuses each dequantized tile across more rows of x. M itself changes
every step, so it is passed at run time and exempt from Triton's value specialisation: each type
and dtype compiles two variants (decode-sized M and larger), not one per batch size.

Precision: the weights are dequantized to float32 and the products accumulate in float32. With
float32 x the dot runs in IEEE float32 (no TF32), so the result matches the dequantize-then-matmul
reference up to summation order. With bfloat16/float16 x on a GPU, the weight tile is rounded to
x's dtype for the tensor cores (as vLLM's kernels dequantize to the activation dtype); in the
interpreter, which keeps bfloat16 as raw bits, x is widened to float32 instead.

Without CUDA the kernel runs on CPU tensors in Triton's interpreter (slowly: it is for tests);
importing this module turns the interpreter on when CUDA is absent and `TRITON_INTERPRET` is unset,
as `minivllm.attention.backends.triton` does.
"""

from __future__ import annotations

import contextlib
import os

import gguf
import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    # Triton decides per kernel, when `@triton.jit` runs, whether it is interpreted or compiled.
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton
    import triton.language as tl
except ImportError as e:
    raise ImportError('the Triton GGUF kernels need Triton: pip install "minivllm[triton]"') from e

# GGML type numbers (gguf.GGMLQuantizationType): constexprs, so the kernel branches at compile time.
Q4_0 = tl.constexpr(2)
Q4_1 = tl.constexpr(3)
Q5_0 = tl.constexpr(6)
Q5_1 = tl.constexpr(7)
Q8_0 = tl.constexpr(8)
Q4_K = tl.constexpr(12)
Q5_K = tl.constexpr(13)
Q6_K = tl.constexpr(14)

# The GGML types `gguf_linear_triton` multiplies by.
TRITON_GGUF_TYPES: frozenset[int] = frozenset(
    t.value for t in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
)

# =============================================================================== byte readers


@triton.jit
def _u8(ptr, mask):
    """The byte at each address, as int32 (so that shifts and ors cannot overflow a byte)."""
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _i8(ptr, mask):
    """The byte at each address read as a signed int8, as float32."""
    return tl.load(ptr, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _f16(ptr, mask):
    """The little-endian float16 at each address (two bytes), as float32.

    Masked lanes read 0x0000, i.e. 0.0, so a weight past the edge of the matrix dequantizes to 0.
    """
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


# ====================================================================== one type per function
# Each takes `blk`, the address of the block that holds each weight of the tile ([BLOCK_K, BLOCK_N]
# uint8 pointers), `j`, the weight's index in that block ([BLOCK_K, 1]), and the tile's mask, and
# returns the weights as float32 [BLOCK_K, BLOCK_N]. The offsets are those drawn in the docstring.


@triton.jit
def _nibble(qs_ptr, j, mask):
    """Q4_0's packing, shared by all the 32-weight types: weight j < 16 low, j + 16 high nibble."""
    return (_u8(qs_ptr + j % 16, mask) >> ((j // 16) * 4)) & 0xF


@triton.jit
def _fifth_bit(qh_ptr, j, mask):
    """Bit j of the 4-byte little-endian qh of Q5_0 / Q5_1."""
    return (_u8(qh_ptr + j // 8, mask) >> (j % 8)) & 1


@triton.jit
def _dequant_q4_0(blk, j, mask):
    q = _nibble(blk + 2, j, mask)
    return _f16(blk, mask) * (q - 8).to(tl.float32)


@triton.jit
def _dequant_q4_1(blk, j, mask):
    q = _nibble(blk + 4, j, mask)
    return _f16(blk, mask) * q.to(tl.float32) + _f16(blk + 2, mask)


@triton.jit
def _dequant_q5_0(blk, j, mask):
    q = _nibble(blk + 6, j, mask) | (_fifth_bit(blk + 2, j, mask) << 4)
    return _f16(blk, mask) * (q - 16).to(tl.float32)


@triton.jit
def _dequant_q5_1(blk, j, mask):
    q = _nibble(blk + 8, j, mask) | (_fifth_bit(blk + 4, j, mask) << 4)
    return _f16(blk, mask) * q.to(tl.float32) + _f16(blk + 2, mask)


@triton.jit
def _dequant_q8_0(blk, j, mask):
    return _f16(blk, mask) * _i8(blk + 2 + j, mask)


@triton.jit
def _k4_scale_min(scales_ptr, s, mask):
    """Sub-block s's 6-bit scale and min from the 12 packed bytes of Q4_K / Q5_K, as float32."""
    t = s % 4
    lo = _u8(scales_ptr + t, mask)  # sc[t], and bits 4-5 of sc[t + 4]
    mid = _u8(scales_ptr + 4 + t, mask)  # mn[t], and bits 4-5 of mn[t + 4]
    hi = _u8(scales_ptr + 8 + t, mask)  # bits 0-3 of sc[t + 4] and of mn[t + 4]
    first = s < 4
    sc = tl.where(first, lo & 63, (hi & 0xF) | ((lo >> 6) << 4))
    mn = tl.where(first, mid & 63, (hi >> 4) | ((mid >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _k4_nibble(qs_ptr, j, mask):
    """Q4_K / Q5_K's packing: byte 32c + i holds weights 64c + i (low) and 64c + 32 + i (high)."""
    return (_u8(qs_ptr + 32 * (j // 64) + j % 32, mask) >> (4 * ((j // 32) % 2))) & 0xF


@triton.jit
def _dequant_q4_k(blk, j, mask):
    sc, mn = _k4_scale_min(blk + 4, j // 32, mask)
    q = _k4_nibble(blk + 16, j, mask)
    return _f16(blk, mask) * sc * q.to(tl.float32) - _f16(blk + 2, mask) * mn


@triton.jit
def _dequant_q5_k(blk, j, mask):
    sc, mn = _k4_scale_min(blk + 4, j // 32, mask)
    fifth = (_u8(blk + 16 + j % 32, mask) >> (j // 32)) & 1
    q = _k4_nibble(blk + 48, j, mask) | (fifth << 4)
    return _f16(blk, mask) * sc * q.to(tl.float32) - _f16(blk + 2, mask) * mn


@triton.jit
def _dequant_q6_k(blk, j, mask):
    half = j // 128
    r = j % 128  # the weight's place in its half
    low = (_u8(blk + 64 * half + r % 64, mask) >> (4 * (r // 64))) & 0xF
    high = (_u8(blk + 128 + 32 * half + r % 32, mask) >> (2 * (r // 32))) & 3
    q = low | (high << 4)
    return _f16(blk + 208, mask) * _i8(blk + 192 + j // 16, mask) * (q - 32).to(tl.float32)


@triton.jit
def _dequant(blk, j, mask, QTYPE: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton ABI
    """The weights of one tile, by type: a compile-time branch, so each type is its own kernel."""
    if QTYPE == Q4_0:
        w = _dequant_q4_0(blk, j, mask)
    elif QTYPE == Q4_1:
        w = _dequant_q4_1(blk, j, mask)
    elif QTYPE == Q5_0:
        w = _dequant_q5_0(blk, j, mask)
    elif QTYPE == Q5_1:
        w = _dequant_q5_1(blk, j, mask)
    elif QTYPE == Q8_0:
        w = _dequant_q8_0(blk, j, mask)
    elif QTYPE == Q4_K:
        w = _dequant_q4_k(blk, j, mask)
    elif QTYPE == Q5_K:
        w = _dequant_q5_k(blk, j, mask)
    else:
        tl.static_assert(QTYPE == Q6_K, "unsupported GGML type")
        w = _dequant_q6_k(blk, j, mask)
    return w


# ======================================================================================= GEMM


@triton.jit(do_not_specialize=["M"])
def gguf_linear_kernel(  # type: ignore[no-untyped-def]  # Triton's untyped kernel ABI
    x_ptr,  # [M, K] float32 / bfloat16 / float16, K contiguous
    w_ptr,  # uint8 [N, row_bytes], C-contiguous: GGUF's blocks
    out_ptr,  # [M, N], N contiguous
    M,
    N,
    K,
    row_bytes,
    stride_xm,
    stride_om,
    QTYPE: tl.constexpr,
    QBLOCK: tl.constexpr,  # weights per block (32, or 256 for the K-quants)
    QBYTES: tl.constexpr,  # bytes per block
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_16BIT: tl.constexpr,  # x is 16-bit and the dot runs in it (GPU); else in float32
):
    """out[m, n] = sum_k x[m, k] * W[n, k], one [BLOCK_M, BLOCK_N] tile per program."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # int64 row offsets: an LM head of 256k rows of 8 KiB passes 2**31 bytes.
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :] * row_bytes  # [1, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        # W^T's tile: weight k of row n is weight k % QBLOCK of the row's block k // QBLOCK.
        blk = w_rows + (offs_k // QBLOCK * QBYTES)[:, None]  # [BLOCK_K, BLOCK_N] uint8 pointers
        j = (offs_k % QBLOCK)[:, None]  # [BLOCK_K, 1]
        w = _dequant(blk, j, k_mask[:, None] & n_mask[None, :], QTYPE)  # [BLOCK_K, BLOCK_N] fp32
        if DOT_16BIT:
            acc = tl.dot(x, w.to(x.dtype), acc)
        else:
            acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# True when the kernel above was decorated under Triton's interpreter (it runs on CPU tensors).
INTERPRETED = not isinstance(gguf_linear_kernel, triton.runtime.jit.JITFunction)

# ===================================================================================== launch


def gguf_tiles(
    num_rows: int, dtype: torch.dtype, interpreted: bool = INTERPRETED
) -> dict[str, int]:
    """Tile sizes and warps for a launch with `num_rows` rows of x of `dtype`.

    `tl.dot` needs every tile dimension >= 16. The interpreter runs one program at a time, each op
    on a whole tile at numpy speed, so there the tiles are large: fewer programs, fewer ops. On a
    GPU, a few rows (decode) make the launch a stream over the weight: narrow N tiles give enough
    programs to occupy every SM, and a long K tile keeps many loads in flight. Many rows (prefill)
    reuse each dequantized tile over 64 rows of x. float32 dots run on the FMA units, which hold
    their operands in registers, so float32 gets shorter K tiles (or more warps). Every type
    compiles with these sizes for sm_90 without spilling registers
    (test_every_type_compiles_for_sm90_without_spills holds it); larger K tiles spilled.
    """
    if interpreted:
        block_m = min(64, max(16, triton.next_power_of_2(num_rows)))
        return {"BLOCK_M": block_m, "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4}
    fp32 = dtype == torch.float32
    if num_rows <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64 if fp32 else 128, "num_warps": 4}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 8 if fp32 else 4}


def gguf_linear_triton(
    x: torch.Tensor, qweight: torch.Tensor, qtype: int, tiles: dict[str, int] | None = None
) -> torch.Tensor:
    """`x @ dequantize(qweight, qtype).T` without dequantizing the weight into memory.

    x: [M, K] float32 (or bfloat16 / float16); qweight: uint8 [N, row_bytes], GGUF's blocks of
    type `qtype` (a GGML type number in TRITON_GGUF_TYPES). Returns [M, N] in x's dtype.
    `tiles` overrides `gguf_tiles` (the tests run a GPU's tiles in the interpreter).
    """
    _check_inputs(x, qweight, qtype)
    num_rows, k = x.shape
    n = qweight.shape[0]
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    if x.stride(-1) != 1:
        x = x.contiguous()
    # The interpreter's float32 -> bfloat16 cast truncates (a GPU rounds to nearest); there the
    # kernel writes float32 and torch rounds, as the attention backend does.
    out_dtype = torch.float32 if INTERPRETED else x.dtype
    out = torch.empty((num_rows, n), dtype=out_dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out.to(x.dtype)
    tiles = tiles or gguf_tiles(num_rows, x.dtype)
    grid = (triton.cdiv(num_rows, tiles["BLOCK_M"]), triton.cdiv(n, tiles["BLOCK_N"]))
    guard = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
    with guard:  # Triton launches on the current CUDA device, which may not be x's
        gguf_linear_kernel[grid](
            x, qweight, out, num_rows, n, k, qweight.shape[1], x.stride(0), out.stride(0),
            QTYPE=int(qtype), QBLOCK=block_size, QBYTES=type_size,
            DOT_16BIT=x.dtype != torch.float32 and not INTERPRETED, **tiles,
        )  # fmt: skip
    return out.to(x.dtype)


def _check_inputs(x: torch.Tensor, qweight: torch.Tensor, qtype: int) -> None:
    """What the kernel assumes and would otherwise get silently wrong (or fault the GPU on)."""
    if qtype not in TRITON_GGUF_TYPES:
        names = ", ".join(gguf.GGMLQuantizationType(t).name for t in sorted(TRITON_GGUF_TYPES))
        raise ValueError(f"GGML type {qtype} has no Triton kernel; supported: {names}")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or not qweight.is_contiguous():
        raise ValueError(
            "qweight must be a C-contiguous uint8 [N, row_bytes] tensor, got "
            f"{qweight.dtype} of shape {tuple(qweight.shape)} strides {qweight.stride()}"
        )
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"x must be a float32/bfloat16/float16 [M, K] tensor, got {x.dtype} of shape "
            f"{tuple(x.shape)}"
        )
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    k = x.shape[1]
    if k % block_size or qweight.shape[1] != k // block_size * type_size:
        raise ValueError(
            f"{gguf.GGMLQuantizationType(qtype).name} rows of {k} weights need K a multiple of "
            f"{block_size} and {k // block_size * type_size} bytes, got {qweight.shape[1]}"
        )
    if x.device != qweight.device:
        raise ValueError(f"x is on {x.device} and qweight on {qweight.device}")
    if not INTERPRETED and not x.is_cuda:
        raise ValueError("the compiled Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1)")


__all__ = [
    "INTERPRETED",
    "TRITON_GGUF_TYPES",
    "gguf_linear_kernel",
    "gguf_linear_triton",
    "gguf_tiles",
]
