"""The layers every model file shares (vLLM's `vllm/model_executor/layers/`).

- `layernorm.py`         RMSNorm and SwiGLU's activation (`SiluAndMul`)
- `rotary_embedding.py`  rotary position embeddings with the scalings checkpoints use
- `linear.py`            Megatron-style parallel linears and the vocabulary-parallel embedding/head
- `fused_moe.py`         mixture of experts: the router and the fused experts op
- `triton_fused_moe.py`  that op's experts as a Triton grouped GEMM (the CUDA forward)

Each fast layer is a `CustomOp` (minivllm/model/custom_op.py): its `forward_native` is the
specification, and a platform registers a faster forward of equal results.
"""
