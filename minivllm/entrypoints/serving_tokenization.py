"""POST /tokenize, /detokenize and GET /tokenizer_info: vLLM's tokenizer endpoints
(vLLM's serving_tokenization.py).

A client counts a prompt's tokens, or renders a conversation through the chat template exactly as a
chat completion would, without running the model; `return_token_strs` adds each token's string, and
`tools` are rendered as a chat completion with those tools renders them. `tokenizer_info` is vLLM's
`GET /tokenizer_info` (behind `--enable-tokenizer-info-endpoint`, because it exposes the chat
template): the tokenizer's class and its JSON-safe init settings.
"""

from __future__ import annotations

import json
from typing import Any

from minivllm.entrypoints.protocol import DetokenizeRequest, OpenAIError, TokenizeRequest
from minivllm.entrypoints.serving_chat import OpenAIServingChat


class OpenAIServingTokenization:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat  # the chat template, applied as for chat completions
        self.engine_client = chat.engine_client

    def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self.chat.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError("give exactly one of prompt and messages", param="prompt")
        tokenizer = self.engine_client.tokenizer
        if req.messages is not None:
            ids = self.chat.apply_chat_template(
                req.messages,
                req.add_generation_prompt,
                req.continue_final_message,
                req.chat_template_kwargs,
                tools=req.tools,
            )
        else:
            assert req.prompt is not None
            ids = list(tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        # `token_strs` is always in the answer, null unless asked for (vLLM's TokenizeResponse).
        strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": self.engine_client.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.chat.check_model(req.model)
        vocab = self.engine_client.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"tokens must be in [0, {vocab - 1}], got {bad[0]}", param="tokens")
        return {"prompt": self.engine_client.tokenizer.decode(req.tokens)}


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    """vLLM's `/tokenizer_info`: `tokenizer_class` plus every init setting that is JSON."""
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
    for key, value in getattr(tokenizer, "init_kwargs", {}).items():
        if key in ("vocab_file", "merges_file"):  # paths on the server's disk (vLLM drops them)
            continue
        if key == "added_tokens_decoder" and isinstance(value, dict):
            # id -> the token's settings, as tokenizer_config.json writes them (not its repr)
            info[key] = {str(i): _added_token(token) for i, token in value.items()}
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            value = str(value)  # e.g. an AddedToken: its text is what a client can use
        info[key] = value
    template = getattr(tokenizer, "chat_template", None)
    if template is not None:
        info["chat_template"] = template
    return info


def _added_token(token: Any) -> dict[str, Any]:
    if isinstance(token, dict):
        return token
    names = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
    return {name: getattr(token, name) for name in names if hasattr(token, name)}
