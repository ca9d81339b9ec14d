"""Gather-based PagedAttention in plain PyTorch: the specification every kernel is tested against.

The idea of the paper's §4.1 kernel, written for clarity rather than speed: for each request, read
its K/V blocks through the block table into one contiguous tensor, then call
`scaled_dot_product_attention` with a *bottom-right* aligned causal mask. The new tokens are the
last `query_len` of the `seq_len` tokens in cache, so query row i may see keys 0..seq_len-query_len+i.
(`is_causal=True` aligns the triangle top-left, which is wrong as soon as a cached prefix or an
earlier prefill chunk precedes the new tokens.)

Decode-only requests (one new token each) are batched into one padded call, which is what makes this
backend fast enough to be the CPU default; prompt chunks are attended one request at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm.attention import AttentionMetadata


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [B, n] physical block ids, logical order
) -> torch.Tensor:  # [B, n * block_size, num_kv_heads, head_dim]
    """Read whole blocks through the block tables and lay them end to end, in logical order."""
    b, n = block_tables.shape
    _, block_size, h, d = cache.shape
    # index_select copies whole rows of the cache and is ~2x faster on CPU than cache[tables].
    blocks = cache.index_select(0, block_tables.reshape(-1).long())  # [B * n, block_size, H, D]
    return blocks.view(b, n * block_size, h, d)


def bottom_right_causal_mask(query_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """Bool [query_len, seq_len]: query i (at position seq_len-query_len+i) sees keys <= its position."""
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    return k_pos <= q_pos


def group_by_length(
    rows: list[int], seq_lens: list[int], max_waste: float = 0.25
) -> list[list[int]]:
    """Split rows, shortest first, into groups padded to their longest with at most `max_waste`
    of the group's slots being padding. One padded call per group keeps the number of calls small
    while a batch of very different lengths does not pay for its longest sequence everywhere."""
    groups: list[list[int]] = []
    total = 0
    for i in sorted(rows, key=lambda r: seq_lens[r]):
        padded = seq_lens[i] * (len(groups[-1]) + 1) if groups else 0
        if groups and padded - (total + seq_lens[i]) <= max_waste * padded:
            groups[-1].append(i)
            total += seq_lens[i]
        else:
            groups.append([i])
            total = seq_lens[i]
    return groups


class ReferenceBackend:
    """Readable PagedAttention: scatter K/V into slots, gather through block tables, SDPA."""

    name = "reference"

    def write_kv(
        self,
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [T]
    ) -> None:
        keep = slot_mapping >= 0  # -1 marks tokens whose K/V is already in cache (or padding)
        slots = slot_mapping[keep]
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        # A slot is block * block_size + offset, so the cache viewed as [slots, H, D] is indexed directly.
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = key[keep].to(k_cache.dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = value[keep].to(v_cache.dtype)

    def attend(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        out = torch.empty_like(query)
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        query_lens = [starts[i + 1] - starts[i] for i in range(len(seq_lens))]
        decode_rows = [i for i, q in enumerate(query_lens) if q == 1]
        for group in group_by_length(decode_rows, seq_lens):
            self._attend_decodes(query, k_cache, v_cache, meta, scale, group, starts, out)
        for i, q_len in enumerate(query_lens):
            if q_len > 1:
                self._attend_one(query, k_cache, v_cache, meta, scale, i, starts[i], q_len, out)
        return out

    def _attend_one(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        i: int,
        start: int,
        q_len: int,
        out: torch.Tensor,  # [T, num_heads, head_dim], written in place
    ) -> None:
        """One request with several new tokens (a prompt or a prompt chunk)."""
        seq_len = int(meta.seq_lens[i])
        block_size = k_cache.shape[1]
        n_blocks = -(-seq_len // block_size)
        table = meta.block_tables[i : i + 1, :n_blocks]  # [1, n_blocks]
        k = gather_kv(k_cache, table)[:, :seq_len]  # [1, seq_len, num_kv_heads, head_dim]
        v = gather_kv(v_cache, table)[:, :seq_len]
        q = query[start : start + q_len].unsqueeze(0)  # [1, q_len, num_heads, head_dim]
        mask = bottom_right_causal_mask(q_len, seq_len, query.device)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),  # [1, num_heads, q_len, head_dim]
            k.transpose(1, 2).to(q.dtype),  # [1, num_kv_heads, seq_len, head_dim]
            v.transpose(1, 2).to(q.dtype),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )  # [1, num_heads, q_len, head_dim]
        out[start : start + q_len] = o[0].transpose(0, 1)

    def _attend_decodes(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        rows: list[int],
        starts: list[int],
        out: torch.Tensor,  # [T, num_heads, head_dim], written in place
    ) -> None:
        """Requests with one new token each, padded to the group's longest, attended in one call."""
        idx = torch.tensor(rows, device=query.device)
        seq_lens = meta.seq_lens[idx].long()  # [Bd]
        block_size = k_cache.shape[1]
        n_blocks = -(-int(seq_lens.max()) // block_size)
        tables = meta.block_tables[idx, :n_blocks]  # [Bd, n_blocks]
        k = gather_kv(k_cache, tables)  # [Bd, n_blocks * block_size, num_kv_heads, head_dim]
        v = gather_kv(v_cache, tables)
        # A decode token is the newest token, so it sees every valid key: the mask is only padding.
        valid = torch.arange(k.shape[1], device=query.device)[None, :] < seq_lens[:, None]
        token_idx = torch.tensor([starts[i] for i in rows], device=query.device)
        q = query[token_idx].unsqueeze(2)  # [Bd, num_heads, 1, head_dim]
        o = F.scaled_dot_product_attention(
            q,
            k.transpose(1, 2).to(q.dtype),  # [Bd, num_kv_heads, L, head_dim]
            v.transpose(1, 2).to(q.dtype),
            attn_mask=valid[:, None, None, :],  # [Bd, 1, 1, L]
            scale=scale,
            enable_gqa=True,
        )  # [Bd, num_heads, 1, head_dim]
        out[token_idx] = o[:, :, 0]
