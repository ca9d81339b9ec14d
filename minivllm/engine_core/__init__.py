"""The engine behind the server, seen through one interface: `EngineClient` (protocol.py).

vLLM keeps the same split between `vllm/engine/protocol.py` (the interface),
`vllm/v1/engine/async_llm.py` (the in-process driver) and `vllm/v1/engine/core.py` /
`core_client.py` (the engine in a process of its own):

- protocol.py     `EngineClient`, and `EngineClientBase`, the code its two implementations share
- async_engine.py `AsyncLLMEngine`: the `LLMEngine` stepped by a thread of the server's process
- core.py         `EngineCoreProc`: the `LLMEngine` in a spawned process, served over a pipe
- client.py       `EngineCoreClient` (starts the core) and `AsyncMPClient` (its `EngineClient`)

`minivllm.entrypoints` imports this package; this package imports nothing of the entrypoints.
The package itself imports nothing, so that importing one module loads only what it needs.
"""
