"""What a model is before it loads: its files on disk, and what its authors ask of generation.

Plain data that the engine's configuration carries (`ResolvedConfig` in minivllm/config/__init__.py) and
the loader fills (minivllm/model/loader.py). It sits beside the configs, so that the configuration
can name these types without importing the loader.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from minivllm.model.hf_overrides import HfOverrides


@dataclass
class ModelSource:
    """A model as a HuggingFace-style folder (config.json, *.safetensors, tokenizer files)."""

    path: Path  # the folder; for a GGUF model, its converted copy in the cache
    name: str  # what to call the model (served model name, logs)
    gguf_file: Path | None = None  # the original file when the model came as GGUF
    hf_overrides: HfOverrides | None = None  # changes to config.json made at load (hf_overrides.py)


@dataclass(frozen=True)
class GenerationDefaults:
    """What the model's authors ask of generation, from its `generation_config.json`.

    vLLM reads this file by default: chat models often end a turn with a token that is not the
    tokenizer's `eos_token` (Llama 3's `<|eot_id|>`) and name it only here, and their authors
    tune temperature or top_p for them. A request's own values win over `sampling_defaults`.
    """

    eos_token_ids: tuple[int, ...]  # config.json's EOS ids, then generation_config.json's others
    # The SamplingParams fields the file sets, under SamplingParams' names, only those present;
    # vLLM's `get_diff_sampling_param()`. E.g. {"temperature": 0.6, "top_p": 0.9}.
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
