"""minivllm/cpu/csrc/cpu_attention.cpp and its per-level loops (cpu_attention_avx512.cpp,
cpu_attention_avx2.cpp) over a cache narrower than the queries (kv_cache_dtype="bfloat16" or "float16" under float32 weights), against the reference.

The reference backend is the specification (tests/attention/test_attention_reference.py holds it to float64
attention over the rounded cache): `write_kv` rounds K/V to the cache's dtype, `attend` widens the
cache back to the query's float32. The kernels must write the very same bits (rounding to nearest
even, as `.to` does) and, reading those bits, agree with the reference to float32's tolerance
(1e-5): the cache's rounding is shared, only the order of the float32 sums differs. A bfloat16
cache at head sizes 32, 64 and 128 runs the loops of the library's level, AVX-512 or AVX2 (widened
on load); head size 80 and a float16 cache run the portable loops.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from minivllm.attention.backends.cpu import CpuBackend
from minivllm.attention.backends.reference import ReferenceBackend
from minivllm.cpu.ops import paged_decode, reshape_and_cache
from tests.attention.test_attention_reference import TOLERANCES, batch_shape, make_paged_batch
from tests.cpu.test_kernels_cpu_attention import (
    MODES,
    feature_major_qkv,
    index_copy_write,
    mixed_lengths,
)

pytestmark = pytest.mark.cpu_isa  # run again at each lower instruction-set level (make test)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
KV_CASES = [
    *itertools.product(MODES, [(9, 3), (8, 1)], [32, 64, 80, 128], [16, 48], [BF16]),
    *itertools.product(MODES, [(9, 3)], [64, 80], [16], [F16]),
]


def kv_case_id(case: tuple) -> str:
    mode, (h, hkv), head_dim, block_size, cache_dtype = case
    cache = str(cache_dtype).removeprefix("torch.")
    return f"{mode}-{h}q{hkv}kv-d{head_dim}-bs{block_size}-{cache}-cache"


@pytest.mark.parametrize("case", KV_CASES, ids=kv_case_id)
def test_cpu_backend_matches_reference_over_a_narrower_cache(case: tuple) -> None:
    """float32 Q/K/V (views of one fused qkv), a bfloat16/float16 cache holding stale values:
    both backends write the same bits and attend to float32's tolerance."""
    mode, (h, hkv), head_dim, block_size, cache_dtype = case
    seq_lens, query_lens = batch_shape(mode, block_size)
    b = make_paged_batch(
        seq_lens, query_lens, h, hkv, head_dim, block_size, F32,
        seed=zlib.crc32(kv_case_id(case).encode()), cache_dtype=cache_dtype,
    )  # fmt: skip
    qkv = torch.cat([b.query, b.key, b.value], dim=1)  # [T, h + 2 * hkv, head_dim]
    query, key, value = qkv[:, :h], qkv[:, h : h + hkv], qkv[:, h + hkv :]
    ref, cpu = ReferenceBackend(), CpuBackend()
    ref_k, ref_v = b.k_cache.clone(), b.v_cache.clone()
    ref.write_kv(key, value, ref_k, ref_v, b.meta.slot_mapping)
    cpu.write_kv(key, value, b.k_cache, b.v_cache, b.meta.slot_mapping)
    assert torch.equal(b.k_cache, ref_k) and torch.equal(b.v_cache, ref_v)
    expected = ref.attend(query, ref_k, ref_v, b.meta, b.scale)
    out = cpu.attend(query, b.k_cache, b.v_cache, b.meta, b.scale)
    assert out.dtype == F32 and out.shape == query.shape
    torch.testing.assert_close(out, expected, **TOLERANCES[F32])


@pytest.mark.parametrize("head_dim", [64, 80])  # the level's loops, portable loops
def test_decode_kernel_reads_a_bfloat16_cache_for_a_batch_of_mixed_lengths(head_dim: int) -> None:
    """32 requests of 1..600 tokens, a feature-major float32 query (the model's layout)."""
    lens = mixed_lengths(16, seed=head_dim)
    b = make_paged_batch(lens, [1] * len(lens), 9, 3, head_dim, 16, seed=5, cache_dtype=BF16)
    query, _, _ = feature_major_qkv(b.query, b.key, b.value)
    out = torch.full(b.query.shape, float("nan"))
    rows = b.meta.query_start_loc[:-1].long()
    paged_decode(
        query, b.k_cache, b.v_cache, b.meta.block_tables, b.meta.seq_lens, rows, b.scale, out
    )
    expected = ReferenceBackend().attend(b.query, b.k_cache, b.v_cache, b.meta, b.scale)
    torch.testing.assert_close(out, expected, **TOLERANCES[F32])


def test_a_bfloat16_cache_is_the_float32_result_to_within_bfloat16_rounding() -> None:
    """What kv_cache_dtype="bfloat16" costs in accuracy: the same step with a float32 cache and a
    bfloat16 one (same stale context, rounded) differs by bfloat16's rounding of K and V only."""
    lens = mixed_lengths(16, seed=3)
    b = make_paged_batch(lens, [1] * len(lens), 9, 3, 64, 16, seed=3)
    cpu = CpuBackend()
    exact = cpu.attend(b.query, b.k_cache, b.v_cache, b.meta, b.scale)
    narrow = cpu.attend(b.query, b.k_cache.to(BF16), b.v_cache.to(BF16), b.meta, b.scale)
    assert not torch.equal(narrow, exact)
    torch.testing.assert_close(narrow, exact, **TOLERANCES[BF16])


@pytest.mark.parametrize("cache_dtype", [BF16, F16], ids=str)
@pytest.mark.parametrize("layout", ["token-major", "feature-major"])
@pytest.mark.parametrize("num_tokens", [1, 300])  # 300: shared out between threads
def test_reshape_and_cache_rounds_float32_to_the_cache_as_to_does(
    cache_dtype: torch.dtype, layout: str, num_tokens: int
) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    hkv, d, num_blocks, bs = 3, 64, 40, 16
    query = torch.randn(num_tokens, 9, d, generator=gen)
    key = torch.randn(num_tokens, hkv, d, generator=gen) * 100  # bits below bfloat16's to round
    value = torch.randn(num_tokens, hkv, d, generator=gen)
    if layout == "feature-major":  # a CPU linear's transposed output
        _, key, value = feature_major_qkv(query, key, value)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:num_tokens]  # int64 [T]
    slots[::3] = -1
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(cache_dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    index_copy_write(key.to(cache_dtype), value.to(cache_dtype), expected_k, expected_v, slots)
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_the_kernels_refuse_a_cache_wider_than_or_unlike_the_query() -> None:
    """A narrower cache is for float32 activations; a bfloat16 query over a float32 (or float16)
    cache is refused with the dtypes named, not read wrong."""
    b = make_paged_batch([20], [1], 4, 2, 64, 16, BF16, cache_dtype=F32)
    out = torch.empty(b.query.shape)
    rows = b.meta.query_start_loc[:-1].long()
    with pytest.raises(RuntimeError, match="a Float KV cache needs Float or float32 activations"):
        paged_decode(
            b.query, b.k_cache, b.v_cache, b.meta.block_tables, b.meta.seq_lens, rows, b.scale, out
        )
    with pytest.raises(RuntimeError, match="reshape_and_cache: a Half KV cache"):
        reshape_and_cache(b.key, b.value, b.k_cache.half(), b.v_cache.half(), b.meta.slot_mapping)
