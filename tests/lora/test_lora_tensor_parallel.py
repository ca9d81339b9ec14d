"""LoRA over two tensor-parallel ranks is token-exact with transformers + peft, adapter by adapter.

Each rank reads the whole adapter from the same folder and keeps its shard in a slot, cut as the
base weights are (vLLM's column- and row-parallel LoRA layers, minivllm/lora/layers.py): a
column-parallel B by the rank's output rows, per slice of the fused q/k/v and gate/up; a
row-parallel A by the rank's input columns, its partial delta summed in the base layer's one
all-reduce. The base is a Qwen2 (q/k/v biases) with one KV head, so both ranks hold the same
replicated KV head and take the same rows of k_proj's and v_proj's B. One engine, two ranks
spawned over gloo on this CPU, a mixed batch of the base model and two adapters (attention-only,
and all linears with rsLoRA); a bad adapter is refused by name on every rank and the group serves
on, and an adapter removed is forgotten by every rank. In one process, with no collective, the
shards of a slot are checked on four ranks against the one-device delta: rank by rank for q/k/v
(separate modules, and fused as Phi-3 stores them), summed over ranks for o_proj.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from minivllm.distributed.parallel_state import TensorParallelGroup
from minivllm.llm import LLM
from minivllm.lora.errors import LoRAFileError
from minivllm.lora.layers import (
    ColumnParallelLinearWithLoRA,
    LoRAMapping,
    LoRASlice,
    MergedQKVParallelLinearWithLoRA,
    RowParallelLinearWithLoRA,
)
from minivllm.lora.peft_loader import LoRALayerWeights
from minivllm.lora.request import LoRARequest
from minivllm.model.layers.linear import QKVParallelLinear, RowParallelLinear
from tests.lora.lora_utils import ADAPTERS, peft_greedy, save_adapter, save_base
from tests.lora.test_lora_engine import greedy, prompts_for
from tests.utils.tp_utils import lora_ids, no_leftover_processes

pytestmark = pytest.mark.timeout(600)  # a hang guard for a broken collective; no timing


@pytest.fixture(autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    yield from no_leftover_processes()


def test_two_ranks_give_each_request_peft_s_greedy_tokens_for_its_adapter(tmp_path: Path) -> None:
    base = save_base(tmp_path / "base", "qwen2", num_key_value_heads=1)
    attn = LoRARequest(
        "attn", 1, str(save_adapter(base, tmp_path / "attn", 10, **ADAPTERS["attn"]))
    )
    full = LoRARequest("all", 2, str(save_adapter(base, tmp_path / "all", 12, **ADAPTERS["all"])))
    order: list[LoRARequest | None] = [None, attn, full, attn, full, None]
    prompts = prompts_for(len(order))
    max_tokens = [4] * len(order)
    expected: list[list[int]] = [[] for _ in order]
    for lora in (None, attn, full):  # peft's tokens of each request, under its own adapter
        mine = [i for i, r in enumerate(order) if r == lora]
        tokens = peft_greedy(base, lora, [prompts[i] for i in mine], [max_tokens[i] for i in mine])
        for i, t in zip(mine, tokens):
            expected[i] = t
    llm = LLM(
        str(base),
        tensor_parallel_size=2,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        skip_tokenizer_init=True,
        max_model_len=64,
        cpu_kv_cache_space=0.01,
    )
    try:
        missing = LoRARequest("missing", 3, str(tmp_path / "no-such-adapter"))
        with pytest.raises(LoRAFileError, match="no-such-adapter is not a folder"):
            llm.llm_engine.add_lora(missing)
        got = greedy(llm, prompts, max_tokens, order)
        executor = llm.llm_engine.executor
        assert executor.collective_rpc(lora_ids) == [[1, 2], [1, 2]]  # each rank read both
        assert llm.llm_engine.remove_lora(attn.lora_int_id)
        assert executor.collective_rpc(lora_ids) == [[2], [2]]  # and each rank forgot one
    finally:
        llm.shutdown()
    assert got == expected


# ---------------------------------------------------------------------------------- one process
HIDDEN, HEAD_DIM, HEADS, KV_HEADS, RANKS, R = 32, 4, 8, 2, 4, 4  # 2 KV heads: 2 ranks share each
SCALE = 0.5


class PartialSums(TensorParallelGroup):
    """A rank that keeps its partial sum instead of all-reducing it."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def lora(out: int, gen: torch.Generator) -> LoRALayerWeights:
    return LoRALayerWeights(
        torch.randn(R, HIDDEN, generator=gen), torch.randn(out, R, generator=gen)
    )


def delta(x: torch.Tensor, w: LoRALayerWeights) -> torch.Tensor:  # [T, in] -> [T, out]
    return SCALE * (x @ w.lora_a.T) @ w.lora_b.T


def slot_zero(
    wrapper: ColumnParallelLinearWithLoRA | RowParallelLinearWithLoRA,
    loras: dict[str, LoRALayerWeights],
) -> None:
    wrapper.set_lora(0, loras, SCALE)
    wrapper.mapping.set(torch.zeros(5, dtype=torch.int64))  # every row under slot 0


@pytest.mark.parametrize("fused", [False, True], ids=["q-k-v-modules", "fused-qkv_proj"])
def test_each_rank_s_q_k_v_shard_adds_the_delta_of_the_rows_its_base_weight_holds(
    fused: bool,
) -> None:
    gen = torch.Generator().manual_seed(0)
    sizes = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]
    weights = [torch.randn(n, HIDDEN, generator=gen) for n in sizes]
    full_weight = torch.cat(weights)  # [q + k + v, in]: random, so each row is found once
    x = torch.randn(5, HIDDEN, generator=gen)
    if fused:  # Phi-3's checkpoint: one module, its B the q, k, v rows stacked
        loras = {"qkv_proj": lora(sum(sizes), gen)}
        full_delta = delta(x, loras["qkv_proj"])
    else:
        loras = {name: lora(n, gen) for name, n in zip(("q_proj", "k_proj", "v_proj"), sizes)}
        full_delta = torch.cat([delta(x, w) for w in loras.values()], dim=1)
    for rank in range(RANKS):
        layer = QKVParallelLinear(
            HIDDEN, HEAD_DIM, HEADS, KV_HEADS, False, PartialSums(rank, RANKS)
        )
        for w, part in zip(weights, "qkv"):
            layer.weight_loader(layer.weight, w, part)
        # Which rows of the one-device output this rank computes: where its weight's rows are.
        rows = [int((full_weight == row).all(dim=1).nonzero()) for row in layer.weight.data]
        base = layer(x)
        local = layer.local_sizes
        if fused:
            slices = [LoRASlice("qkv_proj", sum(sizes), sum(local), (0, 1, 2))]
            cls = ColumnParallelLinearWithLoRA
        else:
            names = ("q_proj", "k_proj", "v_proj")
            slices = [LoRASlice(n, sizes[p], local[p], (p,)) for p, n in enumerate(names)]
            cls = MergedQKVParallelLinearWithLoRA
        args = (LoRAMapping(), 1, R, torch.float32, torch.device("cpu"))
        wrapper = cls(layer, HIDDEN, HIDDEN, slices, *args)
        slot_zero(wrapper, loras)
        torch.testing.assert_close(wrapper(x), base + full_delta[:, rows])


def test_o_proj_s_shards_sum_over_ranks_to_the_one_device_delta() -> None:
    gen = torch.Generator().manual_seed(1)
    width = HEADS * HEAD_DIM  # o_proj reads the attention output, split by heads
    weight = torch.randn(HIDDEN, width, generator=gen)
    w = LoRALayerWeights(
        torch.randn(R, width, generator=gen), torch.randn(HIDDEN, R, generator=gen)
    )
    x = torch.randn(5, width, generator=gen)
    total = torch.zeros(5, HIDDEN)
    for rank in range(RANKS):
        layer = RowParallelLinear(width, HIDDEN, False, PartialSums(rank, RANKS))
        layer.weight_loader(layer.weight, weight)
        args = (LoRAMapping(), 1, R, torch.float32, torch.device("cpu"))
        slices = [LoRASlice("o_proj", HIDDEN, HIDDEN)]
        wrapper = RowParallelLinearWithLoRA(layer, width, layer.input_size, slices, *args)
        slot_zero(wrapper, {"o_proj": w})
        x_rank = x[:, rank * layer.input_size : (rank + 1) * layer.input_size]  # its heads
        total += wrapper(x_rank)
    torch.testing.assert_close(total, x @ weight.T + SCALE * (x @ w.lora_a.T) @ w.lora_b.T)
