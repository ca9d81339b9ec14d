"""`LoRAConfig`: how many adapters a step may carry and how big they may be (vLLM's
`vllm/config/lora.py`).

vLLM's field names and meanings: `max_loras` adapters are resident on the device at once (one slot
each, and so at most that many distinct adapters in one step), every adapter's rank is at most
`max_lora_rank` (the slots' A and B are that wide), and `max_cpu_loras` adapters are kept loaded in
host memory (an LRU), so that an adapter that leaves its slot comes back without reading its files.
The engine builds it from `EngineArgs` (`enable_lora=True`); without it, LoRA is off.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's allowed ranks are these too: the slot width is one of them (punica's kernels tile by it).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
MAX_LORAS_LIMIT = 64  # slots: each holds a max_lora_rank-wide A and B for every adapted linear


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int  # device slots: the most distinct adapters in one step
    max_lora_rank: int  # the widest adapter rank; every slot's A/B are this wide
    max_cpu_loras: int  # adapters kept loaded in host memory (LRU), at least max_loras

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not 1 <= self.max_loras <= MAX_LORAS_LIMIT:
            raise ValueError(f"max_loras must be in [1, {MAX_LORAS_LIMIT}], got {self.max_loras}")
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {LORA_RANKS}, got {self.max_lora_rank}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras must be at least max_loras ({self.max_loras}), "
                f"got {self.max_cpu_loras}"
            )
