"""The Triton GGUF GEMM against gguf's own dequantize followed by a float32 matmul.

The reference is `x @ torch.from_numpy(gguf.quants.dequantize(q, type)).T`: the `gguf` library
(maintained with llama.cpp) is the specification of every block layout. On a CPU machine the
kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before Triton is
imported, and importing the kernel module does the same), on small shapes: M in {1, 5}, N in
{8, 24}, K of one and two super-blocks, and for the 32-weight types a K that is not a multiple of
the interpreter's 256-weight tile. The GPU's tile sizes run in the interpreter too, on shapes that
cross several tiles in every direction, and a compile-only test builds every variant for sm_90
without a GPU. The `gpu`-marked test runs model-sized shapes compiled on CUDA (`make test-gpu`).

Weights: `gguf.quants.quantize` of Gaussian rows for Q4_0..Q8_0 (gguf has no quantizer for the
K-quants); for Q4_K, Q5_K and Q6_K random bytes, every code and packed scale equally likely,
with the float16 d and dmin set to values in [0.001, 0.1] so that no block is inf or NaN.

Tolerance (float32): the kernel dequantizes each weight with the reference's own float32
operations in the same order (a float16 scale times small integers is exact in float32), so
the two differ only in the order the K products are summed: a few float32 ulps of the largest
terms, about 1e-6 of the output's scale at these K. `rtol=1e-4, atol=1e-4 * max|ref|` leaves
two orders of magnitude of room for that and none for a misread bit, which moves an output by
d·|x| or more, a percent of the scale or more.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from minivllm.model.quantization.gguf.triton_kernels import (  # after the skip: needs Triton
    INTERPRETED,
    TRITON_GGUF_TYPES,
    gguf_linear_triton,
    gguf_tiles,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
T = gguf.GGMLQuantizationType
SIMPLE_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
K_QUANTS = [T.Q4_K, T.Q5_K, T.Q6_K]
ALL_TYPES = SIMPLE_TYPES + K_QUANTS
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def random_qweight(qtype: T, n: int, k: int, seed: int) -> np.ndarray:  # uint8 [n, row_bytes]
    """N rows of K weights of `qtype`, as the bytes a GGUF file stores."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in SIMPLE_TYPES:
        return gguf.quants.quantize(rng.standard_normal((n, k), dtype=np.float32), qtype)
    blocks = rng.integers(0, 256, (n, k // block_size, type_size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.1, (n, k // block_size, 2)).astype(np.float16)
    scale_bytes = scales.view(np.uint8)  # [n, blocks, 4]: d, then dmin (Q6_K: d only)
    if qtype == T.Q6_K:
        blocks[..., 208:210] = scale_bytes[..., :2]
    else:
        blocks[..., 0:4] = scale_bytes
    return blocks.reshape(n, -1)


def reference(x: torch.Tensor, q: np.ndarray, qtype: T) -> torch.Tensor:  # float32 [M, N]
    weight = torch.from_numpy(gguf.quants.dequantize(q, qtype)).to(x.device)  # [N, K]
    return x.float() @ weight.T


def check_matches_reference(
    qtype: T,
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype = F32,
    device: str = "cpu",
    tiles: dict[str, int] | None = None,
    rtol: float = 1e-4,
) -> None:
    seed = zlib.crc32(f"{qtype.name}-{m}-{n}-{k}-{dtype}".encode())
    q = random_qweight(qtype, n, k, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(device, dtype)
    out = gguf_linear_triton(x, torch.from_numpy(q).to(device), int(qtype), tiles=tiles)
    assert out.shape == (m, n) and out.dtype == dtype
    ref = reference(x, q, qtype)
    torch.testing.assert_close(out.float(), ref, rtol=rtol, atol=rtol * ref.abs().max().item())


# ================================================================ the interpreter (CPU tensors)

GRID = [
    (qtype, m, n, k)
    for qtype in ALL_TYPES
    for k in ((256, 288, 512) if qtype in SIMPLE_TYPES else (256, 512))
    for m in (1, 5)
    for n in (8, 24)
]


@pytest.mark.parametrize(
    ("qtype", "m", "n", "k"), GRID, ids=[f"{t.name}-m{m}-n{n}-k{k}" for t, m, n, k in GRID]
)
def test_triton_gguf_matches_dequantize_then_matmul(qtype: T, m: int, n: int, k: int) -> None:
    check_matches_reference(qtype, m, n, k)


# (M, N, K, the dtype whose GPU tiles run): the decode tiles cross 2 N tiles and 8 (float32) or
# 4 K tiles, so a K-quant super-block spans several; the prefill tiles cross 2 M tiles, 2 N tiles
# and 16 K tiles.
GPU_TILE_SHAPES = [(5, 40, 512, F32), (5, 40, 512, BF16), (70, 72, 512, F32), (70, 72, 512, BF16)]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_gpu_tiles_match_in_the_interpreter(qtype: T) -> None:
    """The tiles a GPU launch uses, which are smaller than the interpreter's along every axis."""
    for m, n, k, tile_dtype in GPU_TILE_SHAPES:
        tiles = gguf_tiles(m, tile_dtype, interpreted=False)
        check_matches_reference(qtype, m, n, k, tiles=tiles)


@pytest.mark.parametrize(
    ("dtype", "rtol"), [(BF16, 2**-8), (F16, 2**-11)], ids=["bfloat16", "float16"]
)
def test_16bit_activations_round_only_the_output(dtype: torch.dtype, rtol: float) -> None:
    """In the interpreter x is widened to float32, so the result is the float32 one, rounded once
    to x's dtype: within half an ulp (2^-8 relative for bfloat16, 2^-11 for float16, with room)."""
    for qtype in (T.Q4_0, T.Q6_K):
        check_matches_reference(qtype, 5, 24, 256, dtype=dtype, rtol=rtol)


def test_x_with_a_row_stride_wider_than_k() -> None:
    q = random_qweight(T.Q5_K, 8, 256, seed=1)
    wide = torch.randn(3, 300)
    x = wide[:, :256]  # a view: rows 300 apart, as a slice of a fused projection's output
    out = gguf_linear_triton(x, torch.from_numpy(q), int(T.Q5_K))
    ref = reference(x, q, T.Q5_K)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_zero_rows_give_an_empty_output() -> None:
    q = torch.from_numpy(random_qweight(T.Q8_0, 8, 64, seed=2))
    assert gguf_linear_triton(torch.empty(0, 64), q, int(T.Q8_0)).shape == (0, 8)


def test_supported_types_are_the_four_to_eight_bit_block_types() -> None:
    assert {int(t) for t in ALL_TYPES} == TRITON_GGUF_TYPES


def test_wrong_inputs_are_refused_with_the_reason() -> None:
    q = torch.from_numpy(random_qweight(T.Q4_0, 8, 64, seed=3))  # [8, 36]
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="GGML type 10 has no Triton kernel; supported: Q4_0"):
        gguf_linear_triton(x, q, int(T.Q2_K))
    with pytest.raises(ValueError, match="need K a multiple of 32 and 54 bytes, got 36"):
        gguf_linear_triton(torch.randn(2, 96), q, int(T.Q4_0))
    with pytest.raises(ValueError, match="need K a multiple of 32"):
        gguf_linear_triton(torch.randn(2, 48), q, int(T.Q4_0))
    with pytest.raises(ValueError, match="C-contiguous uint8"):
        gguf_linear_triton(x, q.to(torch.int8), int(T.Q4_0))
    with pytest.raises(ValueError, match="C-contiguous uint8"):
        gguf_linear_triton(x, q.T.contiguous().T, int(T.Q4_0))
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        gguf_linear_triton(x.double(), q, int(T.Q4_0))


# ======================================================================== compile-only, sm_90


def compile_all_variants() -> list[dict[str, Any]]:
    """Build every launch variant (type × float32/16-bit × decode/prefill tiles) for sm_90.

    `warmup` specialises the arguments exactly as a launch does and compiles, with CPU tensors
    standing in for the GPU's (the driver is `Sm90Driver`, which only names the target).
    """
    import triton

    from minivllm.model.quantization.gguf.triton_kernels import gguf_linear_kernel
    from tests.attention.test_attention_triton_launch import Sm90Driver, resource_usage

    if not torch.cuda.is_available():
        triton.runtime.driver.set_active(Sm90Driver())
    rows = []
    for qtype in ALL_TYPES:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        k, n = 4096, 4096
        qweight = torch.empty(n, k // block_size * type_size, dtype=torch.uint8)
        for dtype in (F32, BF16):
            for m in (1, 300):
                x, out = torch.empty(m, k, dtype=dtype), torch.empty(m, n, dtype=dtype)
                tiles = gguf_tiles(m, dtype, interpreted=False)
                kernel = gguf_linear_kernel.warmup(
                    x, qweight, out, m, n, k, qweight.shape[1], x.stride(0), out.stride(0),
                    QTYPE=int(qtype), QBLOCK=block_size, QBYTES=type_size,
                    DOT_16BIT=dtype != F32, grid=(1, 1), **tiles,
                )  # fmt: skip
                usage = resource_usage(kernel.asm["cubin"])
                rows.append(dict(
                    variant=f"{qtype.name} {str(dtype).removeprefix('torch.')} m{m}",
                    regs=usage["REG"], spill_bytes=usage["STACK"] + usage["LOCAL"],
                ))  # fmt: skip
    return rows


@pytest.mark.slow
def test_every_type_compiles_for_sm90_without_spills() -> None:
    """32 sm_90 builds in a process of their own (this one runs the kernel interpreted): ~30 s."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    # The worker is started as a script, so its sys.path starts at tests/: name this checkout.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-4000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    table = "\n".join(
        f"{r['variant']:<20} regs {r['regs']:>3}  spills {r['spill_bytes']} B" for r in rows
    )
    print("\nsm_90 builds:\n" + table)
    assert len(rows) == len(ALL_TYPES) * 4
    assert not [r for r in rows if r["spill_bytes"]], f"variants that spill:\n{table}"


# ================================================================================ a real GPU


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_compiled_triton_gguf_matches_reference_at_model_shapes(
    qtype: T, request: pytest.FixtureRequest
) -> None:
    """A decode batch and a prefill, N not a multiple of any tile, K of eight super-blocks.

    16-bit x rounds each weight to its dtype for the tensor cores (2^-9 relative for bfloat16,
    2^-12 for float16) before the float32 sum, and rounds the output: 4 ulps of room.
    """
    from tests.attention.test_attention_gpu import require_compiled_cuda

    require_compiled_cuda(request.config)
    assert not INTERPRETED
    for dtype, rtol in ((F32, 1e-4), (BF16, 2**-6), (F16, 2**-9)):
        for m in (1, 16, 300):
            check_matches_reference(qtype, m, 1000, 2048, dtype=dtype, device="cuda", rtol=rtol)


if __name__ == "__main__":  # the compile-only test's worker
    print(json.dumps(compile_all_variants()))
