"""Compiles constraints once, hands each sequence its matcher (vLLM v1: `StructuredOutputManager`).

Where the costs land:

- Compilation happens when a request is added (`LLMEngine.add_request`, or earlier, in the
  server's handler, where a bad schema becomes a 400), never inside a step. Compiled grammars are
  cached by their canonical text, least recently used dropped first, so a schema that many
  requests share is compiled once. Every compilation's time is recorded (`compile_times_s`).
- The backend (and its `TokenizerInfo`, a pass over the whole vocabulary) is built at the first
  constrained request: an engine that never sees one pays nothing.

The matcher of a sequence is a function of its output tokens. The engine advances it only after a
step committed (a failed step leaves it untouched), and `backend.sync_grammar` rebuilds it by replaying the output
tokens whenever the two disagree — which is how a matcher could be re-created after preemption
by recompute, though recompute keeps the output tokens and so the matcher stays valid as it is.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from minivllm.structured_output.backend import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
)
from minivllm.structured_output.params import (
    StructuredOutputError,
    StructuredOutputsConfig,
    StructuredOutputsParams,
)


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        config: StructuredOutputsConfig | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.config = config or StructuredOutputsConfig()
        self._backend: StructuredOutputBackend | None = None
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        # The server compiles in its handlers while the engine thread adds requests.
        self._lock = threading.Lock()
        self.compile_times_s: list[float] = []  # one per compilation (cache misses only)
        self.num_cache_hits = 0
        self.backend_init_s: float | None = None  # the TokenizerInfo's pass over the vocabulary

    @property
    def backend(self) -> StructuredOutputBackend:
        if self._backend is None:
            if self.tokenizer is None:
                raise StructuredOutputError(
                    "structured outputs need a tokenizer (the engine has skip_tokenizer_init)",
                    param="structured_outputs",
                )
            # xgrammar is imported only here: an engine without constraints never loads it.
            from minivllm.structured_output.xgrammar_backend import XgrammarBackend

            start = time.perf_counter()
            self._backend = XgrammarBackend(
                self.tokenizer, self.vocab_size, self.stop_token_ids, self.config
            )
            self.backend_init_s = time.perf_counter() - start
        return self._backend

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of `params`, from the cache or compiled now (and cached)."""
        key = params.key()
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                self.num_cache_hits += 1
                return compiled
            backend = self.backend  # built outside the timing: once per engine, not per grammar
            start = time.perf_counter()
            compiled = backend.compile_grammar(params)
            self.compile_times_s.append(time.perf_counter() - start)
            self._compiled[key] = compiled
            if len(self._compiled) > self.config.max_cached_grammars:
                self._compiled.popitem(last=False)
            return compiled

    def new_grammar(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        """A fresh matcher for one sequence of a request constrained by `params`."""
        compiled = self.compile(params)
        return self.backend.new_grammar(compiled)
