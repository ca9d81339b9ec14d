"""The reference backend against the specification of the specification: dense float64 attention.

`naive_attention` reads the paged cache one key at a time through the block table and computes
softmax(q·k·scale)·v for each new token of each request in float64, with nothing batched, padded
or masked. If the reference backend agrees with it, the reference can be trusted as the oracle
for the Triton kernels (tests/attention/test_attention_kernels.py).

`make_paged_batch` builds the inputs every attention test uses (`batch_shape` names the mixes of
requests the fast backends are checked on): a paged cache full of random
values (stale tails of blocks included, to catch any read past seq_len), shuffled block tables
and the metadata of a step; the kernel tests import it.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from minivllm.attention.abstract import AttentionMetadata
from minivllm.attention.backends.reference import ReferenceBackend

# Output tolerances of a fast backend against the reference, per dtype. Both sides accumulate in
# float32; what separates them is rounding: float32 only summation order (~1e-6, so 1e-5 leaves
# margin); float16 has a 2^-11 ≈ 5e-4 ulp near 1 and SDPA rounds its intermediates in float16,
# ~2 ulps apart (2e-3); bfloat16 has a 2^-8 ≈ 4e-3 ulp near 1, and on a GPU the Triton kernel
# also rounds the softmax weights to bfloat16 (2e-2).
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def batch_shape(mode: str, bs: int) -> tuple[list[int], list[int]]:
    """(seq_lens, query_lens) of one call: several requests of different lengths.

    The Triton and CPU backend tests (tests/attention/test_attention_kernels.py, test_kernels_cpu_attention.py)
    check every mode against the reference."""
    if mode == "decode":  # every length at a block edge, plus a long one
        return [1, bs - 1, bs, bs + 1, 300], [1] * 5
    if mode == "decode_split":  # a 1-token context leaves all splits but the first empty
        return [1, bs + 1, 600], [1] * 3
    if mode == "prefill":  # whole prompts, nothing cached before
        lens = [1, bs - 1, bs, bs + 1, 200]
        return lens, lens
    if mode == "extend":  # new chunks over cached context (prefix hits, chunked prefill),
        # starting mid-block and crossing block boundaries
        return [bs + 7, 3 * bs + 1, 290], [bs, 2 * bs - 3, 37]
    if mode == "mixed":  # decodes among prompt chunks: all through the prefill kernel
        return [bs + 1, 300, 2 * bs + 5, bs - 1], [1, 1, bs + 3, bs - 1]
    raise ValueError(mode)


@dataclass
class PagedBatch:
    """One step's attention inputs. T new tokens over B requests."""

    query: torch.Tensor  # [T, num_heads, head_dim]
    key: torch.Tensor  # [T, num_kv_heads, head_dim]  new tokens' K, not yet in cache
    value: torch.Tensor  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]  context already in
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata
    scale: float


def make_paged_batch(
    seq_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    shuffle: bool = True,
    spare_blocks: int = 3,
    cache_dtype: torch.dtype | None = None,  # the KV cache's (kv_cache_dtype); None: `dtype`
) -> PagedBatch:
    """Request i has seq_lens[i] tokens in cache after the step, the last query_lens[i] of them new.

    Physical blocks are handed out in a random order (non-contiguous, non-monotone block tables),
    with `spare_blocks` that no request owns. Every slot starts with random values, so the cached
    context is whatever is there and a kernel that reads past a request's length reads garbage.
    """
    assert len(seq_lens) == len(query_lens) and all(
        1 <= q <= s for q, s in zip(query_lens, seq_lens)
    )
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen) if shuffle else torch.arange(num_blocks)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    # [B, max_blocks_per_seq], padded with 0 like the model runner does
    taken = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = order[taken : taken + n]
        taken += n
    slots = []  # flat slot of every new token, in token order
    for i, (s, q) in enumerate(zip(seq_lens, query_lens)):
        for pos in range(s - q, s):
            slots.append(int(block_tables[i, pos // block_size]) * block_size + pos % block_size)
    num_tokens = sum(query_lens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    query_start_loc = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    meta = AttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return PagedBatch(
        query=randn(num_tokens, num_heads, head_dim),
        key=randn(num_tokens, num_kv_heads, head_dim),
        value=randn(num_tokens, num_kv_heads, head_dim),
        k_cache=randn(num_blocks, block_size, num_kv_heads, head_dim).to(cache_dtype or dtype),
        v_cache=randn(num_blocks, block_size, num_kv_heads, head_dim).to(cache_dtype or dtype),
        meta=meta,
        scale=head_dim**-0.5,
    )


def naive_attention(
    batch: PagedBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> torch.Tensor:
    """Float64, one new token at a time, keys fetched one position at a time: [T, num_heads, head_dim]."""
    meta = batch.meta
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_heads = batch.query.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        table = meta.block_tables[i].tolist()
        query_len = starts[i + 1] - starts[i]
        for j in range(query_len):
            pos = seq_len - query_len + j  # bottom-right: the new tokens end the sequence
            visible = range(pos + 1)
            k = torch.stack([k_cache[table[p // block_size], p % block_size] for p in visible])
            v = torch.stack([v_cache[table[p // block_size], p % block_size] for p in visible])
            # [pos + 1, num_kv_heads, head_dim] -> one KV head per query head (GQA)
            k = k.double().repeat_interleave(group, dim=1)
            v = v.double().repeat_interleave(group, dim=1)
            q = batch.query[starts[i] + j].double()  # [num_heads, head_dim]
            scores = torch.einsum("hd,phd->hp", q, k) * batch.scale  # [num_heads, pos + 1]
            out[starts[i] + j] = torch.einsum("hp,phd->hd", scores.softmax(-1), v)
    return out


CASES = {
    # name: (seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size)
    "prefill_mha_partial_blocks": ([5, 16, 21], [5, 16, 21], 4, 4, 16, 8),
    "prefill_gqa_3to1": ([13, 30], [13, 30], 6, 2, 32, 8),
    "decode_batch_gqa_4to1": ([1, 7, 8, 9, 40], [1, 1, 1, 1, 1], 8, 2, 16, 8),
    "extend_over_cached_context": ([20, 37], [4, 11], 4, 2, 16, 8),
    "mixed_decode_and_chunks": ([9, 33, 2], [1, 12, 2], 4, 1, 24, 16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_naive_float64_attention(name: str) -> None:
    seq_lens, query_lens, h, hkv, d, bs = CASES[name]
    batch = make_paged_batch(seq_lens, query_lens, h, hkv, d, bs, seed=len(name))
    ref = ReferenceBackend()
    ref.write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    out = ref.attend(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    expected = naive_attention(batch, batch.k_cache, batch.v_cache)
    # float32 SDPA against float64: only float32 rounding separates them.
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_reference_uses_the_block_table_not_physical_order() -> None:
    """Same logical content in a contiguous and in a shuffled layout gives the same output."""
    args = ([40, 25], [6, 25], 4, 2, 16, 8)
    straight = make_paged_batch(*args, seed=1, shuffle=False, spare_blocks=0)
    shuffled = make_paged_batch(*args, seed=1, shuffle=False, spare_blocks=0)
    perm = torch.randperm(straight.k_cache.shape[0], generator=torch.Generator().manual_seed(2))
    # Move physical block b to perm[b]; rewrite the tables and slots to follow it.
    shuffled.k_cache[perm] = straight.k_cache.clone()
    shuffled.v_cache[perm] = straight.v_cache.clone()
    shuffled.meta.block_tables = perm[straight.meta.block_tables.long()].int()
    bs = straight.k_cache.shape[1]
    slots = straight.meta.slot_mapping
    shuffled.meta.slot_mapping = perm[slots // bs] * bs + slots % bs
    outs = []
    for b in (straight, shuffled):
        ref = ReferenceBackend()
        ref.write_kv(b.key, b.value, b.k_cache, b.v_cache, b.meta.slot_mapping)
        outs.append(ref.attend(b.query, b.k_cache, b.v_cache, b.meta, b.scale))
    assert not torch.equal(shuffled.meta.block_tables, straight.meta.block_tables)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)


def test_reference_write_kv_skips_minus_one_slots() -> None:
    batch = make_paged_batch([10, 20], [10, 20], 2, 2, 8, 8, seed=3)
    slots = batch.meta.slot_mapping.clone()
    slots[::3] = -1
    k_before, v_before = batch.k_cache.clone(), batch.v_cache.clone()
    ReferenceBackend().write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, slots)
    flat_k = batch.k_cache.view(-1, 2, 8)
    kept = slots >= 0
    assert torch.equal(flat_k[slots[kept]], batch.key[kept])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[kept]] = False
    assert torch.equal(flat_k[untouched], k_before.view(-1, 2, 8)[untouched])
    assert torch.equal(batch.v_cache.view(-1, 2, 8)[untouched], v_before.view(-1, 2, 8)[untouched])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_reference_rounds_on_write_and_attends_in_the_query_dtype_over_a_narrower_cache(
    name: str, cache_dtype: torch.dtype
) -> None:
    """kv_cache_dtype's specification: float32 K/V are rounded to the cache's dtype as they are
    written (as `.to` rounds), and attention over the rounded cache is float32 attention."""
    seq_lens, query_lens, h, hkv, d, bs = CASES[name]
    batch = make_paged_batch(
        seq_lens, query_lens, h, hkv, d, bs, seed=len(name), cache_dtype=cache_dtype
    )
    ref = ReferenceBackend()
    ref.write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    slots = batch.meta.slot_mapping
    assert torch.equal(batch.k_cache.view(-1, hkv, d)[slots], batch.key.to(cache_dtype))
    assert torch.equal(batch.v_cache.view(-1, hkv, d)[slots], batch.value.to(cache_dtype))
    out = ref.attend(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert out.dtype == torch.float32
    # The cache's values widen exactly; only float32 rounding separates SDPA from float64.
    expected = naive_attention(batch, batch.k_cache, batch.v_cache)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
