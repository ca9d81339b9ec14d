"""The model runner of a model whose layers share the KV cache in groups (Gemma 2/3: windowed
and global layers mixed; core/kv_cache_groups.py draws the layout).

vLLM's GPU model runner builds one attention metadata per KV cache group and hands each layer its
group's (vllm/v1/worker/gpu_model_runner.py); this runner does the same around the plain one:

    kv_cache                  [group_size, 2, num_blocks, block_size, num_kv_heads, head_dim]
    layer i                   slot j = i's place in its group: kv_cache[j] ([2, num_blocks, ...])
    AttentionMetadata of g    the step's, with group g's block tables and slot mapping

A block belongs to one group at a time (the coordinator's one pool hands it out), so the layers
that share slot j never write the same slots: layer i writes through its group's tables only.
Everything else (query_start_loc, seq_lens, the sampled rows) is the step's, shared by all
groups. The model gets a cache view and a metadata per layer (`Gemma2Model.forward`); every
attention backend then sees what it sees for any layer, a window or none. A copy-on-write copies
a block in every slot, which copies the group's layers that hold it.

The C++ decode loop is not used: it runs no sliding window, and such a model always has one.

It imports the model runner, core and leaves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from minivllm.attention.abstract import AttentionBackend, AttentionMetadata
from minivllm.core.kv_cache_groups import KVCacheGroupSpec, num_cache_slots
from minivllm.core.scheduler import SchedulerOutput
from minivllm.model.models.llama import LlamaForCausalLM
from minivllm.worker.model_runner import ModelInput, ModelRunner


@dataclass
class HybridModelInput(ModelInput):
    layer_meta: list[AttentionMetadata]  # [num_layers]  each layer's group's metadata


class HybridModelRunner(ModelRunner):
    """`ModelRunner` with a block table, a slot mapping and a cache slot per group of layers."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        enforce_eager: bool = False,
        *,
        kv_cache_groups: Sequence[KVCacheGroupSpec],
    ) -> None:
        slots = num_cache_slots(kv_cache_groups)
        # Always eager: the C++ decode loop runs no sliding window, and this model has one.
        super().__init__(model, backend, num_blocks, block_size, dtype, device, True, slots)
        self.kv_cache_groups = list(kv_cache_groups)
        group_of: dict[int, int] = {}
        slot_of: dict[int, int] = {}
        for g, group in enumerate(kv_cache_groups):
            for slot, layer in enumerate(group.layer_ids):
                group_of[layer], slot_of[layer] = g, slot
        num_layers = model.config.num_hidden_layers
        if sorted(group_of) != list(range(num_layers)):
            raise ValueError(f"the KV cache groups must place each of the {num_layers} layers once")
        self.layer_group = [group_of[i] for i in range(num_layers)]  # [num_layers]
        self.layer_caches = [self.kv_cache[slot_of[i]] for i in range(num_layers)]  # views

    def prepare_inputs(self, sched: SchedulerOutput) -> HybridModelInput:
        inp = super().prepare_inputs(sched)  # group 0's metadata: `ScheduledSequence.block_table`
        metas = [inp.meta]
        for g in range(1, len(self.kv_cache_groups)):
            metas.append(self.group_metadata(sched, inp.meta, g))
        return HybridModelInput(**vars(inp), layer_meta=[metas[g] for g in self.layer_group])

    def group_metadata(
        self, sched: SchedulerOutput, meta: AttentionMetadata, g: int
    ) -> AttentionMetadata:
        """Group g's metadata: the step's, with the group's block tables and the slots its layers
        write (as the plain runner maps them: block table entry, then offset in the block)."""
        bs = self.block_size
        tables = [item.group_block_tables[g - 1] for item in sched.scheduled]
        slots = [
            table[p // bs] * bs + p % bs
            for item, table in zip(sched.scheduled, tables)
            for p in range(item.num_computed_tokens, item.seq_len)
        ]
        width = max(len(table) for table in tables)
        padded = [table + [0] * (width - len(table)) for table in tables]
        group_meta = replace(
            meta,
            block_tables=torch.tensor(padded, dtype=torch.int32, device=self.device),  # [B, width]
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),  # [T]
            plan=None,
        )
        group_meta.plan = self.backend.plan(group_meta, bs)  # its tables: a plan of its own
        return group_meta

    def run_model(self, inp: ModelInput) -> torch.Tensor:  # [T, hidden_size]
        assert isinstance(inp, HybridModelInput)
        return self.model(inp.input_ids, inp.positions, self.layer_caches, inp.layer_meta)
