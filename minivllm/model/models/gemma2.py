"""Gemma 2 (Google): a decoder with sandwich norms, soft-capped logits and alternating windows.

Against Llama (llama.py), transformers' `modeling_gemma2.py` (and vLLM's `gemma2.py`) changes:

- **Embedding scale**: the token embeddings are multiplied by sqrt(hidden_size), the constant
  rounded to the model's dtype first, as transformers does (`Gemma2TextScaledWordEmbedding`).
- **(1 + w) RMSNorm** (`GemmaRMSNorm`): the weight is stored as an offset from 1, and the whole
  norm, the product included, is computed in float32 and only then rounded to the model's dtype.
- **Sandwich norms**: each sublayer's output is normalised before it is added to the residual
  (`post_attention_layernorm`, `post_feedforward_layernorm`), and the MLP's input has its own
  norm (`pre_feedforward_layernorm`): four norms a layer, where Llama has two.
- **GeGLU MLP**: gelu(gate, tanh approximation) * up (`gelu_pytorch_tanh`), not SwiGLU.
- **Attention scale** `query_pre_attn_scalar ** -0.5`, which need not be head_dim's.
- **Soft-capping** (Gemma 2 paper, §2): attention scores become `cap * tanh(score / cap)` before
  the mask and softmax (`attn_logit_softcapping`, 50), done inside every attention backend, and
  so do the final logits (`final_logit_softcapping`, 30), done in `compute_logits`.
- **Alternating layers**: `layer_types` names each layer `sliding_attention` (a window of
  `sliding_window` keys) or `full_attention`; Gemma 2 alternates them, the first sliding.

A model that mixes windowed and global layers keeps its KV cache in groups of layers, each with
block tables of its own (core/kv_cache_groups.py, core/kv_cache_coordinator.py: vLLM's hybrid
allocator): a global group holds every block of a sequence, a windowed one frees what left its
window. The runner then hands `Gemma2Model.forward` a cache view and an attention metadata per
layer (minivllm/worker/hybrid_model_runner.py); each windowed layer still masks its window in the
backend, so the output is the same either way.

The norm and the activation live here, beside the only models that use them, rather than in
layers.py, whose lines count against the README's reading path; Gemma 3 (gemma3.py) imports them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.attention.abstract import AttentionBackend, AttentionMetadata
from minivllm.distributed.parallel_state import SINGLE_DEVICE, TensorParallelGroup
from minivllm.distributed.pipeline import IntermediateTensors
from minivllm.model.config import LlamaConfig, UnsupportedModelError
from minivllm.model.custom_op import CustomOp
from minivllm.model.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    Sliceable,
    VocabParallelEmbedding,
    kv_heads_per_rank,
)
from minivllm.model.layers.rotary_embedding import RotaryEmbedding
from minivllm.model.models.llama import LlamaForCausalLM
from minivllm.model.models.mixtral import load_moe_weights

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass
class Gemma2Config(LlamaConfig):
    """Llama's shapes plus Gemma's constants; `layer_types[i]` says whether layer i has a window."""

    query_pre_attn_scalar: float = 256.0  # the attention scale is its inverse square root
    attn_logit_softcapping: float | None = None  # cap of the attention scores (None: off)
    final_logit_softcapping: float | None = None  # cap of the LM head's logits (None: off)
    layer_types: list[str] = field(default_factory=list)  # one of LAYER_TYPES per layer
    rope_local_base_freq: float | None = None  # Gemma 3: the sliding layers' RoPE theta
    architecture: str = "Gemma2ForCausalLM"
    # What an old config that has no `layer_types` alternates with: layer i is global iff
    # (i + 1) % pattern == 0 (Gemma 2: every other; Gemma 3: `sliding_window_pattern`, 6).
    default_pattern: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.layer_types:
            p = self.default_pattern
            self.layer_types = [
                LAYER_TYPES[(i + 1) % p == 0] for i in range(self.num_hidden_layers)
            ]
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {
            *LAYER_TYPES
        }:
            raise ValueError(
                f"layer_types must name one of {LAYER_TYPES} for each of the "
                f"{self.num_hidden_layers} layers, got {self.layer_types}"
            )
        if self.query_pre_attn_scalar <= 0:
            raise ValueError(f"query_pre_attn_scalar must be > 0, got {self.query_pre_attn_scalar}")
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            cap = getattr(self, name)
            if cap is not None and not cap > 0:
                raise ValueError(f"{name} must be > 0 or None, got {cap}")

    @property
    def sliding_layers(self) -> list[bool]:
        """Whether each layer attends through a window (a window of None is no window)."""
        return [kind == "sliding_attention" for kind in self.layer_types]

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> Gemma2Config:
        return cls(**gemma_fields(cfg, default_pattern=2))


def gemma_fields(cfg: dict[str, Any], default_pattern: int) -> dict[str, Any]:
    """A Gemma config.json's fields for `Gemma2Config` (Gemma 3's too): Llama's reader for the
    shapes, on a copy stripped of what it would refuse (the GeGLU activation, mixed layer kinds,
    Gemma 3's RoPE parameters per layer kind), then Gemma's own constants."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(
            f"hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)"
        )
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention is not supported (a decoder only)")
    rope = dict(cfg.get("rope_parameters") or {})
    local = rope.pop("sliding_attention", None)  # transformers 5's Gemma 3: one set per layer kind
    rope = rope.pop("full_attention", rope)
    llama = {k: v for k, v in cfg.items() if k not in ("layer_types", "sliding_window")}
    llama.update(
        hidden_act="silu", rope_parameters=rope or None, architectures=["LlamaForCausalLM"]
    )
    base = LlamaConfig.from_hf_dict(llama)
    local_theta = cfg.get("rope_local_base_freq")
    if local is not None:
        if dict(local).get("rope_type", "default") != "default":
            raise UnsupportedModelError(
                f"the sliding layers' RoPE scaling {local} is not supported"
            )
        local_theta = local.get("rope_theta", local_theta)
    window = cfg.get("sliding_window")
    return {
        **vars(base),
        "architecture": str((cfg.get("architectures") or ["Gemma2ForCausalLM"])[0]),
        "sliding_window": None if window is None else int(window),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
        "attn_logit_softcapping": cfg.get("attn_logit_softcapping"),
        "final_logit_softcapping": cfg.get("final_logit_softcapping"),
        "layer_types": list(cfg.get("layer_types") or []),
        "rope_local_base_freq": None if local_theta is None else float(local_theta),
        "default_pattern": int(cfg.get("sliding_window_pattern") or default_pattern),
    }


# ===================================================================================== layers


class GemmaRMSNorm(CustomOp):
    """x / rms(x) * (1 + weight), all in float32, then rounded to x's dtype (transformers'
    `Gemma2RMSNorm`: unlike Llama's, the product is taken before the rounding). Its own op, not a
    subclass of RMSNorm, so no platform's Llama-norm kernel (w, not 1 + w) is run in its place."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden_size]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GeluAndMul(CustomOp):
    """GeGLU's gate: gelu(gate, tanh approximation) * up, for the fused [T, 2 * I] projection."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap): bounded by ±cap, and x itself near 0 (None: x as it is)."""
    return x if cap is None else torch.tanh(x / cap) * cap


# ===================================================================================== model


class Gemma2Attention(nn.Module):
    """Llama's fused-QKV, RoPE, paged attention, with Gemma's scale, window and score cap."""

    def __init__(
        self, config: Gemma2Config, backend: AttentionBackend, tp: TensorParallelGroup, idx: int
    ) -> None:
        super().__init__()
        self.head_dim = d = config.head_dim
        bias = config.attention_bias
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, d, config.num_attention_heads, config.num_key_value_heads, bias, tp
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's query heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # this rank's KV heads
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * d, config.hidden_size, bias, tp
        )
        self.scale = config.query_pre_attn_scalar**-0.5
        self.is_sliding = config.sliding_layers[idx]  # which RoPE table (Gemma 3) and window
        # The KV cache manager reads every layer's window (None: a global layer) to pick itself.
        self.sliding_window: int | None = config.sliding_window if self.is_sliding else None
        self.softcap = float(config.attn_logit_softcapping or 0.0)  # 0: off, as the kernels take it
        self.backend = backend

    def project(
        self, hidden: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [T, H, D], k, v [T, Hkv, D]
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, (num_heads + 2 * num_kv_heads) * head_dim]
        qk = rope(positions, qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim))
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden_size]
        positions: torch.Tensor,  # int64 [T]
        rope: RotaryEmbedding,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        q, k, v = self.project(hidden, positions, rope)
        self.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = self.backend.attend(
            q, k_cache, v_cache, meta, self.scale, self.sliding_window, self.softcap
        )  # [T, num_heads, head_dim]
        return self.o_proj(out.reshape(hidden.shape[0], self.q_size))


class Gemma2MLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, config: Gemma2Config, tp: TensorParallelGroup) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [size, size], False, tp)
        self.down_proj = RowParallelLinear(size, config.hidden_size, False, tp)
        self.act_fn = GeluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden_size]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma2DecoderLayer(nn.Module):
    attention_type: ClassVar[type[Gemma2Attention]] = Gemma2Attention  # Gemma 3's: q/k norms

    def __init__(
        self, config: Gemma2Config, backend: AttentionBackend, tp: TensorParallelGroup, idx: int
    ) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = self.attention_type(config, backend, tp, idx)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = Gemma2MLP(config, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden_size]  the residual stream
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        # transformers' order of adds (residual + normed output), so float32 sums agree.
        attn = self.self_attn(self.input_layernorm(hidden), positions, rope, *kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma2Model(nn.Module):
    carries_residual: ClassVar[bool] = False  # each layer adds its own: one tensor between stages

    def __init__(
        self,
        config: Gemma2Config,
        backend: AttentionBackend,
        max_positions: int,
        tp: TensorParallelGroup,
        layer_type: type[Gemma2DecoderLayer],
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            layer_type(config, backend, tp, i) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, max_positions)  # rebuilt by the loader
        # Gemma 3's sliding layers rotate with their own theta (None: every layer uses the above).
        self.rotary_emb_local: RotaryEmbedding | None = None
        self.embed_scale = math.sqrt(config.hidden_size)
        self.sliding_layers = config.sliding_layers  # which layers rotate with the local table
        # The layers this pipeline stage runs (all of them on one stage; model/pipeline.py).
        self.start_layer, self.end_layer = 0, config.num_hidden_layers

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        # [stage_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], or with the layers in
        # KV cache groups (minivllm/worker/hybrid_model_runner.py) each stage layer's [2, ...] view
        kv_caches: torch.Tensor | Sequence[torch.Tensor],
        meta: AttentionMetadata | Sequence[AttentionMetadata],  # all layers', or each layer's
        intermediate: IntermediateTensors | None = None,  # the previous pipeline stage's output
    ) -> torch.Tensor | IntermediateTensors:  # [T, hidden_size]; a stage before the last's
        if intermediate is None:
            hidden = self.embed_tokens(input_ids)  # [T, hidden_size]
            # sqrt(hidden_size) as a float32 constant rounded to the dtype, as transformers has it.
            hidden = hidden * torch.tensor(self.embed_scale).to(hidden.dtype)
        else:
            hidden = intermediate.hidden
        stage = slice(self.start_layer, self.end_layer)
        metas = [meta] * len(self.layers) if isinstance(meta, AttentionMetadata) else meta
        for layer, kv_cache, layer_meta, sliding in zip(
            self.layers[stage], kv_caches, metas, self.sliding_layers[stage]
        ):
            local = sliding and self.rotary_emb_local is not None
            rope = self.rotary_emb_local if local else self.rotary_emb
            hidden = layer(hidden, positions, rope, kv_cache, layer_meta)
        if self.end_layer < len(self.layers):  # the next stage goes on from here
            return IntermediateTensors(hidden, None)
        return self.norm(hidden)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 with its (tied) LM head; `compute_logits` soft-caps the logits."""

    layer_type: ClassVar[type[Gemma2DecoderLayer]] = Gemma2DecoderLayer  # type: ignore[assignment]

    def __init__(
        self,
        config: Gemma2Config,
        backend: AttentionBackend,
        max_positions: int | None = None,
        tp: TensorParallelGroup = SINGLE_DEVICE,
    ) -> None:
        nn.Module.__init__(self)  # not Llama's: its layers are Llama's
        self.config, self.tp = config, tp
        self.max_positions = max_positions or config.max_position_embeddings
        self.model = Gemma2Model(config, backend, self.max_positions, tp, self.layer_type)  # type: ignore[assignment]
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            self.lm_head.tied = True
        self.num_kv_heads = kv_heads_per_rank(config.num_key_value_heads, tp.world_size)

    def load_weights(self, weights: Mapping[str, Sliceable]) -> None:
        """Every tensor by its name (q/k/v and gate/up into their fused layers): Gemma's four
        norms a layer are not the Llama checkpoint's two that weights.py checks for."""
        load_moe_weights(self, weights, {})

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head.compute_logits(hidden)  # float32 [S, vocab]; None off rank 0
        cap = self.config.final_logit_softcapping  # type: ignore[attr-defined]
        return None if logits is None else soft_cap(logits, cap)


__all__ = [
    "GeluAndMul",
    "Gemma2Attention",
    "Gemma2Config",
    "Gemma2DecoderLayer",
    "Gemma2ForCausalLM",
    "GemmaRMSNorm",
    "gemma_fields",
    "soft_cap",
]
