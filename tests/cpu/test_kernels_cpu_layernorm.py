"""The fused RMSNorm ops of minivllm/cpu/csrc/cpu_layernorm.cpp against their plain-PyTorch form.

The formula is written out here as the model computes it: RMSNorm as in `llama.py` (float32,
cast back to the input dtype before the weight), and the decoder layer's `hidden + attn` before
its norm. This file also holds the helpers of tests/cpu/test_kernels_cpu_activation_rope.py, which
checks the other elementwise source the same way.

float32 is held to 1e-6 of the output's magnitude, not to bit equality: the kernel sums a row's
squares in vector-wide partial sums and contracts `a * b + c` into one FMA (-ffast-math), PyTorch
sums and rounds in its own order, and the last bits differ. In bfloat16 and float16 the kernel
rounds each output once from float32 where the formula rounds after every op, so they may differ
by an ulp or two of the output's largest value.

Each op is held to its formula in both layouts it takes: token-major rows, and the feature-major
views that the CPU platform's linears return ((W · xᵀ)ᵀ, a [T, N] view of a contiguous [N, T]),
made here the way they make them, with `torch.mm(w, x.t()).t()`.

Like tests/cpu/test_kernels_cpu_attention.py, these build the library (once per machine, ~20 s) and
fail rather than skip where it cannot be built: a skipped kernel test would pass on a broken build.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from minivllm.cpu.ops import fused_add_rms_norm, rms_norm

pytestmark = pytest.mark.cpu_isa  # run again at each lower instruction-set level (make test)

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


# ---------------------------------------------------------------------------- invalid input
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


BAD_CALLS: list[tuple[Callable[[], None], str]] = [
    (_rms_norm_wrong_weight, r"rms_norm: weight must be a contiguous \[hidden\] = \[576\] tensor"),
    (_rms_norm_weight_dtype, r"rms_norm: weight must have the input's dtype BFloat16, got Float"),
    (_rms_norm_3d, r"rms_norm: input must be 2-D \[T, hidden\], got 3-D"),
    (_fused_add_strided_residual, r"fused_add_rms_norm: residual must be a contiguous tensor"),
    (
        _fused_add_strided_input,
        r"fused_add_rms_norm: input must be contiguous \(token-major\) or .*feature-major.*"
        r"got strides \[600, 1\]",
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
