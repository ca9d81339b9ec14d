"""The fused CPU layer ops (minivllm/model/cpu_*_kernels.cpp) against their plain-PyTorch forms.

Each formula is written out here as the model computes it: RMSNorm as in `llama.py` (float32,
cast back to the input dtype before the weight), the decoder layer's `hidden + attn` before its
norm, the MLP's `silu(gate) * up`, and `x * cos + rotate_half(x) * sin` as in `rope.py`.

float32 is held to 1e-6 of the output's magnitude, not to bit equality: the kernel sums a row's
squares in vector-wide partial sums and contracts `a * b + c` into one FMA (-ffast-math), PyTorch
sums and rounds in its own order, and the last bits differ. In bfloat16 and float16 the kernel
rounds each output once from float32 where the formula rounds after every op (RoPE's cos and sin
too), so they may differ by an ulp or two of the output's largest value.

Each op is held to its formula in both layouts it takes: token-major rows, and the feature-major
views that the model's CPU linears return ((W · xᵀ)ᵀ, a [T, N] view of a contiguous [N, T]), made
here the way the model makes them, with `torch.mm(w, x.t()).t()`.

Like tests/test_kernels_cpu_attention.py, these build the library (once per machine, ~20 s) and fail
rather than skip where it cannot be built: a skipped kernel test would pass on a broken build.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from minivllm.kernels.cpu_build import load_cpu_kernels
from minivllm.kernels.cpu_ops import (
    fused_add_rms_norm,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = [F32, BF16, F16]
TOKENS = [1, 3, 37, 300]
HIDDEN = [576, 72]  # SmolLM2's, and one that leaves a remainder after every SIMD width
EPS = 1e-5
# Largest |out - expected| allowed, as a fraction of max |expected|. bfloat16 keeps 8 bits
# (2^-8 ≈ 4e-3 per ulp), float16 11 bits (2^-11 ≈ 5e-4).
REL_TOL = {F32: 1e-6, F16: 2e-3, BF16: 1.6e-2}


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def assert_close_to_scale(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    err = (out.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    assert err <= REL_TOL[expected.dtype] * scale, f"max error {err:.3g} at scale {scale:.3g}"


def randn(*shape: int, dtype: torch.dtype, seed: int, std: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * std).to(dtype)


def linear_output(
    tokens: int, features: int, dtype: torch.dtype, seed: int, std: float = 1.0
) -> torch.Tensor:  # [T, features]
    """A CPU linear's [T, features] output as `parallel_layers.linear` computes it, (W · xᵀ)ᵀ:
    feature-major, a view of a contiguous [features, T]. Entries have standard deviation `std`
    (16 inputs of std 1, weights of std std / 4)."""
    x = randn(tokens, 16, dtype=dtype, seed=seed)
    w = randn(features, 16, dtype=dtype, seed=seed + 1, std=std / 4)
    y = torch.mm(w, x.t()).t()  # [T, features]
    assert y.stride() == (1, tokens) or tokens == 1  # a single token is both layouts
    return y


def assert_feature_major(y: torch.Tensor) -> None:  # y: [T, N]
    assert y.t().is_contiguous(), f"not feature-major: strides {y.stride()}"


# ------------------------------------------------------------------------ the specifications
def rms_norm_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_formula(
    positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor
) -> torch.Tensor:  # x: [T, heads, head_dim]
    cos, sin = cos_sin[:, positions].to(x.dtype).unsqueeze(2)  # each [T, 1, head_dim]
    return x * cos + rotate_half(x) * sin


def rope_table(head_dim: int, max_positions: int, theta: float = 10000.0) -> torch.Tensor:
    """float32 [2, max_positions, head_dim], built as RotaryEmbedding builds it."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.outer(torch.arange(max_positions).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return torch.stack((emb.cos(), emb.sin()))


# ---------------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("strided", [False, True], ids=["rows", "strided-rows"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_matches_the_float32_formula(
    tokens: int, hidden: int, dtype: torch.dtype, strided: bool
) -> None:
    wide = randn(tokens, hidden + (40 if strided else 0), dtype=dtype, seed=tokens * hidden, std=3)
    x = wide[:, :hidden]  # [T, hidden], rows hidden + 40 apart when strided
    before = wide.clone()
    weight = randn(hidden, dtype=dtype, seed=1)
    out = rms_norm(x, weight, EPS)
    assert out.is_contiguous()
    assert_close_to_scale(out, rms_norm_formula(x, weight, EPS))
    assert torch.equal(wide, before)  # the input is read only


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("tokens", TOKENS)
def test_fused_add_rms_norm_leaves_the_sum_in_residual_and_its_norm_in_input(
    tokens: int, hidden: int, dtype: torch.dtype
) -> None:
    attn = randn(tokens, hidden, dtype=dtype, seed=tokens + hidden)  # the sublayer's output
    hidden_states = randn(tokens, hidden, dtype=dtype, seed=tokens + hidden + 1, std=4)
    weight = randn(hidden, dtype=dtype, seed=2)
    expected_residual = hidden_states + attn  # the decoder layer's add, rounded to dtype
    expected = rms_norm_formula(expected_residual, weight, EPS)
    x, residual = attn.clone(), hidden_states.clone()
    fused_add_rms_norm(x, residual, weight, EPS)
    # The sum is computed in float32 and rounded once, as PyTorch's add does: equal in every dtype.
    assert torch.equal(residual, expected_residual)
    assert_close_to_scale(x, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("tokens", TOKENS)
def test_fused_add_rms_norm_takes_a_feature_major_sublayer_output_and_keeps_its_layout(
    tokens: int, hidden: int, dtype: torch.dtype
) -> None:
    """The o_proj or down_proj output as the linear returns it, normalized where it lies; the
    residual stream stays token-major."""
    x = linear_output(tokens, hidden, dtype, seed=tokens + hidden)  # [T, hidden]
    hidden_states = randn(tokens, hidden, dtype=dtype, seed=tokens + hidden + 1, std=4)
    weight = randn(hidden, dtype=dtype, seed=2)
    expected_residual = hidden_states + x
    expected = rms_norm_formula(expected_residual, weight, EPS)
    rows = x.clone(memory_format=torch.contiguous_format)  # the same op on rows (a copy)
    rows_residual = hidden_states.clone()
    fused_add_rms_norm(rows, rows_residual, weight, EPS)
    residual, strides = hidden_states.clone(), x.stride()
    fused_add_rms_norm(x, residual, weight, EPS)
    assert x.stride() == strides and residual.is_contiguous()
    assert torch.equal(residual, expected_residual)
    assert_close_to_scale(x, expected)
    assert torch.equal(x, rows)  # the row path's arithmetic, bit for bit


def test_rms_norm_of_a_zero_row_is_zero_not_nan() -> None:
    """eps keeps the root positive: an all-zero row (padding, a dead token) normalizes to 0."""
    x = torch.zeros(3, 576)
    x[1] = 1.0
    out = rms_norm(x, torch.ones(576), EPS)
    assert torch.equal(out[0], torch.zeros(576)) and torch.equal(out[2], torch.zeros(576))
    torch.testing.assert_close(out[1], torch.full((576,), (1 + EPS) ** -0.5))


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


def _rms_norm_wrong_weight() -> None:
    rms_norm(torch.zeros(2, 576), torch.ones(72), EPS)


def _rms_norm_weight_dtype() -> None:
    rms_norm(torch.zeros(2, 576, dtype=BF16), torch.ones(576), EPS)


def _rms_norm_3d() -> None:
    rms_norm(torch.zeros(2, 3, 576), torch.ones(576), EPS)


def _fused_add_strided_residual() -> None:
    fused_add_rms_norm(torch.zeros(2, 576), torch.zeros(2, 600)[:, :576], torch.ones(576), EPS)


def _fused_add_strided_input() -> None:
    fused_add_rms_norm(torch.zeros(2, 600)[:, :576], torch.zeros(2, 576), torch.ones(576), EPS)


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
    (_rms_norm_wrong_weight, r"rms_norm: weight must be a contiguous \[hidden\] = \[576\] tensor"),
    (_rms_norm_weight_dtype, r"rms_norm: weight must have the input's dtype BFloat16, got Float"),
    (_rms_norm_3d, r"rms_norm: input must be 2-D \[T, hidden\], got 3-D"),
    (_fused_add_strided_residual, r"fused_add_rms_norm: residual must be a contiguous tensor"),
    (
        _fused_add_strided_input,
        r"fused_add_rms_norm: input must be contiguous \(token-major\) or .*feature-major.*"
        r"got strides \[600, 1\]",
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
