"""`hf_overrides`: changes to a checkpoint's config.json made at load (vLLM's `LLM(...,
hf_overrides=...)` and `--hf-overrides`), for the one use minivllm supports: serving a causal LM
as a sequence classifier built from its LM head (vLLM's `as_seq_cls_model`,
vllm/model_executor/models/adapters.py).

Qwen3-Reranker is a `Qwen3ForCausalLM` that answers "yes" or "no" to a (query, document) prompt;
its relevance score is P(yes) over the two tokens, softmax([logit_no, logit_yes])[1] =
sigmoid(logit_yes - logit_no) at the last token. vLLM serves it with

    hf_overrides={"architectures": ["Qwen3ForSequenceClassification"],
                  "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}

and, at load, keeps of the LM head only what that score reads: one row, lm_head[yes] -
lm_head[no] (`method="from_2_way_softmax"`). With `method="no_post_processing"` each listed
token's row is one label (bge-reranker-v2-gemma's `["Yes"]`: sigmoid(logit_Yes)).

Every other key vLLM would accept (any config field) is refused by name here, so that an
override is never silently ignored. The tokens are turned into ids with the model's tokenizer
before any weight loads (`with_token_ids`), and the ids travel with the model's files
(`ModelSource.hf_overrides`) to every process that reads its config.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

SEQ_CLS_METHODS = ("from_2_way_softmax", "no_post_processing")
SUPPORTED_KEYS = ("architectures", "classifier_from_token", "is_original_qwen3_reranker", "method")
# The classifier an override may turn a causal LM into -> the causal LM it must be.
SEQ_CLS_FROM_CAUSAL_LM = {
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "LlamaForSequenceClassification": "LlamaForCausalLM",
}


@dataclass(frozen=True)
class HfOverrides:
    """A causal LM served as a classifier over some of its vocabulary's logits."""

    architecture: str  # one of SEQ_CLS_FROM_CAUSAL_LM
    classifier_from_token: tuple[
        str, ...
    ]  # token strings, as the tokenizer's vocabulary spells them
    method: str  # one of SEQ_CLS_METHODS
    classifier_token_ids: tuple[int, ...] = ()  # the tokens' ids; () until `with_token_ids`

    @property
    def num_labels(self) -> int:
        return 1 if self.method == "from_2_way_softmax" else len(self.classifier_from_token)

    def apply(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """config.json's dict as the overrides change it (a new dict; the file is not touched)."""
        base = str((cfg.get("architectures") or ["LlamaForCausalLM"])[0])
        wanted = SEQ_CLS_FROM_CAUSAL_LM[self.architecture]
        if base != wanted:
            raise ValueError(
                f"hf_overrides.architectures: {self.architecture} is built from a {wanted} "
                f"checkpoint, got {base}"
            )
        return {
            **cfg,
            "architectures": [self.architecture],
            "num_labels": self.num_labels,
            "classifier_from_token": list(self.classifier_from_token),
            "classifier_token_ids": list(self.classifier_token_ids),
            "method": self.method,
        }

    def with_token_ids(self, tokenizer: Any) -> HfOverrides:
        """The tokens' ids in `tokenizer`'s vocabulary (`convert_tokens_to_ids`, as vLLM); a token
        the vocabulary lacks is refused by name."""
        if tokenizer is None:
            raise ValueError(
                "hf_overrides.classifier_from_token needs the tokenizer (skip_tokenizer_init is set)"
            )
        vocab = tokenizer.get_vocab()
        missing = [t for t in self.classifier_from_token if t not in vocab]
        if missing:
            raise ValueError(
                f"hf_overrides.classifier_from_token: {missing} not in the tokenizer's vocabulary "
                "(a token string, as the vocabulary spells it, e.g. 'yes')"
            )
        return replace(
            self, classifier_token_ids=tuple(vocab[t] for t in self.classifier_from_token)
        )


def parse_hf_overrides(value: str | Mapping[str, Any] | None) -> HfOverrides | None:
    """vLLM's `hf_overrides` (a JSON object, or a dict), checked before any file is read."""
    if not value:
        return None
    try:
        cfg = json.loads(value) if isinstance(value, str) else dict(value)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"hf_overrides must be a JSON object: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"hf_overrides must be a JSON object, got {value!r}")
    unknown = sorted(set(cfg) - set(SUPPORTED_KEYS))
    if unknown:
        raise ValueError(
            f"hf_overrides keys {unknown} are not supported; supported: {list(SUPPORTED_KEYS)} "
            "(a causal LM served as a classifier from its LM head's rows)"
        )
    archs = cfg.get("architectures")
    if not (isinstance(archs, list) and len(archs) == 1 and archs[0] in SEQ_CLS_FROM_CAUSAL_LM):
        raise ValueError(
            f"hf_overrides.architectures must be one of {[[a] for a in SEQ_CLS_FROM_CAUSAL_LM]}, "
            f"got {archs!r}"
        )
    tokens = cfg.get("classifier_from_token")
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens)):
        raise ValueError(
            f"hf_overrides.classifier_from_token must be a list of token strings, got {tokens!r}"
        )
    original = cfg.get("is_original_qwen3_reranker", False)
    if not isinstance(original, bool):
        raise ValueError(
            f"hf_overrides.is_original_qwen3_reranker must be a bool, got {original!r}"
        )
    method = cfg.get("method", "from_2_way_softmax" if original else None)
    if method not in SEQ_CLS_METHODS or (original and method != "from_2_way_softmax"):
        raise ValueError(
            f"hf_overrides.method must be one of {SEQ_CLS_METHODS} (from_2_way_softmax with "
            f"is_original_qwen3_reranker), got {method!r}"
        )
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(
            "hf_overrides.classifier_from_token must name 2 tokens (the false one, then the true "
            f"one) for method 'from_2_way_softmax', got {tokens!r}"
        )
    return HfOverrides(archs[0], tuple(tokens), method)
