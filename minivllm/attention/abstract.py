"""The attention swap point: the per-step metadata and the backend protocol.

PagedAttention (Kwon et al., SOSP 2023, §4.1) stores each request's keys and values in fixed-size
blocks that need not be contiguous; a block table maps a request's logical blocks to physical ones.
Everything the attention layer needs to find a request's context in that paged cache travels in
one `AttentionMetadata`, built once per engine step by the model runner and passed explicitly to
every layer (nano-vllm keeps it in a global; we do not).

A backend does two things per layer: `write_kv` scatters the new tokens' K/V into their cache
slots, then `attend` computes causal attention of the new tokens over everything in the cache for
their request. One interface serves prefill, chunked prefill, prefix-cache hits and decode, because
a step is just a set of (request, new tokens) pairs; a layer's window and score cap are arguments.
An encoder (BERT, minivllm/model/models/bert.py) needs neither half: its tokens attend
bidirectionally over their own prompt, whole in the step, and its K/V is never read again. So it
calls `attend_encoder` with the step's own query, key and value (vLLM's
`AttentionType.ENCODER_ONLY`): attention within each request's rows, no mask, no cache write and
no cache read; only `query_start_loc` of the metadata is used (the block tables are empty, since
an encoder-only model holds no KV blocks).

Backends: "reference" (gather + scaled-dot-product attention, the specification), "cpu" (every
row through a compiled paged kernel, the CPU default) and "triton" (fused kernels, the CUDA
default). `attention/selector.py` picks one by name; which one "auto" means, and which run on a
device, is the device's platform's to say (minivllm/platforms/).

This file is the contract between the model and its kernels and imports nothing of minivllm.
Each backend's per-step work list ("plan") is built by the model runner, once per step, with
`backend.plan(...)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Where each request's new tokens are and where its context lives in the paged cache.

    B requests are scheduled in the step and T new tokens in all. Request i owns the new tokens
    ``query_start_loc[i]:query_start_loc[i+1]``; after this step's write its cache holds
    ``seq_lens[i]`` tokens, the last of which are its new tokens (bottom-right causal alignment).
    """

    query_start_loc: torch.Tensor  # int32 [B + 1]  prefix sums of new-token counts
    seq_lens: torch.Tensor  # int32 [B]  tokens in cache after this step's write
    block_tables: torch.Tensor  # int32 [B, max_blocks]  logical -> physical (0: padding, or freed)
    slot_mapping: torch.Tensor  # int64 [T]  flat slot (block * block_size + offset); -1 skips
    max_query_len: int
    max_seq_len: int
    # The backend's own per-step work list (which rows are decodes, how prompt chunks gather),
    # built once per step by the model runner with `backend.plan(...)` and read by every layer.
    plan: object | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        """Every request adds exactly one token: the decode kernels apply."""
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    """What the model needs from an attention implementation."""

    name: str

    def plan(self, meta: AttentionMetadata, block_size: int) -> object | None:
        """The step's work list, derived from `meta` alone; the model runner calls this once per
        step and stores the result in `meta.plan` for all layers (None: the backend needs none)."""
        ...

    def write_kv(
        self,
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [T]
    ) -> None: ...

    def attend(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,  # the layer's: p sees j iff p - W < j <= p
        softcap: float = 0.0,  # > 0: scores become softcap * tanh(score / softcap) (Gemma 2)
    ) -> torch.Tensor: ...  # [T, num_heads, head_dim]

    def attend_encoder(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]  the step's own, never cached
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        meta: AttentionMetadata,  # query_start_loc: each request's rows, its whole prompt
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Encoder-only attention: each row sees every row of its own request (no mask)."""
        ...


BACKEND_NAMES = ("reference", "cpu", "triton", "auto")


__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionMetadata",
]
