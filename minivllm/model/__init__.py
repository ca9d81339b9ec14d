"""The model: its math in plain PyTorch, and how it gets from disk onto a device.

- `layers/`        the layers every family shares (norms, RoPE, parallel linears, MoE)
- `models/`        one file a family, and the registry of `architectures`
- `quantization/`  weights kept in a checkpoint's quantized format (GGUF) and multiplied as such
- `custom_op.py`   the `CustomOp` base: a plain-PyTorch forward and, per platform, a faster one
- `config.py`, `source.py`, `resolver.py`, `loader.py`, `weights.py`, `packed_weights.py`,
  `tokenizer_class.py`, `errors.py`: a model's config, files, loading and its typed errors
- `hf_overrides.py` vLLM's `hf_overrides`: a causal LM's config changed at load into a classifier's
  (Qwen3-Reranker)

The model calls attention through the backend contract (minivllm/attention/abstract.py) and never
asks which kernel runs.
"""
