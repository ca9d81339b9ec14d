"""Logprobs in OpenAI's two formats, from the engine's per-token `{token_id: Logprob}` dicts.

- /v1/completions (the legacy format): parallel lists `tokens`, `token_logprobs`, `top_logprobs`
  (one `{token: logprob}` dict per position) and `text_offset` (each token's character offset).
- /v1/chat/completions: `content`, a list of `{token, logprob, bytes, top_logprobs: [...]}`.

The engine's dict holds the sampled token and the top k by rank; the sampled token may rank below
k, in which case it is reported as the token but not among the top k, as OpenAI does.

With `as_ids` (the server's `--return-tokens-as-token-ids`, vLLM's flag) every token is the string
`token_id:N` instead of its text: a client that must map logprobs back to ids (some tokens do not
decode to text on their own) gets them exactly; `text_offset` still counts the text's characters.
"""

from __future__ import annotations

from typing import Any

from minivllm.sequence import Logprob


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= k), key=lambda x: x[1].rank)


def _text(lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else ""


def _token(token_id: int, lp: Logprob, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else _text(lp)


def completion_logprobs(
    token_ids: list[int],
    entries: list[dict[int, Logprob]],
    k: int,
    text_offset: int,
    as_ids: bool = False,
) -> dict[str, Any]:
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    offsets: list[int] = []
    for token, entry in zip(token_ids, entries):
        chosen = entry[token]
        tokens.append(_token(token, chosen, as_ids))
        token_logprobs.append(chosen.logprob)
        top_logprobs.append({_token(t, lp, as_ids): lp.logprob for t, lp in _top(entry, k)})
        offsets.append(text_offset)
        text_offset += len(_text(chosen))
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _chat_entry(token_id: int, lp: Logprob, as_ids: bool) -> dict[str, Any]:
    text = _token(token_id, lp, as_ids)
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], k: int, as_ids: bool = False
) -> list[dict[str, Any]]:
    return [
        {
            **_chat_entry(token, entry[token], as_ids),
            "top_logprobs": [_chat_entry(t, lp, as_ids) for t, lp in _top(entry, k)],
        }
        for token, entry in zip(token_ids, entries)
    ]
