"""A MoE layer's experts run as a GGUF file stores them: vLLM's `GGUFMoEMethod`.

llama.cpp stores each MoE layer's experts as three stacked tensors (`ffn_gate_exps`,
`ffn_up_exps`: [E, I, H]; `ffn_down_exps`: [E, H, I]), each quantized row by row like any
weight; a 4-bit file's experts are most of its bytes (Mixtral-8x7B: 45 of 47 billion weights), so
they stay in their blocks. The fused MoE op (`FusedMoE`, fused_moe.py) then holds, in place of its
float `w13_weight` and `w2_weight`:

    w13_qweight_{i}  uint8 [E, rows_i, row_bytes]  expert e's gate rows, then its up rows
    w2_qweight_0     uint8 [E, H, row_bytes]       expert e's down projection

Gate and up share one buffer where they share a type (llama.cpp's files do), else they are two
parts, as a fused linear's are (`merge_parts` in gguf.py); `op.w13_qtypes` / `op.w2_qtypes` hold
the parts' GGML types.

The reference (`GGUFMoEMethod.apply`) is the float op's own `fused_experts_native`, given the
experts as `GGUFExperts`: reading expert e dequantizes its rows only, and only experts that
tokens were routed to are read. The CPU's forward (minivllm/cpu/moe.py) multiplies each expert's
rows by its blocks with `gguf_linear` instead, held to this reference by the tests. On CUDA the
experts run this reference (no GGUF MoE kernel is written for Triton here).
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.model.layers.fused_moe import FusedMoE, fused_experts_native
from minivllm.model.quantization.gguf.blocks import dequantize, row_bytes
from minivllm.model.quantization.gguf.linear import GGUFPart


class GGUFExperts:
    """One stacked weight of the experts as GGUF blocks: `experts[e]` is expert e's weight,
    dequantized (fused_moe.ExpertWeights)."""

    def __init__(self, parts: list[tuple[int, torch.Tensor]], dtype: torch.dtype) -> None:
        self.parts = parts  # (qtype, uint8 [E, rows, row_bytes]) in row order
        self.dtype = dtype  # the activations'

    def __len__(self) -> int:
        return self.parts[0][1].shape[0]

    def __getitem__(self, expert: int) -> torch.Tensor:  # [rows, columns]
        rows = [dequantize(q[expert], qtype) for qtype, q in self.parts]
        return torch.cat(rows).to(self.dtype)


def moe_parts(op: nn.Module, weight: str) -> list[tuple[int, torch.Tensor]]:
    """(qtype, uint8 [E, rows, row_bytes]) of each part of `weight` ("w13" or "w2"), in row order."""
    qtypes: tuple[int, ...] = getattr(op, f"{weight}_qtypes")
    return [(qtype, getattr(op, f"{weight}_qweight_{i}")) for i, qtype in enumerate(qtypes)]


class GGUFMoEMethod:
    """How a `FusedMoE` whose experts are GGUF blocks holds and runs them."""

    def create_weights(self, op: FusedMoE, w13: list[GGUFPart], w2: list[GGUFPart]) -> None:
        """Replace the op's float `w13_weight` and `w2_weight` by empty block buffers of the
        parts' types, to be filled expert by expert."""
        hidden, inner = op.w13_weight.shape[2], op.w2_weight.shape[2]  # H, I
        device = op.w13_weight.device
        for weight, parts, columns in (("w13", w13, hidden), ("w2", w2, inner)):
            del op._parameters[f"{weight}_weight"]
            setattr(op, f"{weight}_qtypes", tuple(p.qtype for p in parts))
            for i, part in enumerate(parts):
                shape = (op.num_experts, part.rows, row_bytes(part.qtype, columns))
                buffer = torch.empty(shape, dtype=torch.uint8, device=device)
                op.register_buffer(f"{weight}_qweight_{i}", buffer)
        op.quant_method = self

    def apply(
        self,
        op: FusedMoE,
        hidden: torch.Tensor,  # [T, H]
        topk_weights: torch.Tensor,  # [T, top_k]
        topk_ids: torch.Tensor,  # int64 [T, top_k]
    ) -> torch.Tensor:  # [T, H]
        w13 = GGUFExperts(moe_parts(op, "w13"), hidden.dtype)  # [E, 2 * I, H] as read
        w2 = GGUFExperts(moe_parts(op, "w2"), hidden.dtype)  # [E, H, I]
        return fused_experts_native(hidden, w13, w2, topk_weights, topk_ids)


__all__ = ["GGUFExperts", "GGUFMoEMethod", "moe_parts"]
