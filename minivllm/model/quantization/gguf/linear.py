"""GGUF weights run as they are stored: vLLM's `GGUFConfig` / `GGUFLinearMethod`.

A GGUF file keeps most weights in llama.cpp's blocks (`gguf_blocks.py`). Dequantizing them at load
would multiply their memory by 6-8 (a 7B Q4_K_M file: 4.4 GB on disk, ~28 GB as float32), so a
layer whose checkpoint tensors are quantized keeps their bytes, `uint8 [rows, row_bytes]`, and
multiplies by them: here in the reference way (dequantize, then `F.linear`: the specification),
on a CPU or GPU by a kernel that dequantizes inside the product (minivllm/cpu/op_forwards.py,
`triton_gguf.py`), each held to this reference by tests.

A fused layer (q/k/v, gate/up) holds its checkpoint tensors as *parts*, one after another in its
output rows; consecutive parts of the same type are one buffer (rows concatenate: a block never
spans two rows), so SmolLM2's all-Q4_1 layers hold one buffer each, while a Q4_K_M file's Q4_K
q/k and Q6_K v give qkv_proj two. Buffers are named `qweight_0`, `qweight_1`, ... in row order;
`layer.qtypes` holds their GGML types. The embedding stays quantized too: a lookup dequantizes
the rows of the step's tokens only, and a tied LM head multiplies by the very same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model.quantization.base_config import (
    EmbeddingMethodBase,
    LinearMethodBase,
    QuantizationConfig,
)
from minivllm.model.quantization.gguf.blocks import BLOCK_LAYOUTS, dequantize


@dataclass(frozen=True)
class GGUFPart:
    """One buffer of a layer's weight: `rows` output rows of one GGML type."""

    qtype: int
    rows: int


def merge_parts(qtypes: list[int], rows: list[int]) -> list[GGUFPart]:
    """Consecutive checkpoint tensors of one type, as one part each."""
    parts: list[GGUFPart] = []
    for qtype, n in zip(qtypes, rows):
        if parts and parts[-1].qtype == qtype:
            parts[-1] = GGUFPart(qtype, parts[-1].rows + n)
        else:
            parts.append(GGUFPart(qtype, n))
    return parts


def gguf_parts(layer: Any) -> list[tuple[int, torch.Tensor]]:
    """(qtype, uint8 [rows, row_bytes]) of each of the layer's buffers, in row order."""
    return [(qtype, getattr(layer, f"qweight_{i}")) for i, qtype in enumerate(layer.qtypes)]


class GGUFLinearMethod(LinearMethodBase):
    """A linear layer (or LM head) whose weight is GGUF blocks."""

    def create_weights(self, layer: Any, parts: list[GGUFPart], in_features: int) -> None:
        """Replace the layer's float `weight` by empty block buffers, filled by `load_part`."""
        if "weight" in layer._parameters:
            del layer._parameters["weight"]
        layer.qtypes = tuple(p.qtype for p in parts)
        device = layer.bias.device if getattr(layer, "bias", None) is not None else None
        for i, part in enumerate(parts):
            block, size = BLOCK_LAYOUTS[part.qtype]
            if in_features % block:
                raise ValueError(
                    f"a row of {in_features} weights is not whole {block}-weight blocks"
                )
            shape = (part.rows, in_features // block * size)
            layer.register_buffer(
                f"qweight_{i}", torch.empty(shape, dtype=torch.uint8, device=device)
            )
        layer.quant_method = self

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [T, in]
        bias: torch.Tensor | None = None,  # [out]
    ) -> torch.Tensor:  # [T, out]
        weight = torch.cat([dequantize(q, qtype) for qtype, q in gguf_parts(layer)])  # [out, in]
        return F.linear(x, weight.to(x.dtype), bias)

    def weight_bytes(self, layer: nn.Module) -> int:
        return sum(q.numel() for _, q in gguf_parts(layer))


class GGUFEmbeddingMethod(EmbeddingMethodBase):
    """An embedding table of GGUF blocks (one part): a lookup dequantizes only the rows it needs."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype  # the model's activations

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        ((qtype, qweight),) = gguf_parts(layer)
        rows = qweight.index_select(0, input_ids)  # uint8 [T, row_bytes]
        return dequantize(rows, qtype).to(self.dtype)  # [T, hidden]


class GGUFConfig(QuantizationConfig):
    """A GGUF checkpoint: the GGML type of every tensor the file stores, by HuggingFace name."""

    name = "gguf"

    def __init__(self, tensor_types: dict[str, int]) -> None:
        self.tensor_types = tensor_types

    def is_quantized(self, name: str) -> bool:
        return self.tensor_types.get(name) in BLOCK_LAYOUTS

    def get_quant_method(self, layer: nn.Module, prefix: str) -> GGUFLinearMethod | None:
        """A method for a layer every checkpoint tensor of which is blocks; None for plain floats
        (F32 / F16 / BF16 tensors, or a fused layer mixing the two, which is dequantized)."""
        names = [n for n in self.tensor_types if n.startswith(f"{prefix}.") or n == prefix]
        weights = [n for n in names if n.endswith(".weight")]
        if weights and all(self.is_quantized(n) for n in weights):
            return GGUFLinearMethod()
        return None
