"""The skinny GEMM (minivllm/cpu/csrc/cpu_skinny_gemm.cpp) against torch.mm, and where the model uses it.

The kernel computes out[T, N] = x[T, K] · weight[N, K]ᵀ with one float32 sum per output, in
16-wide partial sums along K; torch.mm (MKL) sums in its own blocked order, so the two are held
to a tolerance scaled by the inputs' magnitude and K, not to bit equality. Shapes cover every
edge of the kernel's tiling: token counts that fill 6-token tiles, leave each remainder (1-5), or
are a single token; weight rows that fill 4-row tiles or leave 1-3 over; K below, at and past
multiples of 16 (the masked last step); row strides wider than the rows.

Like tests/cpu/test_kernels_cpu_layernorm.py, this builds the library (once per machine) and fails
rather than skips where it cannot be built. On a CPU without AVX-512 the op calls at::mm and
`skinny_gemm_applies` says no, so the model keeps MKL; both are checked here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm.cpu import ops as cpu_ops
from minivllm.cpu.build import load_cpu_kernels
from minivllm.cpu.op_forwards import cpu_linear, linear
from minivllm.cpu.ops import SKINNY_GEMM_MAX_ROWS, skinny_gemm, skinny_gemm_applies
from minivllm.distributed.parallel_state import SINGLE_DEVICE
from minivllm.model.custom_op import dispatch_custom_ops
from minivllm.model.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
)
from minivllm.platforms.cpu import CpuPlatform

pytestmark = pytest.mark.cpu_isa  # run again at each lower instruction-set level (make test)

TOKENS = [1, 2, 5, 6, 7, 13, 32, 64]
ROWS = [1, 3, 4, 5, 17, 96]  # weight rows: below, at and past the 4-row tile
COLS = [1, 15, 16, 17, 40, 576]  # K: inside one 16-wide step, exactly one, a masked last step


def expected(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # [T, N], float64 reference
    return (x.double() @ w.double().t()).float()


def assert_gemm_close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = expected(x, w)
    assert out.shape == ref.shape and out.dtype == torch.float32
    # float32 sums of K products: error grows with sqrt(K) times the products' size.
    bound = 1e-6 * (x.shape[1] ** 0.5 + 1) * x.abs().max().item() * w.abs().max().item() * 8
    err = (out - ref).abs().max().item() if out.numel() else 0.0
    assert err <= bound, f"max error {err:.3g} > {bound:.3g}"


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    load_cpu_kernels()


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("cols", COLS)
def test_matches_matmul(tokens: int, rows: int, cols: int) -> None:
    x, w = randn(tokens, cols, seed=tokens), randn(rows, cols, seed=rows + cols)
    assert_gemm_close(skinny_gemm(x, w), x, w)


@pytest.mark.parametrize("tokens", [1, 7, 32])
def test_reads_every_layout_the_model_hands_over(tokens: int) -> None:
    w = randn(960, 576, seed=1)  # SmolLM2's qkv projection
    rows = randn(tokens, 576, seed=2)
    feature_major = randn(576, tokens, seed=3).t()  # a CPU linear's transposed output
    wider = randn(tokens, 700, seed=4)[:, :576]  # token rows with a longer row stride
    for x in (rows, feature_major, wider):
        assert_gemm_close(skinny_gemm(x, w), x, w)


def test_writes_rows_with_a_longer_stride() -> None:
    x, w = randn(9, 33, seed=5), randn(6, 33, seed=6)
    buffer = torch.full((9, 10), 7.0)
    torch.ops.minivllm_cpu.skinny_gemm(buffer[:, 2:8], x, w)
    assert_gemm_close(buffer[:, 2:8], x, w)
    assert (buffer[:, :2] == 7).all() and (buffer[:, 8:] == 7).all()  # nothing outside written


def test_a_single_column_or_row_in_any_stride() -> None:
    x = randn(1, 5, seed=13).t()  # [5, 1] with strides (1, 5): contiguous to PyTorch
    w = randn(3, 1, seed=14)
    assert_gemm_close(skinny_gemm(x, w), x, w)
    out = torch.empty(1, 4).t()  # [4, 1] with strides (1, 4)
    x, w = randn(4, 9, seed=15), randn(1, 9, seed=16)
    torch.ops.minivllm_cpu.skinny_gemm(out, x, w)
    assert_gemm_close(out, x, w)


def test_zero_tokens() -> None:
    out = skinny_gemm(torch.empty(0, 16), randn(4, 16, seed=7))
    assert out.shape == (0, 4)


@pytest.mark.parametrize(
    ("x", "w", "match"),
    [
        (torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(3, 8), "must be float32"),
        (torch.randn(2, 8), torch.randn(3, 9), r"weight must be \[N, 8\]"),
        (torch.randn(2, 8), torch.randn(8, 3).t(), "weight must be contiguous"),
    ],
)
def test_bad_arguments_name_the_problem(x: torch.Tensor, w: torch.Tensor, match: str) -> None:
    out = torch.empty(x.shape[0], w.shape[0])
    with pytest.raises(RuntimeError, match=match):
        torch.ops.minivllm_cpu.skinny_gemm(out, x, w)


def test_applies_to_decode_rows_of_float32_only() -> None:
    w = torch.randn(8, 16)
    fast = cpu_ops.skinny_gemm_fast()
    assert skinny_gemm_applies(torch.randn(SKINNY_GEMM_MAX_ROWS, 16), w) == fast
    assert not skinny_gemm_applies(torch.randn(SKINNY_GEMM_MAX_ROWS + 1, 16), w)
    assert not skinny_gemm_applies(torch.randn(4, 16, dtype=torch.bfloat16), w.bfloat16())


@pytest.mark.parametrize("tokens", [1, 5, SKINNY_GEMM_MAX_ROWS, SKINNY_GEMM_MAX_ROWS + 1, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_linear_equals_linear_on_both_sides_of_the_threshold(tokens: int, bias: bool) -> None:
    x, w = randn(tokens, 40, seed=8), randn(24, 40, seed=9)
    b = randn(24, seed=10) if bias else None
    got, ref = cpu_linear(x, w, b), linear(x, w, b)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_layers_switch_to_the_kernel_with_the_other_custom_ops() -> None:
    """The CPU platform moves the parallel linears and the LM head's small batches onto it, or
    onto oneDNN where their weights are packed for it, with the same results."""
    model = torch.nn.ModuleDict(
        {
            "column": ColumnParallelLinear(40, [24, 24], True, SINGLE_DEVICE),
            "row": RowParallelLinear(48, 40, False, SINGLE_DEVICE),
            "head": ParallelLMHead(100, 40, SINGLE_DEVICE),
        }
    )
    for p in model.parameters():
        torch.nn.init.normal_(p)
    x = randn(3, 40, seed=11)
    plain = [model["column"](x), model["row"](randn(3, 48, seed=12)), model["head"](x)]
    assert dispatch_custom_ops(model, CpuPlatform(), "all") == 3
    assert all(op.dispatched_to == "cpu" for op in model.values())
    fast = [model["column"](x), model["row"](randn(3, 48, seed=12)), model["head"](x)]
    for got, ref in zip(fast, plain):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    if cpu_ops.skinny_gemm_fast():  # the kernel's rows are token-major, like F.linear's
        assert fast[0].is_contiguous()
    head_weight = model["head"].weight.to_dense()  # packed for oneDNN where torch has it
    torch.testing.assert_close(fast[2], F.linear(x, head_weight), rtol=1e-5, atol=1e-4)
