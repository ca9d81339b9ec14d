"""One device's share of the engine: load the model onto it and size its KV cache.

vLLM's `Worker` (vllm/v1/worker/): what the executor asks of each device before the first step.
With one device (tensor_parallel_size 1) this is all there is: `build_runner` loads the weights
and fits as many KV blocks as the platform's budget allows. With tensor parallelism every rank
runs the same function on its own shard (minivllm/worker/worker_proc.py adds the loop that serves
rank 0's steps), and the ranks agree on the smallest block count, so one block table means the
same blocks on every rank.

It imports the loader, the model runner and the attention selector; a tensor-parallel rank
(worker_proc.py) builds on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from minivllm.attention.abstract import AttentionBackend
from minivllm.attention.selector import get_attention_backend
from minivllm.config import CacheConfig
from minivllm.config.lora import LoRAConfig
from minivllm.core.kv_cache_groups import hybrid_kv_cache_groups
from minivllm.distributed.parallel_state import TensorParallelGroup
from minivllm.distributed.pipeline import SINGLE_STAGE, PipelineParallelGroup
from minivllm.lora.manager import LoRAModelManager
from minivllm.model.hf_overrides import HfOverrides
from minivllm.model.loader import load_model
from minivllm.model.source import ModelSource
from minivllm.pooling.config import PoolerConfig
from minivllm.worker.hybrid_model_runner import HybridModelRunner
from minivllm.worker.model_runner import ModelRunner, determine_num_blocks, kv_cache_torch_dtype
from minivllm.worker.pooling_model_runner import PoolingModelRunner

if TYPE_CHECKING:
    import torch.distributed as dist


@dataclass(frozen=True)
class WorkerConfig:
    """What any rank needs to build its shard: plain data, sent to each worker when it starts."""

    model_path: str  # the resolved model folder (for a GGUF file, its converted copy)
    model_name: str
    dtype: torch.dtype
    device_type: str  # "cpu" or "cuda"; on CUDA, rank r uses its local device cuda:r
    attention_backend: str  # the driver's backend, resolved ("cpu", "reference", "triton")
    enforce_eager: bool  # the layers always from Python (ModelConfig.enforce_eager)
    quantization: str  # "gguf" (the file's blocks as stored) or "none" (ResolvedConfig's)
    gguf_file: str | None  # the .gguf file the model came as, if it did
    max_model_len: int  # the RoPE table's length
    cache: CacheConfig
    tensor_parallel_size: int
    num_threads: int  # torch's intra-op threads per worker on a CPU (the cores, shared out)
    pooler: PoolerConfig | None = None  # a pooling model's: its runner pools instead of logits
    lora: LoRAConfig | None = None  # LoRA adapters' slots (minivllm/lora/); None: off
    pipeline_parallel_size: int = 1
    # Decoder layers per pipeline stage (the even split or VLLM_PP_LAYER_PARTITION, resolved on
    # the driver so that every rank cuts the model the same way); () with one stage.
    pp_layer_sizes: tuple[int, ...] = ()
    hf_overrides: HfOverrides | None = None  # config.json's changes at load (ModelSource's)
    # Machines the ranks span (the "mp" backend's nnodes): each runs world_size / nnodes of them,
    # rank r as local rank r % (world_size / nnodes), on that machine's device of that index.
    nnodes: int = 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes


def rank_device(device_type: str, local_rank: int) -> torch.device:
    """One device per rank: cuda:local_rank on GPUs; every rank shares the CPU."""
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def build_runner(
    wc: WorkerConfig,
    tp: TensorParallelGroup,
    control: dist.ProcessGroup | None,
    device: torch.device,
    backend: AttentionBackend | None = None,
    pp: PipelineParallelGroup = SINGLE_STAGE,
) -> ModelRunner:
    """Load this rank's shard (of its pipeline stage's layers) and size its KV cache, for those
    layers only: as many blocks as the *smallest* rank can hold, so that one block table means
    the same blocks on every rank."""
    backend = backend or get_attention_backend(wc.attention_backend, device)
    gguf_file = Path(wc.gguf_file) if wc.gguf_file is not None else None
    source = ModelSource(Path(wc.model_path), wc.model_name, gguf_file, wc.hf_overrides)
    sizes = list(wc.pp_layer_sizes)
    stage = (sizes, pp.rank) if pp.world_size > 1 else None
    model = load_model(
        source,
        backend,
        wc.dtype,
        device,
        wc.max_model_len,
        tp,
        quantization=wc.quantization,
        stage=stage,
    )
    lora_manager = None
    if wc.lora is not None:  # wrap the linears before the runner checks what its decode loop runs
        lora_manager = LoRAModelManager(
            model, wc.lora, wc.dtype, device, gguf_file, attention_backend=backend.name
        )
    kv_dtype = kv_cache_torch_dtype(wc.cache.cache_dtype, wc.dtype)
    # Windowed and global layers mixed (Gemma 2/3): block tables per group of layers, or None.
    groups = hybrid_kv_cache_groups(model, wc.cache.kv_allocation)
    first, end = model.model.start_layer, model.model.end_layer  # this stage's layers
    stage_layers = None if stage is None else end - first
    if groups is not None:  # the slots: each group's layers on this stage
        stage_layers = max(sum(first <= i < end for i in g.layer_ids) for g in groups)
    num_blocks = 0  # an encoder-only model's attention reads no cache: it holds no blocks
    if not wc.cache.encoder_only:
        num_blocks = determine_num_blocks(model, wc.cache, kv_dtype, device, stage_layers)
    if control is not None:  # tensor parallelism: every rank the same blocks
        from minivllm.distributed.process_group import min_over_ranks

        num_blocks = min_over_ranks(num_blocks, control)
    # The C++ decode loop runs a whole model, from the embedding to the norm: not a stage.
    eager = wc.enforce_eager or stage is not None
    args = (model, backend, num_blocks, wc.cache.block_size, kv_dtype, device, eager)
    if wc.pooler is not None:
        if lora_manager is not None:
            raise ValueError("enable_lora is not supported with runner='pooling'")
        if groups is not None:
            raise ValueError("runner='pooling' does not support models with sliding-window layers")
        return PoolingModelRunner(*args, pooler=wc.pooler)
    runner: ModelRunner
    if groups is not None:
        runner = HybridModelRunner(*args, kv_cache_groups=groups)
    else:
        runner = ModelRunner(*args, num_cache_layers=None if stage is None else stage_layers)
    runner.lora_manager = lora_manager
    runner.pp = pp
    return runner
