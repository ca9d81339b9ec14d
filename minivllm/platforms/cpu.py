"""`CpuPlatform`: x86 CPUs (vLLM's vllm/platforms/cpu.py), with the compiled kernels of
minivllm/cpu/, which it names and never imports (vLLM's platforms return class names for the
same reason: the plug-in sits above the model, the platform below it).

The compiled CPU attention backend is the default ("cpu"), float32 the default dtype, and the KV
cache takes `cpu_kv_cache_space` GiB (vLLM's VLLM_CPU_KVCACHE_SPACE). With `custom_ops="all"`
every custom op runs its CPU forward (`minivllm/cpu/op_forwards.py`: fused norms, SiLU·mul and RoPE,
the linears and an untied LM head on their weights prepacked for oneDNN, else the skinny GEMM and
MKL's faster layout; `minivllm/cpu/moe.py`: the fused MoE op's experts on oneDNN), and a decode
step's layers may run as one C++ loop (`decode_loop_cls`, minivllm/worker/cpu_decode_loop.py).

"auto" is "all" with the CPU attention backend only: the fused ops are built into the same
library as that backend, so where the library could not be built (and "auto" fell back to the
reference backend) they are not there either; the reference backend is the plain-PyTorch
specification end to end; and the Triton backend on a CPU is the interpreter of the tests.
"""

from __future__ import annotations

import importlib

import torch

from minivllm.platforms.interface import Platform, resolve_obj_by_qualname


class CpuPlatform(Platform):
    device_type = "cpu"
    default_attention_backend = "cpu"
    attention_backends = ("reference", "cpu", "triton")  # triton: TRITON_INTERPRET=1 only
    decode_loop_cls = "minivllm.worker.cpu_decode_loop.CpuDecodeLoop"

    def default_dtype(self) -> torch.dtype:
        return torch.float32

    def slow_dtype_note(self, dtype: torch.dtype) -> str | None:
        if dtype == torch.float16 and not float16_matmul():
            return (
                "dtype=float16 on a CPU without float16 matrix instructions (AVX512-FP16 or "
                "AMX-FP16): its matmuls are emulated, many times slower than float32 here; "
                "float32 is the faster choice"
            )
        # float32 stays the default everywhere; bfloat16 is the user's choice, and on a CPU with
        # no bf16 dot products (AVX512-BF16 or AMX) PyTorch and oneDNN convert every operand to
        # float32 and back, which costs more than it saves.
        if (
            dtype != torch.bfloat16
            or torch.cpu._is_avx512_bf16_supported()
            or torch.cpu._is_amx_tile_supported()
        ):
            return None
        return (
            "dtype=bfloat16 on a CPU without bf16 instructions (AVX512-BF16 or AMX): it is "
            "emulated, slower than float32 here; float32 is the default and the faster choice"
        )

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
        # fails here, at load time, with `CpuKernelUnavailable`, not mid-step. Importing the
        # forwards' module registers them (`register_forward`).
        resolve_obj_by_qualname("minivllm.cpu.build.load_cpu_kernels")()
        importlib.import_module("minivllm.cpu.op_forwards")
        importlib.import_module("minivllm.cpu.moe")  # the fused MoE op (torch and oneDNN)


def float16_matmul() -> bool:
    """Whether float16 matmuls run on this CPU's own instructions: oneDNN's float16 GEMM, which
    needs AVX512-FP16 or AMX-FP16 (and honours `ONEDNN_MAX_CPU_ISA`). Without them PyTorch's
    float16 matmul is emulated, many times float32's time (docs/performance.md)."""
    return torch.backends.mkldnn.is_available() and bool(
        torch.ops.mkldnn._is_mkldnn_fp16_supported()
    )
