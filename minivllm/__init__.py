"""minivllm: the readable vLLM.

PagedAttention (Kwon et al., SOSP 2023) and vLLM's engine in small, plain-PyTorch modules: a paged
KV cache with block tables, copy-on-write and prefix caching, continuous batching with chunked
prefill and preemption, a full sampler, a Llama model, and an OpenAI-compatible server.

The public names are vLLM's: `LLM`, `SamplingParams`, `RequestOutput`, `CompletionOutput`,
`EngineArgs` (every engine option, declared once), `BeamSearchParams` and its outputs,
`StructuredOutputsParams` (a grammar the output must follow).
"""

from minivllm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from minivllm.engine import LLMEngine
from minivllm.engine_args import EngineArgs
from minivllm.llm import LLM
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.stats import EngineStats
from minivllm.structured_output import StructuredOutputsParams

__version__ = "0.1.0"

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
