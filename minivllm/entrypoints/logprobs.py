"""Logprobs in OpenAI's two formats, from the engine's per-token `{token_id: Logprob}` dicts.

- /v1/completions (the legacy format): parallel lists `tokens`, `token_logprobs`, `top_logprobs`
  (one `{token: logprob}` dict per position) and `text_offset` (each token's character offset).
- /v1/chat/completions: `content`, a list of `{token, logprob, bytes, top_logprobs: [...]}`.

The engine's dict holds the sampled token and the top k by rank. In the legacy format each
position's `top_logprobs` holds the sampled token first, then the top k (vLLM's rule and order:
`logprobs: 0` gives the sampled token's own entry; a harness compares the token's logprob with the dict's maximum to
tell a greedy continuation). In the chat format `top_logprobs` is the top k only, as OpenAI's.

`echo` with `logprobs` (completions) puts the prompt's tokens ahead of the completion's: the first
prompt token with null logprobs (nothing predicts it), the others from the request's prompt
logprobs. `prompt_logprobs` (vLLM's field) is returned as vLLM does: per prompt token None or
`{token_id: {"logprob", "rank", "decoded_token"}}`.

With `as_ids` (the server's `--return-tokens-as-token-ids`, vLLM's flag) every token is the string
`token_id:N` instead of its text: a client that must map logprobs back to ids (some tokens do not
decode to text on their own) gets them exactly; `text_offset` still counts the text's characters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from minivllm.core.sequence import Logprob


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The top k of a position by rank; k = -1 (vLLM's "the whole vocabulary"): all of them."""
    top = ((t, lp) for t, lp in entry.items() if k == -1 or lp.rank <= k)
    return sorted(top, key=lambda x: x[1].rank)


def _text(lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else ""


def _token(token_id: int, lp: Logprob, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else _text(lp)


def _legacy_top(token: int, entry: dict[int, Logprob], k: int, as_ids: bool) -> dict[str, float]:
    """One position's `top_logprobs` in the legacy format, in vLLM's order: the position's own
    token first, then the top k by rank (a client reads `next(iter(...))` as the token)."""
    top = {_token(token, entry[token], as_ids): entry[token].logprob}
    for t, lp in _top(entry, k):
        top.setdefault(_token(t, lp, as_ids), lp.logprob)
    return top


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
        top_logprobs.append(_legacy_top(token, entry, k, as_ids))
        offsets.append(text_offset)
        text_offset += len(_text(chosen))
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def echo_logprobs(
    prompt_token_ids: list[int],
    prompt_logprobs: list[dict[int, Logprob] | None],
    k: int,
    decode: Callable[[int], str],
    as_ids: bool = False,
) -> tuple[dict[str, Any], int]:
    """The legacy lists for an echoed prompt, and the text offset where the completion starts."""
    out: dict[str, Any] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    offset = 0
    for token, entry in zip(prompt_token_ids, prompt_logprobs):
        text = decode(token) if entry is None else _text(entry[token])
        out["tokens"].append(f"token_id:{token}" if as_ids else text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        chosen = entry[token]
        out["token_logprobs"].append(chosen.logprob)
        out["top_logprobs"].append(_legacy_top(token, entry, k, as_ids))
    return out, offset


def prompt_logprobs_json(
    entries: list[dict[int, Logprob] | None] | None, as_ids: bool = False
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` in JSON: token ids as keys (strings, as JSON needs)."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): {
                "logprob": lp.logprob,
                "rank": lp.rank,
                "decoded_token": _token(t, lp, as_ids),
            }
            for t, lp in entry.items()
        }
        for entry in entries
    ]


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
