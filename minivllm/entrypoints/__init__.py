"""The OpenAI-compatible server and the `minivllm` command (vLLM's vllm/entrypoints/).

The server drives the engine through `EngineClient` (minivllm/engine_core/protocol.py): this package
imports minivllm.engine_core, never the other way.
"""
