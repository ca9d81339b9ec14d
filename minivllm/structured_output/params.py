"""What a request asks the grammar engine for, and how the engine is configured (vLLM's names).

`StructuredOutputsParams` is vLLM's (`vllm/sampling_params.py`): exactly one of `json` (a JSON
schema), `regex`, `choice` (one of these strings), `grammar` (EBNF, GBNF-style as xgrammar reads
it) or `json_object` (any JSON object) constrains what a request may generate.
`StructuredOutputsConfig` is vLLM's engine-wide `--structured-outputs-config`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

BACKENDS = ("auto", "xgrammar")


class StructuredOutputError(ValueError):
    """A schema, regex, grammar or choice the grammar engine cannot compile (a 400 on the server)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # the field at fault: "json", "regex", ...


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output; exactly one field is set."""

    json: str | dict[str, Any] | None = None  # a JSON schema (a dict, or its JSON text)
    regex: str | None = None  # the whole output matches this regular expression
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # an EBNF grammar whose start rule is `root`
    json_object: bool | None = None  # any JSON object ({"type": "json_object"})

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            names = ", ".join(f.name for f in fields(self))
            got = ", ".join(given) if given else "none"
            raise StructuredOutputError(
                f"structured_outputs must set exactly one of {names}; got {got}",
                param="structured_outputs",
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise StructuredOutputError(
                f"json must be a JSON schema (a dict or a JSON string), got {self.json!r}", "json"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise StructuredOutputError(f"{name} must be a non-empty str, got {value!r}", name)
        if self.choice is not None:
            ok = isinstance(self.choice, (list, tuple)) and self.choice
            if not ok or not all(isinstance(c, str) and c for c in self.choice):
                raise StructuredOutputError(
                    f"choice must be a non-empty list of non-empty str, got {self.choice!r}",
                    "choice",
                )
        if self.json_object not in (None, True, False):
            raise StructuredOutputError(
                f"json_object must be a bool, got {self.json_object!r}", "json_object"
            )

    @property
    def kind(self) -> str:
        """Which constraint: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): the compiled-grammar cache's key. Two requests with the same
        schema share one compiled grammar whatever the key order of their dicts."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json" and isinstance(value, dict):
            return kind, json.dumps(value, sort_keys=True)
        if kind == "choice":
            return kind, json.dumps(list(value))
        if kind == "json_object":
            return kind, ""
        return kind, str(value)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """The engine's grammar settings: vLLM's `--structured-outputs-config` (a JSON object)."""

    backend: str = "auto"  # "xgrammar" (vLLM's default); "auto" picks it
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens
    # Most whitespace characters in a row inside JSON (0: unbounded, as vLLM). Bounded by
    # default: unbounded, a model can emit whitespace until max_tokens and never close the JSON.
    max_whitespace: int = 16
    max_cached_grammars: int = 256  # compiled grammars kept (least recently used dropped first)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"structured_outputs_config.backend must be one of {', '.join(BACKENDS)}, "
                f"got {self.backend!r}"
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                "structured_outputs_config.disable_any_whitespace must be a bool, "
                f"got {self.disable_any_whitespace!r}"
            )
        if (
            isinstance(self.max_cached_grammars, bool)
            or not isinstance(self.max_cached_grammars, int)
            or self.max_cached_grammars < 1
        ):
            raise ValueError(
                "structured_outputs_config.max_cached_grammars must be a positive int, "
                f"got {self.max_cached_grammars!r}"
            )

    @classmethod
    def parse(cls, value: str | dict[str, Any] | None) -> StructuredOutputsConfig:
        """From the flag's JSON text (or a dict); unknown keys are named in the error."""
        if value is None:
            return cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"structured_outputs_config must be a JSON object: {exc}"
                ) from None
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"structured_outputs_config has unknown keys {unknown}; known: {sorted(known)}"
            )
        return cls(**value)
