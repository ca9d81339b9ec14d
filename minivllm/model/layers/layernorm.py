"""The layers every model file shares: RMSNorm and SwiGLU's activation (vLLM's `layers/`).

Custom ops (`custom_op.py`): `forward_native` is the plain-PyTorch specification, and a platform
may run a fused kernel of equal results instead (minivllm/cpu/op_forwards.py), for Llama's norms
and Qwen3's per-head q/k norms alike. The linears are `parallel_layers.py`, RoPE `rope.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model.custom_op import CustomOp


class RMSNorm(CustomOp):
    """x / rms(x) * weight over the last dimension, computed in float32 like the reference.

    Given a `residual`, it first adds it to x and returns the sum as the new residual too (vLLM's
    fused add + norm): the decoder adds each sublayer's output to the residual stream right
    before normalising it, so a fused kernel does both in one pass over the rows."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward_native(
        self,
        x: torch.Tensor,  # [T, hidden_size] (or [T, heads, head_dim] for a per-head norm)
        residual: torch.Tensor | None = None,  # x's shape
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(dtype)
        return out if residual is None else (out, residual)


class SiluAndMul(CustomOp):
    """SwiGLU's gate: silu(gate) * up, for the fused gate_up projection's [T, 2 * I] output."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
