"""The Triton kernels of PagedAttention: cache write, paged prefill/extend, split-KV paged decode.

Every kernel reads or writes the paged KV cache `[num_blocks, block_size, num_kv_heads, head_dim]`
of the paper's §4.1: a request's logical token n lives in physical block
`block_table[n // block_size]` at offset `n % block_size`. The kernels resolve that address per
key *inside* the tile loop, so the cache is never gathered into a contiguous copy (which is what
the reference backend does, and what costs it a full extra read and write of the context).

Three ideas, each where it earns its place:

- **Online softmax** (Milakov & Gimelshein 2018; FlashAttention): keys are visited one tile at a
  time while a running max `m`, running denominator `l` and an unnormalised accumulator are kept
  per query row, so attention over any context length needs one pass and O(tile) memory. The
  exponentials are base 2 (`exp2`, with `log2(e)` folded into the scale): one instruction on a GPU.
- **GQA packing**: the query heads that share one KV head are rows of the same tile, so each K/V
  tile is loaded once per group rather than once per query head (vLLM's unified attention does the
  same). It also gives decode a matrix-shaped tile for `tl.dot` with a single query token.
- **Flash-decoding (split-KV)** for the rows with one new token (decodes, in decode-only and
  mixed batches alike): one query token per request leaves only `requests × kv_heads` programs,
  too few to keep an H200's 132 SMs streaming the cache. Stage 1 splits each context into
  `num_splits` ranges and attends each range separately, writing a partial output and its
  log-sum-exp; stage 2 merges the splits exactly, `out = Σ_s exp(lse_s - lse) · out_s`, because
  softmax over a union is a weighted mix of softmaxes. With one split, stage 1 writes the output
  itself and stage 2 is not launched.

What changes from step to step is passed at run time, never as a `tl.constexpr`: a constexpr is
part of the compiled kernel's identity, so a split count that followed the batch would recompile
both decode kernels (seconds each) as a server's load changed. `num_splits` and `num_tokens` are
exempt from Triton's value specialisation (`do_not_specialize`), which would otherwise compile
separate variants for the value 1 and for multiples of 16; so is the block tables' row stride,
which follows the longest request of the step. The partial outputs are laid out
`[row, split, head, dim]`, so their strides do not depend on the split count either.

Addresses: every offset into the cache or the token-major tensors is computed in int64
(`cache_offsets`): a KV cache passes 2**31 elements at about 8 GiB of bfloat16.

Precision: dots accumulate in float32 with `input_precision="ieee"` (no TF32), so float32 matches
the reference to ~1e-6. Under Triton's CPU interpreter the kernels upcast K/V/Q to float32 after
loading (`UPCAST`): the interpreter keeps bfloat16 as raw uint16 bits and would do arithmetic on
them. On a GPU the operands stay in 16 bits for the tensor cores and only `p` is rounded, as in
FlashAttention.
A cache narrower than the queries (kv_cache_dtype="bfloat16" under float32 weights) takes the same
`UPCAST` path on a GPU too: K/V are widened as they are loaded and the dots run in float32, so the
cache's rounding is the only difference from a float32 cache.

This module defines the cache write, the shared tile loop and the prefill/extend kernel; the two
decode stages are in `triton_decode_kernels.py`. Their tile sizes and per-step work lists are in
`minivllm.attention.backends.triton_plan`, their launches in `minivllm.attention.backends.triton`. Import it through
that module, which switches the interpreter on when there is no GPU *before* the `@triton.jit`
decorators below run: Triton decides there, per kernel, whether it is interpreted or compiled.
"""

from __future__ import annotations

import triton
import triton.language as tl

# ================================================================================== addresses


@triton.jit
def cache_offsets(
    block,  # int tensor: physical block of each key (any integer type)
    pos_in_block,  # int tensor of the same shape: offset inside the block
    kv_head,
    stride_cb,
    stride_cs,
    stride_ch,
):
    """Element offset of (block, offset, KV head) in a `[num_blocks, block_size, heads, dim]` cache.

    The block id is widened to int64 *before* it is multiplied by the block stride: a cache of
    8 GiB of bfloat16 has 2**32 elements, and an int32 product would wrap to a wrong address.
    """
    return block.to(tl.int64) * stride_cb + pos_in_block * stride_cs + kv_head * stride_ch


# ================================================================================== cache write


@triton.jit(do_not_specialize=["num_tokens"])
def write_kv_kernel(  # type: ignore[no-untyped-def]  # Triton's untyped kernel ABI
    key_ptr,  # [T, num_kv_heads, head_dim], same dtype as the cache
    value_ptr,  # [T, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # same shape and strides as k_cache
    slot_mapping_ptr,  # int64 [T], block * block_size + offset; -1 = do not write
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,  # next power of two >= HEAD_DIM; the extra lanes are masked
    BLOCK_T: tl.constexpr,
):
    """vLLM's `reshape_and_cache`: BLOCK_T new tokens of one KV head per program."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D_PAD)
    slot = tl.load(slot_mapping_ptr + offs_t, mask=offs_t < num_tokens, other=-1).to(tl.int64)
    # -1 marks a token whose K/V must not be written (already cached, or padding): masked out,
    # so its slot keeps whatever it held.
    mask = (slot >= 0)[:, None] & (offs_d < HEAD_DIM)[None, :]
    dst = cache_offsets(
        slot // BLOCK_SIZE, slot % BLOCK_SIZE, kv_head, stride_cb, stride_cs, stride_ch
    )  # [BLOCK_T] int64
    src_t = offs_t.to(tl.int64)
    k = tl.load(
        key_ptr + (src_t * stride_kt + kv_head * stride_kh)[:, None] + offs_d[None, :], mask=mask
    )
    v = tl.load(
        value_ptr + (src_t * stride_vt + kv_head * stride_vh)[:, None] + offs_d[None, :], mask=mask
    )
    tl.store(k_cache_ptr + dst[:, None] + offs_d[None, :], k, mask=mask)
    tl.store(v_cache_ptr + dst[:, None] + offs_d[None, :], v, mask=mask)


# ======================================================================= shared inner loop


@triton.jit
def _tanh(x):
    """tanh from exp2 (Triton's core has no tanh that both the interpreter and a GPU run), in the
    form that cannot overflow: sign(x) · (1 - e) / (1 + e) with e = 2^(-2|x| log2 e) in (0, 1]."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # 2 log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _attend_key_range(  # type: ignore[no-untyped-def]  # Triton's untyped kernel ABI
    q,  # [BLOCK_M, D_PAD] query rows of one GQA group (float32 if UPCAST)
    acc,  # [BLOCK_M, D_PAD] float32 unnormalised output so far
    m_i,  # [BLOCK_M] float32 running max of the scores (log2 domain)
    l_i,  # [BLOCK_M] float32 running softmax denominator
    q_pos,  # [BLOCK_M] int32 position of each query row in its sequence (used if CAUSAL)
    window,  # a sliding window: row p sees keys > p - window (used if CAUSAL; huge: none)
    softcap,  # > 0: scores become softcap · tanh(score / softcap), in the log2 domain; 0: off
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,  # int32 [max_blocks_per_seq], this request's row of the block tables
    kv_head,
    lo,  # first key position to visit
    hi,  # one past the last key position to visit
    qk_scale,  # softmax scale × log2(e)
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Online softmax over keys [lo, hi) of one request, read through its block table."""
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        # The PagedAttention step: logical key n -> (physical block, offset).
        block = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        kv_off = cache_offsets(
            block, offs_n % BLOCK_SIZE, kv_head, stride_cb, stride_cs, stride_ch
        )  # [BLOCK_N] int64
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N]
        if softcap > 0.0:  # Gemma 2: cap · tanh(x / cap) is the same map in the log2 domain
            s = softcap * _tanh(s / softcap)
        visible = n_mask[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= q_pos[:, None])
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        # Under a sliding window a row may see nothing of the first tiles (its window starts
        # after them): its max is still -inf, and -inf - -inf would be NaN. Rescaling by 0
        # instead keeps such a row at l = 0, acc = 0 until its first visible key.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)  # rescales what was accumulated under the old max
        p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    return acc, m_i, l_i


# ============================================================================ prefill / extend


@triton.jit(do_not_specialize=["stride_bt", "window"])
def paged_prefill_kernel(  # type: ignore[no-untyped-def]  # Triton's untyped kernel ABI
    query_ptr,  # [T, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    out_ptr,  # [T, num_heads, head_dim], the query's dtype
    block_tables_ptr,  # int32 [B, max_blocks_per_seq]
    seq_lens_ptr,  # int32 [B]
    query_start_loc_ptr,  # int32 [B + 1]
    q_blocks_ptr,  # int32 [NB, 2]  (request, block index within its new tokens) per program
    qk_scale,
    window,  # the layer's sliding window (NO_WINDOW: none)
    softcap,  # the layer's score cap × log2(e) (0: none)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # next power of two >= GROUP
    BLOCK_Q: tl.constexpr,  # query tokens per program; BLOCK_M = BLOCK_Q * GROUP_PAD rows
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Causal attention of BLOCK_Q new tokens × one GQA group over the request's whole cache.

    Grid: (query block, KV head), over the query blocks that exist: the step's list `q_blocks`
    holds ceil(query_len / BLOCK_Q) blocks per request with several new tokens, and nothing
    else, so no program starts only to exit (vLLM's unified attention flattens its grid the same
    way). The new tokens are the last `query_len` of the
    `seq_len` in cache (bottom-right alignment), so new token j sits at position
    `seq_len - query_len + j` and sees keys 0..that position: cached prefix, earlier chunks and
    the new tokens before it. That one rule covers prefill, chunked prefill and prefix-cache hits.
    Under a sliding window W it sees only keys > its position - W, and the block's keys start at
    the first one its first row sees: the blocks before, perhaps freed, are never read.
    """
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(q_blocks_ptr + 2 * pid)
    q_block = tl.load(q_blocks_ptr + 2 * pid + 1)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len  # tokens in cache before the new ones

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    tok = q_block * BLOCK_Q + offs_m // GROUP_PAD  # [BLOCK_M] new-token index within the request
    head = kv_head * GROUP + offs_m % GROUP_PAD  # [BLOCK_M] query head of each row
    row_mask = (tok < q_len) & (offs_m % GROUP_PAD < GROUP)
    io_mask = row_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_row = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh  # [BLOCK_M]
    q = tl.load(query_ptr + q_row[:, None] + offs_d[None, :], mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    q_pos = ctx_len + tok
    # Keys beyond the last row's position are invisible to the whole block: stop there; keys
    # before the first row's window are invisible to it too: start after them.
    hi = tl.minimum(seq_len, ctx_len + (q_block + 1) * BLOCK_Q)
    lo = tl.maximum(0, ctx_len + q_block * BLOCK_Q - window + 1)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_key_range(
        q, acc, m_i, l_i, q_pos, window, softcap, k_cache_ptr, v_cache_ptr,
        block_tables_ptr + req.to(tl.int64) * stride_bt, kv_head, lo, hi, qk_scale,
        stride_cb, stride_cs, stride_ch,
        BLOCK_SIZE, HEAD_DIM, D_PAD, BLOCK_N, True, UPCAST,
    )  # fmt: skip
    # A request with nothing in cache (seq_len 0, a padded row) saw no key: its output is 0.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_row = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(
        out_ptr + o_row[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask
    )


# The `window` of a layer without a sliding window: farther back than any context reaches, and
# small enough that position - NO_WINDOW cannot overflow int32.
NO_WINDOW = 2**30

# True when the kernels above were decorated under Triton's interpreter (they run on CPU tensors).
INTERPRETED = not isinstance(write_kv_kernel, triton.runtime.jit.JITFunction)
