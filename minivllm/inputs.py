"""What a prompt may be, and how it becomes token ids (vLLM's `inputs` / input processor).

A prompt is a string (tokenized here), a list of token ids, or a dict `{"prompt": ...}` or
`{"prompt_token_ids": [...]}` (vLLM's TextPrompt / TokensPrompt). Every check that can be made
before a request reaches the scheduler is made here, with a message that names what is wrong.
"""

from __future__ import annotations

from typing import Any

from minivllm.sampling_params import InvalidParamError

PromptType = str | list[int] | dict[str, Any]


class PromptTooLongError(ValueError):
    """The prompt leaves no room for output within max_model_len."""


def process_prompt(
    prompt: PromptType, tokenizer: Any, vocab_size: int
) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids) for any accepted prompt form; ValueError otherwise."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer (skip_tokenizer_init is set)")
        return prompt, list(tokenizer.encode(prompt))
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
        elif "prompt" in prompt:
            return process_prompt(prompt["prompt"], tokenizer, vocab_size)
        else:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    else:
        ids = prompt
    if not isinstance(ids, list | tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise ValueError("prompt_token_ids must be a list of integers")
    if not ids:
        raise ValueError("prompt must not be empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(  # vLLM's wording first: clients search for "out of vocabulary"
            f"Token id {bad[0]} is out of vocabulary: prompt_token_ids must be in "
            f"[0, {vocab_size - 1}]"
        )
    return None, list(ids)


def truncate_prompt(
    ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int
) -> list[int]:
    """The last `truncate_prompt_tokens` tokens of a prompt (vLLM's left truncation: the end of a
    long prompt, nearest the answer, is what matters most); -1 means `max_model_len`."""
    if truncate_prompt_tokens is None:
        return ids
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    return ids[-keep:]


def prepare_prompt(
    prompt: PromptType, tokenizer: Any, vocab_size: int, max_model_len: int, truncate: int | None
) -> tuple[str | None, list[int]]:
    """The prompt the engine runs: tokenized, cut to its last `truncate` tokens, and short enough
    to leave room for one output token (else `PromptTooLongError`)."""
    text, ids = process_prompt(prompt, tokenizer, vocab_size)
    kept = truncate_prompt(ids, truncate, max_model_len)
    if len(kept) < len(ids):  # the text no longer matches the ids
        text, ids = None, kept
    if len(ids) >= max_model_len:
        raise PromptTooLongError(
            f"the prompt has {len(ids)} tokens, but max_model_len is {max_model_len}: "
            "it must be shorter, to leave room for at least one output token"
        )
    return text, ids


def process_token_params(params: Any, tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """Token ids a request names must be in the vocabulary (vLLM's check, made where the
    vocabulary is known); `bad_words` become token-id sequences, as vLLM tokenizes them: each
    word on its own and after a space, since a tokenizer spells the two differently."""
    for name, ids in (
        ("logit_bias", list(params.logit_bias or {})),
        ("allowed_token_ids", params.allowed_token_ids or []),
    ):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidParamError(
                f"{name} contains out-of-vocab token id {bad[0]}: token ids must be in "
                f"[0, {vocab_size - 1}] (vocabulary size: {vocab_size})",
                name,
            )
    if not params.bad_words:
        return []
    if tokenizer is None:
        raise InvalidParamError(
            "bad_words needs a tokenizer (skip_tokenizer_init is set)", "bad_words"
        )
    words: list[list[int]] = []
    for word in params.bad_words:
        alone = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        words.append(alone)
        # The spaced spelling counts when it is a different word of the same length.
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            words.append(spaced)
    return words
