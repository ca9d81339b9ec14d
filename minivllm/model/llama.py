"""The Llama decoder in plain PyTorch, with attention through the paged-KV backend.

Llama = token embedding, N x (RMSNorm -> attention with RoPE -> residual, RMSNorm -> SwiGLU MLP ->
residual), final RMSNorm, LM head. Grouped-query attention (fewer K/V heads than query heads) is
what makes the KV cache small, and the cache is where PagedAttention lives: each layer hands its
new keys/values to `backend.write_kv` and its queries to `backend.attend`, which reads the whole
context through the block tables. The model never sees a padded batch: a step's tokens from all
requests arrive as one flat sequence of `T` tokens with their positions ("one engine step" on the
docs' architecture page).

As in vLLM, q/k/v and gate/up projections are fused into one matmul each (the loader concatenates
the checkpoint's separate weights); that halves the matmul launches, which matters on a CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.attention import AttentionBackend, AttentionMetadata
from minivllm.model.config import LlamaConfig
from minivllm.model.rope import RotaryEmbedding

LM_HEAD_ROWS = 1024  # vocabulary rows per LM-head matmul on a CPU (see compute_logits)


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:  # [M, in] -> [M, out]
    """`layer(x)`, computed on CPUs as (W · xᵀ)ᵀ: the same dot products, but MKL runs the weight
    as the left operand ~1.3x faster at decode batch sizes (M = 16-256, measured on SmolLM2's
    shapes; 1.7x for the LM head). The result is a transposed view; elementwise ops and the next
    `linear` take it as it is, and callers that need rows contiguous copy once."""
    if not x.is_cpu:
        return F.linear(x, layer.weight, layer.bias)
    y = torch.mm(layer.weight, x.t()).t()
    return y if layer.bias is None else y + layer.bias


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 like the reference implementation."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.backend = backend

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden_size]
        positions: torch.Tensor,  # int64 [T]
        rope: RotaryEmbedding,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        t = hidden.shape[0]
        qkv = linear(
            hidden, self.qkv_proj
        ).contiguous()  # [T, (num_heads + 2 * num_kv_heads) * head_dim]
        # Queries and keys sit side by side in each row, so RoPE rotates both in one pass.
        qk = rope.rotate(positions, qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim))
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, Hkv, D]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        # Write first, then attend: the new tokens must see themselves, and another request
        # that shares a prefix block computed in this same step reads it from the cache.
        self.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = self.backend.attend(q, k_cache, v_cache, meta, self.scale)  # [T, num_heads, head_dim]
        return linear(out.reshape(t, self.q_size), self.o_proj)


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up_proj).split(self.intermediate_size, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden_size]
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.self_attn(
            self.input_layernorm(hidden), positions, rope, kv_cache[0], kv_cache[1], meta
        )
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, max_positions)

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        kv_caches: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        hidden = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(hidden, positions, self.rotary_emb, kv_cache, meta)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    """Llama with an LM head. `forward` returns hidden states; `compute_logits` is applied only to
    the rows that will be sampled, since the LM head is the largest matmul for a small model."""

    def __init__(
        self, config: LlamaConfig, backend: AttentionBackend, max_positions: int | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, backend, max_positions or config.max_position_embeddings)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        kv_caches: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(
        self, hidden: torch.Tensor
    ) -> torch.Tensor:  # [N, hidden] -> float32 [N, vocab]
        if not hidden.is_cpu:
            return self.lm_head(hidden).float()
        # On a CPU the LM head's weight ([vocab, hidden]: 113 MB for SmolLM2) is far larger than the
        # caches; MKL runs it 1.2-1.4x faster in slices of LM_HEAD_ROWS vocabulary rows (measured
        # at 16-64 sampled rows, same results), each written straight into one [vocab, N] buffer.
        weight = self.lm_head.weight
        logits_t = torch.empty(weight.shape[0], hidden.shape[0], dtype=weight.dtype)  # [vocab, N]
        for start in range(0, weight.shape[0], LM_HEAD_ROWS):
            rows = slice(start, start + LM_HEAD_ROWS)
            torch.mm(weight[rows], hidden.t(), out=logits_t[rows])
        return logits_t.t().float().contiguous()
