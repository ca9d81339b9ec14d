"""llama.cpp's GGUF files: read, configured, loaded and multiplied without dequantizing first.

- `reader.py`         the file: metadata into a config, tensor names into HuggingFace's
- `config.py`         GGUF metadata as the `config.json` it stands for (and an embedding file's
  `pooling_type` as sentence-transformers' module files)
- `tokenizer.py`      the file's vocabulary as a transformers tokenizer (BERT's WordPiece here)
- `blocks.py`         each block format drawn and dequantized in plain PyTorch (the reference)
- `linear.py`         `GGUFLinearMethod`: a linear's weight kept in its blocks
- `moe.py`            the same for a MoE layer's experts
- `loader.py`         a GGUF file's tensors into the model's layers
- `triton_kernels.py` the Triton kernels that multiply by the blocks on a GPU, with
  `cuda_forwards.py` registering them as the linears' CUDA forward

The CPU's kernels for the same blocks are in minivllm/cpu/ (csrc/cpu_gguf_*.cpp), held to
`blocks.py` by tests.
"""
