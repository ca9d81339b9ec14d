"""The fused MoE op's experts as a Triton grouped GEMM (vLLM's fused_moe_kernel), and the op's
CUDA forward.

vLLM runs a mixture-of-experts layer as two launches of one kernel
(vllm/model_executor/layers/fused_moe/fused_moe.py): the (token, expert) assignments are sorted
by expert and each expert's group is padded to a multiple of `BLOCK_M` (`moe_align_block_size`),
so that every block of `BLOCK_M` sorted rows belongs to one expert. A program then computes one
`[BLOCK_M, BLOCK_N]` tile of that block's output: it gathers its rows of the input by their
token ids (no permuted copy of the activations is written), multiplies them by its expert's
weight, and scatters the tile to the rows of its assignments. The first launch computes every
assignment's gate/up projection (x @ w13[e]^T), SiLU·mul runs between them, and the second
launch computes the down projection (@ w2[e]^T) and multiplies each row by its router weight, so
that what is left is a sum over each token's top_k rows.

    sorted_ids   [a0 a1 a2 P | a3 P P P | a4 a5 a6 a7 | a8 P P P]   BLOCK_M = 4, P: padding
    expert_ids   [    e0     |    e2    |     e5      |    e7   ]   one expert per block

The padded length depends on the routing, which is on the device; the launch grid is sized for
the worst case (T·top_k + (BLOCK_M - 1) per expert that can have a token), and a program past
the padded length (read from `num_post_padded`, a device scalar) returns at once, so the routing
never waits for the host.

Precision: products accumulate in float32; with float32 inputs the dot runs in IEEE float32 (no
TF32), so the result matches `fused_experts_native` up to summation order. The weighted rows are
written in float32 and summed over top_k before the one rounding to the activations' dtype.

Without CUDA the kernel runs on CPU tensors in Triton's interpreter (for tests); importing this
module turns the interpreter on when CUDA is absent and `TRITON_INTERPRET` is unset, as
`triton_gguf.py` does.
"""

from __future__ import annotations

import contextlib
import os

import torch

from minivllm.model.custom_op import register_forward
from minivllm.model.layers.fused_moe import FusedMoE, silu_and_mul, sort_by_expert

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    # Triton decides per kernel, when `@triton.jit` runs, whether it is interpreted or compiled.
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton
    import triton.language as tl
except ImportError as e:
    raise ImportError('the Triton MoE kernel needs Triton: pip install "minivllm[triton]"') from e


# ================================================================================== alignment
def moe_align_block_size(
    topk_ids: torch.Tensor,  # int64 [T, top_k]
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The assignments sorted by expert, each expert's group padded to a multiple of `block_m`.

    Returns `sorted_ids` int32 [max_padded] (assignment a = t · top_k + j, or T · top_k for a
    padding row), `expert_ids` int32 [max_padded // block_m] (the expert of each block) and
    `num_post_padded` int32 [1] (how many of `sorted_ids` are in use), all on the device."""
    num_assignments = topk_ids.numel()
    order, counts = sort_by_expert(topk_ids, num_experts)  # [T * top_k], [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    group_end = padded.cumsum(0)  # [E]  one past each expert's last padded slot
    # Expert e's i-th assignment goes to slot (start of e's padded group) + i.
    expert_of = topk_ids.flatten()[order]  # [T * top_k]  non-decreasing
    first_of_group = (counts.cumsum(0) - counts)[expert_of]  # [T * top_k]
    rank_in_group = torch.arange(num_assignments, device=order.device) - first_of_group
    slots = (group_end - padded)[expert_of] + rank_in_group  # [T * top_k]
    # At most min(E, T · top_k) groups are non-empty, each padded by fewer than block_m rows.
    bound = num_assignments + min(num_experts, num_assignments) * (block_m - 1)
    max_padded = triton.cdiv(bound, block_m) * block_m
    sorted_ids = torch.full((max_padded,), num_assignments, dtype=torch.int32, device=order.device)
    sorted_ids[slots] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=order.device)  # [blocks]
    expert_ids = torch.searchsorted(group_end, block_starts, right=True)  # E past the end
    expert_ids = expert_ids.clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, group_end[-1:].to(torch.int32)


# ======================================================================================= GEMM
@triton.jit(do_not_specialize=["num_assignments"])
def fused_moe_kernel(  # type: ignore[no-untyped-def]  # Triton's untyped kernel ABI
    a_ptr,  # [rows, K], K contiguous: x (rows = T) or the activations (rows = T * top_k)
    b_ptr,  # [E, N, K], K contiguous: w13 or w2
    c_ptr,  # [T * top_k, N], N contiguous
    topk_weights_ptr,  # [T * top_k]
    sorted_ids_ptr,  # int32 [max_padded]
    expert_ids_ptr,  # int32 [max_padded // BLOCK_M]
    num_post_padded_ptr,  # int32 [1]
    N,
    K,
    num_assignments,  # T * top_k: the id of a padding row
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    A_ROWS_PER_TOKEN: tl.constexpr,  # top_k when a's rows are tokens, 1 when assignments
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_16BIT: tl.constexpr,  # inputs are 16-bit and the dot runs in them (GPU); else float32
):
    """c[a, n] = (w[a] ·) sum_k a[row(a), k] * b[e(a), n, k] for the BLOCK_M sorted assignments of
    program 0's index and the BLOCK_N columns of program 1's."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return  # past the padded length: the grid is sized for the worst routing
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    m_mask = ids < num_assignments  # padding rows compute nothing and store nothing
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    a_rows = a_ptr + (ids // A_ROWS_PER_TOKEN).to(tl.int64)[:, None] * stride_am  # [BLOCK_M, 1]
    b_cols = b_ptr + expert * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn  # [1, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        # The expert's weight, read as its transpose's [BLOCK_K, BLOCK_N] tile.
        b = tl.load(b_cols + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_16BIT:
            acc = tl.dot(a, b, acc)
        else:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + ids, mask=m_mask, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
    c = c_ptr + ids.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# True when the kernel above was decorated under Triton's interpreter (it runs on CPU tensors).
INTERPRETED = not isinstance(fused_moe_kernel, triton.runtime.jit.JITFunction)


# ===================================================================================== launch
def moe_tiles(
    num_assignments: int, dtype: torch.dtype, interpreted: bool = INTERPRETED
) -> dict[str, int]:
    """Tile sizes and warps. `tl.dot` needs every dimension >= 16. A decode step has a few rows
    per expert, so a short BLOCK_M wastes less on padding; a prefill's groups fill 64-row
    blocks, which reuse each weight tile over more rows. The interpreter runs one program at a
    time at numpy speed: there, wide tiles and few programs."""
    if interpreted:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4}
    fp32 = dtype == torch.float32
    block_m = 16 if num_assignments <= 64 else 64
    return {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 32 if fp32 else 64, "num_warps": 4}


def _grouped_gemm(
    a: torch.Tensor,  # [rows, K]
    w: torch.Tensor,  # [E, N, K]
    out: torch.Tensor,  # [T * top_k, N]
    topk_weights: torch.Tensor | None,  # [T * top_k]: multiply each row by its weight
    routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # moe_align_block_size's
    rows_per_token: int,
    tiles: dict[str, int],
) -> None:
    sorted_ids, expert_ids, num_post_padded = routing
    n, k = w.shape[1], w.shape[2]
    grid = (expert_ids.numel(), triton.cdiv(n, tiles["BLOCK_N"]))
    weights = topk_weights if topk_weights is not None else out  # unread without the flag
    fused_moe_kernel[grid](
        a, w, out, weights, sorted_ids, expert_ids, num_post_padded, n, k, out.shape[0],
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROWS_PER_TOKEN=rows_per_token, MUL_ROUTED_WEIGHT=topk_weights is not None,
        DOT_16BIT=a.dtype != torch.float32 and not INTERPRETED, **tiles,
    )  # fmt: skip


def fused_experts_triton(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, top_k]
    topk_ids: torch.Tensor,  # int64 [T, top_k]
    tiles: dict[str, int]
    | None = None,  # overrides moe_tiles (tests run a GPU's in the interpreter)
) -> torch.Tensor:  # [T, H]  in hidden's dtype
    """`fused_experts_native`'s result from two launches of the grouped GEMM."""
    num_tokens, top_k = topk_ids.shape
    num_assignments = topk_ids.numel()
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("the experts' weights must have contiguous rows (K stride 1)")
    tiles = tiles or moe_tiles(num_assignments, hidden.dtype)
    routing = moe_align_block_size(topk_ids, w13.shape[0], tiles["BLOCK_M"])
    # The interpreter's float32 -> bfloat16 cast truncates; there the intermediate stays float32.
    inter_dtype = torch.float32 if INTERPRETED else hidden.dtype
    gate_up = torch.empty(num_assignments, w13.shape[1], dtype=inter_dtype, device=hidden.device)
    y = torch.empty(num_assignments, w2.shape[1], dtype=torch.float32, device=hidden.device)
    guard = torch.cuda.device(hidden.device) if hidden.is_cuda else contextlib.nullcontext()
    with guard:  # Triton launches on the current CUDA device, which may not be hidden's
        _grouped_gemm(hidden, w13, gate_up, None, routing, top_k, tiles)  # [T * top_k, 2 * I]
        act = silu_and_mul(gate_up)  # [T * top_k, I]
        if not INTERPRETED:
            act = act.to(w2.dtype)
        _grouped_gemm(act, w2, y, topk_weights.flatten(), routing, 1, tiles)  # [T * top_k, H]
    return y.view(num_tokens, top_k, -1).sum(dim=1).to(hidden.dtype)


# ============================================================================ the CUDA forward
@register_forward(FusedMoE, "cuda")
def fused_moe_forward_cuda(
    op: FusedMoE,
    hidden: torch.Tensor,  # [T, H]
    router_logits: torch.Tensor,  # [T, E]
) -> torch.Tensor:  # [T, H]
    topk_weights, topk_ids = op.route(router_logits)  # [T, top_k] each
    if op.quant_method is not None:  # a GGUF file's experts: no Triton kernel of blocks here
        return op.quant_method.apply(op, hidden, topk_weights, topk_ids)
    return fused_experts_triton(hidden, op.w13_weight, op.w2_weight, topk_weights, topk_ids)


__all__ = [
    "INTERPRETED",
    "fused_experts_triton",
    "fused_moe_forward_cuda",
    "fused_moe_kernel",
    "moe_align_block_size",
    "moe_tiles",
]
