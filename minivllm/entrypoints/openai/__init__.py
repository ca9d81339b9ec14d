"""vLLM's module path for its OpenAI-compatible server (vllm/entrypoints/openai/), kept so that
`python -m minivllm.entrypoints.openai.api_server ...` runs as vLLM's guides write it. The server
itself lives in minivllm/entrypoints/ (api_server.py, serving.py, protocol.py).
"""
