"""`LoRARequest`: which adapter a request runs under (vLLM's `vllm/lora/request.py`).

Plain data, so it travels in the scheduler's message to the worker unchanged: the scheduler reads
`lora_int_id` (slots are counted by it, and it keys the prefix cache), the worker reads
`lora_path` (where the adapter's PEFT folder or GGUF file is, read again if it left host memory).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str  # what the user calls it (the server's model name for it)
    lora_int_id: int  # unique per adapter, >= 1 (vLLM's rule: 0 is the base model)
    lora_path: str  # a PEFT folder, or a llama.cpp GGUF adapter file (GGUF base models)

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"lora_int_id must be an integer, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")

    @property
    def adapter_id(self) -> int:  # vLLM's alias
        return self.lora_int_id
