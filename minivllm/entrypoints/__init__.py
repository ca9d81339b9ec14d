"""The OpenAI-compatible server and the `minivllm` command (vLLM's vllm/entrypoints/).

The server drives the engine through `EngineClient` (minivllm/engine/protocol.py): this package
imports minivllm.engine, never the other way.
"""
