"""Typed, validated configuration of the engine: what to load, how big the cache, how to schedule.

vLLM spreads these over `ModelConfig`, `CacheConfig` and `SchedulerConfig` (vllm/config/); we keep
the same split and field names. Each dataclass validates itself in `__post_init__` with messages
that name the field and the allowed range, so a bad argument fails at construction — and the
server's 400s come from the same checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.attention import BACKEND_NAMES

DTYPES = ("auto", "float32", "float", "float16", "half", "bfloat16")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class ModelConfig:
    model: str | None = None  # folder, .gguf file, hub id; None = the bundled SmolLM2-135M-Instruct
    tokenizer: str | None = None  # folder or hub id; None = the model's own
    skip_tokenizer_init: bool = False  # no tokenizer: prompts are token ids, outputs have no text
    dtype: str = "auto"  # float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # "cuda" when available, else "cpu"
    seed: int = 0  # seeds the per-request generators of unseeded random sampling
    max_model_len: int | None = None  # prompt + output limit; None = the model's own
    attention_backend: str = "auto"  # "reference", "triton", or "auto" (triton on CUDA)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.attention_backend not in BACKEND_NAMES:
            raise ValueError(
                f"attention_backend must be one of {BACKEND_NAMES}, got {self.attention_backend!r}"
            )
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")


@dataclass
class CacheConfig:
    block_size: int = 16  # tokens per KV block (paper §4.1; vLLM's default)
    enable_prefix_caching: bool = True  # reuse KV of identical prompt prefixes (vLLM v1 default)
    num_gpu_blocks_override: int | None = None  # exact block count, on any device; wins
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory minivllm may fill
    cpu_kv_cache_space: float = 4.0  # CPU: GiB for the KV cache (vLLM's VLLM_CPU_KVCACHE_SPACE)

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        if self.num_gpu_blocks_override is not None:
            _positive("num_gpu_blocks_override", self.num_gpu_blocks_override)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if not self.cpu_kv_cache_space > 0:
            raise ValueError(f"cpu_kv_cache_space must be > 0 GiB, got {self.cpu_kv_cache_space}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256  # sequences running at once
    # Tokens computed per step, decodes and prompt chunks together. Prompts are always chunked to
    # fit it (as in vLLM v1), so it bounds a step's latency, not the prompt length.
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
