"""Typed, validated configuration of the engine: what to load, how big the cache, how to schedule.

vLLM spreads these over `ModelConfig`, `CacheConfig`, `SchedulerConfig` and `ParallelConfig`
(vllm/config/); we keep the same split and field names. The user-facing declaration of every option
(its default and what it means) is `EngineArgs` in `minivllm/engine/arg_utils.py`, which builds these
with `create_engine_config()`; the fields here carry no defaults so that no value is declared
twice. Each dataclass validates itself in `__post_init__` with messages that name the field and the
allowed range, so a bad argument fails at construction, the same way from `LLM(...)`, the CLI and
the benches. `ResolvedConfig` is what `create_engine_config()` then found out from the model's
files and the machine (vLLM's `ModelConfig` carries the same: the HF config, the dtype, the
max_model_len), so that the engine receives every decision made and makes none itself.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minivllm.attention.abstract import BACKEND_NAMES
from minivllm.config.lora import LoRAConfig
from minivllm.config.speculative import SpeculativeConfig
from minivllm.model.config import LlamaConfig
from minivllm.model.source import GenerationDefaults, ModelSource
from minivllm.pooling.config import PoolerConfig
from minivllm.structured_output.params import StructuredOutputsConfig

if TYPE_CHECKING:
    import torch

DTYPES = ("auto", "float32", "float", "float16", "half", "bfloat16")
# How weights are held (vLLM's `quantization`): "gguf" keeps a GGUF file's blocks as stored
# (minivllm/model/quantization/); "none" dequantizes them at load. Unset: the checkpoint's own.
QUANTIZATIONS = ("gguf", "none")
# Who starts the ranks of tensor / pipeline parallelism (vLLM's `distributed_executor_backend`).
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")
# How the KV cache is handed out: paged blocks, or the paper's Orca baselines, which reserve a
# contiguous range per request at admission (§6.2). Each names the KV cache manager class the
# engine builds, by qualified name (as vLLM's platforms name classes), so that no module imports
# an experiment to offer it: the baselines live in minivllm/experiments/reservation.py.
KV_CACHE_MANAGERS = {
    "paged": "minivllm.core.kv_cache_manager.KVCacheManager",
    "orca-max": "minivllm.experiments.reservation.ReservationKVCacheManager",
    "orca-pow2": "minivllm.experiments.reservation.ReservationKVCacheManager",
    "orca-oracle": "minivllm.experiments.reservation.ReservationKVCacheManager",
}
KV_ALLOCATIONS = tuple(KV_CACHE_MANAGERS)
# What the KV cache stores (vLLM's `kv_cache_dtype`): "auto" is the model's dtype. A narrower cache
# holds more blocks in the same memory and halves the bytes attention reads per token; every
# backend converts on write and reads it back up to the query's dtype (minivllm/attention/).
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")
KV_CACHE_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# vLLM's fp8 values: accepted by vLLM (with a per-tensor k_scale / v_scale), refused here by name.
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class ModelConfig:
    model: str | None  # None: the bundled SmolLM2-135M-Instruct
    tokenizer: str | None  # None: the model's own
    skip_tokenizer_init: bool
    dtype: str  # one of DTYPES
    device: str  # "auto", "cpu", "cuda" or "cuda:N"
    seed: int
    max_model_len: int | None  # None: the model's own context length
    attention_backend: str  # one of BACKEND_NAMES
    enforce_eager: bool = False  # True: no decode step's layers in one C++ call
    quantization: str | None = None  # one of QUANTIZATIONS; None: the checkpoint's own
    max_logprobs: int = 20  # most (prompt) logprobs per token a request may ask; -1: the vocabulary

    def __post_init__(self) -> None:
        if type(self.max_logprobs) is not int or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be non-negative or -1, got {self.max_logprobs!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be unset or one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
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
    block_size: int  # tokens per KV block
    enable_prefix_caching: bool
    num_gpu_blocks_override: int | None  # None: sized from the memory limits below
    gpu_memory_utilization: float  # fraction of CUDA memory
    cpu_kv_cache_space: float  # GiB
    kv_allocation: str  # one of KV_ALLOCATIONS
    cache_dtype: str  # one of KV_CACHE_DTYPES (EngineArgs.kv_cache_dtype; vLLM's names both)
    sliding_window: int | None = None  # every layer's window: set by the engine from the model
    layer_sliding_windows: tuple[int | None, ...] = ()  # where windowed and global layers mix
    # An encoder-only model (a non-causal pooler; set by the engine's config): no KV blocks at all
    encoder_only: bool = False

    @property
    def kv_cache_manager_cls(self) -> str:
        if self.encoder_only:  # its attention reads no cache (vLLM: no KV cache spec)
            return "minivllm.core.encoder_only_manager.EncoderOnlyKVCacheManager"
        if self.layer_sliding_windows and self.kv_allocation == "paged":  # per group of layers
            return "minivllm.core.kv_cache_coordinator.HybridKVCacheCoordinator"
        if self.sliding_window is not None and self.kv_allocation == "paged":  # frees by it
            return "minivllm.core.sliding_window_manager.SlidingWindowKVCacheManager"
        return KV_CACHE_MANAGERS[self.kv_allocation]  # the qualified name `kv_allocation` names

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        if self.cache_dtype in FP8_KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={self.cache_dtype!r} is not supported: minivllm has no fp8 "
                f"kernels; kv_cache_dtype must be one of {KV_CACHE_DTYPES}"
            )
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.cache_dtype!r}"
            )
        if self.kv_allocation not in KV_ALLOCATIONS:
            raise ValueError(
                f"kv_allocation must be one of {KV_ALLOCATIONS}, got {self.kv_allocation!r}"
            )
        if self.kv_allocation != "paged" and self.enable_prefix_caching:
            # A prefix-cache hit shares blocks between requests; a reservation is one request's.
            raise ValueError(
                f"enable_prefix_caching is not supported with kv_allocation={self.kv_allocation}; "
                "pass enable_prefix_caching=False (--no-enable-prefix-caching)"
            )
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
    max_num_seqs: int  # sequences running at once
    max_num_batched_tokens: int  # tokens computed per step, decodes and prompt chunks together
    # False: a prompt is admitted only when all of it fits the step (an encoder's bidirectional
    # attention needs every token at once; vLLM's flag)
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        # vLLM refuses this too: a decode computes one token per running sequence, so with a
        # smaller budget max_num_seqs sequences could never all step at once.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater than "
                f"or equal to max_num_seqs ({self.max_num_seqs})."
            )


@dataclass
class ParallelConfig:
    # Ranks each layer is split across (Megatron-style, paper §4.6): one device each. Whether the
    # model's heads split this way is checked when the model's config is read
    # (`check_tensor_parallel_size`), before any process starts.
    tensor_parallel_size: int
    # Stages the decoder layers are cut into (pipeline parallelism), each stage on
    # tensor_parallel_size ranks of its own: tensor_parallel_size x pipeline_parallel_size ranks.
    # Whether the model has a layer for each stage is checked when its config is read.
    pipeline_parallel_size: int = 1
    # Engine cores behind one API server (vLLM's data parallelism): each a whole engine, with its
    # own copy of the weights and its own KV cache; the server sends each request to one of them
    # (minivllm/engine/dp_client.py). Only `minivllm serve` runs more than one.
    data_parallel_size: int = 1
    # Of those, how many run on this host (vLLM's names, for DP across hosts): unset, all of them.
    # The API server's host runs ranks 0..local-1; each other host runs `minivllm serve --headless`
    # with its own local count and its first rank (data_parallel_start_rank), and its cores dial
    # the server's coordinator at data_parallel_address:data_parallel_rpc_port over TCP
    # (minivllm/engine/dp_remote.py). 0 on the server's host: every core is remote.
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int | None = None  # unset: 0 (the API server's host)
    # Where the API server's host listens for the other hosts' cores; unset: vLLM's defaults,
    # 127.0.0.1 and 29550 (`coordinator_address`). Unused while every core is local.
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int | None = None
    # Who starts ranks 1..N-1 (vLLM's names): "mp", processes the engine spawns on this machine
    # (and, with nnodes > 1, on each other node a `--headless` invocation spawns its share);
    # "ray", actors placed over a Ray cluster (minivllm/executor/ray_distributed_executor.py).
    distributed_executor_backend: str = "mp"
    # The "mp" backend over several machines (vLLM's flags): nnodes invocations of the same
    # command, each spawning world_size / nnodes ranks; node 0 runs the engine and its rank 0
    # hosts torch.distributed's rendezvous at master_addr:master_port.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501

    def __post_init__(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("pipeline_parallel_size", self.pipeline_parallel_size)
        _positive("data_parallel_size", self.data_parallel_size)
        _positive("nnodes", self.nnodes)
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(
                "distributed_executor_backend must be one of "
                f"{list(DISTRIBUTED_EXECUTOR_BACKENDS)}, got {self.distributed_executor_backend!r}"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank must be in [0, nnodes) = [0, {self.nnodes}), got {self.node_rank}"
            )
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in (0, 65536), got {self.master_port}")
        if self.world_size % self.nnodes != 0:
            raise ValueError(
                f"nnodes ({self.nnodes}) must divide tensor_parallel_size x "
                f"pipeline_parallel_size ({self.world_size}): each node runs the same number of "
                "ranks"
            )
        if self.distributed_executor_backend == "ray":
            if self.nnodes > 1:
                raise ValueError(
                    "nnodes must be 1 with distributed_executor_backend='ray' (Ray places the "
                    f"ranks over its cluster's nodes itself), got nnodes={self.nnodes}"
                )
            if importlib.util.find_spec("ray") is None:
                raise ValueError(
                    "distributed_executor_backend='ray' needs Ray, which is not installed: "
                    "pip install minivllm[ray]"
                )
        self._check_data_parallel()

    def _check_data_parallel(self) -> None:
        n = self.data_parallel_size
        if self.data_parallel_size_local is None:
            self.data_parallel_size_local = n
        if self.data_parallel_start_rank is None:
            self.data_parallel_start_rank = 0
        local, start = self.data_parallel_size_local, self.data_parallel_start_rank
        for name, value, low in (("data_parallel_size_local", local, 0),
                                 ("data_parallel_start_rank", start, 0)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= n:
                raise ValueError(
                    f"{name} must be in [{low}, data_parallel_size={n}], got {value!r}"
                )
        if start + local > n:
            raise ValueError(
                f"data_parallel_start_rank + data_parallel_size_local must be at most "
                f"data_parallel_size={n} (this host's cores are ranks start..start+local-1), got "
                f"{start} + {local}"
            )
        port = self.data_parallel_rpc_port
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"data_parallel_rpc_port must be in (0, 65536), got {port}")
        if n > 1 and self.nnodes > 1:  # every rank's workers would meet at master_addr:port
            raise ValueError(
                "nnodes > 1 is not supported with data_parallel_size > 1 (each DP rank spawns its "
                "own tensor/pipeline-parallel workers on its host); spread the ranks over hosts "
                f"with data_parallel_size_local instead, got nnodes={self.nnodes}"
            )
        if n > 1 and self.world_size > 1 and self.distributed_executor_backend != "mp":
            raise ValueError(
                "distributed_executor_backend must be 'mp' with data_parallel_size > 1 and more "
                "than one rank per core (each DP rank spawns its own workers), got "
                f"{self.distributed_executor_backend!r}"
            )

    @property
    def spans_hosts(self) -> bool:
        """Do some engine cores run on another host than this one (DP across hosts)?"""
        return self.data_parallel_size_local != self.data_parallel_size

    @property
    def coordinator_address(self) -> tuple[str, int]:
        """Where the API server's host listens for other hosts' cores (vLLM's defaults)."""
        return (self.data_parallel_address or "127.0.0.1", self.data_parallel_rpc_port or 29550)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class ResolvedConfig:
    """The options resolved against the model's files and the machine, before any weight loads."""

    source: ModelSource  # where the checkpoint is (a folder, a converted .gguf, a hub snapshot)
    hf_config: LlamaConfig  # its config.json
    generation: GenerationDefaults  # its generation_config.json
    device: torch.device  # "auto" resolved
    dtype: torch.dtype  # "auto" resolved for the device
    max_model_len: int  # the option, or the model's context length (the KV cache may lower it)
    quantization: str = "none"  # "gguf": the GGUF file's blocks as stored; "none": float weights


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    resolved: ResolvedConfig
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative: SpeculativeConfig | None = None  # speculative decoding; None: off
    draft: ResolvedConfig | None = None  # the draft model's files, when `speculative` names one
    pooler: PoolerConfig | None = (
        None  # a pooling model's pooler (minivllm/pooling/); None: generate
    )
    lora: LoRAConfig | None = None  # LoRA adapters (minivllm/lora/); None: enable_lora off

    def __post_init__(self) -> None:
        self.check_cache_dtype()

    def check_cache_dtype(self) -> None:
        """Refuse a KV cache dtype wider than the model's (again after a pooling model's dtype
        is settled: minivllm/engine/arg_utils.py)."""
        # A cache wider than the model stores nothing the model computed (its K and V are already
        # rounded to the model's dtype) and the fast kernels widen only on read: refuse it here,
        # before any weight loads, rather than at the first attention call.
        cache = self.cache.cache_dtype
        model = self.resolved.dtype
        if cache != "auto" and KV_CACHE_DTYPE_BYTES[cache] > model.itemsize:
            raise ValueError(
                f"kv_cache_dtype={cache!r} is wider than the model's dtype "
                f"{str(model).removeprefix('torch.')}: use 'auto' or a dtype of at most "
                f"{model.itemsize} bytes"
            )
