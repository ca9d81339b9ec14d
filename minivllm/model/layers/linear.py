"""Megatron-style parallel layers: each rank holds a slice of a weight and computes its share.

Tensor parallelism as the paper's §4.6 describes it (after Megatron-LM): a Llama layer is split so
that each of N ranks holds 1/N of every weight, and the ranks meet only twice per layer:

- **Column-parallel** (`ColumnParallelLinear`, `QKVParallelLinear`): the weight's *output rows*
  are split. The fused QKV projection is split by heads (rank r computes its own query heads and
  the KV heads they read), gate/up by the MLP's inner width. No communication: each rank's output
  is the input its row-parallel partner needs.
- **Row-parallel** (`RowParallelLinear`): the *input columns* are split (o_proj over heads,
  down_proj over the inner width); each rank's product is a partial sum of the full output, and
  one all-reduce adds them. Attention and the MLP each end in one: two all-reduces per layer.
- **Vocabulary-parallel** (`VocabParallelEmbedding`, `ParallelLMHead`): the vocabulary's rows are
  split. An embedding lookup finds each token on one rank only (the others give zeros, then an
  all-reduce); the LM head computes each rank's slice of the logits, gathered to rank 0, where
  the sampler runs.

When a model has fewer KV heads than ranks, each KV head is replicated on N / num_kv_heads
ranks, as vLLM does: rank r holds the KV head its query heads read.

Each layer has its `weight_loader` beside it (as nano-vllm's `linear.py` and `embed_head.py`
do): given the *checkpoint's* tensor, or a lazy safetensors slice of it, it reads only its own
rows or columns, so no rank ever holds the whole model. With N = 1 every layer is the plain layer:
`TensorParallelGroup` returns at once and no collective is called.

A layer of a quantized checkpoint (a GGUF file's blocks) has a `quant_method` the loader set
(vLLM's `LinearMethodBase`, minivllm/model/quantization/), which holds its weight and computes
its product; every other layer has none and runs `F.linear`.

The linears and the LM head are custom ops (`custom_op.py`): their `forward_native` below is
`F.linear` on token-major rows, the specification; a platform may run a faster matmul of equal
results in its place (the CPU's: minivllm/cpu/op_forwards.py). See "Distributed execution" in
the docs (docs/distributed.md) and the architecture page (docs/architecture.md).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed.parallel_state import TensorParallelGroup
from minivllm.model.config import LlamaConfig
from minivllm.model.custom_op import CustomOp


class Sliceable(Protocol):
    """A checkpoint tensor: a `torch.Tensor`, or safetensors' lazy slice, read on indexing."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...


# ---------------------------------------------------------------------------------- sizes
def kv_heads_per_rank(num_kv_heads: int, world_size: int) -> int:
    """KV heads one rank holds: its 1/N share, or one replicated head when heads < ranks."""
    return max(1, num_kv_heads // world_size)


def first_kv_head(num_kv_heads: int, tp: TensorParallelGroup) -> int:
    """The first of rank r's KV heads. With fewer heads than ranks, N / num_kv_heads consecutive
    ranks share one: exactly the KV head that their query heads read."""
    return tp.rank * num_kv_heads // tp.world_size


def splits(config: LlamaConfig, world_size: int) -> bool:
    n = world_size
    kv = config.num_key_value_heads
    return (
        config.num_attention_heads % n == 0
        and (kv % n == 0 or n % kv == 0)
        and config.intermediate_size % n == 0
    )


def check_tensor_parallel_size(config: LlamaConfig, world_size: int) -> None:
    """Refuse a size that does not split the model's heads and MLP evenly, naming those that do."""
    if splits(config, world_size):
        return
    n, heads, kv = world_size, config.num_attention_heads, config.num_key_value_heads
    reasons = []
    if heads % n:
        reasons.append(f"its {heads} attention heads do not divide over {n} ranks")
    if kv % n and n % kv:
        reasons.append(f"its {kv} KV heads neither divide over {n} ranks nor replicate evenly")
    if config.intermediate_size % n:
        reasons.append(f"its MLP width {config.intermediate_size} does not divide over {n} ranks")
    sizes = [size for size in range(1, heads + 1) if splits(config, size)]
    raise ValueError(
        f"tensor_parallel_size {n} does not split this model: {'; '.join(reasons)}; "
        f"tensor_parallel_size must be one of {sizes}"
    )


def linear(layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x Wᵀ (+ b) for a layer's weight: by its quantization method if it has one."""
    if layer.quant_method is not None:
        return layer.quant_method.apply(layer, x, bias)
    return F.linear(x, layer.weight.to_dense(), bias)  # to_dense(): plain, as the checkpoint


def _rows(rank: int, size: int) -> slice:
    return slice(rank * size, (rank + 1) * size)


# ---------------------------------------------------------------------------------- linear layers
class LinearBase(CustomOp):
    """What every linear layer has: a quantization method, None for plain float weights."""

    quant_method: Any = None  # a LinearMethodBase where the checkpoint stores blocks
    weight: nn.Parameter  # [out, in]; a platform may hold it in its kernels' layout
    # True for a layer that only ever runs prompts, never a decode step's few rows (an encoder's:
    # BERT sets it): a platform may then pack its weight for many rows only (the CPU's float16
    # linears on AMX-BF16 tiles, minivllm/cpu/f16_amx.py).
    prefill_only: bool = False


class ColumnParallelLinear(LinearBase):
    """y = x Wᵀ (+ b) with W's output rows split: rank r computes its slice of y, no communication.

    `output_sizes` lists the fused parts (gate and up: [I, I]); each part is split on its own, so a
    rank holds gate_r then up_r, and `split(local_sizes)` separates them again."""

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool, tp: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.tp = tp
        self.output_sizes = list(output_sizes)  # each part's rows in the checkpoint
        self.local_sizes = [size // tp.world_size for size in output_sizes]
        self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), input_size))
        self.bias = nn.Parameter(torch.empty(sum(self.local_sizes))) if bias else None

    def shard_rows(self, part: int) -> slice:
        """The rows of the checkpoint's part `part` that rank r holds (a LoRA B takes the same)."""
        return _rows(self.tp.rank, self.local_sizes[part])

    def weight_loader(self, param: nn.Parameter, loaded: Sliceable, shard_id: Any = 0) -> None:
        """Part `shard_id`'s rank-r rows of the checkpoint tensor, into their place in `param`."""
        offset = sum(self.local_sizes[:shard_id])
        size = self.local_sizes[shard_id]
        param.data[offset : offset + size].copy_(loaded[self.shard_rows(shard_id)])

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, sum(local_sizes)]
        return linear(self, x, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q/k/v projection, split by heads: rank r holds its num_heads / N query heads and
    the KV heads they read (its share, or a replicated one when KV heads are fewer than ranks)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TensorParallelGroup,
    ) -> None:
        self.num_heads = num_heads // tp.world_size  # this rank's query heads
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp.world_size)
        self.head_dim = head_dim
        self.first_kv_head = first_kv_head(num_kv_heads, tp)
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        sizes = [q * tp.world_size, kv * tp.world_size, kv * tp.world_size]
        super().__init__(hidden_size, sizes, bias, tp)
        # The checkpoint's parts: all query heads, all KV heads (fewer than kv * N if replicated).
        self.output_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]

    def shard_rows(self, part: int) -> slice:
        """Rank r's query heads of part 0 (q); of k and v, the KV heads its query heads read."""
        if part == 0:
            return _rows(self.tp.rank, self.local_sizes[0])
        start = self.first_kv_head * self.head_dim
        return slice(start, start + self.local_sizes[part])

    def weight_loader(self, param: nn.Parameter, loaded: Sliceable, shard_id: Any = "q") -> None:
        super().weight_loader(param, loaded, "qkv".index(shard_id))


class RowParallelLinear(LinearBase):
    """y = x Wᵀ (+ b) with W's input columns split: rank r multiplies its slice of x (the output
    of its column-parallel partner) by its columns, and one all-reduce adds the N partial sums.
    The bias is added once, after the sum.

    With `reduce_results` False (vLLM's flag of the same name) the forward returns rank r's
    partial product alone, and whoever called it finishes it with `reduce`: the LoRA wrapper
    (minivllm/lora/layers.py) adds its own partial delta first, so one all-reduce sums both."""

    reduce_results = True

    def __init__(
        self, input_size: int, output_size: int, bias: bool, tp: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size // tp.world_size  # this rank's columns
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def shard_cols(self) -> slice:
        """The checkpoint's input columns rank r holds (a LoRA A takes the same)."""
        return _rows(self.tp.rank, self.input_size)

    def weight_loader(self, param: nn.Parameter, loaded: Sliceable, shard_id: Any = None) -> None:
        if param is self.bias:
            param.data.copy_(loaded[:])
        else:
            param.data.copy_(loaded[:, self.shard_cols()])

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:  # [T, out] -> [T, out]
        """The ranks' partial products summed by one all-reduce, then the bias, once."""
        y = self.tp.all_reduce(partial)
        return y if self.bias is None else y + self.bias

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / N] -> [T, out]
        partial = linear(self, x)  # [T, out], rank r's share of the sum
        return self.reduce(partial) if self.reduce_results else partial


# ---------------------------------------------------------------------------------- vocabulary
class VocabParallelEmbedding(nn.Module):
    """Token embeddings with the vocabulary's rows split: rank r holds rows [r·R, (r+1)·R), R =
    ceil(vocab / N) (the last rank's tail is zero padding). A token is found on one rank; the
    others contribute zeros to the all-reduce."""

    embedding_method: Any = None  # an EmbeddingMethodBase where the checkpoint stores blocks

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.world_size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size))

    def weight_loader(self, param: nn.Parameter, loaded: Sliceable, shard_id: Any = None) -> None:
        end = min(self.vocab_start + self.rows_per_rank, self.vocab_size)
        held = end - self.vocab_start
        param.data[:held].copy_(loaded[self.vocab_start : end])
        param.data[held:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # int64 [T] -> [T, hidden]
        if self.embedding_method is not None:  # a quantized table (one device only)
            return self.embedding_method.embedding(self, input_ids)
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.rows_per_rank)  # bool [T]
        hidden = F.embedding(local.clamp(0, self.rows_per_rank - 1), self.weight)
        return self.tp.all_reduce(hidden * mine.unsqueeze(-1).to(hidden.dtype))


class ParallelLMHead(VocabParallelEmbedding, LinearBase):
    """The LM head: each rank computes the logits of its vocabulary rows; rank 0 gathers them.
    With tied embeddings its weight is the embedding's own slice (the same rows per rank).

    A custom op: calling it computes this rank's logits, which a platform may do faster."""

    forward = CustomOp.forward  # the op's dispatch, not the embedding lookup it inherits
    tied = False  # its weight is the embedding's (tie_word_embeddings), whose lookup reads rows

    def forward_native(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, R]
        """This rank's vocabulary rows' logits, in the weight's dtype."""
        return linear(self, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 [S, vocab] on rank 0 (None on the others) for hidden [S, hidden_size]."""
        local = self(hidden).float().contiguous()  # [S, R]
        logits = self.tp.gather(local)  # [S, R * N] on rank 0
        return None if logits is None else logits[:, : self.vocab_size]
