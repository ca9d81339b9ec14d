"""A request's structured-output fields -> one `StructuredOutputsParams`, compiled before it runs.

Four ways to ask, as vLLM accepts them: OpenAI's `response_format`, vLLM's `structured_outputs`,
vLLM's older `guided_*` fields, and (chat only) a forced tool call. At most one per request. The
constraint is compiled in the handler, so a bad schema, regex or grammar is a 400 that names the
field and quotes the grammar engine, before anything is queued: never a 500, never a hang.
"""

from __future__ import annotations

from typing import Any

from minivllm.entrypoints.protocol import OpenAIError
from minivllm.structured_output.manager import StructuredOutputManager
from minivllm.structured_output.params import StructuredOutputError, StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}  # fmt: skip


def request_structured_outputs(req: Any) -> tuple[StructuredOutputsParams, str] | None:
    """(the constraint, the request field it came from), or None when the request has none."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        else:
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise OpenAIError(
                    'response_format of type "json_schema" needs json_schema.schema',
                    param="response_format",
                )
            found.append(("response_format", {"json": fmt.json_schema.json_schema}))
    so = req.structured_outputs
    if so is not None:
        kwargs = {
            "json": so.json_,
            "regex": so.regex,
            "choice": so.choice,
            "grammar": so.grammar,
            "json_object": so.json_object,
        }
        found.append(("structured_outputs", {k: v for k, v in kwargs.items() if v is not None}))
    for name, kind in GUIDED.items():
        if getattr(req, name) is not None:
            found.append((name, {kind: getattr(req, name)}))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise OpenAIError(
            f"at most one structured-output field per request, got {names}", param=found[1][0]
        )
    field, kwargs = found[0]
    try:
        return StructuredOutputsParams(**kwargs), field
    except StructuredOutputError as exc:
        raise OpenAIError(str(exc), param=field) from None


def compile_or_400(
    manager: StructuredOutputManager, so: StructuredOutputsParams, field: str
) -> None:
    """Compile now (the engine then finds it in the cache); a bad constraint is a 400."""
    try:
        manager.compile(so)
    except StructuredOutputError as exc:
        param = field if field != "structured_outputs" else f"structured_outputs.{exc.param}"
        raise OpenAIError(f"{field}: {exc}", param=param) from None
