"""The AMX kernels (minivllm/cpu/csrc/cpu_gguf_amx.cpp: the K-quants; cpu_gguf_amx32.h: Q4_0, Q4_1,
Q5_0, Q5_1) against the AVX512-VNNI one, bit for bit.

The AMX tiles sum each scale group's (or 32-weight block's) integer products in another order than
the VNNI lanes, and then run the same float steps on the same whole-super-block (whole-block)
integers (the C++ headers say why), so
every output must equal the VNNI kernel's exactly (`torch.equal`), at any token count: partial
token tiles (M not a multiple of 16), a partial block of 32 weight rows (N = 37), and on two
threads, whose workers each configure their own tile registers. Rows computed one at a time (the
decode path) are the same numbers again: what keeps greedy output the same under batching.
The VNNI kernel itself is held to the 8-bit scheme and the float product in test_kernels_cpu_gguf.py.
Skipped where the CPU has no AMX-INT8 (or the library no AMX kernel).
"""

from __future__ import annotations

import pytest
import torch

from minivllm.cpu import ops as cpu_ops
from minivllm.cpu.build import load_cpu_kernels
from tests.cpu.test_kernels_cpu_gguf import T, random_blocks

K_QUANTS = [T.Q4_K, T.Q5_K, T.Q6_K]
BLOCK32 = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
N = 37


@pytest.fixture(scope="module", autouse=True)
def amx() -> None:
    load_cpu_kernels()
    if not cpu_ops.gguf_has_amx():
        pytest.skip("this CPU (or build, or kernel) has no AMX-INT8")


def vnni_and_amx(x: torch.Tensor, q: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor]:
    vnni, tiles = torch.empty(x.shape[0], q.shape[0]), torch.empty(x.shape[0], q.shape[0])
    torch.ops.minivllm_cpu.gguf_linear_int8(vnni, x, q, qtype)
    torch.ops.minivllm_cpu.gguf_linear_amx(tiles, x, q, qtype)
    return vnni, tiles


# Per type: K (the row's weights) and the token counts M. The K-quants at 11 super-blocks a row,
# the 32-weight types at 19 blocks: the 8 float partials wrap around and the last group of 8 is
# partial (the 32-weight types' last pair of blocks is one block, an odd count); M runs through
# partial and whole tiles of 16 tokens.
CASES = [
    *[pytest.param(t, 2816, (1, 16, 17, 31, 33, 100), id=t.name) for t in K_QUANTS],
    *[pytest.param(t, 608, (1, 8, 15, 16, 17, 40), id=t.name) for t in BLOCK32],
]


@pytest.mark.parametrize(("qtype", "k", "ms"), CASES)
def test_amx_rows_equal_the_vnni_kernel_s_bit_for_bit(
    qtype: T, k: int, ms: tuple[int, ...]
) -> None:
    block = 256 if qtype in K_QUANTS else 32  # the weights of x's 8-bit blocks
    q = torch.from_numpy(random_blocks(qtype, N, k, seed=5))
    x = torch.randn(ms[-1], k, generator=torch.Generator().manual_seed(5))
    x[3] = 0.0  # an all-zero row: its blocks' scale is 0
    x[4, :block] *= 1e4  # one block far larger than the others
    for m in ms:
        vnni, tiles = vnni_and_amx(x[:m], q, int(qtype))
        assert torch.equal(tiles, vnni), f"M = {m}"
    rows = [0, 4, ms[-1] // 2, ms[-1] - 1]
    alone = torch.cat([cpu_ops.gguf_linear(x[i : i + 1], q, int(qtype), "int8") for i in rows])
    assert torch.equal(tiles[rows], alone)


@pytest.mark.parametrize("qtype", [*K_QUANTS, T.Q4_1], ids=lambda t: t.name)
def test_amx_on_two_threads_in_inference_mode(qtype: T) -> None:
    # Each worker loads its tile configuration (thread state); N = 300 gives each several blocks.
    q = torch.from_numpy(random_blocks(qtype, 300, 512, seed=6))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            x = torch.randn(40, 512, generator=torch.Generator().manual_seed(6))
            vnni, tiles = vnni_and_amx(x, q, int(qtype))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(tiles, vnni)


def test_the_int8_dot_takes_amx_for_prefill_rows_unless_switched_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MINIVLLM_CPU_AMX", raising=False)
    rows = cpu_ops.GGUF_AMX_MIN_ROWS
    assert cpu_ops.gguf_amx_applies(rows, int(T.Q4_K))
    assert not cpu_ops.gguf_amx_applies(rows - 1, int(T.Q4_K))  # decode: the in-register tiles
    assert cpu_ops.gguf_amx_applies(rows, int(T.Q4_1))
    assert not cpu_ops.gguf_amx_applies(rows, int(T.Q8_0))  # its VNNI kernel is its own
    monkeypatch.setenv("MINIVLLM_CPU_AMX", "0")
    assert not cpu_ops.gguf_amx_applies(rows, int(T.Q4_K))
    monkeypatch.setenv("MINIVLLM_CPU_AMX", "yes")
    with pytest.raises(ValueError, match="MINIVLLM_CPU_AMX must be 0 or 1, got 'yes'"):
        cpu_ops.gguf_amx_applies(rows, int(T.Q4_K))


def test_amx_refuses_a_type_without_a_kernel_by_number() -> None:
    x, q = torch.zeros(16, 64), torch.zeros(4, 68, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="GGML type 8 has no AMX kernel"):
        torch.ops.minivllm_cpu.gguf_linear_amx(torch.empty(16, 4), x, q, 8)
