"""Errors that cross a module boundary: what a caller catches (vLLM's vllm/v1/engine/exceptions.py).

An error lives here when a lower room must catch what a higher one raises (the attention selector
falls back when the CPU plug-in cannot be built).
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core process is gone (killed, crashed, or shut down): every request it held
    fails with this, and so does every new one. Nothing recovers it but a restart of the server."""


class CpuKernelUnavailable(RuntimeError):
    """The C++ kernels (decode attention, layer ops) could not be built or loaded here
    (minivllm/cpu/build.py)."""
