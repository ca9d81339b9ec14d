"""SiLU-and-mul and RoPE of minivllm/cpu/csrc/cpu_activation_rope.cpp against their formulas.

The formulas are written out as the model computes them: the MLP's `silu(gate) * up` and
`x * cos + rotate_half(x) * sin` as in `rope.py`, in both layouts the ops take (token-major rows
and the CPU linears' feature-major views). Tolerances and helpers are those of
tests/cpu/test_kernels_cpu_layernorm.py (RoPE's cos and sin are rounded once by the kernel, after
every op by the formula).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from minivllm.cpu.build import load_cpu_kernels
from minivllm.cpu.ops import rotary_embedding, silu_and_mul
from tests.cpu.test_kernels_cpu_layernorm import (
    DTYPES,
    TOKENS,
    assert_close_to_scale,
    assert_feature_major,
    dtype_id,
    linear_output,
    randn,
    rope_formula,
    rope_table,
)

pytestmark = pytest.mark.cpu_isa  # run again at each lower instruction-set level (make test)


# ------------------------------------------------------------------------------ SiLU and mul
@pytest.mark.parametrize("strided", [False, True], ids=["rows", "strided-rows"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("d", [1536, 72])  # SmolLM2's intermediate size, and an odd one
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul_matches_silu_of_gate_times_up(
    tokens: int, d: int, dtype: torch.dtype, strided: bool
) -> None:
    # Gates spread over [-12, 12]: both tails of the sigmoid, where exp under- and overflows.
    wide = randn(tokens, 2 * d + (24 if strided else 0), dtype=dtype, seed=tokens * d, std=4)
    x = wide[:, : 2 * d]  # [T, 2 * d]: gate then up, rows 2 * d + 24 apart when strided
    before = wide.clone()
    out = silu_and_mul(x)
    assert out.is_contiguous()
    assert_close_to_scale(out, F.silu(x[:, :d]) * x[:, d:])
    assert torch.equal(wide, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("d", [1536, 72])
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul_of_a_feature_major_gate_up_is_feature_major(
    tokens: int, d: int, dtype: torch.dtype
) -> None:
    """The MLP's gate_up linear output as it comes, and an output the down linear reads as is."""
    x = linear_output(tokens, 2 * d, dtype, seed=tokens * d, std=4)  # [T, 2 * d]
    before = x.clone()
    out = silu_and_mul(x)
    assert_feature_major(out)
    assert_close_to_scale(out, F.silu(x[:, :d]) * x[:, d:])
    assert torch.equal(x, before)


def test_silu_and_mul_saturates_instead_of_overflowing_for_huge_gates() -> None:
    """exp(-g) is +inf for g < -88 in float32: silu must reach its limits (0 and g), not NaN."""
    gate = torch.tensor([[-1e4, -1e3, -100.0, -89.0, -88.0, 0.0, 88.0, 89.0, 100.0, 1e3, 1e4]])
    up = torch.full_like(gate, 2.0)
    out = silu_and_mul(torch.cat([gate, up], dim=1))
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-30, rtol=1e-6)
    assert torch.isfinite(out).all()


# -------------------------------------------------------------------------- rotary embedding
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)], ids=["9q3kv", "4q4kv"])
@pytest.mark.parametrize("head_dim", [64, 32])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary_embedding_rotates_the_qk_part_of_a_qkv_row_in_place(
    tokens: int, head_dim: int, heads: tuple[int, int], dtype: torch.dtype
) -> None:
    """x is the query-and-key part of the fused qkv output, as the model passes it: a view whose
    rows are longer than heads * head_dim. The values after it must not move."""
    num_heads, num_kv_heads = heads
    qk_width = (num_heads + num_kv_heads) * head_dim
    qkv = randn(tokens, qk_width + num_kv_heads * head_dim, dtype=dtype, seed=tokens + head_dim)
    x = qkv[:, :qk_width].view(tokens, num_heads + num_kv_heads, head_dim)
    max_positions = 4096
    gen = torch.Generator().manual_seed(tokens)
    positions = torch.randint(0, max_positions, (tokens,), generator=gen)  # any order, repeats
    cos_sin = rope_table(head_dim, max_positions)
    expected = rope_formula(positions, x, cos_sin)
    values = qkv[:, qk_width:].clone()
    rotary_embedding(positions, x, cos_sin)
    assert_close_to_scale(x, expected)
    assert torch.equal(qkv[:, qk_width:], values)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)], ids=["9q3kv", "4q4kv"])
@pytest.mark.parametrize("head_dim", [64, 32])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary_embedding_rotates_the_qk_part_of_a_feature_major_qkv_in_place(
    tokens: int, head_dim: int, heads: tuple[int, int], dtype: torch.dtype
) -> None:
    """The qkv linear's output as it comes, (W · xᵀ)ᵀ: the query-and-key view has strides
    (1, head_dim * T, T). The values after it, the v columns, must not move."""
    num_heads, num_kv_heads = heads
    qk_width = (num_heads + num_kv_heads) * head_dim
    qkv = linear_output(tokens, qk_width + num_kv_heads * head_dim, dtype, seed=tokens + head_dim)
    x = qkv[:, :qk_width].view(tokens, num_heads + num_kv_heads, head_dim)
    assert tokens == 1 or x.stride() == (1, head_dim * tokens, tokens)
    gen = torch.Generator().manual_seed(tokens)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)  # any order, repeats
    cos_sin = rope_table(head_dim, 4096)
    expected = rope_formula(positions, x, cos_sin)
    values = qkv[:, qk_width:].clone()
    rotary_embedding(positions, x, cos_sin)
    assert_feature_major(qkv)
    assert_close_to_scale(x, expected)
    assert torch.equal(qkv[:, qk_width:], values)


@pytest.mark.parametrize("layout", ["token-major", "feature-major"])
def test_rotary_embedding_uses_both_halves_of_the_table_as_given(layout: str) -> None:
    """The formula reads cos[i + half] and sin[i + half] for the second half; a table whose
    halves differ (none that RotaryEmbedding builds) shows the kernel does the same."""
    gen = torch.Generator().manual_seed(7)
    cos_sin = torch.randn(2, 10, 16, generator=gen)
    x = torch.randn(5, 3, 16, generator=gen)  # [T, heads, head_dim]
    if layout == "feature-major":  # strides (1, head_dim * T, T)
        x = x.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    positions = torch.tensor([9, 0, 4, 4, 2])
    expected = rope_formula(positions, x, cos_sin)
    rotary_embedding(positions, x, cos_sin)
    assert_close_to_scale(x, expected)


# ---------------------------------------------------------------------------- invalid input
def _rotary_out_of_range() -> None:
    rotary_embedding(torch.tensor([0, 64]), torch.zeros(2, 3, 32), rope_table(32, 64))


def _rotary_negative_position() -> None:
    rotary_embedding(torch.tensor([-1]), torch.zeros(1, 3, 32), rope_table(32, 64))


def _rotary_heads_apart() -> None:
    x = torch.zeros(2, 3, 64)[..., :32]  # each head's 32 values, then 32 others: stride(1) 64
    rotary_embedding(torch.tensor([0, 1]), x, rope_table(32, 64))


def _rotary_feature_major_with_gaps() -> None:
    x = torch.zeros(3, 32, 4)[..., :2].permute(2, 0, 1)  # [2, 3, 32], tokens 4 apart, not 2
    rotary_embedding(torch.tensor([0, 1]), x, rope_table(32, 64))


def _rotary_int32_positions() -> None:
    rotary_embedding(torch.tensor([0], dtype=torch.int32), torch.zeros(1, 3, 32), rope_table(32, 8))


def _rotary_wrong_table() -> None:
    rotary_embedding(torch.tensor([0]), torch.zeros(1, 3, 32), rope_table(64, 8))


def _silu_odd_width() -> None:
    silu_and_mul(torch.zeros(2, 7))


def _silu_neither_layout() -> None:
    silu_and_mul(torch.zeros(4, 8, 2)[:, :, 0])  # [4, 8], strides (16, 2)


def _silu_out_not_in_the_input_s_layout() -> None:
    x = torch.zeros(8, 3).t()  # [3, 8] feature-major
    load_cpu_kernels()
    torch.ops.minivllm_cpu.silu_and_mul(torch.zeros(3, 4), x)


BAD_CALLS: list[tuple[Callable[[], None], str]] = [
    (_rotary_out_of_range, r"rotary_embedding: positions must be in \[0, 64\), got 64 at index 1"),
    (_rotary_negative_position, r"positions must be in \[0, 64\), got -1 at index 0"),
    (
        _rotary_heads_apart,
        r"rotary_embedding: x must be token-major \(strides \(>= heads \* head_dim, head_dim, 1\)"
        r" = \(>= 96, 32, 1\)\) or feature-major .* got strides \[192, 64, 1\]",
    ),
    (
        _rotary_feature_major_with_gaps,
        r"x must be .* or feature-major \(strides \(1, head_dim \* T, T\) = \(1, 64, 2\)\), "
        r"got strides \[1, 128, 4\]",
    ),
    (_rotary_int32_positions, r"rotary_embedding: positions must be int64 \[T\]"),
    (
        _rotary_wrong_table,
        r"cos_sin must be a contiguous float32 \[2, max_positions, head_dim = 32\]",
    ),
    (_silu_odd_width, r"silu_and_mul: input's last dim must be even .*got 7"),
    (
        _silu_neither_layout,
        r"silu_and_mul: input must be token-major \(stride\(1\) == 1\) or feature-major "
        r"\(input.t\(\) contiguous, strides \(1, T\) = \(1, 4\)\), got strides \[16, 2\]",
    ),
    (
        _silu_out_not_in_the_input_s_layout,
        r"silu_and_mul: out must be a \[T, d\] = \[3, 4\] tensor in the input's feature-major "
        r"layout",
    ),
]


@pytest.mark.parametrize(
    ("call", "message"), BAD_CALLS, ids=[call.__name__.strip("_") for call, _ in BAD_CALLS]
)
def test_invalid_input_raises_naming_the_argument_and_the_rule(
    call: Callable[[], None], message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        call()


def test_a_refused_rotation_leaves_x_as_it_was() -> None:
    """Positions are checked before any row turns: a bad batch changes nothing."""
    x = torch.randn(3, 2, 16)
    before = x.clone()
    with pytest.raises(RuntimeError, match="positions must be in"):
        rotary_embedding(torch.tensor([1, 2, 99]), x, rope_table(16, 8))
    assert torch.equal(x, before)
