"""Punica's shrink and expand as Triton kernels: one launch per op, every adapter of the batch.

vLLM v1's `vllm/lora/ops/triton_ops/lora_shrink_op.py` and `lora_expand_op.py`, reduced to their
idea. Before a launch the rows are grouped by slot (`LoRAKernelMeta` in vLLM, `slot_groups`
here): the row indices sorted by slot, and where each slot's run of them starts and how long it
is. The grid is then

    (row blocks x output blocks,  slots)        axis 0: pid -> (m, n);  axis 1: the slot

and a program takes rows [m * BLOCK_M, (m + 1) * BLOCK_M) of its slot's run, so every row of its
tile has the same adapter and one tile of A (or B) serves them all through `tl.dot`, as a
GEMM's does. A program past the end of its slot's run returns at once; rows of slot -1 belong to
no run, so no program touches them. vLLM adds a third axis for the slices of a packed q|k|v or
gate|up (their A and B reached through a tensor of pointers) and a split-K for shrink; here a
slice is one launch (the wrappers call the op per slice), which keeps the kernels' arguments plain
tensors.

    shrink  y[rows, n]          = Σ_k x[rows, k] · A[s, n, k]            x [T, in], A [L, R, in]
    expand  out[rows, off + n] += (Σ_r y[rows, r] · B[s, n, r]) · scale[s]   B [L, N, R]

Products accumulate in float32; the result is rounded once to the output's dtype (the reference
also rounds the product before scaling it in bfloat16). minivllm/lora/punica.py is the
specification: tests/lora/test_kernels_triton_punica.py holds the kernels to it in Triton's
interpreter on small shapes (float32), which this module turns on when CUDA is absent, as
minivllm/attention/backends/triton.py does.
"""

from __future__ import annotations

import contextlib
import os

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    # Triton decides per kernel, when `@triton.jit` runs, whether it is interpreted or compiled.
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton
    import triton.language as tl
except ImportError as e:
    raise ImportError('the Triton LoRA kernels need Triton: pip install "minivllm[triton]"') from e

# Row and output tiles: 16 is tl.dot's smallest side on a GPU; a LoRA rank (R <= 512) is one tile
# of expand's reduction, padded to a power of two.
BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


def slot_groups(
    token_slots: torch.Tensor,  # int64 [T]  -1: no adapter
    num_slots: int,  # L
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows sorted by slot [T], each slot's first place in them [L], its number of rows [L]);
    rows of slot -1 sort first and belong to no slot."""
    order = torch.argsort(token_slots, stable=True)
    counts = torch.bincount(token_slots + 1, minlength=num_slots + 1)  # [L + 1], -1 first
    starts = torch.cumsum(counts, 0) - counts
    return order, starts[1:].contiguous(), counts[1:].contiguous()


@triton.jit
def lora_shrink_kernel(  # type: ignore[no-untyped-def]  # Triton's untyped kernel ABI
    x_ptr, a_ptr, y_ptr,  # x [T, K], A [L, R, K] contiguous, y [T, R] contiguous
    rows_ptr, start_ptr, count_ptr,  # slot_groups
    R, K, stride_x,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(1)
    blocks_n = tl.cdiv(R, BLOCK_N)
    m, n = tl.program_id(0) // blocks_n, tl.program_id(0) % blocks_n
    count = tl.load(count_ptr + slot)
    if m * BLOCK_M >= count:  # past this slot's rows (or none of them)
        return
    start = tl.load(start_ptr + slot)
    offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < count
    rows = tl.load(rows_ptr + start + offs_m, mask=row_ok, other=0)  # [BLOCK_M] row indices
    offs_n = n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_slot = a_ptr + slot.to(tl.int64) * R * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + k[None, :],
            mask=row_ok[:, None] & (k[None, :] < K),
            other=0.0,
        ).to(tl.float32)  # [BLOCK_M, BLOCK_K]
        a_t = tl.load(
            a_slot + offs_n[None, :] * K + k[:, None],
            mask=(offs_n[None, :] < R) & (k[:, None] < K),
            other=0.0,
        ).to(tl.float32)  # [BLOCK_K, BLOCK_N]: A[slot]ᵀ's tile
        acc += tl.dot(x, a_t, input_precision="ieee")
    tl.store(
        y_ptr + rows[:, None] * R + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (offs_n[None, :] < R),
    )


@triton.jit
def lora_expand_kernel(  # type: ignore[no-untyped-def]  # Triton's untyped kernel ABI
    y_ptr, b_ptr, scale_ptr, out_ptr,  # y [T, R], B [L, N, R] contiguous, scales [L], out [T, *]
    rows_ptr, start_ptr, count_ptr,  # slot_groups
    N, R, stride_out_t, stride_out_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(1)
    blocks_n = tl.cdiv(N, BLOCK_N)
    m, n = tl.program_id(0) // blocks_n, tl.program_id(0) % blocks_n
    count = tl.load(count_ptr + slot)
    if m * BLOCK_M >= count:
        return
    start = tl.load(start_ptr + slot)
    offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < count
    rows = tl.load(rows_ptr + start + offs_m, mask=row_ok, other=0)  # [BLOCK_M]
    offs_n = n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    y = tl.load(
        y_ptr + rows[:, None] * R + offs_r[None, :],
        mask=row_ok[:, None] & (offs_r[None, :] < R),
        other=0.0,
    ).to(tl.float32)  # [BLOCK_M, BLOCK_R]
    b_t = tl.load(
        b_ptr + slot.to(tl.int64) * N * R + offs_n[None, :] * R + offs_r[:, None],
        mask=(offs_n[None, :] < N) & (offs_r[:, None] < R),
        other=0.0,
    ).to(tl.float32)  # [BLOCK_R, BLOCK_N]: B[slot]ᵀ's tile
    delta = tl.dot(y, b_t, input_precision="ieee") * tl.load(scale_ptr + slot).to(tl.float32)
    # Each (row, column) is one program's: a load, an add and a store, no atomics.
    out = out_ptr + rows[:, None] * stride_out_t + offs_n[None, :] * stride_out_n
    mask = row_ok[:, None] & (offs_n[None, :] < N)
    old = tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, (old + delta).to(out_ptr.dtype.element_ty), mask=mask)


INTERPRETED = not isinstance(lora_shrink_kernel, triton.runtime.jit.JITFunction)


def _launch_guard(t: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    # Triton launches on the current CUDA device, which may not be the tensor's.
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def lora_shrink_triton(
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [L, R, in]  contiguous
    token_slots: torch.Tensor,  # int64 [T]
) -> torch.Tensor:  # [T, R]
    """punica.shrink in one launch."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_rows, k = x.shape
    num_slots, rank = lora_a.shape[0], lora_a.shape[1]
    y = torch.zeros((num_rows, rank), dtype=x.dtype, device=x.device)  # -1 rows stay zero
    if num_rows == 0:
        return y
    rows, starts, counts = slot_groups(token_slots, num_slots)
    grid = (triton.cdiv(num_rows, BLOCK_M) * triton.cdiv(rank, BLOCK_N), num_slots)
    with _launch_guard(x):
        lora_shrink_kernel[grid](
            x, lora_a.contiguous(), y, rows, starts, counts, rank, k, x.stride(0),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        )  # fmt: skip
    return y


def lora_expand_triton(
    out: torch.Tensor,  # [T, out_total]  any strides, added to in place
    y: torch.Tensor,  # [T, R]
    lora_b: torch.Tensor,  # [L, out_i, R]  contiguous
    token_slots: torch.Tensor,  # int64 [T]
    scales: torch.Tensor,  # [L]
    offset: int = 0,
) -> None:
    """punica.expand in one launch."""
    num_rows, rank = y.shape
    num_slots, width = lora_b.shape[0], lora_b.shape[1]
    if num_rows == 0 or width == 0:
        return
    rows, starts, counts = slot_groups(token_slots, num_slots)
    grid = (triton.cdiv(num_rows, BLOCK_M) * triton.cdiv(width, BLOCK_N), num_slots)
    with _launch_guard(out):
        lora_expand_kernel[grid](
            y.contiguous(), lora_b.contiguous(), scales, out[:, offset:], rows, starts, counts,
            width, rank, out.stride(0), out.stride(1),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=max(16, triton.next_power_of_2(rank)),
        )  # fmt: skip


__all__ = [
    "INTERPRETED",
    "lora_expand_kernel",
    "lora_expand_triton",
    "lora_shrink_kernel",
    "lora_shrink_triton",
    "slot_groups",
]
