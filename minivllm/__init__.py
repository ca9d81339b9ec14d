"""minivllm: the readable vLLM.

PagedAttention (Kwon et al., SOSP 2023) and vLLM's engine in small, plain-PyTorch modules: a paged
KV cache with block tables, copy-on-write and prefix caching, continuous batching with chunked
prefill and preemption, a full sampler, a Llama model, and an OpenAI-compatible server.

The public names are vLLM's: `LLM`, `SamplingParams`, `RequestOutput`, `CompletionOutput`,
`EngineArgs` (every engine option, declared once), `BeamSearchParams` and its outputs,
`StructuredOutputsParams` (a grammar the output must follow).

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
    "BeamSearchOutput": "minivllm.beam_search",
    "BeamSearchParams": "minivllm.beam_search",
    "BeamSearchSequence": "minivllm.beam_search",
    "CompletionOutput": "minivllm.outputs",
    "EngineArgs": "minivllm.engine_args",
    "EngineStats": "minivllm.stats",
    "LLMEngine": "minivllm.engine",
    "RequestOutput": "minivllm.outputs",
    "SamplingParams": "minivllm.sampling_params",
    "StructuredOutputsParams": "minivllm.structured_output.params",
}

if TYPE_CHECKING:
    from minivllm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from minivllm.engine import LLMEngine
    from minivllm.engine_args import EngineArgs
    from minivllm.llm import LLM
    from minivllm.outputs import CompletionOutput, RequestOutput
    from minivllm.sampling_params import SamplingParams
    from minivllm.stats import EngineStats
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
    "CompletionOutput",
    "EngineArgs",
    "EngineStats",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]
