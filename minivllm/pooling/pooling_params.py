"""`PoolingParams`: what one pooling request asks of the model's pooler (vLLM's
`vllm/pooling_params.py`, the fields an embedding request has).

Each field is validated here, with an `InvalidParamError` that names it, so the server's 400 says
which field is wrong (minivllm/entrypoints/serving.py). What depends on the model (whether it
supports matryoshka `dimensions`, and how many) is checked by `verify` against its `PoolerConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.pooling.config import PoolerConfig
from minivllm.sampling_params import InvalidParamError, verify_truncate_prompt_tokens

__all__ = ["PoolingParams"]


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's names and defaults: None leaves the choice to the model's pooler config."""

    # Matryoshka embeddings (Kusupati et al., 2022): keep the first `dimensions` values, then
    # normalize; only for a model trained for it (PoolerConfig.matryoshka_dimensions).
    dimensions: int | None = None
    normalize: bool | None = None  # unit length (cosine-ready); None: the model's default
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1: max_model_len
    task: str | None = None  # "embed" or "classify"; None: the model's own task
    # A classifier's logits through its activation: sigmoid for one label (a cross-encoder's
    # score, as sentence-transformers' CrossEncoder), softmax over several; None: on.
    activation: bool | None = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise InvalidParamError(f"dimensions must be at least 1, got {d!r}", "dimensions")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidParamError(
                f"normalize must be a boolean, got {self.normalize!r}", "normalize"
            )
        if self.activation is not None and not isinstance(self.activation, bool):
            raise InvalidParamError(
                f"activation must be a boolean, got {self.activation!r}", "activation"
            )
        verify_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.task not in (None, "embed", "classify"):
            raise InvalidParamError(
                f"task must be 'embed' or 'classify', got {self.task!r}", "task"
            )

    def verify(self, pooler: PoolerConfig) -> None:
        """Refuse what the model cannot do, naming the field (vLLM's `PoolingParams.verify`)."""
        if self.task is not None and self.task != pooler.task:
            raise InvalidParamError(
                f"task {self.task!r} is not supported by this model, whose pooling task is "
                f"{pooler.task!r}",
                "task",
            )
        if self.dimensions is None:
            return
        if not pooler.is_matryoshka:
            raise InvalidParamError(
                "dimensions is not supported: the model does not support matryoshka "
                "representation (set is_matryoshka or matryoshka_dimensions in pooler_config)",
                "dimensions",
            )
        allowed = pooler.matryoshka_dimensions
        if allowed and self.dimensions not in allowed:
            raise InvalidParamError(
                f"dimensions must be one of {list(allowed)} for this model, got {self.dimensions}",
                "dimensions",
            )
        if self.dimensions > pooler.hidden_size:
            raise InvalidParamError(
                f"dimensions must be at most the model's {pooler.hidden_size}, got "
                f"{self.dimensions}",
                "dimensions",
            )
