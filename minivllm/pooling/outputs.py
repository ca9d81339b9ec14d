"""What a pooling request gives back: vLLM's `PoolingRequestOutput` family (vllm/outputs.py),
field for field where minivllm has the field.

`LLM.embed` returns `EmbeddingRequestOutput`s (`.outputs.embedding`, a list of floats),
`LLM.classify` `ClassificationRequestOutput`s (`.outputs.probs`), and `LLM.score`
`ScoringRequestOutput`s (`.outputs.score`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # [dimensions or hidden_size]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]  # [num_labels]  softmax over the labels (sigmoid for one)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float  # an embedding model's cosine similarity, or a cross-encoder's output


@dataclass
class PoolingRequestOutput(Generic[T]):
    request_id: str
    outputs: T
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (LAST pooling only)


EmbeddingRequestOutput = PoolingRequestOutput[EmbeddingOutput]
ClassificationRequestOutput = PoolingRequestOutput[ClassificationOutput]
ScoringRequestOutput = PoolingRequestOutput[ScoringOutput]
