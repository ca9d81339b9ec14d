"""`CpuBackend`: PagedAttention on CPUs, with a compiled paged decode kernel (the CPU default).

Decode is where a CPU engine spends its attention time: every step, every running request reads
its whole context to produce one token. The reference backend gathers that context into a padded
contiguous tensor before `scaled_dot_product_attention`, so each key and value crosses memory three
times. This backend sends decode rows to `cpu_kernels.cpp`, which follows each request's block
table and reads each key and value once (the paper's §4.1 kernel); measured on SmolLM2 at 64
requests x 256 tokens of context, decode attention drops from ~8 ms to ~2 ms per layer.

The cache write is a C++ op too, vLLM's `reshape_and_cache`: one call writes K and V and skips
slots of -1 without the reference's host-side check. Prompt chunks are the reference backend's
(gather + SDPA, where the gather is paid once for many query rows and SDPA runs as matmuls). vLLM's
CPU backend splits the work the same way.

The kernel is compiled on first use, into one library with the layer ops (about 20 s, once per
machine; `cpu_build.py` says how, and what a user sees). Where it cannot be built, `get_attention_backend("auto")` says why in one line
and falls back to the reference backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.attention import AttentionMetadata
from minivllm.attention.cpu_build import CpuKernelUnavailable, load_cpu_kernels
from minivllm.attention.reference import (
    PromptChunk,
    ReferenceBackend,
    attend_prompt_chunk,
    plan_prompt_chunks,
    query_lens_of,
)

__all__ = [
    "CpuBackend",
    "CpuKernelUnavailable",
    "load_cpu_kernels",
    "paged_decode",
    "reshape_and_cache",
]


def reshape_and_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]  any strides
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]  any strides
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [T]  block * block_size + offset; -1: skip the token
) -> None:
    """Write the new tokens' K and V into their cache slots, both caches in one call (C++)."""
    load_cpu_kernels()
    torch.ops.minivllm_cpu.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_decode(
    query: torch.Tensor,  # [T, num_heads, head_dim]  any strides
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [B, max_blocks]
    seq_lens: torch.Tensor,  # int32 [B]
    token_rows: torch.Tensor,  # int64 [B]  each request's query row
    scale: float,
    out: torch.Tensor,  # float32 [T, num_heads, head_dim]  rows token_rows are written
) -> None:
    """Decode attention of one query row per request over its paged context (the C++ kernel)."""
    load_cpu_kernels()
    # The model's queries are a view of the fused qkv output, token-major or (a CPU linear's
    # transposed output) feature-major: the kernel takes their strides and reads them where they
    # are, one request's query at a time, rather than have them copied out first.
    torch.ops.minivllm_cpu.paged_decode(
        out, query, k_cache, v_cache, block_tables, seq_lens, token_rows, scale
    )


@dataclass
class CpuPlan:
    """A step's attention work, built once in the first layer and reused by the others."""

    decode_rows: torch.Tensor  # int64 [D]  rows of the flat batch that are decodes
    decode_block_tables: torch.Tensor  # int32 [D, max_blocks]
    decode_seq_lens: torch.Tensor  # int32 [D]
    prompt_chunks: list[PromptChunk]


def make_cpu_plan(meta: AttentionMetadata, block_size: int) -> CpuPlan:
    query_lens, _ = query_lens_of(meta)
    decodes = [i for i, q in enumerate(query_lens) if q == 1]
    idx = torch.tensor(decodes, dtype=torch.long)
    return CpuPlan(
        decode_rows=meta.query_start_loc[idx].long(),
        decode_block_tables=meta.block_tables[idx].contiguous(),
        decode_seq_lens=meta.seq_lens[idx].contiguous(),
        prompt_chunks=plan_prompt_chunks(meta, block_size),
    )


class CpuBackend(ReferenceBackend):
    """The reference backend with decodes computed by the compiled paged decode kernel."""

    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        load_cpu_kernels()  # fail at construction, not in the middle of a step

    def plan(self, meta: AttentionMetadata, block_size: int) -> CpuPlan:  # type: ignore[override]
        return make_cpu_plan(meta, block_size)

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
        # read at their strides (the CPU linears' feature-major view included), never copied.
        reshape_and_cache(
            key.to(k_cache.dtype), value.to(v_cache.dtype), k_cache, v_cache, slot_mapping
        )

    def attend(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        plan = meta.plan
        if not isinstance(plan, CpuPlan):  # called without the runner: build it for this call
            plan = make_cpu_plan(meta, k_cache.shape[1])
        out = torch.empty(query.shape, dtype=torch.float32)  # the kernel accumulates in float32
        if plan.decode_rows.numel():
            paged_decode(
                query,
                k_cache,
                v_cache,
                plan.decode_block_tables,
                plan.decode_seq_lens,
                plan.decode_rows,
                scale,
                out,
            )
        for chunk in plan.prompt_chunks:
            attend_prompt_chunk(query, k_cache, v_cache, chunk, scale, out)
        return out.to(query.dtype)
