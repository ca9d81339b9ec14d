"""The CUDA forwards of the linear layers for GGUF blocks: the Triton GEMM (`triton_gguf.py`).

A layer holding GGUF blocks (`quant_method` set by the loader) multiplies each of its parts with
`gguf_linear_triton`, which dequantizes inside the product, instead of its `forward_native`, which
dequantizes the whole weight into memory on every call; every other layer keeps `forward_native`
(cuBLAS). The CUDA platform imports this module when its custom ops are enabled
(`CudaPlatform.register_op_forwards`), as the CPU platform imports minivllm/cpu/op_forwards.py.
tests/model/test_kernels_triton_gguf.py holds the kernel to the reference, in Triton's interpreter.
"""

from __future__ import annotations

import torch

from minivllm.model.custom_op import register_forward
from minivllm.model.layers.linear import ColumnParallelLinear, ParallelLMHead, RowParallelLinear
from minivllm.model.quantization.gguf.linear import gguf_parts
from minivllm.model.quantization.gguf.triton_kernels import gguf_linear_triton


def gguf_linear_cuda(
    op: ColumnParallelLinear | RowParallelLinear | ParallelLMHead,
    x: torch.Tensor,  # [T, in]
) -> torch.Tensor:  # [T, out]
    outs = [gguf_linear_triton(x, q, qtype) for qtype, q in gguf_parts(op)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


@register_forward(ColumnParallelLinear, "cuda")
def column_parallel_linear_forward_cuda(op: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
    if op.quant_method is None:
        return op.forward_native(x)
    y = gguf_linear_cuda(op, x)
    return y if op.bias is None else y + op.bias


@register_forward(RowParallelLinear, "cuda")
def row_parallel_linear_forward_cuda(op: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
    if op.quant_method is None:  # GGUF blocks run on one device: no all-reduce to do
        return op.forward_native(x)
    partial = gguf_linear_cuda(op, x)
    return op.reduce(partial) if op.reduce_results else partial


@register_forward(ParallelLMHead, "cuda")
def lm_head_forward_cuda(head: ParallelLMHead, hidden: torch.Tensor) -> torch.Tensor:
    return (
        head.forward_native(hidden) if head.quant_method is None else gguf_linear_cuda(head, hidden)
    )
