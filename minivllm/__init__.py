"""minivllm: the readable vLLM.

PagedAttention (Kwon et al., SOSP 2023) and vLLM's engine in small, plain-PyTorch modules: a paged
KV cache with block tables, copy-on-write and prefix caching, continuous batching with chunked
prefill and preemption, a full sampler, a Llama model, and an OpenAI-compatible server.
"""

__version__ = "0.1.0"
