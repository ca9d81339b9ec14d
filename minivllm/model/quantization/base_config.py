"""What a quantization is to the layers: vLLM's `QuantizationConfig` and `LinearMethodBase`.

In vLLM every linear layer asks the checkpoint's `QuantizationConfig` for its `quant_method`, which
creates the layer's weights in the checkpoint's format (`create_weights`) and computes the layer's
product from them (`apply`); the layer itself stays the same class whatever the format. minivllm
keeps that shape with one simplification: a layer without a quantization has no method at all
(`quant_method is None`) and runs its plain `F.linear`, so the model files a learner reads first
carry no quantization code. The loader sets a method on each layer a quantized checkpoint
stores in blocks (`gguf.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


class LinearMethodBase(ABC):
    """How a linear layer (or the LM head) holds its weight and multiplies by it."""

    @abstractmethod
    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [T, in]
        bias: torch.Tensor | None = None,  # [out]
    ) -> torch.Tensor:  # [T, out]
        """x Wᵀ (+ b), the specification: a platform may compute it faster, to the same result."""

    @abstractmethod
    def weight_bytes(self, layer: nn.Module) -> int:
        """The bytes the layer's weight takes in memory, as stored."""


class EmbeddingMethodBase(ABC):
    """How an embedding table is held and looked up."""

    @abstractmethod
    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 [T] -> [T, hidden]: the rows of the given tokens."""


class QuantizationConfig(ABC):
    """A checkpoint's quantization: its name and the method each layer runs."""

    name: str

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        """The method layer `prefix` (e.g. "model.layers.0.mlp.down_proj") runs, or None where
        the checkpoint stores that layer's weight as plain floats."""
