"""How a linear gets its LoRA delta: a wrapper that runs the base layer, then punica's two ops.

vLLM's `vllm/lora/layers/`: after the weights are loaded, each adaptable linear of the model is
replaced by a wrapper holding it (`base_layer`) and the stacked A/B of every slot, so the model
file stays the math and knows nothing of adapters (as gpt-fast's quantization swaps a linear from
outside). The wrapper is the same for every kind; what differs is the slices of its output that
the adapter's separate modules write:

    MergedQKVParallelLinearWithLoRA      qkv_proj      q_proj | k_proj | v_proj  (3 slices)
    MergedColumnParallelLinearWithLoRA   gate_up_proj  gate_proj | up_proj       (2 slices)
    ColumnParallelLinearWithLoRA         a checkpoint that stores them fused (Phi-3's qkv_proj)
    RowParallelLinearWithLoRA            o_proj, down_proj                      (1 slice)

A transformers checkpoint has q/k/v and gate/up as separate linears, and so has a PEFT adapter of
it; minivllm fuses them into one matmul (`packed_weights.py`), so slice i of the fused output gets
the delta of the adapter's module i, each with its own A (its shrink reads the same x) and B.

Every wrapper reads the step's row -> slot map from one `LoRAMapping` that the manager owns and
the model runner fills before each forward (vLLM's `PunicaWrapper` plays this part): the model's
forward signature stays the attention metadata's, and the map is an explicit object every wrapper
was handed, not a global. The mapping also carries the shrink and expand the wrappers run, chosen
once with the attention backend (punica_selector.py: punica.py, the CPU library's, or Triton's).

Tensor parallelism would shard A and B as vLLM does (a column-parallel layer's B by output rows, a
row-parallel layer's A by input columns, its partial shrink all-reduced); minivllm refuses
`enable_lora` with `tensor_parallel_size > 1` instead (arg_utils.py), so here a rank holds all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from minivllm.lora.peft_loader import LoRALayerWeights
from minivllm.lora.punica import NO_LORA
from minivllm.lora.punica_selector import REFERENCE_OPS, PunicaOps
from minivllm.model.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    QKVParallelLinear,
    RowParallelLinear,
)
from minivllm.model.models.llama import LlamaForCausalLM


@dataclass
class LoRAMapping:
    """The step's rows -> slots, shared by every wrapper of one model (set once per step), and the
    shrink / expand every wrapper runs on it (chosen once, with the attention backend)."""

    ops: PunicaOps = REFERENCE_OPS
    token_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    has_lora: bool = False  # some row has an adapter: otherwise the wrappers skip both ops

    def set(self, token_slots: torch.Tensor) -> None:  # int64 [T]
        self.token_slots = token_slots
        self.has_lora = bool((token_slots != NO_LORA).any())


class BaseLinearLayerWithLoRA(nn.Module):
    """`base_layer(x)`, plus each slice's `scale * (x Aᵀ) Bᵀ` for the rows that have an adapter."""

    def __init__(
        self,
        base_layer: LinearBase,
        input_size: int,
        slices: list[tuple[str, int]],  # (the adapter's module name, its output columns), in order
        mapping: LoRAMapping,
        max_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.input_size = input_size
        self.slices = slices
        self.mapping = mapping
        # Zero: an empty slot (and a slice an adapter does not target) adds nothing. Tuples of
        # tensors, one per slice, as vLLM's `lora_a_stacked` / `lora_b_stacked`.
        self.lora_a_stacked = tuple(  # each [L, R, in]
            torch.zeros(max_loras, max_lora_rank, input_size, dtype=dtype, device=device)
            for _ in slices
        )
        self.lora_b_stacked = tuple(  # each [L, out_i, R]
            torch.zeros(max_loras, width, max_lora_rank, dtype=dtype, device=device)
            for _, width in slices
        )
        self.scales = torch.zeros(max_loras, dtype=dtype, device=device)  # [L]

    @property
    def targets(self) -> dict[str, tuple[int, int]]:
        """Each slice's module name -> (in, out): what an adapter of this model must match."""
        return {name: (self.input_size, width) for name, width in self.slices}

    def set_lora(self, slot: int, weights: dict[str, LoRALayerWeights], scale: float) -> None:
        """Copy an adapter's A and B for this layer's slices into `slot` (zero where it has none:
        an attention-only adapter leaves the MLP as the base model's)."""
        self.reset_lora(slot)
        for i, (name, _) in enumerate(self.slices):
            w = weights.get(name)
            if w is not None:
                rank = w.lora_a.shape[0]
                self.lora_a_stacked[i][slot, :rank].copy_(w.lora_a)
                self.lora_b_stacked[i][slot, :, :rank].copy_(w.lora_b)
        self.scales[slot] = scale

    def reset_lora(self, slot: int) -> None:
        for a, b in zip(self.lora_a_stacked, self.lora_b_stacked):
            a[slot].zero_()
            b[slot].zero_()
        self.scales[slot] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, sum(out_i)]
        out = self.base_layer(x)
        if not self.mapping.has_lora:
            return out
        slots, ops = self.mapping.token_slots, self.mapping.ops
        offset = 0
        for a, b in zip(self.lora_a_stacked, self.lora_b_stacked):
            y = ops.shrink(x, a, slots)  # [T, R]
            ops.expand(out, y, b, slots, self.scales, offset)
            offset += b.shape[1]
        return out


class ColumnParallelLinearWithLoRA(BaseLinearLayerWithLoRA):
    pass


class MergedColumnParallelLinearWithLoRA(BaseLinearLayerWithLoRA):
    pass


class MergedQKVParallelLinearWithLoRA(BaseLinearLayerWithLoRA):
    pass


class RowParallelLinearWithLoRA(BaseLinearLayerWithLoRA):
    pass


# The fused linears of minivllm's models and the transformers modules they hold, in output order.
PACKED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
ROW_MODULES = ("o_proj", "down_proj")


def wrap_linears(
    model: LlamaForCausalLM,
    mapping: LoRAMapping,
    max_loras: int,
    max_lora_rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, BaseLinearLayerWithLoRA]:
    """Replace every adaptable linear of `model` by its LoRA wrapper, in place; returns the
    wrappers by module path. A checkpoint that stores q/k/v fused (`packed_checkpoint`) has its
    adapter on the fused module, so there the fused linear is one slice. Sizes come from the
    layers' own fields and the config, not from `weight`, which a platform may hold packed
    (oneDNN) or a GGUF layer may not have."""
    packed_checkpoint = model.packed_checkpoint
    hidden_size = model.config.hidden_size  # what every column-parallel linear reads
    wrapped: dict[str, BaseLinearLayerWithLoRA] = {}
    for path, module in list(model.named_modules()):
        parent_path, _, attr = path.rpartition(".")
        wrapper: BaseLinearLayerWithLoRA | None = None
        args = (mapping, max_loras, max_lora_rank, dtype, device)
        if isinstance(module, RowParallelLinear) and attr in ROW_MODULES:
            wrapper = RowParallelLinearWithLoRA(
                module, module.input_size, [(path, hidden_size)], *args
            )
        elif isinstance(module, ColumnParallelLinear) and attr in PACKED_MODULES:
            in_size = hidden_size
            names = PACKED_MODULES[attr]
            if packed_checkpoint or len(names) != len(module.local_sizes):
                cls: type[BaseLinearLayerWithLoRA] = ColumnParallelLinearWithLoRA
                slices = [(path, sum(module.local_sizes))]
            else:
                cls = (
                    MergedQKVParallelLinearWithLoRA
                    if isinstance(module, QKVParallelLinear)
                    else MergedColumnParallelLinearWithLoRA
                )
                slices = [(f"{parent_path}.{n}", w) for n, w in zip(names, module.local_sizes)]
            wrapper = cls(module, in_size, slices, *args)
        if wrapper is not None:
            setattr(model.get_submodule(parent_path), attr, wrapper)
            wrapped[path] = wrapper
    return wrapped
