"""Float16 linears on AMX-BF16 tiles, for CPUs that have AMX-BF16 but no float16 tile unit.

A pooling model runs in float16 by default (vLLM's rule: `resolve_pooling_dtype` in
minivllm/model/resolver.py), and its linears are nearly all of its time. On a Sapphire Rapids
Xeon (AVX512-FP16, AMX-BF16, no AMX-FP16) oneDNN multiplies float16 at float32's speed, while its
bfloat16 GEMM on the AMX tiles is an order of magnitude faster. `cpu_f16_amx_gemm.cpp` runs the
float16 GEMM there: each float16 is exactly the sum of two bfloat16 (hi, lo), and
x · Wᵀ = hi_x · hi_Wᵀ + hi_x · lo_Wᵀ + lo_x · hi_Wᵀ (+ lo_x · lo_Wᵀ, below 2^-16 of the product,
dropped), three tile products with exact bfloat16 products summed in float32: a float16 GEMM's
result within its own output rounding, at bfloat16's tile speed times three.

The weight is split and packed into the tiles' layout once, at load (`f16_amx_pack`); the layer
keeps its plain float16 weight beside it, which `forward_native` and `state_dict()` read (the pack
is twice its bytes: an encoder's few million weights). Only layers that never run a decode step
take it (`LinearBase.prefill_only`: an encoder's), since a decode step's few rows would pay for the
pack's bytes with nothing to reuse them for. The epilogue (bias, GELU, residual add) runs on the
float32 sums before the one rounding to float16, as oneDNN's post-ops do (minivllm/cpu/op_forwards.py
runs BERT's sublayer ends on it); BERT's post-LayerNorm after the residual add runs in the kernel
too, on each panel's float16 rows while they are in the writing thread's cache.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.cpu.build import load_cpu_kernels
from minivllm.envs import cpu_amx

# The kernel's activations (cpu_f16_amx_gemm.cpp `Activation`), by F.gelu's `approximate`.
ACTIVATIONS = {None: 0, "none": 1, "tanh": 2}
TILE_COLS, TILE_K = 16, 32  # a packed tile: 16 output columns by 32 inputs


@functools.cache
def f16_amx_available() -> bool:
    """Whether this process may run float16 GEMMs on AMX-BF16 tiles: an AVX-512 build on a CPU
    with AMX-BF16 and AVX512-BF16, whose tile registers Linux has granted (cpu_f16_amx_gemm.cpp)."""
    load_cpu_kernels()
    return bool(torch.ops.minivllm_cpu.f16_amx_available())


def f16_amx_applies(weight: torch.Tensor) -> bool:
    """Whether a prefill-only float16 linear runs on the tiles: where the CPU has AMX-BF16 but no
    AMX-FP16 (with AMX-FP16 oneDNN's own float16 GEMM uses the tiles), and `MINIVLLM_CPU_AMX` is
    not 0."""
    return (
        weight.dtype == torch.float16
        and weight.dim() == 2
        and cpu_amx()
        and not amx_fp16()
        and f16_amx_available()
    )


@functools.cache
def amx_fp16() -> bool:
    """Whether the CPU has AMX-FP16 (Granite Rapids): /proc/cpuinfo's `amx_fp16` flag."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_fp16" in line for line in f)
    except OSError:
        return False


def f16_amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """A float16 weight [N, K] split into bfloat16 hi and lo (hi + lo == weight, exactly) and laid
    out as the kernel's tiles: [N / 16, K / 32, 2 (hi, lo), 16, 32] bfloat16, N padded with zero
    rows to a multiple of 32 and K with zero columns to a multiple of 32; row r of a tile holds
    inputs 2r and 2r + 1 of each of its 16 columns, the order TDPBF16PS reads."""
    n, k = weight.shape
    n_pad, k_pad = -n % (2 * TILE_COLS), -k % TILE_K
    w = F.pad(weight.float(), (0, k_pad, 0, n_pad))  # [N', K']
    hi = w.to(torch.bfloat16)
    lo = (w - hi.float()).to(torch.bfloat16)  # exact: at most 3 bits remain below hi's 8

    def tiles(t: torch.Tensor) -> torch.Tensor:  # [N', K'] -> [N' / 16, K' / 32, 16, 16, 2]
        blocks = t.view(t.shape[0] // TILE_COLS, TILE_COLS, t.shape[1] // TILE_K, TILE_K // 2, 2)
        return blocks.permute(0, 2, 3, 1, 4)  # (column block, k step, input pair, column, 2)

    packed = torch.stack([tiles(hi), tiles(lo)], dim=2)  # [N'/16, K'/32, 2, 16, 16, 2]
    return packed.reshape(*packed.shape[:3], TILE_K // 2, 2 * TILE_COLS).contiguous()


def f16_amx_linear(
    x: torch.Tensor,  # [M, K] float16, rows contiguous
    packed: torch.Tensor,  # from f16_amx_pack: an [N, K] weight
    out_features: int,  # N
    bias: torch.Tensor | None = None,  # [N] float16
    residual: torch.Tensor | None = None,  # [M, N] float16
    activation: str | None = None,  # F.gelu's approximate ("none": erf, "tanh"), or None
    layer_norm: nn.LayerNorm | None = None,  # float16 weight and bias of [N]
) -> torch.Tensor:  # [M, N] float16, token-major
    """act(x · Wᵀ + bias) + residual, rounded once to float16, on AMX-BF16 tiles; then
    `layer_norm` of those rows if given (BERT's post-LayerNorm), by the thread that wrote them,
    while they are in its cache."""
    load_cpu_kernels()
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((x.shape[0], out_features), dtype=torch.float16)
    empty = x.new_empty(0)
    torch.ops.minivllm_cpu.f16_amx_linear(
        out,
        x,
        packed,
        empty if bias is None else bias,
        empty if residual is None else residual.contiguous(),
        ACTIVATIONS[activation],
        empty if layer_norm is None else layer_norm.weight,
        empty if layer_norm is None else layer_norm.bias,
        0.0 if layer_norm is None else layer_norm.eps,
    )
    return out


__all__ = ["f16_amx_applies", "f16_amx_available", "f16_amx_linear", "f16_amx_pack"]
