"""The Triton kernel of encoder-only attention: variable-length, bidirectional, no KV cache.

vLLM's `AttentionType.ENCODER_ONLY` (BERT and the embedding models built on it), which its
FlashAttention backend runs as `flash_attn_varlen_func(..., causal=False)` over the step's own
key and value. An encoder's prompt is whole in the step and its K/V is never read again, so the
kernel reads the keys and values where the QKV projection left them, `[T, num_kv_heads, head_dim]`
in the flat batch, instead of through a block table; nothing is written to a cache.

The step is block-diagonal: request r owns rows `query_start_loc[r]:query_start_loc[r+1]`, and
each of its rows attends to all of those rows' keys (no causal mask). A program takes BLOCK_Q
rows of one request × one GQA group (the query heads that share a KV head are rows of one tile,
as in the paged prefill kernel, `triton_kernels.py`) and walks its request's keys tile by tile with
the online softmax. The grid is the flat list of query blocks that exist (`flatten_query_blocks`),
so a batch of short and long prompts starts no idle program.

Import it through `minivllm.attention.backends.triton`, which turns the interpreter on first.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["stride_qt", "stride_kt", "stride_vt"])
def encoder_attention_kernel(  # type: ignore[no-untyped-def]  # Triton's untyped kernel ABI
    query_ptr,  # [T, num_heads, head_dim]
    key_ptr,  # [T, num_kv_heads, head_dim]
    value_ptr,  # [T, num_kv_heads, head_dim]
    out_ptr,  # [T, num_heads, head_dim]
    query_start_loc_ptr,  # int32 [B + 1]
    q_blocks_ptr,  # int32 [NB, 2]  (request, block index within its rows) per program
    qk_scale,  # softmax scale × log2(e)
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # next power of two >= GROUP
    BLOCK_Q: tl.constexpr,  # query rows per program; BLOCK_M = BLOCK_Q * GROUP_PAD tile rows
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per inner-loop tile
    UPCAST: tl.constexpr,  # float32 after loading (the interpreter's bfloat16 is raw bits)
):
    """Attention of BLOCK_Q rows × one GQA group over every key of their request."""
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(q_blocks_ptr + 2 * pid)
    q_block = tl.load(q_blocks_ptr + 2 * pid + 1)
    start = tl.load(query_start_loc_ptr + req)
    seq_len = tl.load(query_start_loc_ptr + req + 1) - start

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    tok = q_block * BLOCK_Q + offs_m // GROUP_PAD  # [BLOCK_M] row within the request
    head = kv_head * GROUP + offs_m % GROUP_PAD  # [BLOCK_M] query head of each tile row
    row_mask = (tok < seq_len) & (offs_m % GROUP_PAD < GROUP)
    io_mask = row_mask[:, None] & d_mask[None, :]
    q_row = (start + tok).to(tl.int64) * stride_qt + head * stride_qh  # [BLOCK_M]
    q = tl.load(query_ptr + q_row[:, None] + offs_d[None, :], mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for key_start in range(0, seq_len, BLOCK_N):
        offs_n = key_start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key rows within the request
        n_mask = offs_n < seq_len
        kv_mask = n_mask[:, None] & d_mask[None, :]
        row = (start + offs_n).to(tl.int64)
        k_off = row * stride_kt + kv_head * stride_kh
        v_off = row * stride_vt + kv_head * stride_vh
        k = tl.load(key_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(value_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))  # only the tail tile's padding
        # Every tile holds at least one real key, so the running max is finite from the first.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_row = (start + tok).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(
        out_ptr + o_row[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask
    )
