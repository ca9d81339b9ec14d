"""`SpeculativeConfig`: which proposer drafts how many tokens (vLLM's `vllm/config/speculative.py`).

vLLM's field names and defaults, for what minivllm runs: the n-gram proposer (`method="ngram"`,
prompt lookup over the sequence's own tokens). A draft model (`model=...`) is refused by name: it is
not built yet. Every check names the field and the allowed range, so the server answers a bad
`--speculative-config` before any weight loads.

Tier: leaves (no torch, no package import).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16  # a verification step carries 1 + k tokens per request
MAX_PROMPT_LOOKUP = 64  # the longest n-gram matched (each step searches once per n)


@dataclass
class SpeculativeConfig:
    method: str | None = None  # "ngram"; unset: "ngram" when no draft model is named
    num_speculative_tokens: int | None = None  # k, the draft length; required
    prompt_lookup_max: int | None = None  # longest n-gram matched; unset: prompt_lookup_min or 5
    prompt_lookup_min: int | None = None  # shortest n-gram matched; unset: prompt_lookup_max or 5
    model: str | None = None  # a draft model: refused (not supported yet)
    # Speculate only while at most this many sequences run (vLLM's name): a big batch already
    # reads each weight once for many tokens, and drafts would only add verification work.
    # Unset: 8 (vLLM's unset never turns it off; see spec_decode/speculator.py).
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.model is not None and self.model not in ("ngram", "[ngram]"):
            raise ValueError(
                f"speculative_config.model={self.model!r}: a draft model is not supported yet; "
                'use {"method": "ngram", "num_speculative_tokens": k}'
            )
        self.model = None
        if self.method is None:
            self.method = "ngram"
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {list(METHODS)}, got {self.method!r}"
            )
        _int_in("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        self.prompt_lookup_min = lo if lo is not None else (hi if hi is not None else 5)
        self.prompt_lookup_max = hi if hi is not None else self.prompt_lookup_min
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            _int_in(name, getattr(self, name), 1, MAX_PROMPT_LOOKUP)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.disable_by_batch_size is not None:
            _int_in("disable_by_batch_size", self.disable_by_batch_size, 2, None)

    @classmethod
    def parse(
        cls, value: str | Mapping[str, Any] | SpeculativeConfig | None
    ) -> SpeculativeConfig | None:
        """`LLM(speculative_config={...})` or `--speculative-config '{json}'`; None: off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ValueError(
                f"speculative_config has no field {unknown[0]!r}; its fields are: "
                + ", ".join(names)
            )
        return cls(**value)


def _int_in(name: str, value: object, lo: int, hi: int | None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo
    if not ok or (hi is not None and value > hi):  # type: ignore[operator]
        allowed = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"speculative_config.{name} must be an integer {allowed}, got {value!r}")
