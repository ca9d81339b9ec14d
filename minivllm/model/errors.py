"""The typed errors of finding and reading a model: each says what was looked for and what to do.

A module of their own so that the loader (minivllm/model/loader.py) and the weight reader
(minivllm/model/weights.py) raise the same classes; `minivllm.model.loader` re-exports them. See
the architecture page (docs/architecture.md).
"""

from __future__ import annotations

from minivllm.model.config import UnsupportedModelError


class ModelLoadError(Exception):
    """Base class of every error raised while locating or reading a model."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The path does not exist, or holds nothing minivllm can read."""


class CorruptCheckpointError(ModelLoadError):
    """A weight file is truncated, malformed, or lacks tensors the model needs."""


class HubUnavailableError(ModelLoadError, ConnectionError):
    """A hub id was given but the Hugging Face Hub could not be reached."""


class UnsupportedArchitectureError(ModelLoadError, UnsupportedModelError):
    """The checkpoint's architecture is not one the model registry names, or it asks for a
    feature of one (a RoPE scaling, an activation) that this code does not run exactly."""


class TokenizerNotFoundError(ModelNotFoundError):
    """The model folder (or the folder given as `tokenizer`) holds no tokenizer files."""


class UnsupportedQuantizationError(ModelLoadError):
    """A checkpoint tensor is stored in a quantization type minivllm does not run."""
