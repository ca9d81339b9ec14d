"""The model registry: a checkpoint's architecture name -> the class that runs it (vLLM's registry).

A HuggingFace `config.json` names its model class in `architectures` ("Qwen2ForCausalLM"); a GGUF
file names its family in `general.architecture` ("qwen2", which minivllm/model/quantization/gguf/config.py turns into the
former).
vLLM's `vllm/model_executor/models/registry.py` maps each name to a module and a class and imports
the module only when a model of that kind is loaded; the same here, so adding a family is one line
below plus its model file, and reading a config imports no model code.

Several names may share a class where the math is the same: Mistral is Llama with a sliding
window, which every attention layer takes from the config (vLLM maps it to `LlamaForCausalLM`
too). An architecture not listed is refused by name, with the list of those that run, before any
weight is read.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from minivllm.model.config import LlamaConfig
from minivllm.model.errors import UnsupportedArchitectureError

if TYPE_CHECKING:
    from minivllm.model.models.llama import LlamaForCausalLM

# architecture (config.json's `architectures[0]`) -> "module:Class" of the model that runs it.
MODELS: dict[str, str] = {
    "LlamaForCausalLM": "minivllm.model.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "minivllm.model.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "minivllm.model.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "minivllm.model.models.qwen3:Qwen3ForCausalLM",
    "Phi3ForCausalLM": "minivllm.model.models.phi3:Phi3ForCausalLM",
    "MixtralForCausalLM": "minivllm.model.models.mixtral:MixtralForCausalLM",
    "Qwen3MoeForCausalLM": "minivllm.model.models.qwen3_moe:Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM": "minivllm.model.models.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "minivllm.model.models.gemma3:Gemma3ForCausalLM",
    # Bare decoders, as transformers' AutoModel (and so sentence-transformers) saves them: no LM
    # head, run by the pooling runner (minivllm/pooling/), which never calls one.
    "LlamaModel": "minivllm.model.models.llama:LlamaForCausalLM",
    "MistralModel": "minivllm.model.models.llama:LlamaForCausalLM",
    "Qwen2Model": "minivllm.model.models.qwen2:Qwen2ForCausalLM",
    "Qwen3Model": "minivllm.model.models.qwen3:Qwen3ForCausalLM",
    # Encoders (bidirectional attention), pooling only: embeddings, and a cross-encoder's scores.
    "BertModel": "minivllm.model.models.bert:BertEmbeddingModel",
    "BertForSequenceClassification": "minivllm.model.models.bert:BertForSequenceClassification",
    # A causal LM read as a classifier through some of its LM head's rows: only as hf_overrides
    # (minivllm/model/hf_overrides.py) builds it from a *ForCausalLM checkpoint (Qwen3-Reranker).
    "Qwen3ForSequenceClassification": "minivllm.model.models.adapters:Qwen3ForSequenceClassification",
    "Qwen2ForSequenceClassification": "minivllm.model.models.adapters:Qwen2ForSequenceClassification",
    "LlamaForSequenceClassification": "minivllm.model.models.adapters:LlamaForSequenceClassification",
}
# The families whose config has fields of its own (experts, Gemma's); the others: LlamaConfig.
CONFIGS: dict[str, str] = {
    "MixtralForCausalLM": "minivllm.model.models.mixtral:MixtralConfig",
    "Qwen3MoeForCausalLM": "minivllm.model.models.qwen3_moe:Qwen3MoeConfig",
    "Gemma2ForCausalLM": "minivllm.model.models.gemma2:Gemma2Config",
    "Gemma3ForCausalLM": "minivllm.model.models.gemma3:Gemma3Config",
    "BertModel": "minivllm.model.models.bert:BertConfig",
    "BertForSequenceClassification": "minivllm.model.models.bert:BertConfig",
    "Qwen3ForSequenceClassification": "minivllm.model.models.adapters:SeqClsConfig",
    "Qwen2ForSequenceClassification": "minivllm.model.models.adapters:SeqClsConfig",
    "LlamaForSequenceClassification": "minivllm.model.models.adapters:SeqClsConfig",
}


def supported_architectures() -> list[str]:
    return sorted(MODELS)


def check_architecture(architecture: str) -> None:
    """Refuse an architecture the registry does not name, listing those it does."""
    if architecture not in MODELS:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; minivllm runs "
            f"{', '.join(supported_architectures())}"
        )


def config_from_hf_dict(cfg: dict[str, object]) -> LlamaConfig:
    """A config.json's config, read by its architecture's config class, after the registry has
    said the architecture runs."""
    architecture = str((cfg.get("architectures") or ["LlamaForCausalLM"])[0])  # type: ignore[index]
    check_architecture(architecture)
    if architecture not in CONFIGS:
        return LlamaConfig.from_hf_dict(cfg)
    module, _, name = CONFIGS[architecture].partition(":")
    config: LlamaConfig = getattr(importlib.import_module(module), name).from_hf_dict(cfg)
    return config


def model_class(config: LlamaConfig) -> type[LlamaForCausalLM]:
    """The class that runs `config`, its module imported now (the first time it is asked);
    refused by name where nothing runs it exactly."""
    check_architecture(config.architecture)
    module, _, name = MODELS[config.architecture].partition(":")
    cls: type[LlamaForCausalLM] = getattr(importlib.import_module(module), name)
    return cls
