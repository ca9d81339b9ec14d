"""Logprobs in OpenAI's two formats, from the engine's per-token `{token_id: Logprob}` dicts.

- /v1/completions (the legacy format): parallel lists `tokens`, `token_logprobs`, `top_logprobs`
  (one `{token: logprob}` dict per position) and `text_offset` (each token's character offset).
- /v1/chat/completions: `content`, a list of `{token, logprob, bytes, top_logprobs: [...]}`.

The engine's dict holds the sampled token and the top k by rank; the sampled token may rank below
k, in which case it is reported as the token but not among the top k, as OpenAI does.
"""

from __future__ import annotations

from typing import Any

from minivllm.sequence import Logprob


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= k), key=lambda x: x[1].rank)


def _text(lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else ""


def completion_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], k: int, text_offset: int
) -> dict[str, Any]:
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    offsets: list[int] = []
    for token, entry in zip(token_ids, entries):
        chosen = entry[token]
        tokens.append(_text(chosen))
        token_logprobs.append(chosen.logprob)
        top_logprobs.append({_text(lp): lp.logprob for _, lp in _top(entry, k)})
        offsets.append(text_offset)
        text_offset += len(_text(chosen))
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _chat_entry(lp: Logprob) -> dict[str, Any]:
    text = _text(lp)
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], k: int
) -> list[dict[str, Any]]:
    return [
        {**_chat_entry(entry[token]), "top_logprobs": [_chat_entry(lp) for _, lp in _top(entry, k)]}
        for token, entry in zip(token_ids, entries)
    ]
