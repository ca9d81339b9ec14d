"""The model's pooler, decided once before the engine starts (vLLM's `PoolerConfig` and the
`runner` / `convert` resolution of vllm/config/model.py).

Which runner a model gets: `runner="pooling"` (or vLLM's older `task="embed"`), `convert="embed"`
(any causal LM as an embedding model), or, left on "auto", what the checkpoint says: a bare
decoder or encoder (`Qwen3Model`, `BertModel`: no head to generate with), a classifier
(`*ForSequenceClassification`) or a folder that sentence-transformers saved (`modules.json`)
pools; everything else generates.

How it pools, in order of precedence: `pooler_config` (vLLM's flag, a JSON object), then
sentence-transformers' files (`modules.json` names a `Pooling` module whose `config.json` gives
the mode, and a `Normalize` module), then the model's default: the last token for a causal
decoder (Qwen3-Embedding's), [CLS] for an encoder. Embeddings are normalized by default (vLLM's
default for `embed`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
# vLLM's older `task` option, and the runner and conversion each stands for.
TASKS: dict[str, tuple[str, str]] = {
    "auto": ("auto", "auto"),
    "generate": ("generate", "none"),
    "embed": ("pooling", "embed"),
    "classify": ("pooling", "classify"),
    "score": ("pooling", "auto"),  # a cross-encoder scores; an embedding model's cosine
}
# sentence-transformers' `pooling_mode` names (and its older boolean keys) -> ours.
ST_POOLING_MODES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}
ST_POOLING_FLAGS = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}


@dataclass(frozen=True)
class PoolerConfig:
    """What the pooling runner does with a prompt's hidden states."""

    pooling_type: str  # one of POOLING_TYPES: the last token, the mean of all, the first ([CLS])
    normalize: bool  # embeddings of unit length unless a request says otherwise
    task: str  # "embed" (a vector) or "classify" (a classifier's logits)
    hidden_size: int  # the pooled vector's width before `dimensions` (a classifier's: num_labels)
    causal: bool = True  # the model's attention; False: an encoder, whose prompt runs whole
    is_matryoshka: bool = False  # trained so that a prefix of the vector is an embedding too
    matryoshka_dimensions: tuple[int, ...] = ()  # the prefixes it was trained for; (): any
    # How a classifier reads a scored pair: the tokenizer's pair encoding ([CLS] a [SEP] b [SEP],
    # a cross-encoder's), or False: the two texts joined as one (an LLM as reranker; vLLM's name).
    use_pad_token: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}"
            )
        if self.task not in ("embed", "classify"):
            raise ValueError(f"task must be 'embed' or 'classify', got {self.task!r}")

    @property
    def supports_prefix_caching(self) -> bool:
        """A prefix-cache hit skips its tokens' hidden states, so only a causal model that pools
        the last token (always recomputed, even on a full hit) may take one (vLLM's rule)."""
        return self.causal and self.pooling_type == "LAST"

    @property
    def supports_chunked_prefill(self) -> bool:
        """An encoder's token attends to every other: its prompt runs in one step."""
        return self.causal


def resolve_runner(runner: str, convert: str, task: str | None) -> tuple[str, str]:
    """(runner, convert) from the options, vLLM's older `task` folded in."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {CONVERTS}, got {convert!r}")
    if task is not None:
        if task not in TASKS:
            raise ValueError(f"task must be one of {tuple(TASKS)}, got {task!r}")
        task_runner, task_convert = TASKS[task]
        if runner not in ("auto", task_runner) and task_runner != "auto":
            raise ValueError(f"task={task!r} asks for runner={task_runner!r}, got {runner!r}")
        runner = task_runner if runner == "auto" else runner
        convert = task_convert if convert == "auto" else convert
    if runner == "generate" and convert in ("embed", "classify"):
        raise ValueError(f"convert={convert!r} needs runner='pooling', got runner='generate'")
    return runner, convert


def is_pooling_architecture(architecture: str) -> bool:
    """A checkpoint without a language-model head: a bare decoder or encoder, or a classifier."""
    return architecture.endswith("Model") or architecture.endswith("ForSequenceClassification")


def resolve_pooler_config(
    runner: str,
    convert: str,
    task: str | None,
    overrides: Mapping[str, Any],
    model_path: Path,
    architecture: str,
    hidden_size: int,
    causal: bool = True,
    num_labels: int = 0,  # a `*ForSequenceClassification` checkpoint's head; 0: none
    use_pad_token: bool = True,  # PoolerConfig's
) -> PoolerConfig | None:
    """The model's pooler, or None for a generating model (see the module's docstring)."""
    runner, convert = resolve_runner(runner, convert, task)
    st_modules = _read_json(model_path / "modules.json")
    if runner == "auto":
        pools = convert in ("embed", "classify") or is_pooling_architecture(architecture)
        runner = "pooling" if pools or st_modules is not None else "generate"
    if runner == "generate":
        if overrides:
            raise ValueError("pooler_config is set, but the model runs with runner='generate'")
        return None
    if convert not in ("embed", "classify"):
        convert = "classify" if architecture.endswith("ForSequenceClassification") else "embed"
    if convert == "classify":
        if not num_labels:  # vLLM would add an untrained head; a reference must be a checkpoint
            raise ValueError(
                f"convert='classify' needs a classifier checkpoint (*ForSequenceClassification, "
                f"with its head); {architecture} has none"
            )
        hidden_size = num_labels
    values: dict[str, Any] = {
        "pooling_type": "LAST" if causal else "CLS",
        "normalize": convert == "embed",
    }
    if st_modules is not None:
        values.update(_sentence_transformers_pooler(model_path, st_modules))
    hf = _read_json(model_path / "config.json") or {}
    if hf.get("matryoshka_dimensions") or hf.get("is_matryoshka"):
        values["is_matryoshka"] = True
        values["matryoshka_dimensions"] = tuple(hf.get("matryoshka_dimensions") or ())
    values.update(overrides)
    return PoolerConfig(
        task=convert,
        hidden_size=hidden_size,
        causal=causal,
        use_pad_token=use_pad_token,
        **values,
    )


def class_labels(model_path: Path, num_labels: int) -> list[str]:
    """A classifier's label per class: config.json's `id2label`, else transformers' default
    names (`LABEL_0`, ...), which is what a checkpoint saved without labels means."""
    labels = (_read_json(model_path / "config.json") or {}).get("id2label") or {}
    return [str(labels.get(str(i), f"LABEL_{i}")) for i in range(num_labels)]


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def _sentence_transformers_pooler(
    model_path: Path, modules: list[dict[str, Any]]
) -> dict[str, Any]:
    """Pooling and normalization as the folder's sentence-transformers modules declare them.
    A module that would change the vector in a way the pooler does not (a `Dense` projection, a
    max pooling) is refused by name rather than silently skipped."""
    values: dict[str, Any] = {"normalize": False}
    for module in modules[1:]:  # the first is the Transformer: the model itself
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            cfg = _read_json(model_path / module.get("path", "") / "config.json") or {}
            values["pooling_type"] = _st_pooling_type(cfg)
        elif kind == "Normalize":
            values["normalize"] = True
        else:
            raise ValueError(
                f"sentence-transformers module {module.get('type')!r} is not supported (only "
                "Transformer, Pooling and Normalize)"
            )
    return values


def _st_pooling_type(cfg: dict[str, Any]) -> str:
    if isinstance(cfg.get("pooling_mode"), str):
        modes = [cfg["pooling_mode"]]
    else:  # sentence-transformers < 6: one boolean per mode
        modes = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
    named = [ST_POOLING_MODES.get(m) or ST_POOLING_FLAGS.get(m) for m in modes]
    if len(named) != 1 or named[0] is None:
        raise ValueError(
            f"sentence-transformers pooling {modes} is not supported; supported: lasttoken, "
            "mean, cls (one of them)"
        )
    return named[0]


def parse_pooler_config(overrides: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """vLLM's `pooler_config` JSON: pooling_type, normalize, is_matryoshka / matryoshka_dimensions;
    checked before any file is read."""
    if not overrides:
        return {}
    try:
        cfg = json.loads(overrides) if isinstance(overrides, str) else dict(overrides)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"pooler_config must be a JSON object: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"pooler_config must be a JSON object, got {overrides!r}")
    known = ("pooling_type", "normalize", "is_matryoshka", "matryoshka_dimensions")
    unknown = sorted(set(cfg) - set(known))
    if unknown:
        raise ValueError(f"pooler_config has unknown keys {unknown}; known: {list(known)}")
    values = dict(cfg)
    if "pooling_type" in values:
        values["pooling_type"] = str(values["pooling_type"]).upper()
        if values["pooling_type"] not in POOLING_TYPES:
            raise ValueError(
                f"pooler_config.pooling_type must be one of {POOLING_TYPES}, got "
                f"{cfg['pooling_type']!r}"
            )
    if values.get("matryoshka_dimensions"):
        values["matryoshka_dimensions"] = tuple(values["matryoshka_dimensions"])
        values["is_matryoshka"] = True
    return values
