"""Choosing the attention backend: a name ("auto", "reference", "cpu", "triton") to an instance.

vLLM's vllm/attention/selector.py: the platform says which backend "auto" means on a device and
names each backend's class (`Platform.get_attn_backend_cls`); the selector imports the one asked
for. It is the only module that turns a backend's name into its class, so the contract
(attention/abstract.py) imports no backend and the compiled CPU backend stays a plug-in.
"""

from __future__ import annotations

import logging

import torch

from minivllm.attention.abstract import BACKEND_NAMES, AttentionBackend
from minivllm.exceptions import CpuKernelUnavailable
from minivllm.platforms import platform_for, resolve_obj_by_qualname


def resolve_backend_name(name: str, device: torch.device) -> str:
    """`"auto"` is the platform's default: Triton on CUDA, the compiled CPU backend on a CPU."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}")
    if name == "auto":
        return platform_for(device).default_attention_backend
    return name


def get_attention_backend(
    name: str = "auto", device: torch.device | None = None
) -> AttentionBackend:
    """Return the backend called `name` ("reference", "cpu", "triton", or "auto" for the device).

    `"auto"` on a CPU falls back to the reference backend, with a warning, where the CPU kernel
    cannot be compiled; asking for `"cpu"` by name raises `CpuKernelUnavailable` there instead.
    """
    device = device or torch.device("cpu")
    resolved = resolve_backend_name(name, device)
    platform = platform_for(device)
    # Imported by name, on first use: the default path pays for no backend it does not use, and
    # the compiled ones (minivllm/cpu/) are plug-ins from a room above this one.
    backend_cls = resolve_obj_by_qualname(platform.get_attn_backend_cls(resolved))
    try:
        return backend_cls()
    except CpuKernelUnavailable as e:
        if name != "auto":
            raise
        logging.getLogger("minivllm").warning("%s; using the reference backend", e)
    return resolve_obj_by_qualname(platform.get_attn_backend_cls("reference"))()


__all__ = ["get_attention_backend", "resolve_backend_name"]
