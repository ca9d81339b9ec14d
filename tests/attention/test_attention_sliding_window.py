"""Sliding-window attention in every backend, against a dense masked softmax in float64.

HF transformers' mask for Mistral and Gemma 2/3 (`masking_utils.sliding_window_overlay` on the
causal mask): a query at position p sees key j iff j <= p and p - j < W. Each backend is checked
on prefill, chunked prefill (new tokens over a cached context), decode and a mixed step, with
windows smaller than the context (1, mid-block, a block, more than a block) and one larger.

The blocks that the KV cache manager would have freed (every key in them is before the step's
first visible key, core/kv_cache_manager.py) are filled with NaN and their block-table entries
pointed at one of them, the manager's placeholder: a backend that reads them unmasked, or
multiplies a masked weight by them, returns NaN.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.attention.backends.cpu import CpuBackend
from minivllm.attention.backends.reference import ReferenceBackend
from minivllm.attention.backends.triton import TritonBackend
from tests.attention.test_attention_reference import (
    TOLERANCES,
    PagedBatch,
    batch_shape,
    make_paged_batch,
)

MODES = ["decode", "prefill", "extend", "mixed"]


def windows_for(block_size: int) -> list[int]:
    return [1, 5, block_size, block_size + 3, 1000]


def naive_windowed_attention(batch: PagedBatch, window: int) -> torch.Tensor:
    """Float64 dense masked softmax per new token: [T, num_heads, head_dim]."""
    meta, k_cache, v_cache = batch.meta, batch.k_cache, batch.v_cache
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = batch.query.shape[1] // num_kv_heads
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        table = meta.block_tables[i].tolist()
        query_len = starts[i + 1] - starts[i]
        for r in range(query_len):
            pos = seq_len - query_len + r
            visible = [j for j in range(seq_len) if j <= pos and pos - j < window]
            k = torch.stack([k_cache[table[j // block_size], j % block_size] for j in visible])
            v = torch.stack([v_cache[table[j // block_size], j % block_size] for j in visible])
            k = k.double().repeat_interleave(group, dim=1)  # [len(visible), num_heads, head_dim]
            v = v.double().repeat_interleave(group, dim=1)
            q = batch.query[starts[i] + r].double()  # [num_heads, head_dim]
            scores = torch.einsum("hd,phd->hp", q, k) * batch.scale
            out[starts[i] + r] = torch.einsum("hp,phd->hd", scores.softmax(-1), v)
    return out


def windowed_batch(
    mode: str, window: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype = torch.float32, seed: int = 0,
) -> PagedBatch:  # fmt: skip
    """A paged batch whose new K/V are already written, with the blocks a window frees poisoned."""
    seq_lens, query_lens = batch_shape(mode, block_size)
    b = make_paged_batch(
        seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=seed
    )
    ReferenceBackend().write_kv(b.key, b.value, b.k_cache, b.v_cache, b.meta.slot_mapping)
    for i, (s, q) in enumerate(zip(seq_lens, query_lens)):
        # vLLM's SlidingWindowManager rule: blocks before (first query - W + 1) // block_size.
        num_freed = max(0, s - q - window + 1) // block_size
        if num_freed:
            freed = b.meta.block_tables[i, :num_freed]
            b.k_cache[freed.long()] = float("nan")
            b.v_cache[freed.long()] = float("nan")
            b.meta.block_tables[i, :num_freed] = freed[0]  # the placeholder
    return b


def close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    tol = TOLERANCES[dtype]  # float32 against float64: summation order only
    torch.testing.assert_close(out.double(), expected, atol=tol["atol"], rtol=tol["rtol"])


def check_backend(
    backend: object, mode: str, window: int, block_size: int, head_dim: int = 16,
    heads: tuple[int, int] = (4, 2), dtype: torch.dtype = torch.float32,
) -> None:  # fmt: skip
    b = windowed_batch(mode, window, *heads, head_dim, block_size, dtype)
    expected = naive_windowed_attention(b, window)
    b.meta.plan = backend.plan(b.meta, block_size)  # type: ignore[attr-defined]
    out = backend.attend(b.query, b.k_cache, b.v_cache, b.meta, b.scale, sliding_window=window)  # type: ignore[attr-defined]
    assert not out.isnan().any()
    close(out, expected, dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", windows_for(8))
def test_reference_backend_masks_outside_the_window(mode: str, window: int) -> None:
    check_backend(ReferenceBackend(), mode, window, 8)


def test_reference_backend_without_window_is_unchanged_by_a_windowed_layer() -> None:
    """One step's plan serves a windowed and a global layer (Gemma alternates them)."""
    b = windowed_batch("extend", 1000, 4, 2, 16, 8)
    ref = ReferenceBackend()
    b.meta.plan = ref.plan(b.meta, 8)
    windowed = ref.attend(b.query, b.k_cache, b.v_cache, b.meta, b.scale, sliding_window=5)
    full = ref.attend(b.query, b.k_cache, b.v_cache, b.meta, b.scale)
    close(full, naive_windowed_attention(b, 10**6))
    close(windowed, naive_windowed_attention(b, 5))


# head_dim 16 runs the portable loops of cpu_attention.cpp, 64 the AVX-512 ones where the CPU has
# them (cpu_attention_avx512.cpp): the window shifts the block table both walk.
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", windows_for(16))
@pytest.mark.parametrize("head_dim", [16, 64])
def test_cpu_backend_masks_outside_the_window(mode: str, window: int, head_dim: int) -> None:
    check_backend(CpuBackend(), mode, window, 16, head_dim)


# Triton in its interpreter (tests/attention/test_attention_kernels.py's way, where there is no GPU): fewer
# windows, each through one KV split and several (a window's range shared out by the splits).
# The split count only changes decode rows: prompt modes run with one.
TRITON_CASES = [
    ("prefill", 1),
    ("extend", 1),
    ("decode", 1),
    ("decode", 3),
    ("mixed", 1),
    ("mixed", 3),
]


@pytest.mark.parametrize(("mode", "num_splits"), TRITON_CASES)
@pytest.mark.parametrize("window", [1, 19, 1000])
def test_triton_backend_masks_outside_the_window(mode: str, window: int, num_splits: int) -> None:
    check_backend(TritonBackend(num_splits=num_splits), mode, window, 16)


def test_triton_prefill_rows_that_see_nothing_of_the_first_key_tile_stay_finite() -> None:
    """The GPU's bfloat16 tiles hold 128 query rows and 64 keys (MHA): with W = 5, the later rows
    of a query block see none of the first key tile, whose max is -inf for them."""
    backend = TritonBackend(gpu_tiles=True)
    check_backend(backend, "prefill", 5, 16, 64, heads=(4, 4), dtype=torch.bfloat16)
