"""Float16 linears on AMX-BF16 tiles (minivllm/cpu/csrc/cpu_f16_amx_gemm.cpp, minivllm/cpu/f16_amx.py)
against a float64 product of the same float16 operands.

The kernel splits each float16 into two bfloat16 exactly and sums three exact products in
float32, so its result must be the float16 rounding of the exact one, up to the dropped
lo · lo term and float32's sums: within half an ulp of the float16 result plus 2^-14 of
Σ|x||w| (the dropped term is below 2^-16 of it). Shapes that fill no tile (M, N, K not
multiples of 16 or 32), every epilogue (bias, erf and tanh GELU, residual), two threads (each
configures its own tile registers). With a LayerNorm (BERT's post-LayerNorm, run on the rows the
kernel has just written) the rows are F.layer_norm of the kernel's own float16 output, in float32,
rounded once. Skipped where the CPU has no AMX-BF16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minivllm.cpu.f16_amx import f16_amx_available, f16_amx_linear, f16_amx_pack


@pytest.fixture(scope="module", autouse=True)
def amx() -> None:
    if not f16_amx_available():
        pytest.skip("this CPU (or build, or kernel) has no AMX-BF16")


def half_ulp(y: torch.Tensor) -> torch.Tensor:  # float64 -> half a float16 ulp of each value
    exponent = torch.floor(torch.log2(y.abs().clamp(min=2.0**-14)))
    return torch.exp2(exponent - 11)


@pytest.mark.parametrize(
    ("m", "k", "n", "threads"), [(1, 64, 32, 1), (37, 100, 70, 2), (130, 384, 96, 1)]
)
@pytest.mark.parametrize("epilogue", ["bias", "gelu", "gelu_tanh", "residual", "none"])
def test_f16_amx_linear_is_the_rounded_float16_product(
    m: int, k: int, n: int, epilogue: str, threads: int
) -> None:
    gen = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, generator=gen).half()
    w = (torch.randn(n, k, generator=gen) * 0.1).half()
    b = torch.randn(n, generator=gen).half()
    r = torch.randn(m, n, generator=gen).half()
    exact = x.double() @ w.double().t()
    bias = None if epilogue == "none" else b
    act = {"gelu": "none", "gelu_tanh": "tanh"}.get(epilogue)
    residual = r if epilogue == "residual" else None
    ref = exact + (0 if bias is None else b.double())
    if act is not None:
        ref = F.gelu(ref, approximate=act)
    if residual is not None:
        ref = ref + r.double()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = f16_amx_linear(x, f16_amx_pack(w), n, bias, residual, act)
    finally:
        torch.set_num_threads(before)
    assert got.dtype == torch.float16 and got.shape == (m, n)
    bound = half_ulp(ref) + 2.0**-14 * (x.double().abs() @ w.double().abs().t()) + 1e-6
    assert ((got.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize(("m", "k", "n", "threads"), [(37, 100, 70, 2), (130, 384, 384, 1)])
def test_f16_amx_linear_layer_norm_is_layer_norm_of_its_float16_rows(
    m: int, k: int, n: int, threads: int
) -> None:
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=gen).half()
    packed = f16_amx_pack((torch.randn(n, k, generator=gen) * 0.1).half())
    b = torch.randn(n, generator=gen).half()
    r = torch.randn(m, n, generator=gen).half()
    norm = nn.LayerNorm(n, eps=1e-12).half()
    with torch.no_grad():
        norm.weight.copy_(torch.rand(n, generator=gen) + 0.5)
        norm.bias.copy_(torch.randn(n, generator=gen))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plain = f16_amx_linear(x, packed, n, b, r)  # [m, n]: the rows the LayerNorm reads
        got = f16_amx_linear(x, packed, n, b, r, None, norm)
    finally:
        torch.set_num_threads(before)
    w, beta = norm.weight.double(), norm.bias.double()
    ref = F.layer_norm(plain.double(), (n,), w, beta, norm.eps)
    assert got.dtype == torch.float16 and got.shape == (m, n)
    bound = half_ulp(ref) + 1e-5 * (ref.abs() + beta.abs()) + 1e-6  # float32's sums
    assert ((got.double() - ref).abs() <= bound).all()


def test_f16_amx_linear_layer_norm_rows_are_the_same_in_a_short_batch_and_a_long_one() -> None:
    """Fewer panels of 64 rows than threads (a short request alone) run the LayerNorm after the
    GEMM, many panels inside it: a row's values are the same bits either way."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(200, 96, generator=gen).half()
    packed = f16_amx_pack((torch.randn(80, 96, generator=gen) * 0.1).half())
    b = torch.randn(80, generator=gen).half()
    r = torch.randn(200, 80, generator=gen).half()
    norm = nn.LayerNorm(80, eps=1e-12).half()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        whole = f16_amx_linear(x, packed, 80, b, r, None, norm)  # 4 panels: inside the GEMM
        short = f16_amx_linear(x[:40], packed, 80, b, r[:40], None, norm)  # 1 panel: after it
    finally:
        torch.set_num_threads(before)
    assert torch.equal(short, whole[:40])


def test_f16_amx_pack_holds_the_weight_exactly() -> None:
    """hi + lo of every packed weight is the float16 weight itself, padding zeros."""
    w = (torch.randn(40, 70) * 3).half()
    packed = f16_amx_pack(w)  # [N' / 16, K' / 32, 2, 16, 32]
    assert packed.shape == (4, 3, 2, 16, 32) and packed.dtype == torch.bfloat16
    tiles = packed.float().view(4, 3, 2, 16, 16, 2).sum(dim=2)  # hi + lo: [4, 3, 16, 16, 2]
    plain = tiles.permute(0, 3, 1, 2, 4).reshape(64, 96)
    assert torch.equal(plain[:40, :70], w.float())
    assert not plain[40:].any() and not plain[:, 70:].any()
