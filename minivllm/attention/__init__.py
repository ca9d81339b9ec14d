"""Attention: the swap point between the model and its kernels (PagedAttention, paper §4.1).

- `abstract.py`: the contract, `AttentionMetadata` (where each request's new tokens are and where
  its context lives in the paged cache) and the `AttentionBackend` protocol (`write_kv`, `attend`);
- `selector.py`: picks a backend by name, from the names the platform gives (vLLM's
  vllm/attention/selector.py);
- `backends/`: the implementations: `reference` (plain PyTorch, the specification), `cpu` (compiled
  paged kernels, the CPU default) and `triton` (fused kernels, the CUDA default).

The model imports the contract only; a backend is a plug-in loaded by its qualified name, so the
package imports nothing here.
"""
