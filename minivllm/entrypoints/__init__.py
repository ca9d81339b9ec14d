"""The OpenAI-compatible server and the `minivllm` command (vLLM's vllm/entrypoints/).

Tier: frontends (may import anything below; nothing below imports it). The server drives the
engine through `EngineClient` (minivllm/engine/protocol.py): this package imports
minivllm.engine, never the other way.
"""
