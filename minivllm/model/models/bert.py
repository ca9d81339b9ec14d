"""BERT (Devlin et al., 2019): the encoder behind sentence-transformers' embedding models
(all-MiniLM, bge) and their cross-encoders (ms-marco-MiniLM), in transformers' `modeling_bert.py`.

Against Llama (llama.py) nearly everything differs, so this file is its own math over the shared
linear layers:

- **Embeddings**: word + token type (0 for the first text of a pair, 1 for the second) + absolute
  position, then a LayerNorm. No RoPE.
- **Post-LayerNorm**: each sublayer's output is added to its input, then normalised
  (`LayerNorm(x + attn(x))`), where a decoder normalises before the sublayer.
- **GELU MLP** (`intermediate` then `output`): one up and one down projection, no gate.
- **Bidirectional attention**: every token sees every token of its text. It is encoder-only
  attention (`backend.attend_encoder`, vLLM's `AttentionType.ENCODER_ONLY`): the layer hands the
  backend the step's own query, key and value, and each prompt, whole in the step, attends over
  its own rows. Nothing is written to a KV cache, since nothing would read it again: an encoder
  holds no KV blocks at all (minivllm/core/encoder_only_manager.py), and
  its prompts are scheduled whole, never chunked (`enable_chunked_prefill=False`).

Two heads over the encoder: `BertModel`, the bare encoder (embedding models pool its last hidden
states: mean, or [CLS]), and `BertForSequenceClassification`, whose [CLS] state goes through the
pooler (dense + tanh) and the classifier to `num_labels` logits (`classify`; a cross-encoder
scores a pair with one logit).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.attention.abstract import AttentionBackend, AttentionMetadata
from minivllm.distributed.parallel_state import SINGLE_DEVICE, TensorParallelGroup
from minivllm.distributed.pipeline import IntermediateTensors
from minivllm.model.config import LlamaConfig, UnsupportedModelError
from minivllm.model.custom_op import CustomOp
from minivllm.model.errors import CorruptCheckpointError
from minivllm.model.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    QKVParallelLinear,
    RowParallelLinear,
    Sliceable,
    VocabParallelEmbedding,
)
from minivllm.model.models.llama import LlamaForCausalLM

# transformers' names for GELU -> F.gelu's `approximate`
GELU_KINDS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


@dataclass
class BertConfig(LlamaConfig):
    """Llama's shape fields (every head is a KV head: the cache sizes itself from them) and BERT's."""

    type_vocab_size: int = 2  # token types: 0 and 1 (the two texts of a pair)
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"  # one of GELU_KINDS
    num_labels: int = 0  # a classifier's logits (BertForSequenceClassification); 0: none
    is_causal: bool = False  # read by the pooler config: an encoder's prompt runs whole
    architecture: str = "BertModel"

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> BertConfig:
        arch = str((cfg.get("architectures") or ["BertModel"])[0])
        act = cfg.get("hidden_act", "gelu")
        if act not in GELU_KINDS:
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported ({list(GELU_KINDS)})")
        kind = cfg.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise UnsupportedModelError(f"position_embedding_type {kind!r} is not supported")
        heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
        labels = cfg.get("id2label") or {}
        num_labels = int(cfg.get("num_labels") or len(labels) or 2)
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=hidden // heads,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 512)),
            type_vocab_size=int(cfg.get("type_vocab_size", 2)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
            hidden_act=act,
            num_labels=num_labels if arch.endswith("ForSequenceClassification") else 0,
            architecture=arch,
        )


# ===================================================================================== layers


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, h, tp)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, h)
        self.LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]  0.. within each prompt
        token_type_ids: torch.Tensor,  # int64 [T]
    ) -> torch.Tensor:  # [T, hidden_size]
        # transformers' order of adds: (words + types) + positions.
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x + self.position_embeddings(positions))


class BertSelfOutput(CustomOp):
    """A sublayer's end: its output projection, the residual add and the post-LayerNorm,
    `LayerNorm(dense(x) + residual)` (transformers' `BertSelfOutput`, after attention).

    A custom op rather than three calls in the layer, because a platform can fuse them: on a CPU
    the residual add rides in oneDNN's GEMM as a post-op (minivllm/cpu/op_forwards.py)."""

    def __init__(
        self, input_size: int, hidden_size: int, eps: float, tp: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.dense = RowParallelLinear(input_size, hidden_size, True, tp)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=eps)

    def forward_native(
        self,
        hidden: torch.Tensor,  # [T, input_size]  the sublayer's output
        residual: torch.Tensor,  # [T, hidden_size]  the sublayer's input
    ) -> torch.Tensor:  # [T, hidden_size]
        return self.LayerNorm(self.dense(hidden) + residual)


class BertOutput(BertSelfOutput):
    """The FFN's end (transformers' `BertOutput`): the down projection, the residual add and the
    layer's last LayerNorm; the same math as `BertSelfOutput` from `intermediate_size` inputs."""


class BertIntermediate(CustomOp):
    """The FFN's up projection and its GELU, `gelu(dense(x))` (transformers' `BertIntermediate`);
    a custom op so that a platform can run the GELU inside the GEMM (oneDNN's post-op on a CPU)."""

    def __init__(self, config: BertConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(config.hidden_size, [config.intermediate_size], True, tp)
        self.approximate = GELU_KINDS[config.hidden_act]  # F.gelu's: "none" (erf) or "tanh"

    def forward_native(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, I / N]
        return F.gelu(self.dense(hidden), approximate=self.approximate)


class BertAttention(nn.Module):
    """Self-attention over the whole prompt, then its output projection, the residual add and the
    post-LayerNorm (`output`)."""

    def __init__(
        self, config: BertConfig, backend: AttentionBackend, tp: TensorParallelGroup
    ) -> None:
        super().__init__()
        h, d, heads = config.hidden_size, config.head_dim, config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(h, d, heads, heads, True, tp)
        self.num_heads = self.qkv_proj.num_heads  # this rank's heads (all of them KV heads too)
        self.head_dim, self.q_size = d, self.num_heads * d
        self.scale = d**-0.5
        self.output = BertSelfOutput(heads * d, h, config.layer_norm_eps, tp)
        self.backend = backend

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden_size]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        t, d = hidden.shape[0], self.head_dim
        q, k, v = self.qkv_proj(hidden).split([self.q_size] * 3, dim=-1)
        q, k, v = (x.reshape(t, self.num_heads, d) for x in (q, k, v))  # [T, H, D] each
        out = self.backend.attend_encoder(q, k, v, meta, self.scale)  # [T, H, D]
        return self.output(out.reshape(t, self.q_size), hidden)


class BertLayer(nn.Module):
    def __init__(
        self, config: BertConfig, backend: AttentionBackend, tp: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.attention = BertAttention(config, backend, tp)
        self.intermediate = BertIntermediate(config, tp)
        self.output = BertOutput(
            config.intermediate_size, config.hidden_size, config.layer_norm_eps, tp
        )

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden_size]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        hidden = self.attention(hidden, meta)
        return self.output(self.intermediate(hidden), hidden)


class BertModel(nn.Module):
    """The encoder: embeddings, then N post-LayerNorm layers; its output is the last hidden state."""

    def __init__(
        self, config: BertConfig, backend: AttentionBackend, tp: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(config, tp)
        self.layers = nn.ModuleList(
            BertLayer(config, backend, tp) for _ in range(config.num_hidden_layers)
        )
        # One pipeline stage holds them all (pooling refuses pipeline parallelism).
        self.start_layer, self.end_layer = 0, config.num_hidden_layers
        for module in self.modules():  # an encoder runs prompts only, never a decode step
            if isinstance(module, LinearBase):
                module.prefill_only = True

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        meta: AttentionMetadata,
        token_type_ids: torch.Tensor | None = None,  # int64 [T]; None: every token's is 0
    ) -> torch.Tensor:  # [T, hidden_size]
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.layers:
            hidden = layer(hidden, meta)
        return hidden


# ===================================================================================== heads


class BertEmbeddingModel(LlamaForCausalLM):
    """A bare BERT (`BertModel` checkpoints): the pooling runner pools its hidden states. It has
    no LM head; it subclasses the decoder's class for the interface the runner reads (`config`,
    `num_kv_heads`, `model`), as Gemma 2 does."""

    def __init__(
        self,
        config: BertConfig,
        backend: AttentionBackend,
        max_positions: int | None = None,
        tp: TensorParallelGroup = SINGLE_DEVICE,
    ) -> None:
        nn.Module.__init__(self)  # not Llama's: no decoder layers, no LM head
        self.config, self.tp = config, tp
        self.model = BertModel(config, backend, tp)  # type: ignore[assignment]
        self.num_kv_heads = config.num_attention_heads // tp.world_size

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        kv_caches: torch.Tensor,  # the runner's, empty: an encoder holds no KV cache
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,  # one stage only: pooling refuses PP
        *,
        token_type_ids: torch.Tensor | None = None,  # int64 [T]
    ) -> torch.Tensor:  # [T, hidden_size]
        assert intermediate is None, "an encoder runs on one pipeline stage"
        return self.model(input_ids, positions, meta, token_type_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        raise NotImplementedError("BERT has no LM head: it runs with runner='pooling' only")

    @staticmethod
    def checkpoint_names(module_name: str) -> list[str]:
        """The checkpoint weights that feed a module (the GGUF loader asks): see below."""
        return checkpoint_names(module_name)

    def load_weights(self, weights: Mapping[str, Sliceable]) -> None:
        """transformers' names (`bert.` prefixed in a classifier's checkpoint) onto this model's:
        query/key/value into the fused qkv_proj, everything else by its name."""
        params = dict(self.named_parameters())
        fed: set[str] = set()
        for name, tensor in weights.items():
            target, shard = checkpoint_target(name.removeprefix("bert."))
            if target is None or (target.startswith("pooler.") and target not in params):
                continue  # position_ids; a bare encoder's unused pooler
            if target not in params:
                raise CorruptCheckpointError(f"checkpoint has an unexpected tensor {name}")
            module = self.get_submodule(target.rpartition(".")[0])
            loader = getattr(module, "weight_loader", None)
            if loader is not None:
                loader(params[target], tensor, *shard)
            else:
                data = tensor[:]
                if tuple(data.shape) != tuple(params[target].shape):
                    raise CorruptCheckpointError(
                        f"tensor {name} has shape {tuple(data.shape)}, the model "
                        f"{tuple(params[target].shape)}"
                    )
                params[target].data.copy_(data)
            fed.add(target)
        missing = sorted(params.keys() - fed)
        if missing:
            raise CorruptCheckpointError(
                f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}"
            )


def checkpoint_target(name: str) -> tuple[str | None, tuple[str, ...]]:
    """transformers' name of a BERT tensor -> (this model's parameter, the qkv shard), or None for
    a buffer that is not a weight."""
    if name.endswith("position_ids"):
        return None, ()
    if name.startswith(("embeddings.", "encoder.")):
        name = "model." + name.replace("encoder.layer.", "layers.")
        for part in ("query", "key", "value"):
            if f"attention.self.{part}." in name:
                shard = {"query": "q", "key": "k", "value": "v"}[part]
                return name.replace(f"self.{part}.", "qkv_proj."), (shard,)
    return name, ()


def checkpoint_names(module_name: str) -> list[str]:
    """The transformers weights that feed one of this model's linear layers or its word
    embedding, in the layer's row order (query, key, value): `checkpoint_target` inverted, for
    the GGUF loader, which hands a layer its checkpoint tensors' blocks."""
    name = module_name.removeprefix("model.").replace("layers.", "encoder.layer.", 1)
    if name.endswith(".attention.qkv_proj"):
        base = name.removesuffix("qkv_proj")
        return [f"{base}self.{part}.weight" for part in ("query", "key", "value")]
    return [f"{name}.weight"]  # the sublayers carry transformers' names (output.dense, ...)


class BertForSequenceClassification(BertEmbeddingModel):
    """A classifier (a cross-encoder): [CLS] -> pooler (dense, tanh) -> classifier -> logits."""

    def __init__(
        self,
        config: BertConfig,
        backend: AttentionBackend,
        max_positions: int | None = None,
        tp: TensorParallelGroup = SINGLE_DEVICE,
    ) -> None:
        super().__init__(config, backend, max_positions, tp)
        h = config.hidden_size
        self.pooler = nn.ModuleDict({"dense": nn.Linear(h, h)})
        self.classifier = nn.Linear(h, config.num_labels)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:  # [N, H] -> float32 [N, num_labels]
        """The head over the pooled [CLS] states (BertPooler, then the classifier)."""
        x = pooled.to(self.classifier.weight.dtype)
        return self.classifier(torch.tanh(self.pooler["dense"](x))).float()


__all__ = [
    "BertConfig",
    "BertEmbeddingModel",
    "BertForSequenceClassification",
    "BertIntermediate",
    "BertModel",
    "BertOutput",
    "BertSelfOutput",
    "checkpoint_names",
    "checkpoint_target",
]
