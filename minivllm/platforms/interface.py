"""`Platform`: what a kind of device decides for the engine, in one place (vLLM's
vllm/platforms/interface.py).

Every choice that depends on the device, and only on it, is a method or an attribute here, so that
no other module asks `device.type` to pick its code:

- which forwards the custom ops run (`dispatch_custom_ops` in minivllm/model/custom_op.py asks the
  platform), under the `custom_ops` setting that `resolve_custom_ops` settles (vLLM's `CompilationConfig.custom_ops`:
  "all" runs the platform's fused kernels, "none" runs every op's plain-PyTorch `forward_native`);
- the attention backend that `"auto"` means, and the backends that run on the device;
- the dtype that `"auto"` means, and how many bytes the KV cache may take;
- the collective library between tensor-parallel ranks (`dist_backend`, vLLM's name);
- how the sampler draws a random row (`sampling_method`);
- the attention backends by the qualified names of their classes (`get_attn_backend_cls`), and
  the device's decode loop, if it has one (`decode_loop_cls`: a decode step's layers as one
  compiled call, which the model runner owns, as vLLM's runner owns CUDA-graph capture).

A platform states facts and *names* code (vLLM's platforms return qualified class names); it
imports nothing of minivllm. The plug-ins it names (minivllm/cpu/, the attention backends) sit
above the model and are imported by name, on first use, by whoever asks
(`resolve_obj_by_qualname`): they are the package's declared plug-ins.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

import torch

CUSTOM_OPS = ("auto", "all", "none")

# Every attention backend by the qualified name of its class (vLLM's `get_attn_backend_cls`
# returns such names): minivllm/attention/selector.py imports the one a step needs, on first use.
ATTENTION_BACKEND_CLASSES = {
    "reference": "minivllm.attention.backends.reference.ReferenceBackend",
    "cpu": "minivllm.attention.backends.cpu.CpuBackend",
    "triton": "minivllm.attention.backends.triton.TritonBackend",
}


def resolve_obj_by_qualname(qualname: str) -> Any:
    """The object `qualname` ("package.module.Name") names, its module imported now (vLLM's
    `resolve_obj_by_qualname`): how a lower room reaches a plug-in it may only name."""
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


class DecodeLoop(Protocol):
    """A decode step's model body as one compiled call (the CPU's: minivllm/worker/cpu_decode_loop.py)."""

    def applies(self, num_tokens: int, meta: Any) -> bool:
        """Whether this step is one the captured call runs exactly as the model would."""
        ...

    def __call__(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        kv_caches: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: Any,  # AttentionMetadata
    ) -> torch.Tensor:  # [T, hidden_size]  what the model's forward returns
        ...


class Platform:
    """The base: every op in plain PyTorch, no replay. Subclasses say what their device adds."""

    device_type: str = ""
    default_attention_backend: str = "reference"
    attention_backends: tuple[str, ...] = ("reference",)  # those that run on this device
    dist_backend: str = "gloo"  # torch.distributed's library for collectives between ranks
    # How the sampler draws a row's token (sampler.random_sample): inverse-CDF sampling with one
    # uniform per row, or the exponential race, which needs no host sync (a GPU's choice).
    sampling_method: str = "multinomial"
    # The qualified name of a `DecodeLoop` class with `build(model, backend) -> DecodeLoop | None`,
    # where this device has one; None otherwise.
    decode_loop_cls: str | None = None

    def default_dtype(self) -> torch.dtype:
        """What dtype "auto" means."""
        return torch.float32

    def slow_dtype_note(self, dtype: torch.dtype) -> str | None:
        """One line to log when the user asked for a dtype this device only emulates, else None."""
        return None

    def kv_cache_budget_bytes(
        self, device: torch.device, gpu_memory_utilization: float, cpu_kv_cache_space: float
    ) -> float:
        """How many bytes the KV cache may take on `device` (CacheConfig's two limits)."""
        raise NotImplementedError

    def get_attn_backend_cls(self, name: str) -> str:
        """The qualified class name of the attention backend `name` (resolved: not "auto")."""
        self.check_attention_backend(name)
        return ATTENTION_BACKEND_CLASSES[name]

    def check_attention_backend(self, name: str) -> None:
        """Refuse a backend (by its resolved name) that does not run on this device."""
        if name not in self.attention_backends:
            raise ValueError(
                f'attention_backend "{name}" needs device '
                f'"{"cuda" if name == "triton" else "cpu"}", got {self.device_type!r}'
            )

    def resolve_custom_ops(self, custom_ops: str, attention_backend: str) -> str:
        """ "auto" settled for this device and attention backend: "all" or "none". The reference
        backend always means "none": it is the specification, plain PyTorch end to end."""
        if custom_ops not in CUSTOM_OPS:
            raise ValueError(f"custom_ops must be one of {CUSTOM_OPS}, got {custom_ops!r}")
        if custom_ops != "auto":
            return custom_ops
        return "none" if attention_backend == "reference" else "all"

    def register_op_forwards(self) -> None:
        """Make this platform's custom-op forwards known (import the module that registers them,
        load their library). The base has none."""
