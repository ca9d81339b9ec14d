"""The Llama decoder in plain PyTorch, with attention through the paged-KV backend.

Llama = token embedding, N x (RMSNorm -> attention with RoPE -> residual, RMSNorm -> SwiGLU MLP ->
residual), final RMSNorm, LM head. Grouped-query attention (fewer K/V heads than query heads) is
what makes the KV cache small, and the cache is where PagedAttention lives: each layer hands its
new keys/values to `backend.write_kv` and its queries to `backend.attend`, which reads the whole
context through the block tables. The model never sees a padded batch: a step's tokens from all
requests arrive as one flat sequence of `T` tokens with their positions ("one engine step" on the
docs' architecture page).

As in vLLM, q/k/v and gate/up projections are fused into one matmul each (their weight loaders
place the checkpoint's separate weights); that halves the matmul launches, which matters on a CPU.
Also as in vLLM, RMSNorm, SiLU·mul (shared by every family: `layers.py`), RoPE, the projections
and the LM head are custom ops (`custom_op.py`): what they hold is their plain-PyTorch specification,
and a platform may run a fused kernel of equal results in its place (minivllm/platforms/). Each
sublayer's residual add is done by the norm that follows it, so that a fused kernel adds and
normalises in one pass.

The same code runs on one device and as one rank of N (tensor parallelism, paper §4.6): the
projections are the parallel layers of `parallel_layers.py`, built for the `TensorParallelGroup`
the model is given. A rank holds num_heads / N query heads, its KV heads and 1/N of the MLP; the
shapes below are a rank's. With the default single-device group nothing is split and no
collective runs.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from minivllm.attention.abstract import AttentionBackend, AttentionMetadata
from minivllm.distributed.parallel_state import SINGLE_DEVICE, TensorParallelGroup
from minivllm.distributed.pipeline import IntermediateTensors
from minivllm.model.config import LlamaConfig
from minivllm.model.layers.layernorm import RMSNorm, SiluAndMul
from minivllm.model.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    kv_heads_per_rank,
)
from minivllm.model.layers.rotary_embedding import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(
        self, config: LlamaConfig, backend: AttentionBackend, tp: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.attention_bias or config.qkv_bias,  # qkv_bias: Qwen2's q/k/v only
            tp,
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's query heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # this rank's KV heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim,
            config.hidden_size,
            config.attention_bias,
            tp,
        )
        self.backend = backend
        self.sliding_window: int | None = getattr(config, "sliding_window", None)  # None: global

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
        qkv = self.qkv_proj(hidden)  # [T, (num_heads + 2 * num_kv_heads) * head_dim]
        # Queries and keys sit side by side in each row, so RoPE rotates both in one pass.
        qk = rope(positions, qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim))
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, Hkv, D]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        # Write first, then attend: the new tokens must see themselves, and another request
        # that shares a prefix block computed in this same step reads it from the cache.
        self.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = self.backend.attend(q, k_cache, v_cache, meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(t, self.q_size))  # the layer's first all-reduce


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, [size, size], config.mlp_bias, tp
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, config.mlp_bias, tp)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden_size]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # the layer's second all-reduce


class LlamaDecoderLayer(nn.Module):
    # The attention a family's layer builds (Qwen3's adds per-head q/k norms); the rest is Llama's.
    attention_type: ClassVar[type[LlamaAttention]] = LlamaAttention

    def __init__(
        self, config: LlamaConfig, backend: AttentionBackend, tp: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention_type(config, backend, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden_size]  the previous layer's MLP output (or embeddings)
        residual: torch.Tensor | None,  # [T, hidden_size]  the residual stream up to that output
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # this layer's MLP output, the residual before it
        # The residual add of each sublayer is left to the norm that follows it (vLLM's layout):
        # RMSNorm(x, residual) adds and normalises in one pass where a fused kernel runs.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, rope, kv_cache[0], kv_cache[1], meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    # Between pipeline stages the residual stream travels beside the hidden state (each norm adds
    # them, so a stage ends with the two apart).
    carries_residual: ClassVar[bool] = True

    def __init__(
        self,
        config: LlamaConfig,
        backend: AttentionBackend,
        max_positions: int,
        tp: TensorParallelGroup,
        layer_type: type[LlamaDecoderLayer] = LlamaDecoderLayer,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            layer_type(config, backend, tp) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, max_positions)
        # The layers this pipeline stage runs (all of them on one stage; model/pipeline.py).
        self.start_layer, self.end_layer = 0, config.num_hidden_layers

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        # [stage_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]: this stage's layers
        kv_caches: torch.Tensor,
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,  # the previous pipeline stage's output
    ) -> torch.Tensor | IntermediateTensors:  # [T, hidden_size]; a stage before the last's
        if intermediate is None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate.hidden, intermediate.residual
        layers = self.layers[self.start_layer : self.end_layer]
        for layer, kv_cache in zip(layers, kv_caches):
            hidden, residual = layer(hidden, residual, positions, self.rotary_emb, kv_cache, meta)
        if self.end_layer < len(self.layers):  # the next stage goes on from here
            return IntermediateTensors(hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Llama with an LM head. `forward` returns hidden states; `compute_logits` is applied only to
    the rows that will be sampled, since the LM head is the largest matmul for a small model.

    `tp` is this rank's place in the tensor-parallel group; the default is one device. A family
    whose layer differs subclasses it with its own `layer_type` (registry.py lists them)."""

    layer_type: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer
    packed_checkpoint: ClassVar[bool] = False  # q/k/v, gate/up stored fused (Phi-3)

    def __init__(
        self,
        config: LlamaConfig,
        backend: AttentionBackend,
        max_positions: int | None = None,
        tp: TensorParallelGroup = SINGLE_DEVICE,
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = LlamaModel(
            config, backend, max_positions or config.max_position_embeddings, tp, self.layer_type
        )
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            self.lm_head.tied = True
        # What this rank's KV cache holds per token and layer (see ModelRunner's cache).
        self.num_kv_heads = kv_heads_per_rank(config.num_key_value_heads, tp.world_size)

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        # [stage_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        kv_caches: torch.Tensor,
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,  # the previous pipeline stage's output
    ) -> torch.Tensor | IntermediateTensors:  # [T, hidden_size]; what a stage hands on
        return self.model(input_ids, positions, kv_caches, meta, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 [S, vocab] for hidden [S, hidden_size]; with N ranks, on rank 0 only (None on
        the others, which still compute and send their vocabulary slice)."""
        return self.lm_head.compute_logits(hidden)
