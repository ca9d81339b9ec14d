"""Checkpoints that store q/k/v and gate/up already fused (Phi-3), read as their separate parts.

minivllm's layers fuse q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, and each fused
layer's weight loader takes one part at a time ("q", "k", "v"; 0, 1), keeping only this rank's
heads of it under tensor parallelism (parallel_layers.py). Most checkpoints store the parts
separately, which is what the weight loader (weights.py) checks and maps. Phi-3 stores them
fused; vLLM's loader then calls the fused layer's loader without a shard id and lets it cut the
tensor. Here the checkpoint is shown to the loader as the separate-parts checkpoint it is
equivalent to: each part is a `RowRange` of the fused tensor, read lazily, so a rank still reads
only its own rows from the safetensors file. A model class asks for this with `packed_checkpoint`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from minivllm.model.config import LlamaConfig
from minivllm.model.layers.linear import Sliceable

# fused checkpoint tensor -> the separate tensors it holds, in the order of its rows
PACKED_PARAMS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


class RowRange:
    """Rows [start, stop) of a checkpoint tensor, as a tensor of its own: indexing it reads only
    the rows asked for from the (lazy) tensor it is cut from."""

    def __init__(self, tensor: Sliceable, start: int, stop: int) -> None:
        self.tensor, self.start, self.stop = tensor, start, stop

    def get_shape(self) -> list[int]:  # safetensors' name for it, which weights.py asks
        tensor: Any = self.tensor
        shape = tensor.shape if isinstance(tensor, torch.Tensor) else tensor.get_shape()
        return [self.stop - self.start, *shape[1:]]

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        first, last, step = rows.indices(self.stop - self.start)  # a slice of this part's rows
        assert step == 1, "weight loaders read contiguous rows"
        return self.tensor[(slice(self.start + first, self.start + last), *rest)]


def unpack_checkpoint(
    weights: Mapping[str, Sliceable], config: LlamaConfig
) -> dict[str, Sliceable]:
    """The checkpoint with each fused tensor (weight or bias) replaced by its parts, under the
    names a separate-parts checkpoint gives them; every other tensor as it is."""
    d = config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    sizes = {"self_attn.qkv_proj": [q, kv, kv], "mlp.gate_up_proj": [config.intermediate_size] * 2}
    unpacked: dict[str, Sliceable] = {}
    for name, tensor in weights.items():
        fused = next((f for f in PACKED_PARAMS if f".{f}." in name), None)
        if fused is None:
            unpacked[name] = tensor
            continue
        start = 0
        for part, size in zip(PACKED_PARAMS[fused], sizes[fused]):
            unpacked[name.replace(fused, part)] = RowRange(tensor, start, start + size)
            start += size
    return unpacked
