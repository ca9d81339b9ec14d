"""The GGUF block kernels (minivllm/cpu/csrc/cpu_gguf_gemm.cpp) against gguf's own numpy dequantization.

`gguf_dequantize` must give `gguf.quants.dequantize`'s float32 bit for bit: every product in a
block's formula is exact in float32 and the only rounding is one add, so there is no order to
differ in (the C++ file's header says why). `gguf_linear` must equal `x @ dequantize(W).T` up to
float32 summation order: the kernel sums each output in 16-lane partial sums along K, the float64
reference exactly, so each output is held to

    |out - ref| <= 4 * eps32 * sqrt(K) * (|x| @ |W|.T)      (eps32 = 2^-23)

elementwise, the random-walk growth of rounding errors over K products (observed errors are ~30x
below it). Weights: `gguf.quants.quantize` of random normals for Q4_0..Q8_0; for the K-quants, for
which gguf has no quantizer, random bytes with their fp16 scales set to small finite values, so
that every bit pattern of the quants and sub-scales is exercised. N = 37 leaves a partial row
group and an uneven split over threads; M covers one token, partial token tiles, several tiles,
and (300) the chunked path of larger batches.

AVX2 builds take 8-bit integer dots instead (`gguf_dot_kind() == "int8"`, cpu_gguf_gemm_avx2.cpp):
x is rounded to blocks of 32 (K-quants: 256) with one scale dx = max|x_block| / 127 each, which no
float tolerance covers. There every product is held twice: tightly to a numpy model of that same
scheme (x rounded exactly as the kernel rounds it, times the dequantized weight in float64,
`int8_reference`), and to the float product within what the rounding of x can cost,

    |out - x @ W.T| <= (|W| @ (dx / 2).T) + 4 * eps32 * sqrt(K) * (|x| @ |W|.T)

(each x element is off by at most dx / 2). The tests run whichever path the loaded library has; run
them once more with `MINIVLLM_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2` for the AVX2 one.

These build the library (once per machine) and skip, with the reason, where it cannot be built.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from minivllm.cpu import ops as cpu_ops
from minivllm.cpu.build import load_cpu_kernels
from minivllm.cpu.ops import (
    GGUF_BLOCK_SIZES,
    GGUF_KERNEL_TYPES,
    gguf_dequantize,
    gguf_dot_kind,
    gguf_linear,
)

pytestmark = pytest.mark.cpu_isa  # run again at each lower instruction-set level (make test)

T = gguf.GGMLQuantizationType
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
K_QUANTS = {T.Q4_K, T.Q5_K, T.Q6_K}
N = 37
EPS32 = 2.0**-23


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    # Fails, not skips, where the library cannot be built, as the other kernel tests do: a
    # skipped kernel test would pass on a broken build.
    load_cpu_kernels()


def random_blocks(qtype: T, n: int, k: int, seed: int) -> np.ndarray:  # uint8 [n, row_bytes]
    rng = np.random.default_rng(seed)
    if qtype not in K_QUANTS:
        return quantize(rng.standard_normal((n, k), dtype=np.float32), qtype)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n, k // block_size, type_size), dtype=np.uint8)

    def scales() -> np.ndarray:  # uint8 [n, blocks, 2]: fp16 in [0.001, 0.1]
        values = rng.uniform(0.001, 0.1, size=(n, k // block_size)).astype(np.float16)
        return values.view(np.uint8).reshape(n, k // block_size, 2)

    if qtype == T.Q6_K:  # | ql[128] | qh[64] | scales[16] | fp16 d |
        blocks[..., 208:210] = scales()
    else:  # | fp16 d | fp16 dmin | ...
        blocks[..., 0:2], blocks[..., 2:4] = scales(), scales()
    return blocks.reshape(n, -1)


def x_blocks(x: torch.Tensor, block: int) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] rounded as the int8 kernel rounds it: (xq [M, K] integers as float32, dx [M, K]
    each element's block scale). xq = rint(x * (127 / max|x_block|)), rint halving to even."""
    xb = x.contiguous().numpy().astype(np.float32).reshape(x.shape[0], -1, block)
    amax = np.abs(xb).max(axis=-1, keepdims=True)  # [M, K / block, 1] float32
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    xq = np.rint(xb * inv)
    dx = np.broadcast_to(amax / np.float32(127), xb.shape)
    return xq.reshape(x.shape), dx.reshape(x.shape)


def int8_reference(x: torch.Tensor, w: np.ndarray, qtype: T) -> torch.Tensor:  # [M, N] float64
    """The int8 kernel's product done exactly: Σ_blocks dx · (xq · w) in float64."""
    xq, dx = x_blocks(x, 256 if qtype in K_QUANTS else 32)
    return torch.from_numpy(xq.astype(np.float64) * dx) @ torch.from_numpy(w).double().T


def assert_linear_close(out: torch.Tensor, x: torch.Tensor, w: np.ndarray, qtype: T) -> None:
    """out against x @ w.T: within float32 rounding for the float32 path; for the int8 path,
    tightly to `int8_reference` and within x's rounding of the float product."""
    wt = torch.from_numpy(w).double()  # [N, K] dequantized
    ref = x.double() @ wt.T
    magnitude = x.double().abs() @ wt.abs().T  # [M, N]
    bound = 4 * EPS32 * x.shape[1] ** 0.5 * magnitude
    assert out.shape == ref.shape and out.dtype == torch.float32
    if not out.numel():
        return
    if gguf_dot_kind() == "int8":
        scheme = int8_reference(x, w, qtype)
        _, dx = x_blocks(x, 256 if qtype in K_QUANTS else 32)
        excess = ((out.double() - scheme).abs() - bound).max().item()
        assert excess <= 0, f"an output is {excess:.3g} past its bound from the 8-bit scheme"
        bound = bound + torch.from_numpy(dx / 2).double() @ wt.abs().T
    excess = ((out.double() - ref).abs() - bound).max().item()
    assert excess <= 0, f"an output is {excess:.3g} past its bound"


def test_kernel_types_are_gguf_block_formats() -> None:
    assert {int(t) for t in TYPES} == GGUF_KERNEL_TYPES
    for t in TYPES:
        assert GGUF_BLOCK_SIZES[int(t)] == gguf.GGML_QUANT_SIZES[t]


@pytest.mark.parametrize("k", [256, 512])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_is_gguf_dequantize_bit_for_bit(qtype: T, k: int) -> None:
    q = random_blocks(qtype, N, k, seed=k)
    got = gguf_dequantize(torch.from_numpy(q), int(qtype))
    assert got.shape == (N, k) and got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy().view(np.uint32), dequantize(q, qtype).view(np.uint32))


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_dequantize_gathered_rows_as_an_embedding_lookup(qtype: T) -> None:
    q = random_blocks(qtype, 50, 256, seed=3)
    ids = torch.tensor([7, 0, 49, 7])
    got = gguf_dequantize(torch.from_numpy(q)[ids], int(qtype))
    np.testing.assert_array_equal(got.numpy(), dequantize(q, qtype)[ids.numpy()])


@pytest.mark.parametrize("m", [1, 3, 16, 33, 100])
@pytest.mark.parametrize("k", [256, 512])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_linear_equals_matmul_on_the_dequantized_weight(qtype: T, k: int, m: int) -> None:
    q = random_blocks(qtype, N, k, seed=k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    assert_linear_close(
        gguf_linear(x, torch.from_numpy(q), int(qtype)), x, dequantize(q, qtype), qtype
    )


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_linear_of_a_large_batch_takes_the_chunked_path(qtype: T) -> None:
    q = random_blocks(qtype, N, 256, seed=9)
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(9))
    assert_linear_close(
        gguf_linear(x, torch.from_numpy(q), int(qtype)), x, dequantize(q, qtype), qtype
    )


@pytest.mark.parametrize("dot", ["float32", "bf16"])
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_many_rows_dequantize_in_chunks_then_multiply(
    qtype: T, dot: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long prompt's rows: the weight dequantized a few rows at a time (a small chunk here, so
    that several chunks and a short last one run) and multiplied by PyTorch's GEMM, float32 within
    float32's rounding, bf16 within the bf16 rounding of both operands and of the output."""
    monkeypatch.setattr(cpu_ops, "GGUF_DEQUANTIZE_CHUNK_BYTES", 7 * 4 * 256)  # 7 rows a chunk
    q = random_blocks(qtype, N, 256, seed=11)
    x = torch.randn(
        cpu_ops.GGUF_DEQUANTIZE_MIN_ROWS + 3, 256, generator=torch.Generator().manual_seed(3)
    )
    out = cpu_ops.gguf_linear_dequantized(
        x.t().contiguous().t(), torch.from_numpy(q), int(qtype), dot
    )
    wt = torch.from_numpy(dequantize(q, qtype)).double()
    ref = x.double() @ wt.T
    magnitude = x.double().abs() @ wt.abs().T
    rounding = 2**-8 + 2**-9 if dot == "bf16" else 0.0
    bound = (rounding + 4 * EPS32 * x.shape[1] ** 0.5) * magnitude
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert ((out.double() - ref).abs() - bound).max().item() <= 0
    with pytest.raises(ValueError, match="dot must be"):
        cpu_ops.gguf_linear_dequantized(x, torch.from_numpy(q), int(qtype), "int4")


def test_the_model_s_linears_dequantize_from_the_row_bound_only_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gguf_linear_cpu (the CPU forward of a GGUF layer) keeps every row count on the
    batch-invariant tiles by default, and picks by row count under MINIVLLM_CPU_GGUF_GEMM_ROWS."""
    from minivllm.cpu import op_forwards

    calls: list[str] = []
    monkeypatch.setattr(
        cpu_ops, "gguf_linear", lambda *a: calls.append("tiles") or torch.zeros(a[0].shape[0], N)
    )
    monkeypatch.setattr(
        cpu_ops,
        "gguf_linear_dequantized",
        lambda *a: calls.append("dense") or torch.zeros(a[0].shape[0], N),
    )
    q = torch.from_numpy(random_blocks(T.Q4_1, N, 256, seed=1))
    monkeypatch.setattr(op_forwards, "gguf_parts", lambda op: [(int(T.Q4_1), q)])
    bound = cpu_ops.GGUF_DEQUANTIZE_MIN_ROWS
    for rows, expected in ((None, ["tiles"] * 3), (bound, ["tiles", "tiles", "dense"])):
        monkeypatch.setattr(op_forwards, "gguf_gemm_rows", lambda rows=rows: rows)
        calls.clear()
        for m in (1, bound - 1, bound):
            op_forwards.gguf_linear_cpu(None, torch.zeros(m, 256), None)  # type: ignore[arg-type]
        assert calls == expected


def test_the_gemm_rows_variable_is_refused_unless_a_count(monkeypatch: pytest.MonkeyPatch) -> None:
    from minivllm.envs import cpu_gguf_gemm_rows

    monkeypatch.setenv("MINIVLLM_CPU_GGUF_GEMM_ROWS", "256")
    assert cpu_gguf_gemm_rows() == 256
    monkeypatch.setenv("MINIVLLM_CPU_GGUF_GEMM_ROWS", "0")
    assert cpu_gguf_gemm_rows() is None
    monkeypatch.setenv("MINIVLLM_CPU_GGUF_GEMM_ROWS", "many")
    with pytest.raises(ValueError, match="MINIVLLM_CPU_GGUF_GEMM_ROWS must be a whole number"):
        cpu_gguf_gemm_rows()


def test_linear_reads_every_layout_the_model_hands_over() -> None:
    q = random_blocks(T.Q4_1, N, 256, seed=4)
    w = dequantize(q, T.Q4_1)
    g = torch.Generator().manual_seed(4)
    feature_major = torch.randn(256, 5, generator=g).t()  # a CPU linear's transposed output
    wider = torch.randn(5, 300, generator=g)[:, :256]  # token rows with a longer row stride
    one = torch.randn(256, 1, generator=g).t()  # [1, 256] with strides (1, 1)
    for x in (feature_major, wider, one):
        assert_linear_close(gguf_linear(x, torch.from_numpy(q), int(T.Q4_1)), x, w, T.Q4_1)
    out = torch.empty(5, N)  # the op itself takes strided token rows as they are
    torch.ops.minivllm_cpu.gguf_linear(out, wider, torch.from_numpy(q), int(T.Q4_1))
    assert_linear_close(out, wider, w, T.Q4_1)


@pytest.mark.parametrize("m", [1, 8, 64, 300])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_linear_on_two_threads_in_inference_mode(qtype: T, m: int) -> None:
    # The engine runs under inference_mode, and at::parallel_for's workers do not carry it: an ATen
    # op on an inference tensor in a worker is refused ("Inplace update to inference tensor
    # outside InferenceMode"), as the AVX2 build's at::mm_out once was for every request. pytest
    # runs one thread, which runs parallel regions inline; two make the workers real. K = 1024 and
    # N = 300 give every path (tiles, chunks, int8 groups) more than one work item.
    q = random_blocks(qtype, 300, 1024, seed=m)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(m))
            out = gguf_linear(x, torch.from_numpy(q), int(qtype))
    finally:
        torch.set_num_threads(threads)
    assert_linear_close(out, x, dequantize(q, qtype), qtype)


def test_int8_dots_are_the_8bit_block_scheme() -> None:
    # The int8 path's own specification, apart from the float bound: rows of x whose blocks round
    # in the corner cases (all zeros: scale 0, no division by zero; one spike: the rest round to
    # 0; exact half-way points, x * 127 / max = k + 1/2: rint's halving to even) give the numpy
    # model of the scheme. dot="int8": the AVX2 build's own product, or AVX512-VNNI's dots on an
    # AVX-512 build.
    if not cpu_ops.gguf_has_int8_dot():
        pytest.skip("this build (or CPU) has no int8 dot")
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(11))
    x[0, :256] = 0.0
    x[1, 32:64] = 0.0
    x[1, 40] = 3.0
    x[2, :31] = (torch.arange(-16, 15) + 0.5) / 32  # the block's max 127 / 32: x * 127 / max = 32 x
    x[2, 31] = 127 / 32
    for qtype in TYPES:
        q = random_blocks(qtype, N, 512, seed=int(qtype))
        w = dequantize(q, qtype)
        out = gguf_linear(x, torch.from_numpy(q), int(qtype), "int8").double()
        xq, dx = x_blocks(x, 256 if qtype in K_QUANTS else 32)
        magnitude = (
            torch.from_numpy(np.abs(xq).astype(np.float64) * dx)
            @ torch.from_numpy(np.abs(w)).double().T
        )
        bound = 4 * EPS32 * 512**0.5 * magnitude
        assert ((out - int8_reference(x, w, qtype)).abs() <= bound).all(), qtype.name


@pytest.mark.parametrize("qtype", sorted(K_QUANTS), ids=lambda t: t.name)
def test_int8_k_quant_prefill_tile_holds_the_largest_products(qtype: T) -> None:
    # The K-quants' many-token tile (cpu_gguf_krows_avx2.h) adds a sub-scale's products in int16
    # before scaling them; every quant at its largest (all bits set) and |xq| = 127 everywhere
    # give the sums nearest int16's range, which must still come out exact. M = 12 takes that tile.
    if not cpu_ops.gguf_has_int8_dot():
        pytest.skip("this build (or CPU) has no int8 dot")
    q = random_blocks(qtype, N, 512, seed=5).reshape(N, 2, -1)
    quants = {T.Q4_K: slice(16, 144), T.Q5_K: slice(16, 176), T.Q6_K: slice(0, 192)}[qtype]
    q[:, :, quants] = 0xFF
    q = q.reshape(N, -1)
    x = torch.ones(12, 512)
    x[1::2] = -1.0
    w = dequantize(q, qtype)
    out = gguf_linear(x, torch.from_numpy(q), int(qtype), "int8").double()
    magnitude = torch.from_numpy(np.abs(w)).double().sum(dim=1) * x.abs().max()
    assert ((out - int8_reference(x, w, qtype)).abs() <= 4 * EPS32 * magnitude).all()


def test_zero_tokens() -> None:
    q = torch.from_numpy(random_blocks(T.Q8_0, N, 256, seed=5))
    assert gguf_linear(torch.empty(0, 256), q, int(T.Q8_0)).shape == (0, N)


@pytest.mark.parametrize("qtype", [0, 1, 10, 11, 15, 30])  # F32, F16, Q2_K, Q3_K, Q8_K, BF16
def test_unsupported_types_are_refused_by_number(qtype: int) -> None:
    q = torch.zeros(4, 64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=f"GGML type {qtype} is not supported"):
        torch.ops.minivllm_cpu.gguf_linear(torch.empty(1, 4), torch.zeros(1, 256), q, qtype)
    with pytest.raises(RuntimeError, match=f"GGML type {qtype} is not supported"):
        torch.ops.minivllm_cpu.gguf_dequantize(torch.empty(4, 256), q, qtype)


@pytest.mark.parametrize(
    ("x", "q", "qtype", "match"),
    [
        (torch.zeros(2, 256), torch.zeros(3, 144, dtype=torch.uint8), 3, "rows must be 160 bytes"),
        (torch.zeros(2, 100), torch.zeros(3, 80, dtype=torch.uint8), 3, "multiple of the type's block"),
        (torch.zeros(2, 288), torch.zeros(3, 144, dtype=torch.uint8), 12, "multiple of the type's block"),
        (torch.zeros(2, 256, dtype=torch.bfloat16), torch.zeros(3, 160, dtype=torch.uint8), 3, "float32"),
        (torch.zeros(2, 256), torch.zeros(3, 160), 3, "uint8"),
    ],
)  # fmt: skip
def test_bad_arguments_name_the_problem(
    x: torch.Tensor, q: torch.Tensor, qtype: int, match: str
) -> None:
    with pytest.raises(RuntimeError, match=match):
        torch.ops.minivllm_cpu.gguf_linear(torch.empty(x.shape[0], q.shape[0]), x, q, qtype)


def test_bf16_chunks_flush_denormals_as_the_bf16_dot_does() -> None:
    # Past the on-the-fly bound the bf16 products run as float32 FMAs (cpu_gguf_gemm_bf16.cpp),
    # which must read and write denormals as zero, as vdpbf16ps does, to keep a row's bits: tiny
    # activations put many partial sums below float32's smallest normal.
    if not cpu_ops.gguf_has_bf16_dot():
        pytest.skip("this CPU (or build) has no AVX512-BF16")
    q = torch.from_numpy(random_blocks(T.Q4_1, N, 256, seed=5))
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(5)).sign() * 2e-38
    alone = torch.cat([gguf_linear(x[i : i + 1], q, int(T.Q4_1), "bf16") for i in range(40)])
    batch = gguf_linear(x, q, int(T.Q4_1), "bf16")
    assert (alone.abs() < 2**-126).any() and (alone.abs() >= 2**-126).any()
    assert torch.equal(batch, alone)


@pytest.mark.parametrize("dot", ["float32", "bf16", "int8"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_row_s_output_does_not_depend_on_the_batch_around_it(qtype: T, dot: str) -> None:
    # Batch-invariance: a token row multiplied alone gives, bit for bit, what it gives inside a
    # batch of any size, whichever path (in-register tiles at few rows, unpacked rows or chunks at
    # many) each batch takes.
    if dot == "bf16" and not cpu_ops.gguf_has_bf16_dot():
        pytest.skip("this CPU (or build) has no AVX512-BF16")
    if dot == "int8" and (gguf_dot_kind() == "int8" or not cpu_ops.gguf_has_int8_dot()):
        pytest.skip("no int8 dot apart from this build's own product")
    # 11 super-blocks (K-quants) or 19 blocks (the others) a row, so that their 8 float partials
    # (cpu_gguf_kfloat_avx2.h, cpu_gguf_block32_avx2.h) wrap around and the last group of 8 is
    # partial; 19 blocks also leave a pair of one block. N = 37 rows: the interleaved tiles
    # (tile_octet, tile_octet32) end on an octet of 5 rows; M = 13 and 40 end on a tile of 1 and 4
    # tokens.
    k = 2816 if qtype in K_QUANTS else 608
    q = torch.from_numpy(random_blocks(qtype, N, k, seed=3))
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([gguf_linear(x[i : i + 1], q, int(qtype), dot) for i in range(9)])
    for m in (2, 3, 4, 5, 8, 9, 13, 40, 64, 300):
        batch = gguf_linear(x[:m], q, int(qtype), dot)[:9]
        assert torch.equal(batch, alone[:m]), f"M = {m}"


def test_auto_gives_the_k_quants_int8_where_there_are_8bit_dots_and_a_missing_kind_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The engine's choice per block type (op_forwards.gguf_dot), on each kind of CPU: the K-quants,
    # Q8_0, Q4_0 and Q4_1 take 8-bit dots where the library has them, Q5_0 and Q5_1 bf16 or
    # float32; a forced kind holds for every type, and one the CPU lacks is refused by name.
    from minivllm.cpu import op_forwards

    def cpu(env: str, int8: bool, bf16: bool) -> None:
        monkeypatch.setenv("MINIVLLM_CPU_GGUF_DOT", env)
        monkeypatch.setattr(cpu_ops, "gguf_has_int8_dot", lambda: int8)
        monkeypatch.setattr(cpu_ops, "gguf_has_bf16_dot", lambda: bf16)
        op_forwards.gguf_dot.cache_clear()

    int8_types, others = (2, 3, 8, 12, 13, 14), (6, 7)
    try:
        for int8, bf16, k_dot, other_dot in [
            (True, True, "int8", "bf16"),  # AVX512-BF16 and VNNI
            (True, False, "int8", "float32"),  # AVX-512 with VNNI; AVX2 (its float32 is int8)
            (False, False, "float32", "float32"),  # AVX-512 without VNNI, generic, ARM
        ]:
            cpu("auto", int8, bf16)
            assert [op_forwards.gguf_dot(t) for t in int8_types] == [k_dot] * 6
            assert [op_forwards.gguf_dot(t) for t in others] == [other_dot] * 2
        cpu("bf16", True, True)
        assert {op_forwards.gguf_dot(t) for t in int8_types + others} == {"bf16"}
        cpu("int8", False, True)
        with pytest.raises(ValueError, match="MINIVLLM_CPU_GGUF_DOT=int8, but this build has no"):
            op_forwards.gguf_dot(12)
    finally:
        op_forwards.gguf_dot.cache_clear()
