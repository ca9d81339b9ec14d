"""Which implementation of Punica's shrink and expand a model's LoRA wrappers run.

vLLM picks a `PunicaWrapper` per platform (vllm/lora/punica_wrapper/punica_selector.py:
`PunicaWrapperGPU` on the Triton kernels, `PunicaWrapperCPU` on torch ops). Here the choice
follows the attention backend the engine runs, since each backend names a family of kernels:

| attention backend | shrink / expand | where |
|---|---|---|
| `reference` | plain PyTorch, rows grouped by slot (the specification) | minivllm/lora/punica.py |
| `cpu` | the compiled CPU library, one dot per output element | minivllm/cpu/csrc/cpu_lora_punica.cpp |
| `triton` | Triton kernels over (row blocks x output blocks, slots) | minivllm/lora/triton_punica.py |

All three compute the same function (tests/lora/test_punica.py, tests/cpu/
test_kernels_cpu_lora_punica.py, tests/lora/test_kernels_triton_punica.py). Triton is imported
only when the triton backend asks for it: it is an optional dependency.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minivllm.cpu import ops as cpu_ops
from minivllm.cpu.build import load_cpu_kernels
from minivllm.lora import punica

# shrink(x [T, in], lora_a [L, R, in], token_slots int64 [T]) -> y [T, R]
ShrinkFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# expand(out [T, out_total], y [T, R], lora_b [L, out_i, R], token_slots [T], scales [L], offset)
ExpandFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], None
]


@dataclass(frozen=True)
class PunicaOps:
    name: str  # the attention backend's name whose kernels these are
    shrink: ShrinkFn
    expand: ExpandFn


REFERENCE_OPS = PunicaOps("reference", punica.shrink, punica.expand)


def get_punica_ops(attention_backend: str) -> PunicaOps:
    """The shrink and expand of `attention_backend`'s kernel family (the reference for any other)."""
    if attention_backend == "cpu":
        load_cpu_kernels()  # built with the backend's own kernels: one library
        return PunicaOps("cpu", cpu_ops.lora_shrink, cpu_ops.lora_expand)
    if attention_backend == "triton":
        from minivllm.lora import triton_punica

        return PunicaOps(
            "triton", triton_punica.lora_shrink_triton, triton_punica.lora_expand_triton
        )
    return REFERENCE_OPS
