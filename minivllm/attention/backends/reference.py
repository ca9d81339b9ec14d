"""Gather-based PagedAttention in plain PyTorch: the specification every kernel is tested against.

The idea of the paper's §4.1 kernel, written for clarity rather than speed: for each request, read
its K/V blocks through the block table into one contiguous tensor, then call
`scaled_dot_product_attention` with a *bottom-right* aligned causal mask. The new tokens are the
last `query_len` of the `seq_len` tokens in cache, so query row i may see keys 0..seq_len-query_len+i.
(`is_causal=True` aligns the triangle top-left, which is wrong as soon as a cached prefix or an
earlier prefill chunk precedes the new tokens.) A layer's sliding window W narrows the mask to the
last W keys of each query (HF transformers' `sliding_window_overlay`), and a prompt chunk then
gathers only from the block of its first visible key on. A layer's soft-cap (Gemma 2) bounds each
score to `cap * tanh(score / cap)` before the mask and softmax; SDPA has no such step, so capped
layers run transformers' eager attention instead (`softcapped_attention`).

An encoder's attention (`attend_encoder`, vLLM's `AttentionType.ENCODER_ONLY`) touches no cache:
each request's whole prompt is in the step, so its rows of the step's own query, key and value are
all there is to attend over, bidirectionally. One `scaled_dot_product_attention` per request, on
views of the flat batch (vLLM's CPU backend does the same for its encoder prompts); this is also
what the CPU backend runs, since torch's fused CPU SDPA is the fast path there.

Decode requests (one new token each) are batched into a few padded calls, grouped by length, which
is what makes this backend fast enough to be the CPU default; prompt chunks are attended one
request at a time. Which rows go where depends only on the step's metadata, so that "plan" is
built once per step by the model runner (`backend.plan`, stored in `meta.plan`) and read by every
layer of the step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from minivllm.attention.abstract import AttentionMetadata


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [B, n] physical block ids, logical order
) -> torch.Tensor:  # [B, n * block_size, num_kv_heads, head_dim]
    """Read whole blocks through the block tables and lay them end to end, in logical order."""
    b, n = block_tables.shape
    _, block_size, h, d = cache.shape
    # index_select copies whole rows of the cache, a faster kernel on CPU than cache[tables]'s.
    blocks = cache.index_select(0, block_tables.reshape(-1).long())  # [B * n, block_size, H, D]
    return blocks.view(b, n * block_size, h, d)


def bottom_right_causal_mask(
    query_len: int,
    seq_len: int,
    device: torch.device,
    sliding_window: int | None = None,
    first_key: int = 0,
) -> torch.Tensor:
    """Bool [query_len, seq_len - first_key]: query i (at position seq_len-query_len+i) sees keys
    first_key.. up to its position; with a sliding window W only the last W of them (HF's
    `sliding_window_overlay`: key j is visible from position p iff p - W < j <= p)."""
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(first_key, seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= q_pos - k_pos < sliding_window
    return mask


def first_visible_key(query_start: int, sliding_window: int | None) -> int:
    """The first key position any query at `query_start` or later can see: 0 without a window.
    The KV cache manager frees the blocks wholly before it (core/sliding_window_manager.py), so a
    backend must not read them: their block-table entries are a placeholder."""
    return 0 if sliding_window is None else max(0, query_start - sliding_window + 1)


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


@dataclass
class DecodeGroup:
    """Decode rows attended together, padded to the group's longest sequence."""

    token_idx: torch.Tensor  # int64 [G]  their rows in the flat batch
    block_tables: torch.Tensor  # int32 [G, n_blocks]
    valid: torch.Tensor  # bool [G, 1, 1, n_blocks * block_size]  real keys (not padding)


@dataclass
class PromptChunk:
    """One request's several new tokens, attended causally over its whole context."""

    start: int  # first row in the flat batch
    query_len: int
    block_table: torch.Tensor  # int32 [1, n_blocks - first_key // block_size]  from first_key's
    seq_len: int
    mask: torch.Tensor  # bool [query_len, seq_len - first_key]  bottom-right causal (+ window)
    first_key: int = 0  # position of the gathered context's first key: a multiple of block_size


@dataclass
class AttentionPlan:
    decode_groups: list[DecodeGroup]
    prompt_chunks: list[PromptChunk]
    # The same step's plan under each sliding window met so far, built at the first layer with
    # that window (Gemma alternates windowed and global layers; each kind is planned once).
    windowed: dict[int, AttentionPlan] = field(default_factory=dict)

    def for_window(
        self, meta: AttentionMetadata, block_size: int, sliding_window: int | None
    ) -> AttentionPlan:
        if sliding_window is None:
            return self
        if sliding_window not in self.windowed:
            self.windowed[sliding_window] = make_plan(meta, block_size, sliding_window)
        return self.windowed[sliding_window]


def query_lens_of(meta: AttentionMetadata) -> tuple[list[int], list[int]]:
    """(new tokens, tokens in cache) of each request, as host lists."""
    starts = meta.query_start_loc.tolist()
    return [starts[i + 1] - starts[i] for i in range(len(starts) - 1)], meta.seq_lens.tolist()


def plan_prompt_chunks(
    meta: AttentionMetadata, block_size: int, sliding_window: int | None = None
) -> list[PromptChunk]:
    """One `PromptChunk` per request with more than one new token. Under a sliding window the
    gather starts at the block of the first key the chunk's first row sees."""
    device = meta.seq_lens.device
    starts = meta.query_start_loc.tolist()
    query_lens, seq_lens = query_lens_of(meta)
    chunks = []
    for i, q_len in enumerate(query_lens):
        if q_len > 1:
            n_blocks = -(-seq_lens[i] // block_size)
            first_block = first_visible_key(seq_lens[i] - q_len, sliding_window) // block_size
            first_key = first_block * block_size
            chunks.append(
                PromptChunk(
                    start=starts[i],
                    query_len=q_len,
                    block_table=meta.block_tables[i : i + 1, first_block:n_blocks],
                    seq_len=seq_lens[i],
                    mask=bottom_right_causal_mask(
                        q_len, seq_lens[i], device, sliding_window, first_key
                    ),
                    first_key=first_key,
                )
            )
    return chunks


def make_plan(
    meta: AttentionMetadata, block_size: int, sliding_window: int | None = None
) -> AttentionPlan:
    device = meta.seq_lens.device
    starts = meta.query_start_loc.tolist()
    query_lens, seq_lens = query_lens_of(meta)
    groups = []
    for rows in group_by_length([i for i, q in enumerate(query_lens) if q == 1], seq_lens):
        n_blocks = -(-max(seq_lens[i] for i in rows) // block_size)
        idx = torch.tensor(rows, device=device)
        lens = meta.seq_lens[idx].long()  # [G]
        # A decode token is the newest token, so it sees every real key: the mask is padding only,
        # and under a sliding window W also the keys before its last W.
        k_pos = torch.arange(n_blocks * block_size, device=device)[None, :]
        valid = k_pos < lens[:, None]  # [G, n_blocks * block_size]
        if sliding_window is not None:
            valid &= k_pos >= lens[:, None] - sliding_window
        groups.append(
            DecodeGroup(
                token_idx=torch.tensor([starts[i] for i in rows], device=device),
                block_tables=meta.block_tables[idx, :n_blocks],
                valid=valid[:, None, None, :],
            )
        )
    return AttentionPlan(groups, plan_prompt_chunks(meta, block_size, sliding_window))


def softcapped_attention(
    q: torch.Tensor,  # [B, num_heads, L, head_dim]
    k: torch.Tensor,  # [B, num_kv_heads, S, head_dim]
    v: torch.Tensor,  # [B, num_kv_heads, S, head_dim]
    mask: torch.Tensor,  # bool, broadcast to [B, num_heads, L, S]: which keys each query sees
    scale: float,
    softcap: float,  # 0: SDPA itself
) -> torch.Tensor:  # [B, num_heads, L, head_dim]
    """`scaled_dot_product_attention` with the scores capped first, in transformers' order
    (Gemma 2's `eager_attention_forward`): scale, cap, mask, softmax in float32, weigh the values."""
    if softcap <= 0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]  # query heads per KV head
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, num_heads, L, S]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def attend_prompt_chunk(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    chunk: PromptChunk,
    scale: float,
    out: torch.Tensor,  # [T, num_heads, head_dim]  the chunk's rows are written
    softcap: float = 0.0,
) -> None:
    """Causal attention of one request's new tokens over its cached context (from first_key)."""
    context_len = chunk.seq_len - chunk.first_key  # S
    k = gather_kv(k_cache, chunk.block_table)[:, :context_len]  # [1, S, Hkv, D]
    v = gather_kv(v_cache, chunk.block_table)[:, :context_len]
    rows = slice(chunk.start, chunk.start + chunk.query_len)
    q = query[rows].unsqueeze(0).transpose(1, 2)  # [1, num_heads, query_len, head_dim]
    o = softcapped_attention(
        q,
        k.transpose(1, 2).to(q.dtype),  # [1, num_kv_heads, S, head_dim]
        v.transpose(1, 2).to(q.dtype),
        chunk.mask,
        scale,
        softcap,
    )  # [1, num_heads, query_len, head_dim]
    out[rows] = o[0].transpose(0, 1)


class ReferenceBackend:
    """Readable PagedAttention: scatter K/V into slots, gather through block tables, SDPA."""

    name = "reference"

    def plan(self, meta: AttentionMetadata, block_size: int) -> AttentionPlan:
        return make_plan(meta, block_size)

    def write_kv(
        self,
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [T]
    ) -> None:
        if bool((slot_mapping < 0).any()):  # -1: K/V already in cache (or padding), skip it
            keep = slot_mapping >= 0
            slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        # A slot is block * block_size + offset, so the cache viewed as [slots, H, D] is indexed directly.
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(
            0, slot_mapping, value.to(v_cache.dtype)
        )

    def attend(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,  # the layer's: key j seen from p iff p - W < j <= p
        softcap: float = 0.0,  # > 0: each score becomes softcap * tanh(score / softcap)
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        block_size = k_cache.shape[1]
        plan = meta.plan if isinstance(meta.plan, AttentionPlan) else make_plan(meta, block_size)
        plan = plan.for_window(meta, block_size, sliding_window)
        out = torch.empty_like(query)
        for group in plan.decode_groups:
            # The padding of a short row reads never-written slots (the cache is not zero-filled),
            # and keys before a sliding window may sit in freed blocks (a placeholder's, another
            # request's): the mask alone would not do, since 0 * NaN is NaN, so they become 0.
            pad = ~group.valid.view(group.valid.shape[0], -1, 1, 1)  # [G, L, 1, 1]
            k = gather_kv(k_cache, group.block_tables).masked_fill(pad, 0)  # [G, L, Hkv, D]
            v = gather_kv(v_cache, group.block_tables).masked_fill(pad, 0)
            q = query[group.token_idx].unsqueeze(2)  # [G, num_heads, 1, head_dim]
            o = softcapped_attention(
                q,
                k.transpose(1, 2).to(q.dtype),  # [G, num_kv_heads, L, head_dim]
                v.transpose(1, 2).to(q.dtype),
                group.valid,
                scale,
                softcap,
            )  # [G, num_heads, 1, head_dim]
            out[group.token_idx] = o[:, :, 0]
        for chunk in plan.prompt_chunks:
            attend_prompt_chunk(query, k_cache, v_cache, chunk, scale, out, softcap)
        return out

    def attend_encoder(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]  the step's own, never cached
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        meta: AttentionMetadata,  # query_start_loc: each request's rows, its whole prompt
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        return encoder_attention(query, key, value, meta.query_start_loc.tolist(), scale)


def encoder_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    starts: list[int],  # [B + 1]  request i owns rows starts[i]:starts[i+1]
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Bidirectional attention within each request's rows: SDPA without a mask, per request.
    The [1, H, L, D] views read the flat batch at its strides (no gathered copy)."""
    out = torch.empty_like(query)
    for start, end in itertools.pairwise(starts):
        q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)  # [1, H, L, D]
        out[start:end] = o[0].transpose(0, 1)
    return out
