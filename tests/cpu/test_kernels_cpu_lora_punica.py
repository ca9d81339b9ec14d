"""Punica's shrink and expand in C++ (minivllm/cpu/csrc/cpu_lora_punica.cpp) against punica.py.

Each output element is one float32 dot product in the kernel, where the reference runs one GEMM
per slot: the two differ in summation order only, so float32 is held to 1e-5 (the sums here are
of at most 576 products of unit normals). bfloat16 rounds where the reference rounds (y, the
product, its scaling, the sum), and is held to a few of its ulps. Cases: one row and many; every
row of a slot, and rows of slot -1 among them; ranks 1, 8 and 16 in slots 16 wide (zero-padded,
as the wrappers hold them); a packed q|k|v output written slice by slice at its offsets, in a CPU
linear's feature-major layout; one thread and two (each element is one thread's, so the results
are bit for bit the same); `add_lora_linear`, every slice of a linear in one call, bit for bit the
kernels' shrink and expand per slice (what lets the C++ decode loop call it for the wrappers' two).

Like the other kernel tests, this builds the library (once per machine) and fails rather than
skips where it cannot be built; `make test` runs it again at each lower instruction-set level.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.cpu.build import load_cpu_kernels
from minivllm.cpu.ops import add_lora_linear, lora_expand, lora_shrink
from minivllm.lora import punica

pytestmark = pytest.mark.cpu_isa  # run again at each lower instruction-set level (make test)

MAX_RANK, SLOTS = 16, 3


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    load_cpu_kernels()


def stacked(ranks: list[int], rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """[SLOTS, rows, cols] with slot s nonzero in its first ranks[s] rows (A) or columns (B)."""
    t = torch.randn(SLOTS, rows, cols, generator=gen)
    for s, r in enumerate(ranks):
        if rows == MAX_RANK:
            t[s, r:] = 0
        else:
            t[s, :, r:] = 0
    return t


def run_both(x, slices, slots, scales, out, threads):
    """(kernel's out, reference's out) after shrink + expand of every slice at its offset; and
    add_lora_linear's out, which must equal the kernels' shrink + expand per slice bit for bit."""
    got, ref, chained, fused = out.clone(), out.clone(), out.clone(), out.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        offset = 0
        for a, b in slices:
            y = lora_shrink(x, a, slots)
            y_ref = punica.shrink(x, a, slots)
            torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
            assert torch.all(y[slots == punica.NO_LORA] == 0)
            lora_expand(got, y_ref, b, slots, scales, offset)
            punica.expand(ref, y_ref, b, slots, scales, offset)
            lora_expand(chained, y, b, slots, scales, offset)
            offset += b.shape[1]
        add_lora_linear(fused, x, [a for a, _ in slices], [b for _, b in slices], slots, scales)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(fused, chained)
    return got, ref


@pytest.mark.parametrize(
    ("rows", "in_size", "widths"),
    [
        (1, 64, [64]),  # one decode row, o_proj-like
        (37, 576, [576, 192, 192]),  # a prefill chunk through a packed q|k|v
        (9, 40, [24, 24]),  # gate|up
    ],
)
def test_shrink_and_expand_equal_punica_at_one_and_two_threads(
    rows: int, in_size: int, widths: list[int]
) -> None:
    gen = torch.Generator().manual_seed(rows)
    ranks = [8, 1, 16]
    x = torch.randn(rows, in_size, generator=gen)
    slices = [
        (stacked(ranks, MAX_RANK, in_size, gen), stacked(ranks, w, MAX_RANK, gen)) for w in widths
    ]
    slots = torch.randint(-1, SLOTS, (rows,), generator=gen)
    slots[0] = 1 if rows == 1 else -1
    scales = torch.tensor([2.0, 0.5, 0.25])
    out = torch.randn(sum(widths), rows, generator=gen).t()  # feature-major, as a CPU linear's
    results = [run_both(x, slices, slots, scales, out, threads) for threads in (1, 2)]
    for got, ref in results:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[slots == punica.NO_LORA], out[slots == punica.NO_LORA])
    assert torch.equal(results[0][0], results[1][0])


def test_bfloat16_rounds_where_the_reference_does() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(12, 64, generator=gen).bfloat16()
    a = stacked([8, 16, 4], MAX_RANK, 64, gen).bfloat16()
    b = stacked([8, 16, 4], 48, MAX_RANK, gen).bfloat16()
    slots = torch.tensor([0, 1, 2, -1] * 3)
    scales = torch.tensor([2.0, 0.5, 0.25]).bfloat16()
    y, y_ref = lora_shrink(x, a, slots), punica.shrink(x, a, slots)
    torch.testing.assert_close(y, y_ref, rtol=2**-7, atol=2**-7 * 8)
    out = torch.randn(12, 50, generator=gen).bfloat16()
    got, ref = out.clone(), out.clone()
    lora_expand(got, y_ref, b, slots, scales, 2)
    punica.expand(ref, y_ref, b, slots, scales, 2)
    torch.testing.assert_close(got, ref, rtol=2**-7, atol=2**-7 * 8)
    assert torch.equal(got[slots == -1], out[slots == -1])


def test_a_batch_without_adapters_is_left_as_it_is() -> None:
    x, out = torch.randn(4, 8), torch.randn(4, 6)
    slots = torch.full((4,), punica.NO_LORA)
    y = lora_shrink(x, torch.randn(2, 4, 8), slots)
    assert torch.equal(y, torch.zeros(4, 4))
    before = out.clone()
    lora_expand(out, torch.randn(4, 4), torch.randn(2, 6, 4), slots, torch.ones(2))
    assert torch.equal(out, before)


@pytest.mark.parametrize(
    ("slots", "match"),
    [
        (torch.tensor([0, 2]), r"token_slots must be in \[-1, 2\), got 2 at row 1"),
        (torch.tensor([0, -2]), r"got -2 at row 1"),
        (torch.tensor([0, 1], dtype=torch.int32), "must be a contiguous int64"),
    ],
)
def test_a_bad_slot_is_refused_before_anything_is_read(slots: torch.Tensor, match: str) -> None:
    with pytest.raises(RuntimeError, match=match):
        lora_shrink(torch.randn(2, 8), torch.randn(2, 4, 8), slots)
    with pytest.raises(RuntimeError, match=match):
        lora_expand(
            torch.zeros(2, 6), torch.randn(2, 4), torch.randn(2, 6, 4), slots, torch.ones(2)
        )
    with pytest.raises(RuntimeError, match=match):
        add_lora_linear(
            torch.zeros(2, 6),
            torch.randn(2, 8),
            [torch.randn(2, 4, 8)],
            [torch.randn(2, 6, 4)],
            slots,
            torch.ones(2),
        )
