"""`SpeculativeConfig`: which proposer drafts how many tokens (vLLM's `vllm/config/speculative.py`).

vLLM's field names and defaults, for the two proposers minivllm runs: n-gram (`method="ngram"`,
prompt lookup over the sequence's own tokens) and a draft model (`model=PATH_OR_ID`, which makes
`method="draft_model"`: a smaller model of the same vocabulary, with its own paged KV cache). Every
check names the field and the allowed range, so the server answers a bad `--speculative-config`
before any weight loads (the draft model's files are read with the target's, in
`EngineArgs.create_engine_config`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # a verification step carries 1 + k tokens per request
MAX_PROMPT_LOOKUP = 64  # the longest n-gram matched (each step searches once per n)


@dataclass
class SpeculativeConfig:
    method: str | None = None  # "ngram" | "draft_model"; unset: "draft_model" when `model` is set
    num_speculative_tokens: int | None = None  # k, the draft length; required
    prompt_lookup_max: int | None = None  # longest n-gram matched; unset: prompt_lookup_min or 5
    prompt_lookup_min: int | None = None  # shortest n-gram matched; unset: prompt_lookup_max or 5
    model: str | None = None  # the draft model: a folder, a .gguf file or a hub id
    quantization: str | None = None  # the draft's: unset, "gguf" or "none" (as the engine's flag)
    draft_tensor_parallel_size: int | None = None  # the draft runs on the driver alone: 1
    # Speculate only while at most this many sequences run (vLLM's name): a big batch already
    # reads each weight once for many tokens, and drafts would only add verification work.
    # Unset: 8 (vLLM's unset never turns it off; see spec_decode/speculator.py).
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.model in ("ngram", "[ngram]"):  # vLLM's older spelling of the n-gram method
            self.model, self.method = None, self.method or "ngram"
        if self.method is None:
            self.method = "draft_model" if self.model is not None else "ngram"
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {list(METHODS)}, got {self.method!r}"
            )
        _int_in("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        self._check_draft_model_fields()
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

    def _check_draft_model_fields(self) -> None:
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(
                    "speculative_config.model must name the draft model (a folder, a .gguf file "
                    f'or a hub id) when method is "draft_model", got {self.model!r}'
                )
            if self.draft_tensor_parallel_size not in (None, 1):
                raise ValueError(
                    "speculative_config.draft_tensor_parallel_size must be 1 (the draft model runs "
                    f"on the driver alone), got {self.draft_tensor_parallel_size!r}"
                )
            if self.quantization not in (None, "gguf", "none"):
                raise ValueError(
                    "speculative_config.quantization must be one of [None, 'gguf', 'none'], "
                    f"got {self.quantization!r}"
                )
            return
        for name in ("model", "quantization", "draft_tensor_parallel_size"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"speculative_config.{name} is a draft model's field; method "
                    f"{self.method!r} takes none"
                )

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

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
