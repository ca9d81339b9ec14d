"""The matmul floor of a run: the time its matmuls alone take, at the exact shapes each step had.

On a few CPU cores an engine step is compute-bound and most of it is matmul (issue 16's profile:
`aten::mm` ~70 %). So the least time a run can take, with the model's own weights and layout, is
the time its matmuls take by themselves; minivllm's time ÷ that floor says how much the rest of the
step (norms, RoPE, attention, sampling, scheduling, Python) costs on top.

Two phases, both in the bench's own process:

1. `record_shapes` wraps the executor's `execute_model` while the timed run goes on and writes down,
   per step, T (the step's tokens: the rows every decoder layer's linears see) and S (the rows that
   reach the LM head: the scheduled sequences that sample). Two integers from the
   `SchedulerOutput` the step already carries; nothing is timed inside the engine.
2. `replay` times, with the model's own layers, what the model does with those rows: per layer
   the qkv, o, gate_up and down projections' own `forward` (minivllm/cpu/op_forwards.py:
   on the CPU fast path oneDNN on their prepacked weights, or where oneDNN does not pack them the
   skinny GEMM at decode's row counts and MKL above; otherwise MKL throughout), and the LM head's
   own matmul, `ParallelLMHead`'s forward (on the CPU fast path an untied head's oneDNN-prepacked
   weight, a tied head's skinny GEMM at few rows; otherwise slices of `LM_HEAD_ROWS` vocabulary
   rows).
   The elementwise work between them, the float32 cast of the logits and the attention are left
   out: they are what the floor is a floor to.

Replaying every step would take about as long as the run. The body's cost depends on T only and
the head's on S only, so each distinct T (and each distinct S) is timed min(count, 3) times; its
median × its count is its share of the floor. A shape seen once costs one replay, as in the run.
Inputs are random rows in the model's dtype, row-major. The model hands some of its inputs over
as transposed views (the output of MKL's `linear`), which BLAS reads at the same speed (measured:
within ±6 % at 1-512 rows); the replay does not tell the two layouts apart.

Only at tensor_parallel_size 1: at N > 1 the ranks' matmuls run at the same time in other
processes, and rank 0's alone in this one would not be the same floor.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from minivllm.benchmarks.machine import synchronize
from minivllm.core.scheduler import SchedulerOutput
from minivllm.llm import LLM
from minivllm.model.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from minivllm.worker.model_runner import ModelRunnerOutput

REPLAYS_PER_SHAPE = 3  # at most this many timings of one distinct T or S; the median counts


@dataclass
class StepShapes:
    """The matmul rows of every step of a run, in step order."""

    tokens: list[int] = field(default_factory=list)  # T per step: rows through every linear
    sampled: list[int] = field(default_factory=list)  # S per step: rows through the LM head


@contextmanager
def record_shapes(llm: LLM) -> Iterator[StepShapes]:
    """While inside, every step's (T, S) is appended to the yielded `StepShapes`."""
    executor: Any = llm.llm_engine.executor
    shapes = StepShapes()
    inner = executor.execute_model

    def execute_model(sched: SchedulerOutput) -> ModelRunnerOutput:
        shapes.tokens.append(sum(item.num_new_tokens for item in sched.scheduled))
        shapes.sampled.append(sum(1 for item in sched.scheduled if item.sample))
        return inner(sched)

    executor.execute_model = execute_model  # an instance attribute shadows the method
    try:
        yield shapes
    finally:
        del executor.execute_model  # the class's method again


def _median_seconds(device: torch.device, times: int, fn: Any, *args: Any) -> float:
    seconds = []
    for _ in range(times):
        synchronize(device)
        start = time.perf_counter()
        fn(*args)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


Projections = list[tuple[Any, Any, Any, Any]]  # per layer: the qkv, o, gate_up, down modules


def body_matmuls(
    layers: Projections,
    x_hidden: torch.Tensor,  # [T, hidden]: the rows qkv and gate_up read
    x_attn: torch.Tensor,  # [T, heads * head_dim]: the rows o reads
    x_mlp: torch.Tensor,  # [T, intermediate]: the rows down reads
) -> None:
    """Every decoder layer's four projections, as the model calls them."""
    for qkv, o, gate_up, down in layers:
        qkv(x_hidden)
        o(x_attn)
        gate_up(x_hidden)
        down(x_mlp)


@torch.inference_mode()
def replay(model: LlamaForCausalLM, shapes: StepShapes) -> dict[str, Any]:
    """Time the recorded steps' matmuls alone (see the module docstring); seconds and shapes."""
    layers: Projections = [
        (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
        for layer in cast(list[LlamaDecoderLayer], list(model.model.layers))
    ]
    lm_head = model.lm_head
    head = lm_head.weight  # [vocab, hidden]
    qkv, o, gate_up, down = (proj.weight for proj in layers[0])
    # [(heads + 2 kv_heads) * head_dim, hidden], [hidden, heads * head_dim],
    # [2 * intermediate, hidden], [hidden, intermediate]
    device, dtype = head.device, head.dtype

    def rows(n: int, width: int) -> torch.Tensor:  # [n, width]
        return torch.randn(n, width, device=device).to(dtype)

    body_seconds = 0.0
    for t, count in sorted(Counter(shapes.tokens).items()):
        x_hidden, x_attn, x_mlp = rows(t, qkv.shape[1]), rows(t, o.shape[1]), rows(t, down.shape[1])
        times = min(count, REPLAYS_PER_SHAPE)
        seconds = _median_seconds(device, times, body_matmuls, layers, x_hidden, x_attn, x_mlp)
        body_seconds += count * seconds

    head_seconds = 0.0
    for s, count in sorted(Counter(n for n in shapes.sampled if n).items()):
        x = rows(s, head.shape[1])
        times = min(count, REPLAYS_PER_SHAPE)
        seconds = _median_seconds(device, times, lm_head, x)
        head_seconds += count * seconds
    return {
        "seconds": body_seconds + head_seconds,
        "body_seconds": body_seconds,
        "lm_head_seconds": head_seconds,
        "steps": len(shapes.tokens),
        "tokens": sum(shapes.tokens),
        "sampled_rows": sum(shapes.sampled),
        "distinct_tokens_per_step": len(set(shapes.tokens)),
        "distinct_sampled_per_step": len(set(shapes.sampled) - {0}),
        "weight_shapes": {
            "qkv": list(qkv.shape),
            "o": list(o.shape),
            "gate_up": list(gate_up.shape),
            "down": list(down.shape),
            "lm_head": list(head.shape),
            "layers": len(layers),
        },
        "method": f"each distinct T and S timed min(count, {REPLAYS_PER_SHAPE}) times; "
        "median x count",
    }
