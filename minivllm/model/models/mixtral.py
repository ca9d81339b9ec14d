"""Mixtral: the Llama decoder with each layer's MLP a sparse mixture of experts (vLLM's
vllm/model_executor/models/mixtral.py; Jiang et al., "Mixtral of Experts", 2024).

Everything but the MLP is Llama's (`llama.py`): RMSNorm, grouped-query attention with RoPE
through the paged-KV backend, the residual adds done by the norms. The MLP of every layer is a
`SparseMoeBlock` (`fused_moe.py`): a router scores each token against `num_local_experts` SwiGLU
experts and the token runs through its `num_experts_per_tok` best, their outputs summed with the
router's softmax weights, renormalised over the chosen experts.

The checkpoint names the block `block_sparse_moe` (`.gate`, `.experts.{e}.w1/w3/w2`); the model
names it `mlp`, as transformers 5 does, so that Llama's decoder layer runs it unchanged;
`load_moe_weights` renames and places each tensor (expert weights into the stacked w13/w2).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from minivllm.attention.abstract import AttentionBackend
from minivllm.distributed.parallel_state import SINGLE_DEVICE, TensorParallelGroup
from minivllm.model.config import LlamaConfig, UnsupportedModelError
from minivllm.model.errors import CorruptCheckpointError
from minivllm.model.layers.fused_moe import SparseMoeBlock, expert_target_of
from minivllm.model.layers.linear import (
    ParallelLMHead,
    Sliceable,
    VocabParallelEmbedding,
    kv_heads_per_rank,
)
from minivllm.model.layers.rotary_embedding import RotaryEmbedding
from minivllm.model.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    RMSNorm,
)
from minivllm.model.pipeline import stage_target
from minivllm.model.weights import target_of


@dataclass
class MixtralConfig(LlamaConfig):
    """Llama's shapes, with `intermediate_size` each expert's SwiGLU width."""

    num_local_experts: int = 8  # E
    num_experts_per_tok: int = 2  # top_k
    architecture: str = "MixtralForCausalLM"

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> MixtralConfig:
        if cfg.get("sliding_window") is not None:
            raise UnsupportedModelError("MixtralForCausalLM with a sliding window is not supported")
        base = LlamaConfig.from_hf_dict({**cfg, "architectures": ["LlamaForCausalLM"]})
        fields = {**vars(base), "architecture": (cfg.get("architectures") or [cls.architecture])[0]}
        return cls(
            **fields,
            num_local_experts=int(cfg["num_local_experts"]),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        )


class MixtralDecoderLayer(LlamaDecoderLayer):
    """Llama's layer (and its forward) with the MLP a `SparseMoeBlock`."""

    def __init__(
        self, config: MixtralConfig, backend: AttentionBackend, tp: TensorParallelGroup
    ) -> None:
        nn.Module.__init__(self)  # not Llama's: it would build a dense MLP
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, backend, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = SparseMoeBlock(  # type: ignore[assignment]  # Llama's is dense
            config.hidden_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.intermediate_size,
            renormalize=True,
            tp=tp,
        )


def build_causal_lm(
    model: LlamaForCausalLM,
    config: LlamaConfig,
    layers: list[nn.Module],
    max_positions: int | None,
    tp: TensorParallelGroup,
) -> None:
    """`LlamaForCausalLM`'s parts around the given decoder layers (Llama's own `__init__` would
    build dense ones): embedding, layers, final norm, RoPE table, LM head (tied or not)."""
    nn.Module.__init__(model)
    model.config, model.tp = config, tp
    body = LlamaModel.__new__(LlamaModel)
    nn.Module.__init__(body)
    body.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
    body.layers = nn.ModuleList(layers)
    body.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
    body.rotary_emb = RotaryEmbedding(config, max_positions or config.max_position_embeddings)
    body.start_layer, body.end_layer = 0, len(layers)  # every layer: one pipeline stage
    model.model = body
    model.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
    if config.tie_word_embeddings:
        model.lm_head.weight = body.embed_tokens.weight
        model.lm_head.tied = True
    model.num_kv_heads = kv_heads_per_rank(config.num_key_value_heads, tp.world_size)


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral with an LM head; `forward` and `compute_logits` are Llama's."""

    def __init__(
        self,
        config: MixtralConfig,
        backend: AttentionBackend,
        max_positions: int | None = None,
        tp: TensorParallelGroup = SINGLE_DEVICE,
    ) -> None:
        layers: list[nn.Module] = [
            MixtralDecoderLayer(config, backend, tp) for _ in range(config.num_hidden_layers)
        ]
        build_causal_lm(self, config, layers, max_positions, tp)

    def load_weights(self, weights: Mapping[str, Sliceable]) -> None:
        load_moe_weights(self, weights, {".block_sparse_moe.": ".mlp."})


def load_moe_weights(
    model: nn.Module, weights: Mapping[str, Sliceable], renames: Mapping[str, str]
) -> None:
    """Each checkpoint tensor (renamed by `renames`) into the parameter that holds it: an expert's
    into the stacked w13/w2 (`expert_target_of`), q/k/v and a dense MLP's gate/up into their fused
    layers (`weights.target_of`), through the layer's weight loader; the rest copied whole.
    Every parameter must be fed, and by a tensor of its shape where it is copied whole."""
    params = dict(model.named_parameters())  # a tied LM head's weight appears once, as the table's
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    fed: set[str] = set()
    for name, tensor in weights.items():
        if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            continue
        for old, new in renames.items():
            name = name.replace(old, new)
        found = expert_target_of(name)
        fused, shard = found if found is not None else target_of(name)
        target = stage_target(model, fused)
        if target is None:  # another pipeline stage holds it
            continue
        if target not in params:
            raise CorruptCheckpointError(f"checkpoint has an unexpected tensor {name}")
        module_name, _, _ = target.rpartition(".")
        loader = getattr(model.get_submodule(module_name), "weight_loader", None)
        param = params[target]
        if loader is not None:
            loader(param, tensor, *shard)
        else:
            data = tensor[:]
            if tuple(data.shape) != tuple(param.shape):
                raise CorruptCheckpointError(
                    f"tensor {name} has shape {tuple(data.shape)}, the model {tuple(param.shape)}"
                )
            param.data.copy_(data)
        fed.add(target)
    missing = sorted(params.keys() - fed)
    if missing:
        raise CorruptCheckpointError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


__all__ = ["MixtralConfig", "MixtralDecoderLayer", "MixtralForCausalLM", "load_moe_weights"]
