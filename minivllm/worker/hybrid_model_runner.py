"""The model runner of a model whose layers share the KV cache in groups (Gemma 2/3: windowed
and global layers mixed; core/kv_cache_groups.py draws the layout).

vLLM's GPU model runner builds one attention metadata per KV cache group and hands each layer its
group's (vllm/v1/worker/gpu_model_runner.py); this runner does the same around the plain one:

    kv_cache                  [group_size, 2, num_blocks, block_size, num_kv_heads, head_dim]
    layer i                   slot j = i's place in its group: kv_cache[j] ([2, num_blocks, ...]);
                              with pipeline parallelism, its place among the group's layers that
                              this stage holds
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
from minivllm.core.kv_cache_groups import KVCacheGroupSpec
from minivllm.core.scheduler import SchedulerOutput
from minivllm.distributed.pipeline import IntermediateTensors
from minivllm.model.models.llama import LlamaForCausalLM
from minivllm.worker.model_runner import ModelInput, ModelRunner


@dataclass
class HybridModelInput(ModelInput):
    layer_meta: list[AttentionMetadata]  # [stage_layers]  each of this stage's layers' group's


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
        # A pipeline stage holds its own layers only (all of them on one stage): each group's
        # layers on this stage fill its slots, so a stage's block is its layers' K/V only.
        first, end = model.model.start_layer, model.model.end_layer
        stage_groups = [[i for i in g.layer_ids if first <= i < end] for g in kv_cache_groups]
        slots = max(len(layers) for layers in stage_groups)
        # Always eager: the C++ decode loop runs no sliding window, and this model has one.
        super().__init__(model, backend, num_blocks, block_size, dtype, device, True, slots)
        self.kv_cache_groups = list(kv_cache_groups)
        group_of: dict[int, int] = {}
        slot_of: dict[int, int] = {}
        for g, layers in enumerate(stage_groups):
            for slot, layer in enumerate(layers):
                group_of[layer], slot_of[layer] = g, slot
        if sorted(group_of) != list(range(first, end)):
            raise ValueError(
                f"the KV cache groups must place each of layers {first}..{end - 1} once"
            )
        self.layer_group = [group_of[i] for i in range(first, end)]  # [stage_layers]
        self.layer_caches = [self.kv_cache[slot_of[i]] for i in range(first, end)]  # views

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

    def run_model(
        self, inp: ModelInput, intermediate: IntermediateTensors | None = None
    ) -> torch.Tensor | IntermediateTensors:  # [T, hidden_size]; a stage before the last's
        assert isinstance(inp, HybridModelInput)
        caches, metas = self.layer_caches, inp.layer_meta
        return self.model(inp.input_ids, inp.positions, caches, metas, intermediate)
