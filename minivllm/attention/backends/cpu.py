"""`CpuBackend`: PagedAttention on CPUs, with a compiled paged decode kernel (the CPU default).

Decode is where a CPU engine spends its attention time: every step, every running request reads its
whole context to produce one token. The reference backend gathers that context into a padded
contiguous tensor before `scaled_dot_product_attention`, so each key and value crosses memory three
times. This backend sends decode rows to `minivllm/cpu/csrc/cpu_attention.cpp`, which follows each
request's block table and reads each key and value once (the paper's §4.1 kernel), so decode
attention costs what its bytes cost.

Prompt chunks run through the same kernel: row i of a chunk of new tokens sees exactly the request's
cached tokens up to its own position, so causal attention is one decode per row over a prefix of the
context (`make_cpu_plan`), with no mask to build and no gathered copy. A sliding window is the same
walk started later: each row's last W keys, from the block of the first. The reference backend's way
(gather the context, then `scaled_dot_product_attention` with a causal mask) computes the masked
half of every score matrix too, and copies the context first; the kernel computes only the visible
scores and reads the context where it lies (on AVX-512 with float32 loops of its own,
`cpu_attention_avx512.cpp`). vLLM's CPU backend uses SDPA for prompts; this backend needs one
kernel, one plan and one call per layer for a whole step.

An encoder's attention (`attend_encoder`: no cache, each whole prompt over its own rows) is one
C++ call per layer too (`cpu_encoder_attention.cpp`): (prompt, all heads) work items over the
thread pool, float32 register tiles for the scores and the weighted sums. The reference backend
runs torch's fused SDPA once per prompt, whose fixed cost per call outweighs the arithmetic of an
embedding model's short prompts and small heads; its K/V need no cache write either way.

The cache write is a C++ op too, vLLM's `reshape_and_cache`: one call writes K and V and skips
slots of -1 without the reference's host-side check.

The cache may be narrower than the model (`kv_cache_dtype="bfloat16"` under float32 weights): the
write rounds to it, the kernel widens each value back to float32 as it reads it and accumulates
in float32, so the result is the reference backend's on the same rounded cache, read at half the
bytes.

The kernels live with the other compiled code in `minivllm/cpu/` (`cpu_attention.cpp`, their
wrappers in `ops.py`) and are compiled on first use, into one library with the layer ops (once per
machine and instruction-set level; `minivllm/cpu/build.py` says how, and what a user sees). Where it
cannot be built, `get_attention_backend("auto")` says why in one line and falls back to the
reference backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.attention.abstract import AttentionMetadata
from minivllm.attention.backends.reference import ReferenceBackend
from minivllm.cpu.build import CpuKernelUnavailable, load_cpu_kernels
from minivllm.cpu.ops import encoder_attention, paged_decode, reshape_and_cache

__all__ = [
    "CpuBackend",
    "CpuKernelUnavailable",
    "load_cpu_kernels",
    "paged_decode",
    "reshape_and_cache",
]


@dataclass
class CpuPlan:
    """A step's attention work, built once per step by the model runner (`backend.plan`) and read
    by every layer: every query row of the step, decode or prompt, as one work item of the paged
    kernel."""

    rows: torch.Tensor  # int64 [T]  the rows of the flat batch, in order
    block_tables: torch.Tensor  # int32 [T, max_blocks]  each row's request's block table
    seq_lens: torch.Tensor  # int32 [T]  how many cached tokens each row sees (causal)


def make_cpu_plan(meta: AttentionMetadata) -> CpuPlan:
    """A prompt chunk's row i (of query_len) sits at position seq_len - query_len + i and sees the
    keys up to and including its own: causal attention is a decode per row, over a prefix of the
    request's context. So one kernel serves both, with no mask and no gathered copy."""
    if meta.is_decode_only:  # each row is its own request, which sees all its tokens: no gathers
        seq_lens = meta.seq_lens.int()  # the same tensor where it is int32 already
        return CpuPlan(
            rows=torch.arange(seq_lens.shape[0]),
            block_tables=meta.block_tables,
            seq_lens=seq_lens,
        )
    query_lens = meta.query_start_loc.diff()  # int32 [B]
    request = torch.repeat_interleave(query_lens)  # int64 [T]  each row's request
    rows = torch.arange(request.shape[0])  # int64 [T]
    # Rows before this one in its own request: its offset within the chunk.
    offset = rows - meta.query_start_loc[request]
    seq_lens = meta.seq_lens[request] - query_lens[request] + 1 + offset
    return CpuPlan(
        rows=rows,
        block_tables=meta.block_tables.index_select(0, request),
        seq_lens=seq_lens.int(),
    )


class CpuBackend(ReferenceBackend):
    """The reference backend's cache layout, with every row attended by the compiled kernel."""

    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        load_cpu_kernels()  # fail at construction, not in the middle of a step

    def plan(self, meta: AttentionMetadata, block_size: int) -> CpuPlan:  # type: ignore[override]
        return make_cpu_plan(meta)

    def write_kv(
        self,
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]  any strides
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [T]  -1: skip
    ) -> None:
        # One C++ call per layer: the reference's `(slot_mapping < 0).any()` check, a host sync,
        # and its two index_copy_ calls become a loop that skips -1 slots as it goes; k and v are
        # read at their strides (the CPU linears' feature-major view included), never copied; a
        # narrower cache (kv_cache_dtype) is rounded to as they are written, as `.to` rounds.
        reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)

    def attend_encoder(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]  the step's own, never cached
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        meta: AttentionMetadata,  # query_start_loc: each request's rows, its whole prompt
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        # Feature-major views (a float16 model's linears on a CPU without AVX512-FP16 run on MKL,
        # whose (W · xᵀ)ᵀ is a transposed view) are copied token-major first: the kernel reads rows, and one copy of
        # the step's q, k and v costs less than SDPA once per prompt, the reference's way.
        query, key, value = (
            x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value)
        )
        return encoder_attention(query, key, value, meta.query_start_loc, scale)

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
        plan = meta.plan
        if not isinstance(plan, CpuPlan):  # called without the runner: build it for this call
            plan = make_cpu_plan(meta)
        out = torch.empty(query.shape, dtype=torch.float32)  # the kernel accumulates in float32
        paged_decode(
            query, k_cache, v_cache, plan.block_tables, plan.seq_lens, plan.rows, scale, out,
            sliding_window, softcap,
        )  # fmt: skip
        return out.to(query.dtype)
