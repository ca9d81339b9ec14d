"""Which adapters are where: `max_loras` device slots, and an LRU of `max_cpu_loras` in host memory.

vLLM's `LRUCacheLoRAModelManager` and `LRUCacheWorkerLoRAManager` (vllm/lora/models.py,
vllm/lora/worker_manager.py), folded into one object per model runner:

- `add_lora(request)` reads and checks an adapter (a PEFT folder: peft_loader.py; a llama.cpp
  GGUF file on a GGUF base: gguf_loader.py) into host memory, the most
  recently used last; past `max_cpu_loras` the least recently used one is dropped (it is read
  from its folder again if a later request needs it). The engine calls it when a request is
  added, so a bad adapter is refused there, by name, before the request is queued.
- `activate(requests)` makes the step's adapters resident: one already in a slot stays there; a
  new one takes a free slot, or the least recently used slot whose adapter this step does not
  need (its A/B are overwritten: an eviction costs a copy, never a file read while the adapter
  is in host memory). It returns each adapter's slot; the runner turns them into the rows' slots.

The scheduler guarantees a step never carries more than `max_loras` distinct adapters (it admits a
request only when its adapter can get a slot), so `activate` always finds room.

Under tensor parallelism every rank has a manager of its own and reads the whole adapter from
the same file into host memory; a slot holds the rank's shard only, cut as the base weights are
cut when `activate` copies the adapter in (the wrappers' `slice_lora_a` / `slice_lora_b`,
layers.py). The ranks need no message of their own for this: each step's `SchedulerOutput`
carries every scheduled request's `LoRARequest`, and `activate` is deterministic, so every rank
puts each adapter in the same slot; `add_lora` and `remove_lora` reach every rank as one
`AddLoRA` / `RemoveLoRAs` call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minivllm.config.lora import LoRAConfig
from minivllm.lora.errors import LoRAError
from minivllm.lora.gguf_loader import is_gguf_file, load_gguf_adapter
from minivllm.lora.layers import BaseLinearLayerWithLoRA, LoRAMapping, wrap_linears
from minivllm.lora.peft_loader import LoRAModel, load_peft_adapter
from minivllm.lora.punica_selector import get_punica_ops
from minivllm.lora.request import LoRARequest
from minivllm.model.models.llama import LlamaForCausalLM


class LoRAModelManager:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: LoRAConfig,
        dtype: torch.dtype,
        device: torch.device,
        base_gguf: Path | None = None,  # the .gguf file the model came from, if it did
        attention_backend: str = "reference",  # whose shrink / expand kernels run (punica_selector)
    ) -> None:
        self.config = config
        self.model_config = model.config
        self.base_gguf = base_gguf
        self.dtype = dtype
        self.device = device
        self.mapping = LoRAMapping(ops=get_punica_ops(attention_backend))
        self.layers: dict[str, BaseLinearLayerWithLoRA] = wrap_linears(
            model, self.mapping, config.max_loras, config.max_lora_rank, dtype, device
        )
        # Every module an adapter may target: its transformers name -> (in, out).
        self.targets = {
            name: io for layer in self.layers.values() for name, io in layer.targets.items()
        }
        self.cpu_loras: OrderedDict[int, LoRAModel] = OrderedDict()  # id -> adapter, LRU first
        self.slots: OrderedDict[int, int] = OrderedDict()  # id -> its device slot, LRU first

    # ------------------------------------------------------------------ host memory
    def add_lora(self, request: LoRARequest) -> LoRAModel:
        """The adapter in host memory (read and checked now if it is not), marked most recent."""
        lora = self.cpu_loras.get(request.lora_int_id)
        if lora is None:
            lora = self._read(request)  # raises, changing nothing, on a bad adapter
            self.cpu_loras[request.lora_int_id] = lora
            while len(self.cpu_loras) > self.config.max_cpu_loras:
                self.cpu_loras.popitem(last=False)
        self.cpu_loras.move_to_end(request.lora_int_id)
        return lora

    def _read(self, request: LoRARequest) -> LoRAModel:
        """A PEFT folder, or a llama.cpp GGUF adapter file (on a GGUF base only)."""
        rank = self.config.max_lora_rank
        if is_gguf_file(request.lora_path):
            return load_gguf_adapter(
                request, self.targets, rank, self.dtype, self.model_config, self.base_gguf
            )
        return load_peft_adapter(request, self.targets, rank, self.dtype)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter, from its slot and from host memory (vLLM's `remove_lora`)."""
        slot = self.slots.pop(lora_int_id, None)
        if slot is not None:
            for layer in self.layers.values():
                layer.reset_lora(slot)
        return self.cpu_loras.pop(lora_int_id, None) is not None or slot is not None

    def list_loras(self) -> list[int]:
        return list(self.cpu_loras)

    # ------------------------------------------------------------------ device slots
    def activate(self, requests: Iterable[LoRARequest]) -> dict[int, int]:
        """Make every adapter of the step resident; returns lora_int_id -> slot."""
        wanted = {r.lora_int_id: r for r in requests}
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(
                f"a step carries {len(wanted)} adapters but max_loras is {self.config.max_loras}"
            )
        for lora_id in wanted:
            if lora_id in self.slots:
                self.slots.move_to_end(lora_id)
        for lora_id, request in wanted.items():
            if lora_id not in self.slots:
                self._load_into_slot(request, self._take_slot(wanted))
        return {lora_id: self.slots[lora_id] for lora_id in wanted}

    def _take_slot(self, wanted: dict[int, LoRARequest]) -> int:
        """A free slot, else the least recently used one whose adapter the step does not need."""
        used = set(self.slots.values())
        for slot in range(self.config.max_loras):
            if slot not in used:
                return slot
        victim = next(i for i in self.slots if i not in wanted)  # LRU first
        return self.slots.pop(victim)

    def _load_into_slot(self, request: LoRARequest, slot: int) -> None:
        lora = self.add_lora(request)
        for layer in self.layers.values():
            layer.set_lora(slot, lora.layers, lora.scale)
        self.slots[request.lora_int_id] = slot

    def set_mapping(self, token_slots: torch.Tensor) -> None:  # int64 [T]
        """The step's row -> slot map, read by every wrapper in the forward that follows."""
        self.mapping.set(token_slots)


@dataclass(frozen=True)
class AddLoRA:
    """`add_lora` as a `collective_rpc` function, sent by value to every rank (a closure would
    not pickle). A bad adapter's `LoRAError` is returned, not raised: every rank reads the same
    file and refuses it alike, and a rank that raised inside an RPC would stop the whole group
    for one bad request."""

    request: LoRARequest

    def __call__(self, runner: Any) -> LoRAError | None:  # runner: the rank's ModelRunner
        manager: LoRAModelManager = runner.lora_manager
        try:
            manager.add_lora(self.request)
        except LoRAError as exc:
            return exc
        return None


@dataclass(frozen=True)
class RemoveLoRAs:
    """`remove_lora` of each id as a `collective_rpc` function, sent by value to every rank."""

    lora_int_ids: frozenset[int]

    def __call__(self, runner: Any) -> None:  # runner: the rank's ModelRunner
        manager: LoRAModelManager = runner.lora_manager
        for lora_id in self.lora_int_ids:
            manager.remove_lora(lora_id)
