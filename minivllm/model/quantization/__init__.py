"""Quantized weight formats and the matmuls that read them without dequantizing the whole weight.

Tier: model. It imports leaves and core.
"""
