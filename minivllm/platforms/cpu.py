"""`CpuPlatform`: x86 CPUs (vLLM's vllm/platforms/cpu.py), with the compiled kernels of
minivllm/kernels/.

The compiled CPU attention backend is the default ("cpu"), float32 the default dtype, and the KV
cache takes `cpu_kv_cache_space` GiB (vLLM's VLLM_CPU_KVCACHE_SPACE). With `custom_ops="all"`
every custom op runs its CPU forward (`cpu_ops.py`: fused norms, SiLU·mul and RoPE, the skinny
GEMM and MKL's faster layout for the linears, a prepacked LM head), and a decode step's layers
may be replayed as one C++ call (`capture_decode_layers`).

"auto" is "all" with the CPU attention backend only: the fused ops are built into the same
library as that backend, so where the library could not be built (and "auto" fell back to the
reference backend) they are not there either; the reference backend is the plain-PyTorch
specification end to end; and the Triton backend on a CPU is the interpreter of the tests.
"""

from __future__ import annotations

from typing import Any

import torch

from minivllm.platforms.interface import DecodeReplay, Platform


class CpuPlatform(Platform):
    device_type = "cpu"
    default_attention_backend = "cpu"
    attention_backends = ("reference", "cpu", "triton")  # triton: TRITON_INTERPRET=1 only

    def default_dtype(self) -> torch.dtype:
        return torch.float32

    def kv_cache_budget_bytes(
        self, device: torch.device, gpu_memory_utilization: float, cpu_kv_cache_space: float
    ) -> float:
        return cpu_kv_cache_space * 2**30

    def resolve_custom_ops(self, custom_ops: str, attention_backend: str) -> str:
        resolved = super().resolve_custom_ops(custom_ops, attention_backend)
        if custom_ops == "auto" and attention_backend != "cpu":
            return "none"
        return resolved

    def register_op_forwards(self) -> None:
        # Loaded (built on first use) before any op switches, so a machine that cannot build it
        # fails here, at load time, with `CpuKernelUnavailable`, not mid-step.
        from minivllm.kernels.cpu_build import load_cpu_kernels

        load_cpu_kernels()
        import minivllm.platforms.cpu_ops  # noqa: F401  (registers the CPU forwards)

    def capture_decode_layers(self, model: Any, backend: Any) -> DecodeReplay | None:
        """The decode-layers op (kernels/cpu_decode_layers.py) where it runs this model exactly as
        its Python loop does: the CPU attention backend, every op on its CPU forward, and the
        other conditions of `CpuDecodeLayers.supports`."""
        from minivllm.kernels.cpu_decode_layers import CpuDecodeLayers

        if backend.name != "cpu" or not CpuDecodeLayers.supports(model):
            return None
        return CpuDecodeLayers(model)
