"""Scores of text pairs, the two ways vLLM computes them (vllm/entrypoints/score_utils.py):

- a **cross-encoder** (a classifier with one label, `BertForSequenceClassification`) reads both
  texts at once: the pair is tokenized as its tokenizer tokenizes pairs (`[CLS] a [SEP] b [SEP]`,
  token types 0 then 1) and its one logit, through a sigmoid, is the score; an LLM reranker
  (Qwen3-Reranker through `hf_overrides`) reads the two texts joined, each in its template;
- an **embedding model** embeds each text alone, and the score is the cosine of the two vectors.

`LLM.score` and the server's `/score` and `/rerank` both build on these, so that the offline and
the served numbers are the same function of the same prompts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def pair_prompt(
    tokenizer: Any, text_1: str, text_2: str, use_pad_token: bool = True
) -> dict[str, list[int]]:
    """A cross-encoder's prompt: the tokenizer's own encoding of the pair (its special tokens and
    token types), as vLLM's `TokensPrompt` with `token_type_ids`; or, `use_pad_token` False (an
    LLM as reranker, minivllm/model/models/adapters.py), the two texts joined and tokenized as
    one, as vLLM's `get_score_prompt` does: the model's own template is in the texts."""
    if tokenizer is None:
        raise ValueError("scoring text pairs needs a tokenizer (skip_tokenizer_init is set)")
    enc = tokenizer(text_1, text_2) if use_pad_token else tokenizer(text_1 + text_2)
    prompt = {"prompt_token_ids": list(enc["input_ids"])}
    if enc.get("token_type_ids") is not None:
        prompt["token_type_ids"] = list(enc["token_type_ids"])
    return prompt


def cosine(u: Sequence[float], v: Sequence[float]) -> float:
    """The cosine similarity of two embeddings (0 where either is all zeros)."""
    dot = sum(a * b for a, b in zip(u, v))
    norm = math.sqrt(sum(a * a for a in u)) * math.sqrt(sum(b * b for b in v))
    return dot / norm if norm else 0.0


def pair_texts(
    text_1: str | Sequence[str], text_2: str | Sequence[str]
) -> tuple[list[str], list[str]]:
    """vLLM's pairing: one `text_1` against each of `text_2` (1:N), or pairwise (N:N)."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if not seconds or len(firsts) != len(seconds):
        raise ValueError(
            f"text_1 must be one text or as many as text_2 ({len(seconds)}), got {len(firsts)}"
        )
    return firsts, seconds
