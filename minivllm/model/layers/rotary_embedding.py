"""Rotary position embeddings (RoPE) with the scalings Llama checkpoints use.

RoPE rotates each (x_i, x_{i+d/2}) pair of a query/key by an angle proportional to the token's
position, so attention scores depend on relative position. Scalings stretch the frequencies so a
model reaches past its training length: `linear` divides every frequency by a factor; `llama3`
(Llama 3.1) divides only the low frequencies and interpolates smoothly in between (a GGUF file
stores those divisors: `rope_freqs`, read as `freq_factors`). The cos/sin table is computed once
for every position up to the model's limit and indexed by the step's flat `positions`, so one
batch mixes tokens from any place in any request; in float32, in transformers' order of operations.
"""

from __future__ import annotations

import math

import torch

from minivllm.model.config import LlamaConfig
from minivllm.model.custom_op import CustomOp


def rope_inverse_frequencies(config: LlamaConfig) -> torch.Tensor:  # float32 [head_dim // 2]
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling or {}
    if (rope_type := scaling.get("rope_type", "default")) == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    elif rope_type == "freq_factors":  # a GGUF file's rope_freqs: llama3's scaling, as divisors
        inv_freq = inv_freq / torch.tensor(scaling["freq_factors"])
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths are stretched, short ones kept."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(CustomOp):
    """Applies RoPE to queries and keys at arbitrary (flat) positions.

    `forward_native` is the specification; a platform may rotate in place with a fused kernel
    instead (see `custom_op.py`), which is why the table is kept as one [2, positions, head_dim]
    tensor a kernel can take as it is."""

    cos_sin: torch.Tensor

    def __init__(self, config: LlamaConfig, max_positions: int) -> None:
        super().__init__()
        # Computed on the CPU, then moved: on the `meta` device the loader builds the model on,
        # these few ops would import torch._dynamo (a start-up cost) for a table never used.
        device = torch.get_default_device()
        with torch.device("cpu"):
            inv_freq = rope_inverse_frequencies(config)  # [head_dim // 2]
            t = torch.arange(max_positions, dtype=torch.int64).float()
            freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim // 2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
            cos_sin = torch.stack((emb.cos(), emb.sin()))  # [2, max_positions, head_dim]
        # Kept in float32 whatever the model dtype: angles for large positions need the precision.
        self.register_buffer("cos_sin", cos_sin.to(device), persistent=False)
        # [2, max_positions, head_dim]

    def forward_native(
        self,
        positions: torch.Tensor,  # int64 [T]
        x: torch.Tensor,  # [T, heads, head_dim]  queries, keys, or both side by side
    ) -> torch.Tensor:  # [T, heads, head_dim]
        cos, sin = self.cos_sin[:, positions].to(x.dtype).unsqueeze(2)  # each [T, 1, head_dim]
        return x * cos + rotate_half(x) * sin
