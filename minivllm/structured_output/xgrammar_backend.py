"""The xgrammar backend (vLLM v1: `vllm/v1/structured_output/backend_xgrammar.py`).

xgrammar's `TokenizerInfo` is built once from the Hugging Face tokenizer, with the model's
vocabulary size: an LM head is often padded beyond the tokenizer's last id, and those extra
columns must be masked too (xgrammar treats ids it has no text for as never allowed).
Its stop tokens are the engine's EOS ids, so that "EOS" is allowed exactly where the grammar
may end.
"""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr
from torch import Tensor

from minivllm.structured_output.params import (
    StructuredOutputError,
    StructuredOutputsConfig,
    StructuredOutputsParams,
)


class XgrammarGrammar:
    """A `StructuredOutputGrammar` over one `xgrammar.GrammarMatcher`."""

    def __init__(self, matcher: xgr.GrammarMatcher, num_processed_tokens: int = 0) -> None:
        self.matcher = matcher
        self.num_processed_tokens = num_processed_tokens

    def accept_tokens(self, tokens: list[int]) -> bool:
        for i, token in enumerate(tokens):
            if not self.matcher.accept_token(token):
                if i:  # all or nothing: undo the part that was accepted
                    self.matcher.rollback(i)
                return False
        self.num_processed_tokens += len(tokens)
        return True

    def fill_bitmask(self, bitmask: Tensor, index: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, index)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def reset(self) -> None:
        self.matcher.reset()
        self.num_processed_tokens = 0

    def fork(self) -> XgrammarGrammar:
        return XgrammarGrammar(self.matcher.fork(), self.num_processed_tokens)


class XgrammarBackend:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        config: StructuredOutputsConfig,
    ) -> None:
        self.vocab_size = vocab_size
        self.config = config
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        # One thread: the machine's cores run the model; xgrammar's own cache is off because the
        # manager keeps the compiled grammars (one cache, one bound, one place to measure).
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile_grammar(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind = params.kind
        any_whitespace = not self.config.disable_any_whitespace
        try:
            if kind in ("json", "json_object"):
                # json_object: any JSON object, i.e. the schema {"type": "object"}.
                schema = params.json if kind == "json" else {"type": "object"}
                text = schema if isinstance(schema, str) else json.dumps(schema)
                json.loads(text)  # a clear message for text that is not JSON at all
                return self.compiler.compile_json_schema(
                    text,
                    any_whitespace=any_whitespace,
                    max_whitespace_cnt=self.config.max_whitespace or None,
                )
            if kind == "regex":
                assert params.regex is not None
                return self.compiler.compile_regex(params.regex)
            if kind == "choice":
                assert params.choice is not None
                return self.compiler.compile_grammar(choice_grammar(params.choice))
            assert params.grammar is not None
            return self.compiler.compile_grammar(params.grammar)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its parser's words
            message = " ".join(str(exc).split()) or type(exc).__name__
            raise StructuredOutputError(f"invalid {kind}: {message}", param=kind) from None

    def new_grammar(self, compiled: xgr.CompiledGrammar) -> XgrammarGrammar:
        return XgrammarGrammar(xgr.GrammarMatcher(compiled))

    def allocate_token_bitmask(self, num_rows: int) -> Tensor:
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)


def choice_grammar(choices: list[str]) -> str:
    """EBNF for "exactly one of these strings" (vLLM's `choice_as_grammar`)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
