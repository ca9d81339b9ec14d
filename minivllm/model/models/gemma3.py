"""Gemma 3 text models (Google): Gemma 2's decoder with q/k norms and a RoPE base per layer kind.

Against Gemma 2 (gemma2.py), transformers' `modeling_gemma3.py` (`Gemma3ForCausalLM`, config
`Gemma3TextConfig`; vLLM's `gemma3.py`):

- **q/k RMSNorm**: a (1 + w) RMSNorm of width head_dim over each head's query and key, after the
  projection and before RoPE (as Qwen3 has, with Gemma's norm); it takes over from the attention
  soft-cap, which Gemma 3 drops (transformers passes none to its attention, whatever the config
  says, so neither does this file). The final-logit cap stays, if the config sets one.
- **Two RoPE tables**: the sliding layers rotate with `rope_local_base_freq` (10,000) and no
  scaling, the global ones with `rope_theta` (1,000,000) and the config's `rope_scaling` (the 4B
  and larger models stretch it linearly by 8). transformers 5 writes both as `rope_parameters`
  per layer kind; `gemma_fields` reads either spelling.
- **Layer kinds**: `layer_types`, or for older configs `sliding_window_pattern` (every sixth layer
  global, the other five windowed, by default).

As for Gemma 2, such a mixed model keeps its KV cache per group of layers: five windowed layers
per global one make five windowed groups as large as the global one (core/kv_cache_groups.py),
each freeing what left its window. The vision tower of the multimodal checkpoints
(`Gemma3ForConditionalGeneration`) is not here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from minivllm.attention.abstract import AttentionBackend
from minivllm.distributed.parallel_state import SINGLE_DEVICE, TensorParallelGroup
from minivllm.model.layers.linear import Sliceable
from minivllm.model.layers.rotary_embedding import RotaryEmbedding
from minivllm.model.models.gemma2 import (
    Gemma2Attention,
    Gemma2Config,
    Gemma2DecoderLayer,
    Gemma2ForCausalLM,
    GemmaRMSNorm,
    gemma_fields,
)


@dataclass
class Gemma3Config(Gemma2Config):
    architecture: str = "Gemma3ForCausalLM"
    default_pattern: int = 6

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> Gemma3Config:
        return cls(**{**gemma_fields(cfg, default_pattern=6), "qk_norm": True})

    def local_rope_config(self) -> Gemma3Config:
        """The sliding layers' RoPE: their own base, no scaling."""
        return replace(self, rope_theta=self.rope_local_base_freq or 10000.0, rope_scaling=None)


class Gemma3Attention(Gemma2Attention):
    def __init__(
        self, config: Gemma2Config, backend: AttentionBackend, tp: TensorParallelGroup, idx: int
    ) -> None:
        super().__init__(config, backend, tp, idx)
        self.softcap = 0.0  # transformers' Gemma 3 attention takes no cap
        # One weight of head_dim shared by every head (and every rank: it is replicated).
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)

    def project(
        self, hidden: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [T, H, D], k, v [T, Hkv, D]
        t, d = hidden.shape[0], self.head_dim
        qkv = self.qkv_proj(hidden)  # [T, (num_heads + 2 * num_kv_heads) * head_dim]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, self.num_heads, d))  # the norm's last dim is one head
        k = self.k_norm(k.reshape(t, self.num_kv_heads, d))
        return rope(positions, q), rope(positions, k), v.reshape(t, self.num_kv_heads, d)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_type = Gemma3Attention


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text model: Gemma 2's with q/k norms and a second RoPE table."""

    layer_type = Gemma3DecoderLayer

    def __init__(
        self,
        config: Gemma3Config,
        backend: AttentionBackend,
        max_positions: int | None = None,
        tp: TensorParallelGroup = SINGLE_DEVICE,
    ) -> None:
        super().__init__(config, backend, max_positions, tp)
        self.model.rotary_emb_local = RotaryEmbedding(
            config.local_rope_config(), self.max_positions
        )

    def load_weights(self, weights: Mapping[str, Sliceable]) -> None:
        super().load_weights(weights)
        # The RoPE tables are buffers built on the meta device with the model; the loader
        # rebuilds the global one after loading, and this one is rebuilt here, where the
        # weights' device is known.
        config: Gemma3Config = self.config  # type: ignore[assignment]
        # A float weight even where a GGUF file's are blocks (the layer's first: its input norm),
        # of a layer this pipeline stage holds.
        device = next(self.model.layers[self.model.start_layer].parameters()).device
        self.model.rotary_emb_local = RotaryEmbedding(
            config.local_rope_config(), self.max_positions
        ).to(device)


__all__ = ["Gemma3Attention", "Gemma3Config", "Gemma3ForCausalLM"]
