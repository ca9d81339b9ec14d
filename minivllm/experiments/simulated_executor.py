"""A simulated-time executor: the real scheduler and block manager, a modelled GPU.

The paper's headline (§6.2, Figs. 12-13) is about how many requests fit in a step, which only the
scheduler and the KV allocation policy decide; the GPU only sets how long the step takes. This
executor runs no model: for every scheduled row that samples it returns a fixed token (the
workloads ignore EOS and fix every output length), and it advances a simulated clock by a step's
cost under a roofline model of a named GPU running a named model:

    step time = max(bytes moved / HBM bandwidth, FLOPs / peak dense FLOPs) + a fixed overhead
    bytes     = every weight once (one forward pass reads them all, whatever the batch)
              + every scheduled sequence's K/V, read once per layer (its whole context)
    FLOPs     = 2 * parameters * new tokens            (the matmuls)
              + 4 * layers * hidden * new tokens * context   (QK^T and PV of attention)

It cannot show what the roofline leaves out: kernel launch and scheduling gaps beyond the fixed
overhead, attention kernels that reach neither roof, prefill/decode interference inside a real
GPU, memory-allocator behaviour, or any effect of the numbers a model computes. It shows the
batch each policy can hold and what that batch costs on an ideal machine; the docs page
(docs/concepts/paper-experiment.md) says where this matters.

The engine is built as usual (`LLMEngine(config, executor=...)`) from a model folder holding only
a `config.json` written here: two token ids (the output token and an EOS the workload ignores),
no weights, no tokenizer, prompts given as token ids.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from minivllm.core.scheduler import SchedulerOutput
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.model.config import LlamaConfig
from minivllm.worker.model_runner import ModelRunnerOutput

T = TypeVar("T")
GiB = 2**30
OUTPUT_TOKEN = 0  # what every sampled row "generates"
EOS_TOKEN = 1  # declared so the config is complete; the workloads set ignore_eos


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_bytes: float
    hbm_bandwidth: float  # bytes / s
    peak_flops: float  # dense 16-bit FLOP / s
    source: str


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_params: float
    num_layers: int
    hidden_size: int
    kv_dim: int  # num_kv_heads * head_dim: the width of K (and of V) per layer
    max_model_len: int
    dtype_bytes: int  # fp16 / bf16 weights and KV
    source: str

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_dim * self.dtype_bytes  # K and V, every layer


GPUS = {
    "a100-40gb": GPUSpec(
        "A100-40GB (SXM)", 40 * GiB, 1555e9, 312e12,
        "NVIDIA A100 datasheet: 1,555 GB/s HBM2, 312 TFLOPS dense FP16/BF16 tensor core",
    ),
    "h200": GPUSpec(
        "H200 (SXM)", 141e9, 4.8e12, 989e12,
        "NVIDIA H200 datasheet: 141 GB HBM3e at 4.8 TB/s, 989 TFLOPS dense BF16 (1,979 sparse)",
    ),
}  # fmt: skip
MODELS = {
    "opt-13b": ModelSpec(
        "OPT-13B", 12.85e9, 40, 5120, 5120, 2048, 2,
        "facebook/opt-13b config.json: 40 layers, hidden 5120, 40 heads (no GQA), 2048 positions; "
        "12.85e9 parameters (Zhang et al. 2022, Table 1 rounds to 13B); fp16",
    ),
    "tinyllama-1.1b": ModelSpec(
        "TinyLlama-1.1B", 1.10e9, 22, 2048, 256, 2048, 2,
        "TinyLlama/TinyLlama-1.1B-Chat-v1.0 config.json: 22 layers, hidden 2048, 32 heads, "
        "4 KV heads of 64 (GQA), 2048 positions; 1.1e9 parameters; bf16",
    ),
}  # fmt: skip
# The fixed part of every step: host-side scheduling, input preparation, kernel launches and
# sampling, which a GPU step pays whatever its size. An assumption, not a measurement: a few
# milliseconds is what vLLM's early versions spent on the host per step.
STEP_OVERHEAD_S = 0.004
# Held back from the KV cache for activations and the allocator's slack (vLLM profiles this with
# a dummy forward pass; the paper's Fig. 1 shows a sliver of the 40 GB for "others").
ACTIVATION_RESERVE_BYTES = 1 * GiB
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of the device


@dataclass(frozen=True)
class SimulatedSetup:
    """One GPU running one model: the cost of a step and the size of the KV cache."""

    gpu: GPUSpec
    model: ModelSpec
    step_overhead_s: float = STEP_OVERHEAD_S

    @classmethod
    def named(cls, name: str) -> SimulatedSetup:
        """`"a100-40gb/opt-13b"`: GPU/MODEL, from GPUS and MODELS."""
        gpu, _, model = name.partition("/")
        if gpu not in GPUS or model not in MODELS:
            pairs = [f"{g}/{m}" for g in GPUS for m in MODELS]
            raise ValueError(f"simulate must be GPU/MODEL, one of {pairs}, got {name!r}")
        return cls(GPUS[gpu], MODELS[model])

    @property
    def kv_cache_bytes(self) -> float:
        """0.9 of the device, less the weights and the activation reserve."""
        budget = GPU_MEMORY_UTILIZATION * self.gpu.memory_bytes
        return budget - self.model.weight_bytes - ACTIVATION_RESERVE_BYTES

    def num_kv_blocks(self, block_size: int) -> int:
        return int(self.kv_cache_bytes // (self.model.kv_bytes_per_token * block_size))

    def step_time(self, sched: SchedulerOutput) -> float:
        """Seconds one step takes on the modelled GPU (the roofline above)."""
        m = self.model
        new_tokens = 0
        context_tokens = 0  # K/V read: each sequence's whole context, once
        attention_pairs = 0  # (new token, context token) pairs
        for item in sched.scheduled:
            new_tokens += item.num_new_tokens
            context_tokens += item.seq_len
            attention_pairs += item.num_new_tokens * item.seq_len
        bytes_moved = m.weight_bytes + context_tokens * m.kv_bytes_per_token
        flops = 2 * m.num_params * new_tokens + 4 * m.num_layers * m.hidden_size * attention_pairs
        roof = max(bytes_moved / self.gpu.hbm_bandwidth, flops / self.gpu.peak_flops)
        return roof + self.step_overhead_s

    def hf_config(self) -> dict[str, Any]:
        """The config.json the engine reads: the model's shape, with a two-token vocabulary."""
        m = self.model
        return {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 2,
            "hidden_size": m.hidden_size,
            "intermediate_size": 4 * m.hidden_size,
            "num_hidden_layers": m.num_layers,
            "num_attention_heads": m.hidden_size // 64,
            "num_key_value_heads": m.kv_dim // 64,
            "head_dim": 64,
            "max_position_embeddings": m.max_model_len,
            "eos_token_id": EOS_TOKEN,
        }


class _NoRunner:
    """Stands where the engine expects rank 0's runner: it reads only `.model.config`."""

    def __init__(self, config: Any) -> None:
        self.model = self
        self.config = config


class SimulatedExecutor:
    """The executor interface (minivllm/executor/tensor_parallel.py), with time modelled, not spent."""

    def __init__(self, setup: SimulatedSetup, block_size: int) -> None:
        self.setup = setup
        self.num_blocks = setup.num_kv_blocks(block_size)
        self.driver_runner: Any = _NoRunner(LlamaConfig.from_hf_dict(setup.hf_config()))
        self.clock = 0.0  # simulated seconds since the start
        self.num_steps = 0
        self.batched_requests = 0  # summed over steps: Fig. 13's average is this / num_steps
        self._logits = torch.tensor([[1.0, 0.0]])  # [1, vocab]: argmax is OUTPUT_TOKEN

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.clock += self.setup.step_time(sched)
        self.num_steps += 1
        self.batched_requests += len(sched.scheduled)
        num_sampled = sum(1 for item in sched.scheduled if item.sample)
        logits = self._logits.expand(num_sampled, -1) if num_sampled else None  # [S, vocab]
        return ModelRunnerOutput(logits, {})  # no prompt logprobs: there is no model to score

    def collective_rpc(self, fn: Callable[[Any], T]) -> list[T]:
        return []  # no runner to call

    def shutdown(self) -> None:
        pass


def model_folder(setup: SimulatedSetup) -> Path:
    """A folder with the setup's config.json and nothing else: the engine's model source."""
    folder = Path(tempfile.gettempdir()) / "minivllm-sim" / setup.model.name.lower()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    text = json.dumps(setup.hf_config(), indent=1)
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return folder


def build_simulated_engine(setup: SimulatedSetup, **engine_kwargs: Any) -> LLMEngine:
    """An engine whose steps run on `SimulatedExecutor`: token-id prompts, no text."""
    block_size = engine_kwargs.get("block_size", 16)
    executor = SimulatedExecutor(setup, block_size)
    kwargs: dict[str, Any] = {
        "model": str(model_folder(setup)),
        "skip_tokenizer_init": True,
        "attention_backend": "reference",
        "device": "cpu",
        "num_gpu_blocks_override": executor.num_blocks,
        **engine_kwargs,
    }
    return LLMEngine(EngineArgs(**kwargs).create_engine_config(), executor=executor)
