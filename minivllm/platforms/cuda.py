"""`CudaPlatform`: NVIDIA GPUs (vLLM's vllm/platforms/cuda.py).

Triton is the default attention backend; bfloat16 is the default dtype where the GPU has it. The
CUDA forwards are that of layers holding a GGUF file's blocks, a Triton GEMM that dequantizes
inside the product (minivllm/model/quantization/gguf/cuda_forwards.py), and the fused MoE op's
Triton grouped GEMM (minivllm/model/layers/triton_fused_moe.py); every other layer runs
`forward_native` (cuBLAS for the matmuls), and there is no decode loop: a CUDA graph would be
that, and is not built here.
"""

from __future__ import annotations

import importlib

import torch

from minivllm.platforms.interface import Platform

# Kept free for the activations of a step, outside the KV cache's share of the memory.
ACTIVATION_HEADROOM_BYTES = 256 * 2**20


class CudaPlatform(Platform):
    device_type = "cuda"
    default_attention_backend = "triton"
    attention_backends = ("reference", "triton")
    dist_backend = "nccl"
    sampling_method = "exponential"  # B x V exponentials are cheap here, and no host sync

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def register_op_forwards(self) -> None:
        # Named, not imported: the platforms are leaves, the forwards live with the model.
        importlib.import_module("minivllm.model.quantization.gguf.cuda_forwards")
        importlib.import_module("minivllm.model.layers.triton_fused_moe")  # the fused MoE op

    def kv_cache_budget_bytes(
        self, device: torch.device, gpu_memory_utilization: float, cpu_kv_cache_space: float
    ) -> float:
        """`gpu_memory_utilization` of the device, less what is already used (the weights)."""
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        return gpu_memory_utilization * total - used - ACTIVATION_HEADROOM_BYTES
