"""Layers with two implementations: the plain-PyTorch specification and a fused CPU kernel.

vLLM gives every layer whose work is elementwise (RMSNorm, SiLU·mul, RoPE) a `CustomOp` base: a
`forward_native` in plain PyTorch, which is the specification, and a `forward_cuda` /
`forward_cpu` that calls one fused kernel. Between two matmuls a Llama layer does little
arithmetic but several passes over memory: plain PyTorch runs RMSNorm as eight ops, each reading
and writing the whole [T, hidden] tensor, while the fused kernel reads each row once. On a CPU that
work was a sixth of an engine step before it was fused (issue 16's profile; `bench throughput
--profile` shows today's), which is why it is worth a kernel.

Here a layer runs `forward_native` unless `use_cpu_kernels(model)` switched it to `forward_cpu`.
The loader does that when the attention backend is "cpu" (the CPU default), whose compiled
library holds the fused ops beside the paged decode kernel (`cpu_norm_kernels.cpp`,
`cpu_layer_kernels.cpp`); the "reference" backend keeps the whole model in plain PyTorch. The
parallel linears are custom ops too: their `forward_cpu` sends decode's few rows to the skinny
GEMM of `cpu_gemm_kernels.cpp` (see `parallel_layers.cpu_linear`). The parity tests run both,
greedy token-exact against transformers.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class CustomOp(nn.Module):
    """A layer with a plain-PyTorch `forward_native` and a fused `forward_cpu` of equal results."""

    use_cpu_kernels = False  # set per instance by `use_cpu_kernels(model)`

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.use_cpu_kernels:
            return self.forward_cpu(*args, **kwargs)
        return self.forward_native(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def use_cpu_kernels(model: nn.Module, enforce_eager: bool = False) -> int:
    """Switch every `CustomOp` in `model` to its fused CPU kernel, give the LM head its
    prepacked weight (`ParallelLMHead.prepack_for_cpu`) and let decode steps run their layers in
    one C++ call (`LlamaForCausalLM.enable_cpu_decode_layers`) unless `enforce_eager`; returns
    how many ops were switched.

    The library is loaded (built on first use) before any layer switches, so a machine that
    cannot build it fails here, at load time, with `CpuKernelUnavailable`, not mid-step.
    """
    from minivllm.attention.cpu_build import load_cpu_kernels

    load_cpu_kernels()
    ops = [m for m in model.modules() if isinstance(m, CustomOp)]
    for op in ops:
        op.use_cpu_kernels = True
    # Found by their methods, not their classes: parallel_layers and llama build on this module.
    hooks = ["prepack_for_cpu"] + ([] if enforce_eager else ["enable_cpu_decode_layers"])
    for m in model.modules():
        for hook in hooks:
            prepare = getattr(m, hook, None)
            if prepare is not None:
                prepare()
    return len(ops)
