"""POST /tokenize and /detokenize: vLLM's extra endpoints (vLLM's serving_tokenization.py).

A client counts a prompt's tokens, or renders a conversation through the chat template exactly as
a chat completion would, without running the model; `return_token_strs` adds each token's string; `tools` are
rendered into the prompt as a chat completion with those tools would render them.
"""

from __future__ import annotations

from typing import Any

from minivllm.entrypoints.protocol import DetokenizeRequest, OpenAIError, TokenizeRequest
from minivllm.entrypoints.serving_chat import OpenAIServingChat


class OpenAIServingTokenization:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat  # the chat template, applied as for chat completions
        self.engine = chat.engine.engine

    def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self.chat.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError("give exactly one of prompt and messages", param="prompt")
        tokenizer = self.engine.tokenizer
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
            "max_model_len": self.engine.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.chat.check_model(req.model)
        vocab = self.engine.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"tokens must be in [0, {vocab - 1}], got {bad[0]}", param="tokens")
        return {"prompt": self.engine.tokenizer.decode(req.tokens)}
