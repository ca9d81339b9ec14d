"""How a linear gets its LoRA delta: a wrapper that runs the base layer, then punica's two ops.

vLLM's `vllm/lora/layers/`: after the weights are loaded, each adaptable linear of the model is
replaced by a wrapper holding it (`base_layer`) and the stacked A/B of every slot, so the model
file stays the math and knows nothing of adapters (as gpt-fast's quantization swaps a linear from
outside). The wrappers share one forward (a row-parallel one reduces after it, below); what
differs is the slices of the output that the adapter's separate modules write:

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

Under tensor parallelism each wrapper holds rank r's shard of every slot, cut as vLLM's
`ColumnParallelLinearWithLoRA` / `RowParallelLinearWithLoRA` cut it (`slice_lora_a`,
`slice_lora_b`, when the manager copies an adapter into a slot), so that each rank's delta is
its share of the base layer's output:

    column-parallel   A [r, in] whole on every rank; B [out, r] cut to the rows the base weight
                      keeps (per slice of a fused q/k/v or gate/up: the rank's query heads and
                      the KV heads they read, replicated when KV heads are fewer than ranks)
                      x Aᵀ B[rows_r]ᵀ = (x Aᵀ Bᵀ)[:, rows_r]: exactly rank r's own output columns
    row-parallel      A cut to the input columns the base weight keeps; B whole
                      Σ_r x_r A_rᵀ Bᵀ = x Aᵀ Bᵀ: each rank's delta is a partial sum, added to
                      the base layer's partial product before its one all-reduce

so LoRA adds no collective: the row-parallel base layer runs with `reduce_results` off, and the
wrapper reduces base and delta together (vLLM's `RowParallelLinearWithLoRA.forward`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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


@dataclass(frozen=True)
class LoRASlice:
    """One adapter module's share of a wrapped linear's output (q_proj of qkv_proj, ...)."""

    name: str  # the adapter's (transformers') module name
    output_size: int  # its output rows in the checkpoint: what the adapter's B must have
    local_size: int  # the rows rank r computes (output_size under no tensor parallelism)
    parts: tuple[int, ...] = (0,)  # the base layer's parts it covers (all: a fused checkpoint)


class BaseLinearLayerWithLoRA(nn.Module):
    """`base_layer(x)`, plus each slice's `scale * (x Aᵀ) Bᵀ` for the rows that have an adapter."""

    def __init__(
        self,
        base_layer: LinearBase,
        input_size: int,  # the checkpoint's input columns: what the adapter's A must have
        local_input_size: int,  # the columns rank r multiplies
        slices: list[LoRASlice],  # in output order
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
        # tensors, one per slice, as vLLM's `lora_a_stacked` / `lora_b_stacked`; rank r's shard.
        self.lora_a_stacked = tuple(  # each [L, R, in / N] (row-parallel) or [L, R, in]
            torch.zeros(max_loras, max_lora_rank, local_input_size, dtype=dtype, device=device)
            for _ in slices
        )
        self.lora_b_stacked = tuple(  # each [L, local out_i, R]
            torch.zeros(max_loras, s.local_size, max_lora_rank, dtype=dtype, device=device)
            for s in slices
        )
        self.scales = torch.zeros(max_loras, dtype=dtype, device=device)  # [L]

    @property
    def targets(self) -> dict[str, tuple[int, int]]:
        """Each slice's module name -> (in, out) in the checkpoint: what an adapter of this model
        must match, on every rank alike."""
        return {s.name: (self.input_size, s.output_size) for s in self.slices}

    def slice_lora_a(self, i: int, lora_a: torch.Tensor) -> torch.Tensor:
        """Rank r's part of slice i's A ([r, in]): all of it, but for a row-parallel layer."""
        return lora_a

    def slice_lora_b(self, i: int, lora_b: torch.Tensor) -> torch.Tensor:
        """Rank r's part of slice i's B ([out_i, r]): all of it, but for a column-parallel layer."""
        return lora_b

    def set_lora(self, slot: int, weights: dict[str, LoRALayerWeights], scale: float) -> None:
        """Copy rank r's shard of an adapter's A and B for this layer's slices into `slot` (zero
        where it has none: an attention-only adapter leaves the MLP as the base model's)."""
        self.reset_lora(slot)
        for i, s in enumerate(self.slices):
            w = weights.get(s.name)
            if w is not None:
                a, b = self.slice_lora_a(i, w.lora_a), self.slice_lora_b(i, w.lora_b)
                rank = a.shape[0]
                self.lora_a_stacked[i][slot, :rank].copy_(a)
                self.lora_b_stacked[i][slot, :, :rank].copy_(b)
        self.scales[slot] = scale

    def reset_lora(self, slot: int) -> None:
        for a, b in zip(self.lora_a_stacked, self.lora_b_stacked):
            a[slot].zero_()
            b[slot].zero_()
        self.scales[slot] = 0.0

    def add_lora(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[:, slice i] += each row's scale · (x Aᵢᵀ) Bᵢᵀ, in place; x [T, in], out [T, out]."""
        slots, ops = self.mapping.token_slots, self.mapping.ops
        offset = 0
        for a, b in zip(self.lora_a_stacked, self.lora_b_stacked):
            y = ops.shrink(x, a, slots)  # [T, R]
            ops.expand(out, y, b, slots, self.scales, offset)
            offset += b.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, sum(out_i)]
        out = self.base_layer(x)
        if self.mapping.has_lora:
            self.add_lora(x, out)
        return out


class ColumnParallelLinearWithLoRA(BaseLinearLayerWithLoRA):
    """A column-parallel linear: B keeps the rows of each part that the base weight keeps."""

    base_layer: ColumnParallelLinear

    def slice_lora_b(self, i: int, lora_b: torch.Tensor) -> torch.Tensor:
        # [out_i, r] -> [local out_i, r]: each base part it covers, cut as that part's weight
        parts = self.slices[i].parts
        pieces = lora_b.split([self.base_layer.output_sizes[p] for p in parts])
        return torch.cat([piece[self.base_layer.shard_rows(p)] for piece, p in zip(pieces, parts)])


class MergedColumnParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    pass


class MergedQKVParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    pass


class RowParallelLinearWithLoRA(BaseLinearLayerWithLoRA):
    """A row-parallel linear: A keeps the input columns the base weight keeps, and the delta is
    added to the base layer's partial product, before the all-reduce that sums both."""

    base_layer: RowParallelLinear

    def __init__(self, base_layer: RowParallelLinear, *args: Any) -> None:
        super().__init__(base_layer, *args)
        base_layer.reduce_results = False  # this wrapper reduces, once its delta is in

    def slice_lora_a(self, i: int, lora_a: torch.Tensor) -> torch.Tensor:
        return lora_a[:, self.base_layer.shard_cols()]  # [r, in] -> [r, in / N]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / N] -> [T, out]
        partial = self.base_layer(x)  # [T, out]: rank r's share, not yet summed
        if self.mapping.has_lora:
            self.add_lora(x, partial)
        return self.base_layer.reduce(partial)


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
            full_in = module.input_size * module.tp.world_size
            out = [LoRASlice(path, hidden_size, hidden_size)]
            wrapper = RowParallelLinearWithLoRA(module, full_in, module.input_size, out, *args)
        elif isinstance(module, ColumnParallelLinear) and attr in PACKED_MODULES:
            names = PACKED_MODULES[attr]
            full, local = module.output_sizes, module.local_sizes
            if packed_checkpoint or len(names) != len(local):
                cls: type[BaseLinearLayerWithLoRA] = ColumnParallelLinearWithLoRA
                slices = [LoRASlice(path, sum(full), sum(local), tuple(range(len(local))))]
            else:
                cls = (
                    MergedQKVParallelLinearWithLoRA
                    if isinstance(module, QKVParallelLinear)
                    else MergedColumnParallelLinearWithLoRA
                )
                slices = [
                    LoRASlice(f"{parent_path}.{n}", full[p], local[p], (p,))
                    for p, n in enumerate(names)
                ]
            wrapper = cls(module, hidden_size, hidden_size, slices, *args)
        if wrapper is not None:
            setattr(model.get_submodule(parent_path), attr, wrapper)
            wrapped[path] = wrapper
    return wrapped
