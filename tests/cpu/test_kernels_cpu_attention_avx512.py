"""The float32 loops written per instruction set, minivllm/cpu/csrc/cpu_attention_avx512.cpp and
cpu_attention_avx2.cpp, against the reference.

`paged_decode` sends float32 queries over a float32 or bfloat16 cache, at the head sizes these
loops are written for (32, 64 and 128), to the loops of the library's level: the AVX-512 ones in
the avx512 build, the AVX2 ones in the avx2 build (`paged_decode_loops` says which); everything
else goes to the portable loops of cpu_attention.cpp, which tests/cpu/test_kernels_cpu_attention.py
covers. `make test` runs this file again at each lower level the CPU has
(`MINIVLLM_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` on an AVX-512 machine),
so both sets of loops are held to the same cases: every step shape (decode, split decode,
prefill, extend, mixed), with blocks shorter than, equal to and longer than each set's tile (16
tokens for AVX-512, 8 for AVX2), and a block size that is a multiple of neither (12).
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from minivllm.attention.backends.cpu import CpuBackend
from minivllm.attention.backends.reference import ReferenceBackend
from minivllm.cpu.build import loaded_level
from minivllm.cpu.ops import paged_decode_loops
from tests.attention.test_attention_reference import TOLERANCES, batch_shape, make_paged_batch
from tests.cpu.test_kernels_cpu_attention import (
    CASES,
    F32,
    HEADS,
    MODES,
    case_id,
    check_cpu_backend_matches_reference,
    feature_major_qkv,
    mixed_lengths,
)

pytestmark = pytest.mark.cpu_isa  # run again at each lower instruction-set level (make test)

BF16, F16 = torch.bfloat16, torch.float16
SIMD_HEAD_DIMS = [32, 64, 128]
SIMD_CASES = [
    case
    for case in itertools.product(MODES, HEADS, [F32], SIMD_HEAD_DIMS, [8, 12, 16, 32, 48])
    if case not in CASES
]
# The loops of each build (minivllm/cpu/isa.py's `Build.name`) for the cases they are written for.
LOOPS_OF_BUILD = {"avx512": "avx512", "avx2": "avx2", "generic": "portable"}


def test_float32_queries_run_the_loops_of_the_library_s_level() -> None:
    """The avx512 build runs the AVX-512 loops, the avx2 build the AVX2 ones, the generic build the
    portable ones; cases the loops are not written for run the portable ones in every build."""
    expected = LOOPS_OF_BUILD[loaded_level().build.name]
    for head_dim, cache in itertools.product(SIMD_HEAD_DIMS, [F32, BF16]):
        assert paged_decode_loops(F32, cache, head_dim) == expected, (head_dim, cache)
    assert paged_decode_loops(F32, F32, 80) == "portable"
    assert paged_decode_loops(F32, F16, 64) == "portable"
    assert paged_decode_loops(BF16, BF16, 64) == "portable"
    assert paged_decode_loops(F16, F16, 64) == "portable"


@pytest.mark.parametrize("case", SIMD_CASES, ids=case_id)
def test_simd_loops_match_reference(case: tuple) -> None:
    check_cpu_backend_matches_reference(case)


@pytest.mark.parametrize("head_dim", SIMD_HEAD_DIMS)
@pytest.mark.parametrize("mode", MODES)
def test_simd_loops_match_reference_over_a_bfloat16_cache_in_blocks_of_12(
    mode: str, head_dim: int
) -> None:
    """Widened on load, in tiles cut short in every block (tests/cpu/test_kernels_cpu_attention_kv_dtype.py
    has the other block sizes)."""
    seq_lens, query_lens = batch_shape(mode, 12)
    b = make_paged_batch(
        seq_lens, query_lens, 9, 3, head_dim, 12, F32, seed=zlib.crc32(f"{mode}{head_dim}".encode()),
        cache_dtype=BF16,
    )  # fmt: skip
    ref, cpu = ReferenceBackend(), CpuBackend()
    ref_k, ref_v = b.k_cache.clone(), b.v_cache.clone()
    ref.write_kv(b.key, b.value, ref_k, ref_v, b.meta.slot_mapping)
    cpu.write_kv(b.key, b.value, b.k_cache, b.v_cache, b.meta.slot_mapping)
    expected = ref.attend(b.query, ref_k, ref_v, b.meta, b.scale)
    out = cpu.attend(b.query, b.k_cache, b.v_cache, b.meta, b.scale)
    torch.testing.assert_close(out, expected, **TOLERANCES[F32])


@pytest.mark.parametrize("cache_dtype", [F32, BF16], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("head_dim", SIMD_HEAD_DIMS)
def test_simd_loops_on_two_threads_under_inference_mode_match_reference(
    head_dim: int, cache_dtype: torch.dtype
) -> None:
    """As the engine runs a decode step: inference tensors, two threads taking the 32 requests of
    1..600 tokens between them, the cache write then the attention, each a parallel region."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with torch.inference_mode():
            lens = mixed_lengths(16, seed=head_dim)
            b = make_paged_batch(
                lens, [1] * len(lens), 8, 2, head_dim, 16, seed=head_dim, cache_dtype=cache_dtype
            )
            query, key, value = feature_major_qkv(b.query, b.key, b.value)  # the model's layout
            ref, cpu = ReferenceBackend(), CpuBackend()
            ref_k, ref_v = b.k_cache.clone(), b.v_cache.clone()
            ref.write_kv(b.key, b.value, ref_k, ref_v, b.meta.slot_mapping)
            cpu.write_kv(key, value, b.k_cache, b.v_cache, b.meta.slot_mapping)
            expected = ref.attend(b.query, ref_k, ref_v, b.meta, b.scale)
            out = cpu.attend(query, b.k_cache, b.v_cache, b.meta, b.scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(b.k_cache, ref_k) and torch.equal(b.v_cache, ref_v)
    torch.testing.assert_close(out, expected, **TOLERANCES[F32])


@pytest.mark.parametrize("cache_dtype", [F32, BF16], ids=lambda d: str(d).removeprefix("torch."))
def test_simd_loops_match_reference_where_the_value_stream_leads_from_mid_context(
    cache_dtype: torch.dtype,
) -> None:
    """Blocks of 64 KB (8 KV heads of 128, float32), so that the scores pass starts pulling a long
    request's first V blocks into L2 part-way through its keys, and the values pass's lead reaches
    past its last block; a short request's V fits the lead from its first block on."""
    b = make_paged_batch(
        [1100, 300, 17], [1, 1, 1], 16, 8, 128, 16, F32, seed=11, cache_dtype=cache_dtype
    )
    ref, cpu = ReferenceBackend(), CpuBackend()
    expected = ref.attend(b.query, b.k_cache, b.v_cache, b.meta, b.scale)
    out = cpu.attend(b.query, b.k_cache, b.v_cache, b.meta, b.scale)
    torch.testing.assert_close(out, expected, **TOLERANCES[F32])
