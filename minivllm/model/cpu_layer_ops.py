"""Fused CPU layer ops: RMSNorm, residual add + RMSNorm, SiLU-and-mul and RoPE in one pass each.

Between a decoder layer's matmuls, plain PyTorch runs each formula as a chain of elementwise ops,
each one a full pass over the activation (RMSNorm alone is eight). These wrappers call the C++ ops
of `minivllm/model/cpu_norm_kernels.cpp` and `cpu_layer_kernels.cpp`, which read each input once
and write each output once, the way vLLM's CPU backend does (`csrc/cpu/layernorm.cpp`,
`activation.cpp`, `pos_encoding.cpp`; the names and semantics here are vLLM's custom ops'). They
run on float32, bfloat16 and float16 CPU tensors and compute in float32.

Two layouts. On a CPU the model's linears return (W · xᵀ)ᵀ, a transposed view ("feature-major":
logically [T, N], stored as a contiguous [N, T], so `x.stride() == (1, T)`), because MKL runs it
faster (`minivllm/model/parallel_layers.py`). `silu_and_mul`, `fused_add_rms_norm` and
`rotary_embedding` take that layout as it is and keep it, as well as token-major rows: copying
the linears' outputs to rows first cost more than the fusion saved. `is_feature_major` says
which one a tensor has.

The plain-PyTorch forms are their specification: `RMSNorm` and `LlamaMLP` in
`minivllm/model/llama.py`, `RotaryEmbedding.forward_native` in `minivllm/model/rope.py`;
`tests/test_cpu_layer_kernels.py` holds each op equal to its formula. The library is built on
first use by `minivllm/attention/cpu_build.py` (together with the paged decode kernel); where it
cannot be built, `load_cpu_kernels` raises `CpuKernelUnavailable` and the caller keeps the plain
forms. See docs/architecture.md for where the layer sits in a step.
"""

from __future__ import annotations

import functools

import torch

from minivllm.attention.cpu_build import load_cpu_kernels

__all__ = [
    "SKINNY_GEMM_MAX_ROWS",
    "fused_add_rms_norm",
    "is_feature_major",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "skinny_gemm",
    "skinny_gemm_applies",
    "skinny_gemm_fast",
]

# The most token rows a linear sends to the skinny GEMM (`cpu_gemm_kernels.cpp`); above it MKL's
# packed GEMM is as fast or faster (measured over SmolLM2's 30 layers on 2 cores: the kernel is
# 1.2x faster at 32 rows, 1.1x at 64, 0.96x at 96; python -m minivllm.benchmarks.skinny_gemm).
SKINNY_GEMM_MAX_ROWS = 64


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
