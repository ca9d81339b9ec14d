"""Mixture of experts: a router sends each token to `top_k` of E SwiGLU MLPs, and one op runs them.

A sparse MoE layer (Mixtral, Qwen3-MoE; vLLM's vllm/model_executor/layers/fused_moe/) replaces the
dense MLP by E expert MLPs and a router, a linear layer that scores each token against each
expert. A token runs through its `top_k` best experts only, and the layer's output is their
outputs summed with the router's weights. Three parts:

- **Routing** (`select_experts`, vLLM's name): softmax over all E experts' logits in float32, the
  top_k probabilities, then renormalised to sum to 1. Mixtral always renormalises; Qwen3-MoE only
  with `norm_topk_prob`, and rounds the weights to the activations' dtype where Mixtral keeps
  float32 (transformers' `MixtralTopKRouter` and `Qwen3MoeTopKRouter`).
- **The experts' weights, stacked** (`FusedMoE`, vLLM's layout): `w13_weight` [E, 2·I, H] holds
  every expert's gate (w1) and up (w3) projections fused, as the dense MLP's `gate_up_proj` does;
  `w2_weight` [E, H, I] their down projections. A checkpoint stores them per expert
  (`experts.{e}.w1/w3/w2` in Mixtral's names, `experts.{e}.gate_proj/up_proj/down_proj` in
  Qwen3-MoE's); `weight_loader` places each, and `expert_target_of` names where it goes.
- **Grouped GEMM** (`fused_experts_native`): the T·top_k (token, expert) assignments are sorted by
  expert, so each expert multiplies one contiguous group of rows instead of T masked ones; each
  expert's outputs are weighted and added back to their tokens' rows. That sort is what every
  fast forward shares: the CPU's runs each group on oneDNN (minivllm/cpu/moe.py), the Triton
  kernel runs a block of one group per program (triton_fused_moe.py).

With tensor parallelism each rank holds I / N of every expert's inner width (as the dense MLP
splits its own), computes a partial sum of the output, and `SparseMoeBlock` all-reduces it.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed.parallel_state import SINGLE_DEVICE, TensorParallelGroup
from minivllm.model.custom_op import CustomOp
from minivllm.model.layers.linear import ColumnParallelLinear, Sliceable

# A checkpoint's per-expert weight names -> FusedMoE's shard ids (vLLM's): w1 the gate, w3 the
# up projection, w2 the down projection.
EXPERT_SHARDS = {
    "w1": "w1",  # Mixtral
    "w3": "w3",
    "w2": "w2",
    "gate_proj": "w1",  # Qwen3-MoE (and Qwen2-MoE, DeepSeek, OLMoE)
    "up_proj": "w3",
    "down_proj": "w2",
}
_EXPERT_WEIGHT = re.compile(r"^(?P<op>.*\.experts)\.(?P<expert>\d+)\.(?P<part>\w+)\.weight$")


def expert_target_of(name: str) -> tuple[str, tuple[str, int]] | None:
    """The stacked parameter a checkpoint's per-expert tensor feeds, and the loader's
    (shard_id, expert_id); None for a tensor that is not an expert's. E.g.
    "model.layers.0.block_sparse_moe.experts.3.w1.weight" ->
    ("model.layers.0.block_sparse_moe.experts.w13_weight", ("w1", 3))."""
    match = _EXPERT_WEIGHT.match(name)
    if match is None or match["part"] not in EXPERT_SHARDS:
        return None
    shard_id = EXPERT_SHARDS[match["part"]]
    param = "w2_weight" if shard_id == "w2" else "w13_weight"
    return f"{match['op']}.{param}", (shard_id, int(match["expert"]))


class ExpertWeights(Protocol):
    """One stacked weight of the experts, read one expert at a time: a plain tensor [E, rows,
    columns], or a GGUF file's blocks that `experts[e]` dequantizes (quantization/gguf_moe.py)."""

    def __len__(self) -> int: ...

    def __getitem__(self, expert: int) -> torch.Tensor: ...  # [rows, columns]


# ---------------------------------------------------------------------------------- routing
def select_experts(
    router_logits: torch.Tensor,  # [T, E]  in the activations' dtype
    top_k: int,
    renormalize: bool,
    weights_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:  # topk_weights [T, top_k] weights_dtype, topk_ids int64
    """Each token's top_k experts and their weights: softmax over all experts in float32 first,
    then the top_k, then (`renormalize`) divided by their sum, in that order (transformers'
    Mixtral and Qwen3-MoE routers; the softmax-after-top-k variant gives the same weights only
    when renormalised, and is not what either family runs)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    topk_weights, topk_ids = probs.topk(top_k, dim=-1)  # [T, top_k] each, best first
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights.to(weights_dtype), topk_ids


def sort_by_expert(
    topk_ids: torch.Tensor,  # int64 [T, top_k]
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # order int64 [T * top_k], counts int64 [E]
    """The assignments (a = t · top_k + j: token t's j-th expert) grouped by expert: `order`
    lists them expert 0's first, then expert 1's, ... (stable, so by token within a group), and
    `counts[e]` is the size of expert e's group."""
    flat = topk_ids.flatten()  # [T * top_k]  the expert of each assignment
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [n, 2 * I] -> [n, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---------------------------------------------------------------------------------- the experts
def fused_experts_native(
    hidden: torch.Tensor,  # [T, H]
    w13: ExpertWeights,  # [E, 2 * I, H]  gate rows, then up rows
    w2: ExpertWeights,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, top_k]
    topk_ids: torch.Tensor,  # int64 [T, top_k]
) -> torch.Tensor:  # [T, H]  in hidden's dtype
    """sum_j topk_weights[t, j] · expert_{topk_ids[t, j]}(hidden[t]), one matmul pair per expert
    over its group of rows. Weighted outputs are summed in float32 and rounded once at the end.
    Only the experts that have rows are read (`w13[e]`), which is what lets quantized experts
    be dequantized one at a time."""
    num_tokens, top_k = topk_ids.shape
    order, counts = sort_by_expert(topk_ids, len(w13))  # [T * top_k], [E]
    tokens = order // top_k  # [T * top_k]  the token of each sorted assignment
    x = hidden[tokens]  # [T * top_k, H]  rows grouped by expert
    weights = topk_weights.flatten()[order]  # [T * top_k]
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    start = 0
    for expert, n in enumerate(counts.tolist()):  # one host sync; experts with no token skipped
        if n == 0:
            continue
        rows = slice(start, start + n)
        act = silu_and_mul(F.linear(x[rows], w13[expert]))  # [n, I]
        y = F.linear(act, w2[expert])  # [n, H]
        # In the weights' dtype first, as transformers multiplies (float32 for Mixtral).
        out.index_add_(0, tokens[rows], (y * weights[rows, None]).float())
        start += n
    return out.to(hidden.dtype)


class FusedMoE(CustomOp):
    """E SwiGLU experts held as two stacked tensors; `forward(hidden, router_logits)` routes each
    token to its top_k and returns their weighted sum (this rank's partial sum under tensor
    parallelism: `SparseMoeBlock` reduces it). A GGUF file's experts stay in their blocks: the
    loader replaces the two tensors by the blocks and sets `quant_method`, which runs them."""

    quant_method: Any = None  # quantization/gguf_moe.py's GGUFMoEMethod where experts are blocks

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        weights_dtype: torch.dtype | None = torch.float32,  # None: the router logits' dtype
        tp: TensorParallelGroup = SINGLE_DEVICE,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        if intermediate_size % tp.world_size:
            raise ValueError(
                f"the experts' width {intermediate_size} does not divide over {tp.world_size} ranks"
            )
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.weights_dtype = weights_dtype
        self.tp = tp
        self.intermediate_size = intermediate_size // tp.world_size  # this rank's I
        i = self.intermediate_size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * i, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, i))

    def weight_loader(
        self, param: nn.Parameter, loaded: Sliceable, shard_id: str, expert_id: int
    ) -> None:
        """Expert `expert_id`'s checkpoint tensor (w1 / w3: [I, H], w2: [H, I]), this rank's rows
        (w1, w3) or columns (w2) of it, into its place in the stacked parameter."""
        i = self.intermediate_size
        mine = slice(self.tp.rank * i, (self.tp.rank + 1) * i)
        if shard_id == "w2":
            param.data[expert_id].copy_(loaded[:, mine])
        elif shard_id in ("w1", "w3"):
            offset = 0 if shard_id == "w1" else i
            param.data[expert_id, offset : offset + i].copy_(loaded[mine])
        else:
            raise ValueError(f"shard_id must be w1, w2 or w3, got {shard_id!r}")

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`select_experts` with this layer's family's order and dtype."""
        dtype = self.weights_dtype or router_logits.dtype
        return select_experts(router_logits, self.top_k, self.renormalize, dtype)

    def forward_native(
        self,
        hidden: torch.Tensor,  # [T, H]
        router_logits: torch.Tensor,  # [T, E]
    ) -> torch.Tensor:  # [T, H]
        topk_weights, topk_ids = self.route(router_logits)  # [T, top_k] each
        if self.quant_method is not None:
            return self.quant_method.apply(self, hidden, topk_weights, topk_ids)
        return fused_experts_native(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse layer: router logits (a replicated linear: every rank routes every
    token the same way), the experts, and the all-reduce of their partial sums. vLLM's
    `MixtralMoE` and `Qwen3MoeSparseMoeBlock`; the checkpoints name its parts `gate` and
    `experts`."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        weights_dtype: torch.dtype | None = torch.float32,
        tp: TensorParallelGroup = SINGLE_DEVICE,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.gate = ColumnParallelLinear(hidden_size, [num_experts], False, SINGLE_DEVICE)
        self.experts = FusedMoE(
            num_experts, top_k, hidden_size, intermediate_size, renormalize, weights_dtype, tp
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        router_logits = self.gate(hidden)  # [T, E]
        return self.tp.all_reduce(self.experts(hidden, router_logits))


__all__ = [
    "EXPERT_SHARDS",
    "ExpertWeights",
    "FusedMoE",
    "SparseMoeBlock",
    "expert_target_of",
    "fused_experts_native",
    "select_experts",
    "sort_by_expert",
]
