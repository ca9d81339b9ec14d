"""Qwen3-MoE: the Llama decoder with a per-head RMSNorm on queries and keys, and sparse
mixture-of-experts MLPs (vLLM's vllm/model_executor/models/qwen3_moe.py).

Two differences from Llama (`llama.py`):

- **QK-norm**: before RoPE, each query head and each key head is RMS-normalised over its
  `head_dim` with a learned weight (`q_norm`, `k_norm`, shared by all heads), which keeps the
  attention logits' scale in check without a bias. That is dense Qwen3's attention, and this
  file uses it as it is (`Qwen3Attention`, `qwen3.py`): the two families differ only in the MLP.
- **Sparse MLPs**: layer l's MLP is a `SparseMoeBlock` (`fused_moe.py`) of `num_experts` SwiGLU
  experts of width `moe_intermediate_size`, `num_experts_per_tok` of them per token, unless l is
  in `mlp_only_layers` or (l + 1) is not a multiple of `decoder_sparse_step`; such a layer keeps
  Llama's dense MLP of width `intermediate_size`. The router's top-k weights are renormalised
  only with `norm_topk_prob`, and are rounded to the activations' dtype (transformers'
  `Qwen3MoeTopKRouter`), where Mixtral's stay float32.

The checkpoint names match the model's (`mlp.gate`, `mlp.experts.{e}.gate_proj/up_proj/
down_proj`); `load_moe_weights` places the experts' tensors into the stacked w13/w2.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from minivllm.attention.abstract import AttentionBackend
from minivllm.distributed.parallel_state import SINGLE_DEVICE, TensorParallelGroup
from minivllm.model.config import LlamaConfig, UnsupportedModelError
from minivllm.model.layers.fused_moe import SparseMoeBlock
from minivllm.model.layers.linear import Sliceable
from minivllm.model.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    RMSNorm,
)
from minivllm.model.models.mixtral import build_causal_lm, load_moe_weights
from minivllm.model.models.qwen3 import Qwen3Attention


@dataclass
class Qwen3MoeConfig(LlamaConfig):
    """Llama's shapes (`intermediate_size`: the dense layers' MLP width), and the experts'."""

    num_experts: int = 128  # E
    num_experts_per_tok: int = 8  # top_k
    moe_intermediate_size: int = 768  # each expert's SwiGLU width
    norm_topk_prob: bool = False  # renormalise the top-k weights to sum to 1
    decoder_sparse_step: int = 1  # layer l is sparse when (l + 1) % step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and l is not listed here
    architecture: str = "Qwen3MoeForCausalLM"

    def is_sparse(self, layer: int) -> bool:
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> Qwen3MoeConfig:
        if cfg.get("use_sliding_window"):
            raise UnsupportedModelError(
                "Qwen3MoeForCausalLM with a sliding window is not supported"
            )
        base = LlamaConfig.from_hf_dict({**cfg, "architectures": ["LlamaForCausalLM"]})
        fields = {**vars(base), "architecture": (cfg.get("architectures") or [cls.architecture])[0]}
        return cls(
            **fields,
            # Qwen's config.json says num_experts; transformers 5 saves num_local_experts.
            num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
            mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
        )


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's layer (and its forward) with QK-norm attention and, where sparse, the MoE MLP."""

    def __init__(
        self,
        config: Qwen3MoeConfig,
        layer: int,
        backend: AttentionBackend,
        tp: TensorParallelGroup,
    ) -> None:
        nn.Module.__init__(self)  # not Llama's: it would build Llama's attention and MLP
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen3Attention(config, backend, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        mlp: nn.Module
        if config.is_sparse(layer):
            mlp = SparseMoeBlock(
                config.hidden_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.moe_intermediate_size,
                renormalize=config.norm_topk_prob,
                weights_dtype=None,  # the router logits' (activations') dtype
                tp=tp,
            )
        else:
            mlp = LlamaMLP(config, tp)
        self.mlp = mlp  # type: ignore[assignment]  # Llama's is always dense


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE with an LM head; `forward` and `compute_logits` are Llama's."""

    def __init__(
        self,
        config: Qwen3MoeConfig,
        backend: AttentionBackend,
        max_positions: int | None = None,
        tp: TensorParallelGroup = SINGLE_DEVICE,
    ) -> None:
        layers: list[nn.Module] = [
            Qwen3MoeDecoderLayer(config, layer, backend, tp)
            for layer in range(config.num_hidden_layers)
        ]
        build_causal_lm(self, config, layers, max_positions, tp)

    def load_weights(self, weights: Mapping[str, Sliceable]) -> None:
        load_moe_weights(self, weights, {})


__all__ = ["Qwen3MoeConfig", "Qwen3MoeDecoderLayer", "Qwen3MoeForCausalLM"]
