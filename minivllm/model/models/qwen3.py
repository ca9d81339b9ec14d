"""Qwen3 (Alibaba): Llama's decoder with an RMSNorm over each head's query and key.

Against Llama (llama.py), transformers' `modeling_qwen3.py` adds two small norms to the
attention: `q_norm` and `k_norm`, RMSNorms of width head_dim, applied to every head of q and k
after the projection and before RoPE (they keep attention logits in range without the biases
Qwen2 had; Qwen3 drops those). Qwen3's head_dim is given in its config and need not be
hidden / heads (Qwen3-0.6B: 16 heads of 128 over a hidden size of 1024), which the config reader
and Llama's projections already take. Everything else is Llama's, so this file is only the
attention's forward with the two norms, in vLLM's `qwen3.py` layout.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from minivllm.attention.abstract import AttentionBackend, AttentionMetadata
from minivllm.distributed.parallel_state import TensorParallelGroup
from minivllm.model.config import LlamaConfig
from minivllm.model.layers.layernorm import RMSNorm
from minivllm.model.layers.rotary_embedding import RotaryEmbedding
from minivllm.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(
        self, config: LlamaConfig, backend: AttentionBackend, tp: TensorParallelGroup
    ) -> None:
        super().__init__(config, backend, tp)
        # One weight of head_dim shared by every head (and by every rank: it is replicated).
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden_size]
        positions: torch.Tensor,  # int64 [T]
        rope: RotaryEmbedding,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        t, d = hidden.shape[0], self.head_dim
        qkv = self.qkv_proj(hidden)  # [T, (num_heads + 2 * num_kv_heads) * head_dim]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # The norms see one head per row: [T * heads, head_dim] (`reshape` copies where the
        # projection's output is not laid out head by head).
        q = self.q_norm(q.reshape(t * self.num_heads, d)).view(t, self.num_heads, d)
        k = self.k_norm(k.reshape(t * self.num_kv_heads, d)).view(t, self.num_kv_heads, d)
        q, k = rope(positions, q), rope(positions, k)  # [T, H, D], [T, Hkv, D]
        v = v.reshape(t, self.num_kv_heads, d)
        self.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = self.backend.attend(q, k_cache, v_cache, meta, self.scale)  # [T, num_heads, head_dim]
        return self.o_proj(out.reshape(t, self.q_size))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_type: ClassVar[type[LlamaAttention]] = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with per-head q/k RMSNorm (`Qwen3Attention`)."""

    layer_type: ClassVar[type[LlamaDecoderLayer]] = Qwen3DecoderLayer
