"""Python wrappers of the compiled CPU ops (`torch.ops.minivllm_cpu.*`), one function per op.

vLLM keeps these in `vllm/_custom_ops.py`: each wrapper allocates the output, then calls the C++
op, whose name and semantics are vLLM's where vLLM has one (`csrc/cpu/layernorm.cpp`,
`activation.cpp`, `pos_encoding.cpp`, `attention.cpp`, `cache.cpp`). They run on float32, bfloat16
and float16 CPU tensors and compute in float32:

- `rms_norm`, `fused_add_rms_norm` (`cpu_layernorm.cpp`), `silu_and_mul`, `rotary_embedding`
  (`cpu_activation_rope.cpp`): a decoder layer's elementwise formulas, one pass over memory each
  where plain PyTorch runs a chain of ops, each a full pass (RMSNorm alone is eight).
- `skinny_gemm` (`cpu_skinny_gemm.cpp`): x · Wᵀ for decode's few rows, streaming W once.
- `reshape_and_cache`, `paged_decode` (`cpu_attention.cpp`): the paged cache write and attention.
- `encoder_attention` (`cpu_encoder_attention.cpp`): an encoder's attention, each prompt of the
  step over its own rows, no cache.
- `lora_shrink`, `lora_expand` (`cpu_lora_punica.cpp`): Punica's batched LoRA ops, each row with
  its own adapter (minivllm/lora/punica.py is their specification); `add_lora_linear`: both, for
  every slice of one linear in one call, as the C++ decode loop runs them.
- `gguf_linear`, `gguf_dequantize` (`cpu_gguf_gemm.cpp`): x · Wᵀ with W kept in GGUF's quantized
  blocks (unpacked in registers, llama.cpp's `ggml_vec_dot_*` idea; on AVX2 builds, llama.cpp's
  8-bit integer dots, `cpu_gguf_gemm_avx2.cpp`), and W's float32 rows.

Two layouts. On the CPU fast path the model's linears may return (W · xᵀ)ᵀ, a transposed view
("feature-major": logically [T, N], stored as a contiguous [N, T], so `x.stride() == (1, T)`),
because MKL runs it faster (`minivllm/cpu/op_forwards.py`). `silu_and_mul`,
`fused_add_rms_norm`, `rotary_embedding` and the attention ops take that layout as it is and keep
it, as well as token-major rows: copying the linears' outputs to rows first cost more than the
fusion saved. `is_feature_major` says which one a tensor has.

The plain-PyTorch forms are their specification: each custom op's `forward_native` in
`minivllm/model/` (`RMSNorm`, `SiluAndMul`, `RotaryEmbedding`, the parallel linears) and the
reference attention backend; `tests/test_kernels_<source>.py` holds each source to its formula.
The library is built on first use by `build.py`; where it cannot be built, `load_cpu_kernels`
raises `CpuKernelUnavailable`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from minivllm.cpu.build import load_cpu_kernels, loaded_level
from minivllm.envs import cpu_amx

__all__ = [
    "GGUF_AMX_MIN_ROWS",
    "GGUF_AMX_TYPES",
    "GGUF_BLOCK_SIZES",
    "GGUF_DEQUANTIZE_CHUNK_BYTES",
    "GGUF_DEQUANTIZE_MIN_ROWS",
    "GGUF_KERNEL_TYPES",
    "SKINNY_GEMM_MAX_ROWS",
    "add_lora_linear",
    "encoder_attention",
    "fused_add_rms_norm",
    "gguf_dequantize",
    "gguf_dot_kind",
    "gguf_has_amx",
    "gguf_has_bf16_dot",
    "gguf_has_int8_dot",
    "gguf_linear",
    "gguf_linear_dequantized",
    "is_feature_major",
    "lora_expand",
    "lora_shrink",
    "paged_decode",
    "paged_decode_loops",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "skinny_gemm",
    "skinny_gemm_applies",
    "skinny_gemm_fast",
]

# The most token rows a linear sends to the skinny GEMM (`cpu_skinny_gemm.cpp`); above it MKL's
# packed GEMM is as fast or faster: the kernel's lead shrinks with the rows and is gone by 96
# (python benchmarks/skinny_gemm.py measures both over a model's layers).
SKINNY_GEMM_MAX_ROWS = 64
# The GGML types that `gguf_linear` and `gguf_dequantize` take (`int(gguf.GGMLQuantizationType.X)`),
# each with (weights per block, bytes per block) as in `gguf.GGML_QUANT_SIZES`: Q4_0, Q4_1, Q5_0,
# Q5_1, Q8_0 in blocks of 32, the K-quants Q4_K, Q5_K, Q6_K in blocks of 256. Others are refused.
GGUF_BLOCK_SIZES = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
                    12: (256, 144), 13: (256, 176), 14: (256, 210)}  # fmt: skip
GGUF_KERNEL_TYPES = frozenset(GGUF_BLOCK_SIZES)
# The row count from which dequantize-then-GEMM (`gguf_linear_dequantized`) beat the
# unpack-where-used tiles at Llama-3.2-1B's shapes: the dequantization is paid once per call and
# the GEMM library's blocking (oneDNN's AMX or AVX-512 bf16, MKL's float32) wins, where the tiles'
# cost per token row is fixed. A suggestion for MINIVLLM_CPU_GGUF_GEMM_ROWS (off by default: the
# GEMM's sums differ from the tiles', so rows would depend on the size of their step).
GGUF_DEQUANTIZE_MIN_ROWS = 256
# The float32 rows `gguf_linear_dequantized` holds at once: a bounded transient, whatever the weight.
GGUF_DEQUANTIZE_CHUNK_BYTES = 64 * 2**20


def is_feature_major(x: torch.Tensor) -> bool:  # x: [T, N]
    """Whether x is the transpose of a contiguous [N, T], as a CPU linear's output is, and not
    also token-major: a single token (or feature) is both, and counts as token-major."""
    return x.dim() == 2 and not x.is_contiguous() and x.t().is_contiguous()


def rms_norm(
    x: torch.Tensor,  # [T, hidden]  last dim contiguous, any row stride
    weight: torch.Tensor,  # [hidden]  x's dtype
    eps: float,
) -> torch.Tensor:  # [T, hidden]  new, contiguous
    """weight * (x * rsqrt(mean(x^2, -1) + eps)), rounded to x's dtype before the weight."""
    load_cpu_kernels()
    out = torch.empty(x.shape, dtype=x.dtype)
    torch.ops.minivllm_cpu.rms_norm(out, x, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,  # [T, hidden]  contiguous or feature-major; becomes rms_norm(x + residual)
    residual: torch.Tensor,  # [T, hidden]  contiguous; becomes x + residual
    weight: torch.Tensor,  # [hidden]  x's dtype
    eps: float,
) -> None:
    """In place: residual = x + residual, then x = rms_norm(residual, weight, eps).

    A decoder layer's `hidden + attn` followed by the next norm, in one pass over memory: `x` is
    the sublayer's output (a linear's, so feature-major on a CPU) and keeps its layout;
    `residual` is the stream that runs through the layers, always token-major.
    """
    load_cpu_kernels()
    torch.ops.minivllm_cpu.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(
    x: torch.Tensor,  # [T, 2 * d]  gate then up; token-major (any row stride) or feature-major
) -> torch.Tensor:  # [T, d]  new, in x's layout
    """silu(x[:, :d]) * x[:, d:]: the SwiGLU MLP's activation on the fused gate-up output."""
    load_cpu_kernels()
    t, d = x.shape[0], x.shape[1] // 2
    if is_feature_major(x):  # the output in the input's layout: a [T, d] view of a [d, T]
        out = torch.empty((d, t), dtype=x.dtype).t()
    else:
        out = torch.empty((t, d), dtype=x.dtype)
    torch.ops.minivllm_cpu.silu_and_mul(out, x)
    return out


def rotary_embedding(
    positions: torch.Tensor,  # int64 [T]
    x: torch.Tensor,  # [T, heads, head_dim]  strides (>= heads * head_dim, head_dim, 1), or
    # feature-major (1, head_dim * T, T): a view of a CPU linear's transposed qkv output
    cos_sin: torch.Tensor,  # float32 [2, max_positions, head_dim]  RotaryEmbedding.cos_sin
) -> None:
    """In place: x = x * cos + rotate_half(x) * sin at each token's position (NeoX-style RoPE).

    `x` may be the query-and-key part of the fused qkv output (a view whose rows are longer than
    heads * head_dim, or `qkv[:, :n].view(T, heads, head_dim)` of a feature-major qkv), so queries
    and keys turn in one call and nothing is copied.
    """
    load_cpu_kernels()
    torch.ops.minivllm_cpu.rotary_embedding(positions, x, cos_sin)


def skinny_gemm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `skinny_gemm` is the faster way to compute x · weightᵀ here: a few float32 rows on
    a CPU whose library was built with the kernel's AVX-512 path."""
    return (
        x.shape[0] <= SKINNY_GEMM_MAX_ROWS
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and skinny_gemm_fast()
    )


def skinny_gemm(
    x: torch.Tensor,  # [T, K]  float32, either layout
    weight: torch.Tensor,  # [N, K]  float32, contiguous
) -> torch.Tensor:  # [T, N]  new, token-major
    """x · weightᵀ, streaming the weight once for all T rows (decode's linears)."""
    load_cpu_kernels()
    if x.stride(-1) != 1:  # a linear's feature-major output: the kernel reads token rows
        x = x.contiguous()
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype)
    torch.ops.minivllm_cpu.skinny_gemm(out, x, weight)
    return out


@functools.cache
def skinny_gemm_fast() -> bool:
    """Whether the library was built with the skinny GEMM's AVX-512 path (else it calls at::mm)."""
    load_cpu_kernels()
    return bool(torch.ops.minivllm_cpu.skinny_gemm_fast())


def reshape_and_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]  any strides
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]  any strides
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [T]  block * block_size + offset; -1: skip the token
) -> None:
    """Write the new tokens' K and V into their cache slots, both caches in one call."""
    load_cpu_kernels()
    torch.ops.minivllm_cpu.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_decode(
    query: torch.Tensor,  # [T, num_heads, head_dim]  any strides
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [B, max_blocks]  one per row
    seq_lens: torch.Tensor,  # int32 [B]
    token_rows: torch.Tensor,  # int64 [B]  each work item's query row
    scale: float,
    out: torch.Tensor,  # float32 [T, num_heads, head_dim]  rows token_rows are written
    sliding_window: int | None = None,
    softcap: float = 0.0,
) -> None:
    """Attention of each row token_rows[b] over the first seq_lens[b] cached tokens of block table
    b: a decode row sees its whole context, a prompt row the prefix up to its own position; with a
    sliding window W, only the last W of them (the blocks before those are not read); with a
    softcap > 0, each score is first bounded to softcap * tanh(score / softcap) (Gemma 2)."""
    load_cpu_kernels()
    # The model's queries are a view of the fused qkv output, token-major or (a CPU linear's
    # transposed output) feature-major: the kernel takes their strides and reads them where they
    # are, one request's query at a time, rather than have them copied out first.
    if sliding_window is None and softcap == 0:
        torch.ops.minivllm_cpu.paged_decode(
            out, query, k_cache, v_cache, block_tables, seq_lens, token_rows, scale
        )
    else:
        torch.ops.minivllm_cpu.paged_decode_sliding(
            out, query, k_cache, v_cache, block_tables, seq_lens, token_rows, scale,
            sliding_window or 0, softcap,
        )  # fmt: skip


def encoder_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]  last dim contiguous, any row strides
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # int32 [B + 1]  prompt b owns rows [qsl[b], qsl[b + 1])
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]  query's dtype
    """Each row attends over every row of its own prompt (no mask, no cache), in float32."""
    load_cpu_kernels()
    out = torch.empty(query.shape, dtype=query.dtype)
    torch.ops.minivllm_cpu.encoder_attention(out, query, key, value, query_start_loc, scale)
    return out


def paged_decode_loops(query_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> str:
    """Which loops `paged_decode` runs for these dtypes and head size: "avx512" or "avx2" (the
    float32 loops written for the loaded library's instruction set, cpu_attention_avx512.cpp and
    cpu_attention_avx2.cpp: float32 queries over a float32 or bfloat16 cache, head sizes 32, 64
    and 128), else "portable" (cpu_attention.cpp's compiler-vectorized loops)."""
    load_cpu_kernels()
    return torch.ops.minivllm_cpu.paged_decode_loops(query_dtype, cache_dtype, head_dim)


def gguf_linear(
    x: torch.Tensor,  # [M, K]  float32, either layout
    qweight: torch.Tensor,  # uint8 [N, row_bytes]  GGUF's blocks of N rows of K weights, contiguous
    qtype: int,  # the GGML type number, one of GGUF_KERNEL_TYPES
    dot: str = "float32",  # "float32" products, "bf16" or "int8" ones (gguf_has_*_dot() only)
) -> torch.Tensor:  # [M, N]  float32, new, token-major
    """x · dequantize(qweight)ᵀ without a float32 copy of the weight: each block is unpacked where
    it is used, and at decode's few rows the weight's bytes stream from memory once. With
    dot="bf16" the unpacked weights and x are rounded to bf16 and multiplied 32 pairs an
    instruction (cpu_gguf_gemm_bf16.cpp): twice the products a cycle, within 2^-8 · (|x| · |W|ᵀ).
    With dot="int8" x is rounded to 8-bit blocks and multiplied by 8-bit integer dots, as the AVX2
    build's own product (cpu_gguf_gemm_avx2.cpp; on AVX-512 builds with AVX512-VNNI's dots, and
    for prefill-sized calls of the K-quants and Q4_0 to Q5_1 on AMX tiles, `gguf_amx_applies`,
    with the same outputs bit for bit)."""
    load_cpu_kernels()
    if x.stride(-1) != 1:  # a linear's feature-major output: the kernel reads token rows
        x = x.contiguous()
    out = torch.empty((x.shape[0], qweight.shape[0]), dtype=torch.float32)
    if dot == "bf16":
        torch.ops.minivllm_cpu.gguf_linear_bf16(out, x, qweight, qtype)
    elif dot == "float32":
        torch.ops.minivllm_cpu.gguf_linear(out, x, qweight, qtype)
    elif dot == "int8" and gguf_amx_applies(x.shape[0], qtype):
        torch.ops.minivllm_cpu.gguf_linear_amx(out, x, qweight, qtype)
    elif dot == "int8":
        torch.ops.minivllm_cpu.gguf_linear_int8(out, x, qweight, qtype)
    else:
        raise ValueError(f"gguf_linear: dot must be 'float32', 'bf16' or 'int8', got {dot!r}")
    return out


# The types with an AMX kernel (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: not Q8_0, whose VNNI
# kernel is its own), and the fewest token rows it takes: a tile is 16 tokens, and below that the
# VNNI kernel's in-register tiles cost less than a padded AMX tile.
# The C++ decode loop takes the same bound (cpu_decode_layers.cpp `kAmxMinRows`).
GGUF_AMX_TYPES = frozenset({2, 3, 6, 7, 12, 13, 14})
GGUF_AMX_MIN_ROWS = 16


@functools.cache
def gguf_has_amx() -> bool:
    """Whether the int8 product may run on AMX tiles: an AVX-512 build on a CPU with AMX-INT8,
    whose tile registers Linux has granted to this process (cpu_gguf_amx.cpp)."""
    load_cpu_kernels()
    return bool(torch.ops.minivllm_cpu.gguf_has_amx())


def gguf_amx_applies(rows: int, qtype: int) -> bool:
    """Whether `gguf_linear(dot="int8")` runs these `rows` of a `qtype` weight on AMX tiles:
    16 or more rows of the K-quants or the 32-weight types but Q8_0 (prefills, and decode steps
    of many requests), where the CPU has AMX and `MINIVLLM_CPU_AMX` is not 0.
    The outputs are the AVX512-VNNI kernel's bit for bit either way; only the speed differs."""
    return rows >= GGUF_AMX_MIN_ROWS and qtype in GGUF_AMX_TYPES and cpu_amx() and gguf_has_amx()


def gguf_dot_kind() -> str:
    """The products `gguf_linear(dot="float32")` takes in this build of the library: "int8" on AVX2
    builds (x rounded to 8-bit blocks, within (max|x_block| / 127) / 2 · |W| of float32's; see
    cpu_gguf_gemm_avx2.cpp), "float32" on AVX-512 and portable ones."""
    load_cpu_kernels()
    return str(torch.ops.minivllm_cpu.gguf_dot_kind())


def gguf_linear_dequantized(
    x: torch.Tensor,  # [M, K]  float32, either layout
    qweight: torch.Tensor,  # uint8 [N, row_bytes]  GGUF's blocks, contiguous
    qtype: int,  # one of GGUF_KERNEL_TYPES
    dot: str = "float32",  # "float32", or "bf16": x and the weights rounded to bf16 first
) -> torch.Tensor:  # [M, N]  float32, new, token-major
    """x · dequantize(qweight)ᵀ for many token rows: the weight dequantized a chunk of rows at a
    time (GGUF_DEQUANTIZE_CHUNK_BYTES of float32) and each chunk multiplied by PyTorch's GEMM. With
    dot="bf16" the operands are rounded to bf16, as gguf_linear's bf16 dot rounds them, and the
    GEMM's output too: within (2^-8 + 2^-9 + K · 2^-24) · (|x| · |W|ᵀ)."""
    if dot not in ("float32", "bf16"):
        raise ValueError(f"gguf_linear_dequantized: dot must be 'float32' or 'bf16', got {dot!r}")
    x = x.contiguous()
    rows = max(1, GGUF_DEQUANTIZE_CHUNK_BYTES // (4 * x.shape[1]))
    xd = x.to(torch.bfloat16) if dot == "bf16" else x
    out = torch.empty((x.shape[0], qweight.shape[0]), dtype=torch.float32)
    for n0 in range(0, qweight.shape[0], rows):
        w = gguf_dequantize(qweight[n0 : n0 + rows], qtype)  # [rows, K] float32
        out[:, n0 : n0 + w.shape[0]] = torch.mm(xd, w.to(xd.dtype).t())
    return out


def gguf_has_bf16_dot() -> bool:
    """Whether gguf_linear's bf16 dot may run: this CPU has AVX512-BF16, the library was built
    with it, and the process's instruction-set level allows it (`MINIVLLM_CPU_ISA`)."""
    return loaded_level().bf16_dot and bool(torch.ops.minivllm_cpu.gguf_has_bf16_dot())


def gguf_has_int8_dot() -> bool:
    """Whether gguf_linear's int8 dot may run: an AVX2 build (where it is also the "float32"
    product), or an AVX-512 build on a CPU with AVX512-VNNI."""
    load_cpu_kernels()
    return bool(torch.ops.minivllm_cpu.gguf_has_int8_dot())


def gguf_dequantize(
    qweight: torch.Tensor,  # uint8 [N, row_bytes]  contiguous (an embedding's gathered rows)
    qtype: int,  # the GGML type number, one of GGUF_KERNEL_TYPES
) -> torch.Tensor:  # [N, K]  float32, new; bit for bit gguf.quants.dequantize's
    """The float32 weights of GGUF's blocks, K = row_bytes / type_size * block_size."""
    load_cpu_kernels()
    block_size, type_size = GGUF_BLOCK_SIZES.get(qtype, (1, 1))  # the op refuses unknown types
    k = qweight.shape[-1] // type_size * block_size
    out = torch.empty((qweight.shape[0], k), dtype=torch.float32)
    torch.ops.minivllm_cpu.gguf_dequantize(out, qweight, qtype)
    return out


def lora_shrink(
    x: torch.Tensor,  # [T, in]  either layout
    lora_a: torch.Tensor,  # [L, R, in]  contiguous, x's dtype
    token_slots: torch.Tensor,  # int64 [T]  each row's slot, -1 for none
) -> torch.Tensor:  # [T, R]  new, contiguous
    """y = x · A[slot]ᵀ per row, zero for a row without an adapter (punica.shrink)."""
    load_cpu_kernels()
    if x.stride(-1) != 1:  # a linear's feature-major output: the kernel reads token rows
        x = x.contiguous()
    y = torch.empty((x.shape[0], lora_a.shape[1]), dtype=x.dtype)
    torch.ops.minivllm_cpu.lora_shrink(y, x, lora_a, token_slots)
    return y


def lora_expand(
    out: torch.Tensor,  # [T, out_total]  any strides, added to in place
    y: torch.Tensor,  # [T, R]  contiguous: lora_shrink's result
    lora_b: torch.Tensor,  # [L, out_i, R]  contiguous
    token_slots: torch.Tensor,  # int64 [T]
    scales: torch.Tensor,  # [L]
    offset: int = 0,  # where this slice's out_i columns start in `out`
) -> None:
    """out[:, offset : offset + out_i] += (y · B[slot]ᵀ) · scale[slot] per row; rows of slot -1
    untouched (punica.expand)."""
    load_cpu_kernels()
    torch.ops.minivllm_cpu.lora_expand(out, y, lora_b, token_slots, scales, offset)


def add_lora_linear(
    out: torch.Tensor,  # [T, sum(out_i)]  any strides, added to in place
    x: torch.Tensor,  # [T, in]  either layout
    lora_a: Sequence[torch.Tensor],  # per slice: [L, R, in]  contiguous, x's dtype
    lora_b: Sequence[torch.Tensor],  # per slice: [L, out_i, R]  contiguous
    token_slots: torch.Tensor,  # int64 [T]
    scales: torch.Tensor,  # [L]
) -> None:
    """Every slice's `lora_shrink` then `lora_expand`, slice i's columns after slice i - 1's, bit
    for bit (vLLM's `add_lora_linear`): one call for a packed q|k|v or gate|up linear."""
    load_cpu_kernels()
    if x.stride(-1) != 1:  # a linear's feature-major output: the kernel reads token rows
        x = x.contiguous()
    torch.ops.minivllm_cpu.add_lora_linear(out, x, list(lora_a), list(lora_b), token_slots, scales)
