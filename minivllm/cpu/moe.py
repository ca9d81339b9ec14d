"""The CPU's forward of the fused MoE op (`FusedMoE`, minivllm/model/layers/fused_moe.py): each expert's
group of rows multiplied on oneDNN, with the expert's weights prepacked in oneDNN's layout.

The reference (`fused_experts_native`) already groups the assignments by expert, so its matmuls
are few; what it spends beyond them is `F.linear` on plain weights, the kernel the linears of
op_forwards.py leave for oneDNN's blocked layout (`prepack_linear` there says why). Here each
expert's w13 [2·I, H] and w2 [H, I] is reordered once at load (`prepack_experts`), and a step
runs, per expert with tokens, two `packed_linear`s on its contiguous rows; the outputs are put
back in assignment order with one scatter, weighted, and summed over each token's top_k in
float32, the arithmetic of the reference (to summation order).

The stacked tensors stay beside the packed copies, since `forward_native` and `state_dict()` read
them (so this path holds the experts twice); where oneDNN does not pack the dtype (float16, or a
build without oneDNN) the op runs the reference. tests/model/test_fused_moe.py holds this forward to
the reference.

Experts a GGUF file stores in blocks (quantization/gguf_moe.py) are not packed: each expert's
rows are multiplied by its blocks with the quantized GEMM the linears use (`gguf_linear`, which
unpacks each block where it is used), part by part, as `gguf_linear_cpu` runs a fused linear;
the reference it is held to dequantizes the expert and multiplies (tests/model/test_model_gguf_moe.py).
"""

from __future__ import annotations

import torch

from minivllm.cpu import ops as cpu_ops
from minivllm.cpu.op_forwards import gguf_dot, onednn_packs, packed_linear
from minivllm.model.custom_op import register_forward
from minivllm.model.layers.fused_moe import (
    FusedMoE,
    fused_experts_native,
    silu_and_mul,
    sort_by_expert,
)
from minivllm.model.quantization.gguf.moe import moe_parts

# One expert's (w13, w2) in oneDNN's layout: [2·I, H] and [H, I] as `packed_linear` reads them.
PackedExpert = tuple[torch.Tensor, torch.Tensor]


def prepack_experts(op: FusedMoE) -> None:
    """`op.packed_experts`: every expert's two weights reordered for oneDNN, or None where oneDNN
    does not run this dtype. Run once, when the op switches to this forward."""
    if getattr(op, "packed_experts", None) is not None:
        return  # dispatched before
    if op.quant_method is not None:  # a GGUF file's blocks, multiplied as they are
        op.packed_experts = None  # type: ignore[assignment]
        return
    packed: list[PackedExpert] | None = None
    if onednn_packs(op.w13_weight):
        reorder = torch.ops.mkldnn._reorder_linear_weight  # 64: the row count oneDNN plans for
        with torch.no_grad():
            packed = [
                (reorder(op.w13_weight[e].contiguous(), 64), reorder(op.w2_weight[e], 64))
                for e in range(op.num_experts)
            ]
    op.packed_experts = packed  # type: ignore[assignment]


def fused_experts_cpu(
    hidden: torch.Tensor,  # [T, H]
    packed: list[PackedExpert],  # E experts' weights, from `prepack_experts`
    topk_weights: torch.Tensor,  # [T, top_k]
    topk_ids: torch.Tensor,  # int64 [T, top_k]
) -> torch.Tensor:  # [T, H]  in hidden's dtype
    """`fused_experts_native`'s result, each expert's group on oneDNN."""
    top_k = topk_ids.shape[1]
    order, counts = sort_by_expert(topk_ids, len(packed))  # [T * top_k], [E]
    x = hidden[order // top_k]  # [T * top_k, H]  rows grouped by expert
    y = torch.empty_like(x)  # [T * top_k, H]  each sorted assignment's expert output
    start = 0
    for expert, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        w13, w2 = packed[expert]
        rows = slice(start, start + n)
        y[rows] = packed_linear(silu_and_mul(packed_linear(x[rows], w13)), w2)
        start += n
    return combine(y, order, topk_weights).to(hidden.dtype)


def fused_experts_gguf_cpu(
    hidden: torch.Tensor,  # [T, H]
    op: FusedMoE,  # its experts in GGUF blocks (quantization/gguf_moe.py)
    topk_weights: torch.Tensor,  # [T, top_k]
    topk_ids: torch.Tensor,  # int64 [T, top_k]
) -> torch.Tensor:  # [T, H]  in hidden's dtype
    """`GGUFMoEMethod.apply`'s result, each expert's group multiplied by its blocks."""
    w13, w2 = moe_parts(op, "w13"), moe_parts(op, "w2")  # (qtype, uint8 [E, rows, row_bytes])
    top_k = topk_ids.shape[1]
    order, counts = sort_by_expert(topk_ids, op.num_experts)  # [T * top_k], [E]
    x = hidden[order // top_k].float()  # [T * top_k, H]  rows grouped by expert
    y = torch.empty_like(x)  # [T * top_k, H]  each sorted assignment's expert output
    start = 0
    for expert, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        rows = slice(start, start + n)
        gate_up = [cpu_ops.gguf_linear(x[rows], q[expert], t, gguf_dot(t)) for t, q in w13]
        act = silu_and_mul(torch.cat(gate_up, dim=1))  # [n, I]
        down = [cpu_ops.gguf_linear(act, q[expert], t, gguf_dot(t)) for t, q in w2]
        y[rows] = torch.cat(down, dim=1)  # [n, H]
        start += n
    return combine(y, order, topk_weights).to(hidden.dtype)


def combine(
    y: torch.Tensor,  # [T * top_k, H]  the sorted assignments' expert outputs
    order: torch.Tensor,  # int64 [T * top_k]  from sort_by_expert
    topk_weights: torch.Tensor,  # [T, top_k]
) -> torch.Tensor:  # [T, H]  float32
    """The outputs put back in assignment order with one scatter, weighted, and summed over
    each token's top_k in float32."""
    num_tokens, top_k = topk_weights.shape
    by_assignment = torch.empty_like(y)  # [T * top_k, H]  row a = t * top_k + j
    by_assignment[order] = y
    weighted = by_assignment.view(num_tokens, top_k, -1) * topk_weights.unsqueeze(-1)
    return weighted.float().sum(dim=1)


@register_forward(FusedMoE, "cpu", process_weights_after_loading=prepack_experts)
def fused_moe_forward_cpu(
    op: FusedMoE,
    hidden: torch.Tensor,  # [T, H]
    router_logits: torch.Tensor,  # [T, E]
) -> torch.Tensor:  # [T, H]
    topk_weights, topk_ids = op.route(router_logits)  # [T, top_k] each
    if op.quant_method is not None:
        return fused_experts_gguf_cpu(hidden, op, topk_weights, topk_ids)
    packed: list[PackedExpert] | None = getattr(op, "packed_experts", None)
    if packed is None:
        return fused_experts_native(hidden, op.w13_weight, op.w2_weight, topk_weights, topk_ids)
    return fused_experts_cpu(hidden, packed, topk_weights, topk_ids)
