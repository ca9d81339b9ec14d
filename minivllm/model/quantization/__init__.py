"""Quantized weights as a checkpoint stores them: vLLM's `model_executor/layers/quantization`.

A `QuantizationConfig` (`base_config.py`) gives each linear layer its `LinearMethodBase`: the
object that creates the layer's weights in the checkpoint's own format and computes y = x Wᵀ
from them. GGUF's block formats (`gguf_blocks.py`, `gguf.py`; `gguf_moe.py` for a MoE layer's
experts) are the one quantization minivllm runs; the kernels that multiply by the blocks without
dequantizing the whole weight live behind the platform seam (minivllm/cpu/, `triton_gguf.py`),
each held to the plain-PyTorch reference.
"""
