"""Tiny random embedding checkpoints, saved the way sentence-transformers saves a real one.

`save_st_model` builds a random decoder with transformers (`save_pretrained`) and SmolLM2's
tokenizer, wraps it in sentence-transformers' own modules (`Transformer`, `Pooling`, optionally
`Normalize`) and saves the folder with `SentenceTransformer.save`: the checkpoint layout
(`Qwen3Model`, no "model." prefix) and the module files (modules.json, 1_Pooling/config.json,
sentence_bert_config.json) are exactly what a hub embedding model has.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import torch


def save_tiny_decoder(out: Path, family: str = "qwen3", seed: int = 0, **overrides: Any) -> Path:
    """A random 2-layer Qwen3 (or Llama) causal LM with SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from minivllm.model.resolver import resolve_model

    config_cls, model_cls = {
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }[family]
    config = config_cls(
        **{
            "vocab_size": 49152,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 512,
            "tie_word_embeddings": True,
            "initializer_range": 0.2,
            **overrides,
        }
    )
    torch.manual_seed(seed)
    model_cls(config).save_pretrained(out)
    bundled = resolve_model(None).path
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled / name, out)
    return out


def save_st_model(out: Path, base: Path, pooling_mode: str, normalize: bool) -> Path:
    """`base` (a transformers folder) as a sentence-transformers model: Transformer, Pooling
    (`pooling_mode`: "lasttoken", "mean", "cls") and, with `normalize`, Normalize."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.models import Normalize, Pooling, Transformer

    transformer = Transformer(str(base))
    modules = [
        transformer,
        Pooling(transformer.get_word_embedding_dimension(), pooling_mode=pooling_mode),
    ]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    return out


def st_encode(path: Path, texts: list[str]) -> torch.Tensor:
    """sentence-transformers' own embeddings of `texts` (float32 [N, H]): the oracle."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    return model.encode(texts, convert_to_tensor=True).float()


# A WordPiece vocabulary small enough to write out here: BERT's special tokens, the letters and
# digits (alone and as "##" continuations) and a few whole words, so that any lower-case English
# text tokenizes (most words letter by letter), as a real checkpoint's tokenizer would.
_WORDS = [
    "the", "a", "is", "of", "and", "to", "in", "paris", "france", "capital", "city", "rome",
    "italy", "cat", "dog", "sat", "on", "mat", "what", "how", "many", "people", "live", "where",
    "who", "hello", "world", "embeddings", "map", "text", "vectors", "query", "document",
]  # fmt: skip
BERT_VOCAB = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
    *".,!?'-:;()",
    *"abcdefghijklmnopqrstuvwxyz0123456789",
    *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz0123456789"),
    *_WORDS,
]  # fmt: skip


def save_tiny_bert(out: Path, num_labels: int | None = None, seed: int = 0) -> Path:
    """A random 2-layer BERT with a WordPiece tokenizer: a bare `BertModel` (an embedding model's
    encoder), or with `num_labels` a `BertForSequenceClassification` (a cross-encoder)."""
    from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizer

    out.mkdir(parents=True, exist_ok=True)
    labels: dict[str, Any] = {} if num_labels is None else {"num_labels": num_labels}
    config = BertConfig(
        vocab_size=len(BERT_VOCAB),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        initializer_range=0.2,
        **labels,
    )
    torch.manual_seed(seed)
    model = BertModel(config) if num_labels is None else BertForSequenceClassification(config)
    model.save_pretrained(out)
    (out / "vocab.txt").write_text("\n".join(BERT_VOCAB) + "\n")
    BertTokenizer(str(out / "vocab.txt"), do_lower_case=True).save_pretrained(out)
    return out
