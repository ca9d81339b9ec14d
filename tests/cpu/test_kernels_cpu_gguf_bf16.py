"""The GGUF kernels' bf16 dot products (minivllm/cpu/csrc/cpu_gguf_gemm_bf16.cpp) against their specification.

With dot="bf16" `gguf_linear` rounds the dequantized weights and x to bf16 (round to nearest even,
as torch's `.to(torch.bfloat16)`) and sums their products in float32. Two bf16 significands of 8
bits multiply exactly in float32, so the only roundings are the float32 sums: each output is held
to the float64 product of the *rounded* operands within the float32 path's bound,

    |out - bf16(x) @ bf16(W).T| <= 4 * eps32 * sqrt(K) * (|x| @ |W|.T),

which pins the rounding (a kernel that truncated, or paired the wrong weights with a token, is far
outside it), and to the unrounded product within 2^-8 * (|x| @ |W|.T) (each factor is off by at
most 2^-9), the tolerance the op promises. Each output is also the same chain of dot products
whatever the number of token rows, so a row computed in a batch of 300 (the chunked path) equals
it computed alone (on the fly) bit for bit: the property that makes greedy output independent of
batching. CPUs without AVX512-BF16 skip (the float32 path, tested in test_kernels_cpu_gguf.py, is
what they run), and the op refuses to run there.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from minivllm import envs
from minivllm.cpu.build import load_cpu_kernels
from minivllm.cpu.ops import gguf_has_bf16_dot, gguf_linear
from tests.cpu.test_kernels_cpu_gguf import EPS32, TYPES, T, random_blocks

pytestmark = pytest.mark.cpu_isa  # run again at each lower instruction-set level (make test)

N = 37


@pytest.fixture(scope="module", autouse=True)
def bf16_cpu() -> None:
    load_cpu_kernels()  # fails, not skips, where the library cannot be built
    if not gguf_has_bf16_dot():
        pytest.skip("this CPU has no AVX512-BF16: gguf_linear runs its float32 products here")


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def assert_bf16_linear(out: torch.Tensor, x: torch.Tensor, w: np.ndarray) -> None:
    wt = torch.from_numpy(w).double()  # [N, K] dequantized
    magnitude = x.double().abs() @ wt.abs().T
    rounded = bf16(x) @ bf16(wt).T
    excess = ((out.double() - rounded).abs() - 4 * EPS32 * x.shape[1] ** 0.5 * magnitude).max()
    assert excess.item() <= 0, (
        f"an output is {excess.item():.3g} past bf16 products summed in float32"
    )
    promised = ((out.double() - x.double() @ wt.T).abs() - 2.0**-8 * magnitude).max()
    assert promised.item() <= 0, f"an output is {promised.item():.3g} past the 2^-8 tolerance"


@pytest.mark.parametrize("m", [1, 5, 24, 40, 300])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_bf16_linear_is_bf16_products_summed_in_float32(qtype: T, m: int) -> None:
    q = random_blocks(qtype, N, 512, seed=m)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    out = gguf_linear(x, torch.from_numpy(q), int(qtype), dot="bf16")
    assert out.shape == (m, N) and out.dtype == torch.float32
    assert_bf16_linear(out, x, dequantize(q, qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_row_is_the_same_in_any_batch(qtype: T) -> None:
    q = torch.from_numpy(random_blocks(qtype, N, 256, seed=7))
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(7))
    batch = gguf_linear(x, q, int(qtype), dot="bf16")  # the chunked path
    for rows in (slice(0, 1), slice(9, 10), slice(0, 24), slice(3, 19), slice(299, 300)):
        assert torch.equal(batch[rows], gguf_linear(x[rows], q, int(qtype), dot="bf16"))


def test_bf16_linear_reads_strided_token_rows() -> None:
    q = random_blocks(T.Q4_1, N, 256, seed=4)
    wider = torch.randn(5, 300, generator=torch.Generator().manual_seed(4))[:, :256]
    out = torch.empty(5, N)
    torch.ops.minivllm_cpu.gguf_linear_bf16(out, wider, torch.from_numpy(q), int(T.Q4_1))
    assert_bf16_linear(out, wider, dequantize(q, T.Q4_1))


def test_an_unknown_dot_is_refused() -> None:
    q = torch.from_numpy(random_blocks(T.Q8_0, N, 256, seed=5))
    with pytest.raises(ValueError, match="dot must be 'float32', 'bf16' or 'int8', got 'fp8'"):
        gguf_linear(torch.zeros(1, 256), q, int(T.Q8_0), dot="fp8")


def test_the_environment_variable_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINIVLLM_CPU_GGUF_DOT", "BF16")
    assert envs.cpu_gguf_dot() == "bf16"
    monkeypatch.setenv("MINIVLLM_CPU_GGUF_DOT", "fp8")
    with pytest.raises(
        ValueError, match="MINIVLLM_CPU_GGUF_DOT must be one of auto, bf16, float32, int8"
    ):
        envs.cpu_gguf_dot()
