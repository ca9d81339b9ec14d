"""The kernel parity grid on a CUDA GPU, with the kernels compiled for real (`make test-gpu`).

The same cases and tolerances as the interpreter run (tests/test_attention_kernels.py), plus the
shapes the benchmark times and the backend's own split choice at GPU scale. Skipped in a normal
run without CUDA; but when the `gpu` marker is asked for (`pytest -m gpu`) on a machine without
CUDA, every test here FAILS, so a GPU check can never pass by skipping everything.
"""

from __future__ import annotations

import pytest
import torch
from test_attention_kernels import (
    BF16,
    F16,
    F32,
    PARITY_GRID,
    ParityCase,
    check_attend_parity,
    check_write_kv_exact,
)

pytestmark = pytest.mark.gpu


def _gpu_run_requested(config: pytest.Config) -> bool:
    """Was this session started to check the GPU (`-m gpu`, `-m "gpu and not slow"`, ...)?"""
    expr = config.getoption("markexpr", default="") or ""
    return "gpu" in expr and "not gpu" not in expr


@pytest.fixture(autouse=True)
def _require_cuda(request: pytest.FixtureRequest) -> None:
    if torch.cuda.is_available():
        return
    if _gpu_run_requested(request.config):
        pytest.fail("the GPU tests were selected (-m gpu) but torch sees no CUDA device")
    pytest.skip("needs a CUDA device (run with `make test-gpu`)")


@pytest.mark.parametrize("case", PARITY_GRID, ids=lambda c: c.id)
def test_compiled_triton_matches_reference_on_the_parity_grid(case: ParityCase) -> None:
    check_attend_parity(case, "cuda")


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
def test_compiled_write_kv_is_exact_and_skips_minus_one(dtype: torch.dtype) -> None:
    check_write_kv_exact(dtype, "cuda")


# What the GPU tiles (64-key decode tiles, 128-row prefill tiles) see differently from the
# interpreter's: head_dim 128, many splits of a long context, and the backend's own split count.
GPU_SHAPES = [
    ParityCase("decode", (32, 4), BF16, 128, 16),  # the benchmark's shape, default splits
    ParityCase("decode_split", (32, 4), BF16, 128, 16, 7),
    ParityCase("decode_split", (8, 8), F16, 96, 32, 64),  # more splits than some contexts fill
    ParityCase("prefill", (32, 4), BF16, 128, 16),
    ParityCase("extend", (32, 4), F16, 128, 16),
    ParityCase("mixed", (12, 4), BF16, 128, 16),
]


@pytest.mark.parametrize("case", GPU_SHAPES, ids=lambda c: c.id)
def test_compiled_triton_matches_reference_at_model_shapes(case: ParityCase) -> None:
    check_attend_parity(case, "cuda")
