"""The seam between minivllm and a grammar library (vLLM v1: `vllm/v1/structured_output/backend_types.py`).

A backend does the two halves that xgrammar's design splits (Dong et al., "XGrammar", 2024):

- `compile_grammar`: once per distinct constraint, the expensive part. It walks the grammar
  against the whole vocabulary and precomputes, for most grammar states, which tokens can
  follow ("context-independent" tokens), leaving few to check at run time.
- a `StructuredOutputGrammar` per sequence: a cheap matcher that advances one token at a time
  and fills one row of a token bitmask (bit t of the row = token t may come next).

Any library with these two halves fits: xgrammar (`xgrammar_backend.py`, vLLM's default) today;
llguidance or outlines-core could be added as other backends without touching the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from torch import Tensor

from minivllm.structured_output.params import StructuredOutputsParams


class StructuredOutputGrammar(Protocol):
    """One sequence's matcher: where in the grammar its output so far has brought it."""

    num_processed_tokens: int  # output tokens accepted so far (the matcher is a function of them)

    def accept_tokens(self, tokens: list[int]) -> bool:
        """Advance over `tokens`; False (and no change) when the grammar refuses one of them."""
        ...

    def fill_bitmask(self, bitmask: Tensor, index: int) -> None:
        """Write row `index` of `bitmask` (int32 [rows, ceil(V/32)]): the tokens allowed next."""
        ...

    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: the structure is complete and nothing may follow."""
        ...

    def reset(self) -> None:
        """Back to the start of the grammar, as for a sequence with no output."""
        ...

    def fork(self) -> StructuredOutputGrammar:
        """An independent matcher in the same state (a parallel sample forking from this one)."""
        ...


class StructuredOutputBackend(Protocol):
    """Compiles constraints for one tokenizer and vocabulary size."""

    vocab_size: int  # the model's logits width; may exceed the tokenizer's own vocabulary

    def compile_grammar(self, params: StructuredOutputsParams) -> Any:
        """The compiled form of `params`; raises `StructuredOutputError` naming what is wrong."""
        ...

    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        """A fresh matcher at the grammar's start."""
        ...

    def allocate_token_bitmask(self, num_rows: int) -> Tensor:
        """int32 [num_rows, ceil(vocab_size / 32)], every token allowed."""
        ...


def sync_grammar(grammar: StructuredOutputGrammar, output_token_ids: Sequence[int]) -> None:
    """Bring `grammar` to the state after `output_token_ids`: accept what it has not seen,
    or replay from the start when it is ahead (which a committed step never leaves)."""
    done = grammar.num_processed_tokens
    if done > len(output_token_ids):
        grammar.reset()
        done = 0
    if done < len(output_token_ids):
        grammar.accept_tokens(list(output_token_ids[done:]))
