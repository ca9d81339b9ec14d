"""Test helper: run a minivllm model over whole prompts through a small paged KV cache.

The engine's model runner does this for real; model and loader tests need only the smallest
version of it, with deliberately shuffled block tables so that paging is exercised.
"""

from __future__ import annotations

import torch

from minivllm.attention.abstract import AttentionMetadata
from minivllm.model.models.llama import LlamaForCausalLM


def make_kv_cache(model: LlamaForCausalLM, num_blocks: int, block_size: int) -> torch.Tensor:
    cfg = model.config
    p = next(model.parameters())
    # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    shape = (
        cfg.num_hidden_layers,
        2,
        num_blocks,
        block_size,
        cfg.num_key_value_heads,
        cfg.head_dim,
    )
    return torch.zeros(shape, dtype=p.dtype, device=p.device)


def paged_logits(
    model: LlamaForCausalLM,
    token_ids: list[int],
    chunk_sizes: list[int] | None = None,
    block_size: int = 16,
    seed: int = 0,
) -> torch.Tensor:  # float32 [len(token_ids), vocab]
    """Logits at every position, computing the prompt in chunks (one chunk by default)."""
    n = len(token_ids)
    chunk_sizes = chunk_sizes or [n]
    assert sum(chunk_sizes) == n
    num_blocks = -(-n // block_size)
    gen = torch.Generator().manual_seed(seed)
    table = (torch.randperm(num_blocks + 3, generator=gen)[:num_blocks] + 1).to(torch.int32)
    kv = make_kv_cache(model, num_blocks + 4, block_size)
    device = kv.device
    out = []
    done = 0
    for size in chunk_sizes:
        pos = torch.arange(done, done + size)
        slots = table[pos // block_size].long() * block_size + pos % block_size
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, size], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([done + size], dtype=torch.int32, device=device),
            block_tables=table[None].to(device),
            slot_mapping=slots.to(device),
            max_query_len=size,
            max_seq_len=done + size,
        )
        ids = torch.tensor(token_ids[done : done + size], device=device)
        with torch.inference_mode():
            hidden = model(ids, pos.to(device), kv, meta)
            out.append(model.compute_logits(hidden))
        done += size
    return torch.cat(out)
