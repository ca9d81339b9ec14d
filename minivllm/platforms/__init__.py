"""The platform seam: one object per kind of device decides every device-dependent choice.

vLLM resolves `current_platform` once, lazily, and asks it wherever code would otherwise test the
device (vllm/platforms/__init__.py). minivllm does the same: `current_platform` is the platform of
the default device (CUDA where it is available, else the CPU), and `platform_for(device)` the
platform of a device the user named (`device="cpu"` on a machine with a GPU). What a platform
decides is listed in `interface.py`; `cpu.py` and `cuda.py` are the two kinds of device.

The model's files hold the math and never ask which device they run on; the attention selector,
the loader, the model runner and the sampler ask the platform. (The Triton backend, the executors
and the worker also read `device.type`, for what only they do with a device: CUDA streams and
device indices, not a choice of code.)

Nothing here imports a plug-in: the platforms name the code they choose (interface.py).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from minivllm.platforms.interface import CUSTOM_OPS, DecodeLoop, Platform, resolve_obj_by_qualname


@functools.cache
def _platform(device_type: str) -> Platform:
    # Imported here: a machine without CUDA never loads the CUDA platform, and the CPU platform's
    # kernels load only when a model asks for them.
    if device_type == "cuda":
        from minivllm.platforms.cuda import CudaPlatform

        return CudaPlatform()
    from minivllm.platforms.cpu import CpuPlatform

    return CpuPlatform()


def platform_for(device: torch.device | str) -> Platform:
    """The platform of `device` (one instance per kind of device)."""
    return _platform(torch.device(device).type)


def __getattr__(name: str) -> Any:
    """`current_platform`, resolved on first use (vLLM's lazy `current_platform`)."""
    if name == "current_platform":
        return _platform("cuda" if torch.cuda.is_available() else "cpu")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CUSTOM_OPS",
    "DecodeLoop",
    "Platform",
    "current_platform",
    "platform_for",
    "resolve_obj_by_qualname",
]
