"""The two stages of the Triton split-KV paged decode (flash-decoding), for rows with one new token.

Stage 1 (`paged_decode_split_kernel`) splits each request's context into `num_splits` ranges and
attends each range with the shared tile loop of `triton_kernels.py` (`_attend_key_range`),
writing a partial output and its log-sum-exp; stage 2 (`paged_decode_merge_kernel`) merges the
splits exactly, `out = Σ_s exp(lse_s - lse) · out_s`. The ideas, the precision rules and the
reason every step-dependent value is a run-time argument are in `triton_kernels.py`'s docstring;
like it, import this module through `minivllm.attention.backends.triton`, which settles the interpreter
first.
"""

from __future__ import annotations

import triton
import triton.language as tl

from minivllm.attention.backends.triton_kernels import _attend_key_range

# ============================================================================== decode (2 stages)


@triton.jit(do_not_specialize=["num_splits", "window", "stride_bt"])
def paged_decode_split_kernel(  # type: ignore[no-untyped-def]  # Triton's untyped kernel ABI
    query_ptr,  # [T, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    out_ptr,  # [T, num_heads, head_dim]  written here only if DIRECT (one split)
    part_out_ptr,  # float32 [D, num_splits, num_heads, head_dim]  each split's normalised output
    part_lse_ptr,  # float32 [D, num_splits, num_heads]  log2-sum-exp2 of each split's scores
    decode_seqs_ptr,  # int32 [D]  the requests with one new token
    block_tables_ptr,  # int32 [B, max_blocks_per_seq]
    seq_lens_ptr,  # int32 [B]
    query_start_loc_ptr,  # int32 [B + 1]
    num_splits,
    qk_scale,
    window,  # the layer's sliding window (NO_WINDOW: none): the row sees its last `window` keys
    softcap,  # the layer's score cap × log2(e) (0: none)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_ps,  # part_out's stride between (row, split) pairs: num_heads * head_dim
    stride_ph,
    stride_ls,  # part_lse's stride between (row, split) pairs: num_heads
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # >= 16: the smallest M that tl.dot accepts
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: write the output itself; no partials, no stage 2
):
    """Stage 1 of flash-decoding. Grid: (decode row, KV head, split).

    The newest token sees every key (under a sliding window, the last `window`), so no causal
    mask: only the split's range [lo, hi). Splits are whole numbers of key tiles, sized per
    request (`ceil(visible keys / num_splits)`), so a short
    request leaves its last splits empty; those write lse = -inf and weigh nothing in stage 2.
    A request with nothing in cache (seq_len 0, a padded row) leaves every split empty.
    """
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(decode_seqs_ptr + row)
    token = tl.load(query_start_loc_ptr + req)
    # A decode-only step lists every request, and a padded one may have no new token at all.
    if tl.load(query_start_loc_ptr + req + 1) - token != 1:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    # The keys the newest token sees: all, or under a sliding window the last `window`; the
    # splits share out that range, so blocks before it (perhaps freed) are never read.
    first = tl.maximum(0, seq_len - window)
    split_len = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    lo = first + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    head = kv_head * GROUP + offs_g  # [GROUP_PAD] query heads of this KV head
    g_mask = offs_g < GROUP
    io_mask = g_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_row = token.to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(query_ptr + q_row[:, None] + offs_d[None, :], mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc, m_i, l_i = _attend_key_range(
        q, acc, m_i, l_i, offs_g, window, softcap, k_cache_ptr, v_cache_ptr,
        block_tables_ptr + req.to(tl.int64) * stride_bt, kv_head, lo, hi, qk_scale,
        stride_cb, stride_cs, stride_ch,
        BLOCK_SIZE, HEAD_DIM, D_PAD, BLOCK_N, False, UPCAST,
    )  # fmt: skip
    # An empty split has l = 0 and m = -inf: store out = 0 and lse = -inf instead of 0/0.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    if DIRECT:
        o_row = token.to(tl.int64) * stride_ot + head * stride_oh
        out = acc / l_safe[:, None]
        tl.store(
            out_ptr + o_row[:, None] + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )
    else:
        lse = m_i + tl.log2(l_safe)  # [GROUP_PAD]
        # (row, split) pairs are numbered row * num_splits + split and multiplied by a stride
        # that is fixed for the model, so the split count never reaches the compiled code.
        pair = row.to(tl.int64) * num_splits + split
        p_row = pair * stride_ps + head * stride_ph
        tl.store(
            part_out_ptr + p_row[:, None] + offs_d[None, :], acc / l_safe[:, None], mask=io_mask
        )
        tl.store(part_lse_ptr + pair * stride_ls + head, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def paged_decode_merge_kernel(  # type: ignore[no-untyped-def]  # Triton's untyped kernel ABI
    part_out_ptr,  # float32 [D, num_splits, num_heads, head_dim]
    part_lse_ptr,  # float32 [D, num_splits, num_heads]
    out_ptr,  # [T, num_heads, head_dim], the query's dtype
    decode_seqs_ptr,  # int32 [D]
    query_start_loc_ptr,  # int32 [B + 1]
    num_splits,
    stride_ot,
    stride_oh,
    stride_ps,
    stride_ph,
    stride_ls,
    SPLITS_PAD: tl.constexpr,  # a power of two >= num_splits (64 for every automatic count)
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """Stage 2 of flash-decoding: out = Σ_s 2^(lse_s - max lse) · out_s / Σ_s 2^(lse_s - max lse).

    Grid: (decode row, query head). Split 0 holds the first visible key whenever seq_len > 0, so the max is
    finite; with seq_len 0 every split is empty, and the output is defined as 0 (not the NaN of
    -inf - -inf).
    """
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    req = tl.load(decode_seqs_ptr + row)
    token = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) - token != 1:
        return  # stage 1 skipped this padded request too
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < num_splits
    pair = row * num_splits + offs_s  # [SPLITS_PAD] (row, split) pairs, as stage 1 numbers them
    lse = tl.load(part_lse_ptr + pair * stride_ls + head, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # no key at all: weights all 0
    weight = tl.exp2(lse - lse_max)  # [SPLITS_PAD]; 0 for empty and padding splits
    io_mask = s_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    p_off = pair * stride_ps + head * stride_ph  # [SPLITS_PAD]
    part = tl.load(
        part_out_ptr + p_off[:, None] + offs_d[None, :], mask=io_mask, other=0.0
    )  # [SPLITS_PAD, D_PAD]
    total = tl.sum(weight, 0)
    out = tl.sum(part * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )
