"""minivllm: the readable vLLM.

PagedAttention (Kwon et al., SOSP 2023) and vLLM's engine in small, plain-PyTorch modules: a paged
KV cache with block tables, copy-on-write and prefix caching, continuous batching with chunked
prefill and preemption, a full sampler, a Llama model, and an OpenAI-compatible server.

The public names are vLLM's: `LLM`, `SamplingParams`, `RequestOutput`, `CompletionOutput`,
`EngineArgs` (every engine option, declared once), `BeamSearchParams` and its outputs,
`StructuredOutputsParams` (a grammar the output must follow); for pooling models `PoolingParams`
and `EmbeddingRequestOutput` / `ClassificationRequestOutput` / `ScoringRequestOutput`
(`LLM.embed`, `LLM.classify`, `LLM.score`).

Each name is imported on first use (vLLM's `MODULE_ATTRS`): importing one module,
`minivllm.core.block_pool` say, runs this file first and must not load the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module that defines it.
MODULE_ATTRS = {
    "LLM": "minivllm.llm",
    "BeamSearchOutput": "minivllm.engine.beam_search",
    "BeamSearchParams": "minivllm.engine.beam_search",
    "BeamSearchSequence": "minivllm.engine.beam_search",
    "CompletionOutput": "minivllm.core.outputs",
    "EngineArgs": "minivllm.engine.arg_utils",
    "EngineStats": "minivllm.engine.stats",
    "ClassificationOutput": "minivllm.pooling.outputs",
    "ClassificationRequestOutput": "minivllm.pooling.outputs",
    "EmbeddingOutput": "minivllm.pooling.outputs",
    "EmbeddingRequestOutput": "minivllm.pooling.outputs",
    "PoolingParams": "minivllm.pooling.pooling_params",
    "PoolingRequestOutput": "minivllm.pooling.outputs",
    "ScoringOutput": "minivllm.pooling.outputs",
    "ScoringRequestOutput": "minivllm.pooling.outputs",
    "LLMEngine": "minivllm.engine.llm_engine",
    "RequestOutput": "minivllm.core.outputs",
    "SamplingParams": "minivllm.sampling_params",
    "StructuredOutputsParams": "minivllm.structured_output.params",
}

if TYPE_CHECKING:
    from minivllm.core.outputs import CompletionOutput, RequestOutput
    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.engine.stats import EngineStats
    from minivllm.llm import LLM
    from minivllm.pooling.outputs import (
        ClassificationOutput,
        ClassificationRequestOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        PoolingRequestOutput,
        ScoringOutput,
        ScoringRequestOutput,
    )
    from minivllm.pooling.pooling_params import PoolingParams
    from minivllm.sampling_params import SamplingParams
    from minivllm.structured_output.params import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    if name in MODULE_ATTRS:
        return getattr(importlib.import_module(MODULE_ATTRS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "EngineStats",
    "LLMEngine",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "SamplingParams",
    "ScoringOutput",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
    "__version__",
]
