"""The Megatron split, rank by rank, in one process: shards tile the weights, partial sums add up.

A rank's shard is built with its `TensorParallelGroup` and no process group at all, which is
enough to check the two claims the parallel layers rest on (paper §4.6):

- **Sharded loading**: each rank reads its own slices of the checkpoint (its query heads, the KV
  heads they read, its share of the MLP and of the vocabulary), and the shards put side by side
  are the full model's weights; replicated parameters are equal everywhere.
- **The split computes the same thing**: with the all-reduce replaced by "keep my partial sum",
  the N ranks' attention outputs and MLP outputs add up to the full layer's, and their logit
  slices side by side are the full logits. The engine tests check the real collectives.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minivllm.attention.abstract import AttentionMetadata
from minivllm.attention.selector import get_attention_backend
from minivllm.distributed.parallel_state import TensorParallelGroup
from minivllm.model.config import LlamaConfig
from minivllm.model.layers.linear import check_tensor_parallel_size
from minivllm.model.loader import load_model
from minivllm.model.resolver import resolve_model
from tests.model.test_model_llama import save_tiny_llama as save_perturbed_llama
from tests.utils.engine_utils import save_tiny_llama

CPU = torch.device("cpu")
BACKEND = get_attention_backend("reference")
# name: (ranks, overrides of a 4-head tiny Llama); vocab 1001 divides by neither 2 nor 4
CASES = {
    "2-ranks-untied-biases": (
        2,
        dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True, vocab_size=1001),
    ),
    "4-ranks-replicated-kv-tied": (
        4,
        dict(num_key_value_heads=2, tie_word_embeddings=True, vocab_size=1001),
    ),
}


class PartialSums(TensorParallelGroup):
    """A rank that keeps its partial sums and its logit slice instead of communicating."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.fixture(scope="module", params=list(CASES))
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(the full model, each rank's shard); norms and biases are random, not 1 and 0."""
    n, overrides = CASES[request.param]
    _, path = save_perturbed_llama(tmp_path_factory.mktemp(request.param), overrides)
    source = resolve_model(path)
    full = load_model(source, BACKEND, torch.float32, CPU)
    shards = [
        load_model(source, BACKEND, torch.float32, CPU, tp=PartialSums(r, n)) for r in range(n)
    ]
    return full, shards


def shard_params(config: LlamaConfig, n: int) -> int:
    """Parameters one rank of n holds: 1/n of every matrix (its KV heads: at least one, since
    they are replicated when fewer than ranks), ceil(vocab / n) vocabulary rows, whole norms."""
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    heads = config.num_attention_heads // n
    kv_heads = max(1, config.num_key_value_heads // n)
    rows = -(-config.vocab_size // n)
    layer = (heads + 2 * kv_heads) * d * h + h * heads * d + 3 * h * (i // n) + 2 * h
    head = 0 if config.tie_word_embeddings else rows * h
    return rows * h + config.num_hidden_layers * layer + h + head


def _split_qkv(model) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer: (q, k, v) rows of the fused projection's weight."""
    out = []
    for layer in model.model.layers:
        attn = layer.self_attn
        out.append(tuple(attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])))
    return out


def test_shards_tile_the_full_weights_and_kv_heads_are_replicated_when_fewer_than_ranks(
    tmp_path: Path,
) -> None:
    n, overrides = CASES["4-ranks-replicated-kv-tied"]
    source = resolve_model(save_tiny_llama(tmp_path, **overrides))
    full = load_model(source, BACKEND, torch.float32, CPU)
    shards = [
        load_model(source, BACKEND, torch.float32, CPU, tp=PartialSums(r, n)) for r in range(n)
    ]
    d = full.config.head_dim
    for layer, (q, k, v) in enumerate(_split_qkv(full)):
        parts = [_split_qkv(s)[layer] for s in shards]
        assert torch.equal(torch.cat([p[0] for p in parts]), q)  # one query head per rank
        for rank, (_, k_r, v_r) in enumerate(parts):  # 2 KV heads over 4 ranks: head rank // 2
            head = slice(rank // 2 * d, (rank // 2 + 1) * d)
            assert torch.equal(k_r, k[head]) and torch.equal(v_r, v[head])
        o = torch.cat([s.model.layers[layer].self_attn.o_proj.weight for s in shards], dim=1)
        assert torch.equal(o, full.model.layers[layer].self_attn.o_proj.weight)
    vocab = full.config.vocab_size  # 1001 rows over 4 ranks: 251 each, 3 rows of zero padding
    embed = torch.cat([s.model.embed_tokens.weight for s in shards])
    assert torch.equal(embed[:vocab], full.model.embed_tokens.weight)
    assert not embed[vocab:].any()
    assert all(s.lm_head.weight is s.model.embed_tokens.weight for s in shards)  # still tied
    assert sum(p.numel() for p in full.parameters()) == shard_params(full.config, 1)
    for shard in shards:
        assert sum(p.numel() for p in shard.parameters()) == shard_params(full.config, n)


def test_ranks_partial_sums_add_up_to_the_full_attention_and_mlp_and_logits(models) -> None:
    full, shards = models
    torch.manual_seed(1)
    t = 21
    x = torch.randn(t, full.config.hidden_size)  # [T, hidden]
    positions = torch.arange(t)

    def attention(model) -> torch.Tensor:  # one 21-token prompt through layer 0's attention
        attn = model.model.layers[0].self_attn
        block_size, blocks = 16, 2
        cache = torch.zeros(2, blocks + 1, block_size, attn.num_kv_heads, attn.head_dim)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, t], dtype=torch.int32),
            seq_lens=torch.tensor([t], dtype=torch.int32),
            block_tables=torch.tensor([[1, 2]], dtype=torch.int32),
            slot_mapping=torch.arange(t) + block_size,
            max_query_len=t,
            max_seq_len=t,
        )
        meta.plan = BACKEND.plan(meta, block_size)
        return attn(x, positions, model.model.rotary_emb, cache[0], cache[1], meta)

    def row_parallel_sum(outputs: list[torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
        """The all-reduce: the ranks' partial sums added. Each rank added the bias (it adds it
        after the all-reduce, which is not here), so n - 1 of them come off."""
        total = sum(outputs[1:], outputs[0])
        return total if bias is None else total - (len(outputs) - 1) * bias

    with torch.inference_mode():
        attn = [attention(s) for s in shards]
        o_bias = full.model.layers[0].self_attn.o_proj.bias
        torch.testing.assert_close(row_parallel_sum(attn, o_bias), attention(full))
        mlp = [s.model.layers[1].mlp(x) for s in shards]
        down_bias = full.model.layers[1].mlp.down_proj.bias
        torch.testing.assert_close(row_parallel_sum(mlp, down_bias), full.model.layers[1].mlp(x))
        vocab = full.config.vocab_size
        logits = torch.cat([s.compute_logits(x) for s in shards], dim=-1)[:, :vocab]
        torch.testing.assert_close(logits, full.compute_logits(x))
        ids = torch.tensor([0, 5, 250, 251, 500, 501, 750, 1000])  # rows at the ranks' edges
        embedded = [s.model.embed_tokens(ids) for s in shards]
        torch.testing.assert_close(row_parallel_sum(embedded, None), full.model.embed_tokens(ids))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "sizes"),
    [(9, 3, [1, 3, 9]), (32, 8, [1, 2, 4, 8, 16, 32]), (4, 1, [1, 2, 4])],
)
def test_the_refusal_names_exactly_the_sizes_that_split_the_heads(
    heads: int, kv_heads: int, sizes: list[int]
) -> None:
    config = LlamaConfig(
        vocab_size=10,
        hidden_size=heads * 8,
        intermediate_size=heads * 16,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=8,
    )
    for size in sizes:
        check_tensor_parallel_size(config, size)
    bad = next(s for s in range(2, heads + 2) if s not in sizes)
    with pytest.raises(ValueError, match=rf"must be one of \[{', '.join(map(str, sizes))}\]$"):
        check_tensor_parallel_size(config, bad)
