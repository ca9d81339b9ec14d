"""The float32 AVX-512 loops of minivllm/cpu/cpu_attention_avx512.cpp against the reference.

`paged_decode` sends float32 queries at the head sizes these loops are compiled for (32, 64 and
128) to them, and everything else to the generic loop of cpu_attention.cpp, which
tests/test_kernels_cpu_attention.py covers. Here: every step shape (decode, split decode, prefill,
extend, mixed) at those head sizes, with blocks shorter than, equal to and longer than the loops'
16-token tile, and a block size that is not a multiple of it. On a CPU without AVX-512 the same
cases run the generic loop and must agree just the same.
"""

from __future__ import annotations

import itertools

import pytest
from test_kernels_cpu_attention import (
    CASES,
    F32,
    HEADS,
    MODES,
    case_id,
    check_cpu_backend_matches_reference,
)

pytestmark = pytest.mark.cpu_isa  # run again at each lower instruction-set level (make test)

AVX512_CASES = [
    case
    for case in itertools.product(MODES, HEADS, [F32], [32, 64, 128], [8, 16, 32, 48])
    if case not in CASES
]


@pytest.mark.parametrize("case", AVX512_CASES, ids=case_id)
def test_avx512_loops_match_reference(case: tuple) -> None:
    check_cpu_backend_matches_reference(case)
