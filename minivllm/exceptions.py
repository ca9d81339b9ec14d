"""Errors that cross a module boundary: what a caller catches (vLLM's vllm/v1/engine/exceptions.py)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core process is gone (killed, crashed, or shut down): every request it held
    fails with this, and so does every new one. Nothing recovers it but a restart of the server."""
