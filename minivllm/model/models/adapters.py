"""A causal LM as a sequence classifier whose head is some rows of its LM head (vLLM's
`as_seq_cls_model` and `load_weights_using_from_2_way_softmax` / `load_weights_no_post_processing`,
vllm/model_executor/models/adapters.py).

An LLM reranker (Qwen3-Reranker) scores a prompt by the logits of a few tokens at its last
position, and reads nothing else of the vocabulary's logits. `hf_overrides`
(minivllm/model/hf_overrides.py) names those tokens; this model keeps their rows as a small
float32 head `score` [num_labels, hidden] and the pooling runner applies it to the last token's
hidden state (LAST pooling, `classify`):

    from_2_way_softmax   score = lm_head[true] - lm_head[false]   [1, H]
                         sigmoid(h . score) = softmax([logit_false, logit_true])[1]
    no_post_processing   score = lm_head[tokens]                   [k, H]   (k logits, as they are)

The rows are read from the checkpoint itself (the LM head's tensor, or the embedding's when the
two are tied), whole, by every tensor-parallel rank: each rank's head is the same small matrix
and no collective is needed, where the vocabulary-parallel LM head would hold the two rows on
different ranks. The decoder loads as its causal LM does; the LM head is dropped after loading.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from minivllm.model.config import LlamaConfig, UnsupportedModelError
from minivllm.model.layers.linear import Sliceable
from minivllm.model.models.llama import LlamaForCausalLM
from minivllm.model.models.qwen2 import Qwen2ForCausalLM
from minivllm.model.models.qwen3 import Qwen3ForCausalLM
from minivllm.model.weights import load_llama_weights


@dataclass
class SeqClsConfig(LlamaConfig):
    """The causal LM's config, and the classifier that `hf_overrides` made of it."""

    num_labels: int = 1  # the head's rows (1 for from_2_way_softmax)
    classifier_token_ids: tuple[int, ...] = ()  # the tokens whose LM-head rows make the head
    method: str = "from_2_way_softmax"  # or "no_post_processing" (hf_overrides.SEQ_CLS_METHODS)
    # A scored pair is its two texts joined as one, with no separator (vLLM's default for an LLM
    # as reranker, where a cross-encoder's tokenizer puts [SEP] between them).
    use_pad_token: bool = False

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> SeqClsConfig:
        base = LlamaConfig.from_hf_dict(cfg)
        ids = tuple(int(i) for i in cfg.get("classifier_token_ids") or ())
        if not ids:  # a *ForSequenceClassification checkpoint with a trained `score` of its own
            raise UnsupportedModelError(
                f"{base.architecture} is run only as a causal LM converted by hf_overrides "
                "(classifier_from_token and method); a checkpoint with its own score head is not "
                "supported"
            )
        return cls(
            **{f.name: getattr(base, f.name) for f in fields(LlamaConfig)},
            num_labels=int(cfg["num_labels"]),
            classifier_token_ids=ids,
            method=str(cfg["method"]),
        )


class SeqClsFromLMHead:
    """The classifier head and its loading; mixed in before a causal LM class."""

    score: torch.Tensor  # float32 [num_labels, hidden_size], set by `load_weights`

    def load_weights(self, weights: Mapping[str, Sliceable]) -> None:
        """The causal LM's weights, then the head from the checkpoint's LM-head rows."""
        assert isinstance(self, LlamaForCausalLM)
        config = self.config
        assert isinstance(config, SeqClsConfig)
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        dtype = self.model.embed_tokens.weight.dtype
        load_llama_weights(self, weights)
        # Each row as the model's dtype holds it, then float32 (vLLM: the loaded LM head's rows).
        rows = torch.cat([weights[head][i : i + 1].to(dtype) for i in config.classifier_token_ids])
        rows = rows.float()  # [len(tokens), H]
        if config.method == "from_2_way_softmax":
            rows = rows[1:2] - rows[0:1]  # the true token's row minus the false one's: [1, H]
        del self.lm_head  # the pooling runner computes no logits
        self.score = rows.to(self.model.embed_tokens.weight.device)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:  # [N, H] -> float32 [N, num_labels]
        """The head over the pooled last-token states, in float32 (vLLM's `_classifier`)."""
        return pooled.float() @ self.score.T

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        raise RuntimeError("a sequence classifier computes no vocabulary logits (runner='pooling')")


class Qwen3ForSequenceClassification(SeqClsFromLMHead, Qwen3ForCausalLM):
    """Qwen3-Reranker's form (hf_overrides: is_original_qwen3_reranker)."""


class Qwen2ForSequenceClassification(SeqClsFromLMHead, Qwen2ForCausalLM):
    """mxbai-rerank-v2's form (hf_overrides: classifier_from_token ["0", "1"])."""


class LlamaForSequenceClassification(SeqClsFromLMHead, LlamaForCausalLM):
    """A Llama causal LM read through some of its LM head's rows."""
