"""Pipeline parallelism: the decoder layers cut into stages, each stage on its own ranks.

GPipe's split, as vLLM runs it for inference (`get_pp_indices` in vllm/distributed/utils.py, the
`pp` group of vllm/distributed/parallel_state.py): stage 0 holds the embedding and the first
layers, the last stage the last layers, the final norm and the LM head. A step's tokens go through
stage 0, which sends each token's hidden state (and Llama's residual stream beside it) to stage 1,
and so on; the last stage computes the logits and sends them to the driver, which samples.

    world of tp_size x pp_size ranks, rank = pp_rank * tp_size + tp_rank (vLLM's layout):
        stage 0: ranks 0 .. tp-1      stage 1: ranks tp .. 2tp-1      ...
    each stage is a tensor-parallel group of its own; rank r's peer in the next stage is r + tp.

- `stage_sizes`       how many layers each stage holds: the even split, or VLLM_PP_LAYER_PARTITION
- `IntermediateTensors` what one stage hands the next: [T, hidden] per tensor
- `PipelineParallelGroup` a rank's place in the pipeline, and its point-to-point sends

Which layers exist on a rank is decided outside the model file (minivllm/model/pipeline.py), so
the model stays its math. See "Pipeline parallelism" in the docs (docs/distributed.md).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class IntermediateTensors:
    """What a stage before the last hands on (vLLM's name): one row per token of the step."""

    hidden: torch.Tensor  # [T, hidden_size]  the last layer's output on this stage
    # [T, hidden_size]  the residual stream, where the model keeps it apart from `hidden` until
    # the next norm adds them (Llama's layout); None where each layer adds its own (Gemma's)
    residual: torch.Tensor | None


def stage_sizes(num_layers: int, pp_size: int, partition: list[int] | None = None) -> list[int]:
    """Decoder layers per stage. `partition` (VLLM_PP_LAYER_PARTITION) is taken as given, once
    checked; else vLLM's even split, where the remainder goes one layer each to the stages just
    before the last (the last one also holds the final norm and the LM head): 10 layers over 4
    stages are 2, 3, 3, 2."""
    if partition is not None:
        if len(partition) != pp_size or sum(partition) != num_layers:
            raise ValueError(
                f"VLLM_PP_LAYER_PARTITION {','.join(map(str, partition))} must give each of the "
                f"{pp_size} pipeline stages (pipeline_parallel_size) a layer count, summing to the "
                f"model's {num_layers} decoder layers"
            )
        return list(partition)
    if num_layers < pp_size:
        raise ValueError(
            f"pipeline_parallel_size {pp_size} is larger than the model's {num_layers} decoder "
            "layers: each stage must hold at least one"
        )
    sizes = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        sizes[-i] += 1
    return sizes


def stage_range(sizes: list[int], pp_rank: int) -> tuple[int, int]:
    """[start, end) of the layers stage `pp_rank` holds."""
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


@dataclass
class PipelineParallelGroup:
    """A rank's place in the pipeline: its stage, and the sends between stages. One stage (the
    default) is no pipeline: nothing is sent."""

    rank: int = 0  # the stage: 0 .. world_size - 1
    world_size: int = 1  # stages (pipeline_parallel_size)
    tp_size: int = 1  # ranks per stage: this rank's peer in the next stage is global_rank + tp_size
    global_rank: int = 0
    sent_bytes: int = 0  # hidden states (and residuals) this rank has sent to the next stage
    # Between the driver (rank 0) and `output_rank` only: the steps' outputs (gloo); None with
    # one stage, and on ranks outside it.
    output_group: dist.ProcessGroup | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    @property
    def output_rank(self) -> int:
        """The global rank that sends a step's logits to the driver: the last stage's rank 0,
        where its tensor-parallel gather collects them."""
        return (self.world_size - 1) * self.tp_size

    @property
    def sends_output(self) -> bool:
        return self.world_size > 1 and self.global_rank == self.output_rank

    # ------------------------------------------------------------------ stage to stage
    def send(self, tensors: IntermediateTensors) -> None:
        """To the same tensor-parallel rank of the next stage (every rank of a stage holds the
        whole hidden state after its all-reduce, so each sends its own copy)."""
        for x in (tensors.hidden, tensors.residual):
            if x is not None:
                x = x.contiguous()
                dist.send(x, dst=self.global_rank + self.tp_size)
                self.sent_bytes += x.numel() * x.element_size()

    def recv(
        self,
        num_tokens: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        with_residual: bool,
    ) -> IntermediateTensors:
        """The previous stage's `send` of this step: the receiver knows the shapes from the step
        it was sent (T tokens), so only the values travel."""
        src = self.global_rank - self.tp_size

        def one() -> torch.Tensor:  # [T, hidden_size]
            x = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
            dist.recv(x, src=src)
            return x

        hidden = one()
        return IntermediateTensors(hidden, one() if with_residual else None)

    # ------------------------------------------------------------------ last stage to driver
    def send_output(self, output: object) -> None:
        """The step's runner output (logits, prompt logprobs) to the driver, on the output group;
        `torch.save` so that the driver can put CUDA tensors on its own device."""
        buffer = io.BytesIO()
        torch.save(output, buffer)
        dist.send_object_list([buffer.getvalue()], dst=0, group=self.output_group)

    def recv_output(self, device: torch.device) -> Any:
        """The next step's output from the last stage, in the order the steps were sent."""
        box: list[Any] = [None]
        dist.recv_object_list(box, src=self.output_rank, group=self.output_group)
        # Our own ranks' bytes, as the control group's messages are (pickled) already.
        return torch.load(io.BytesIO(box[0]), map_location=device, weights_only=False)


SINGLE_STAGE = PipelineParallelGroup()
