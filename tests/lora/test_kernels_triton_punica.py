"""The Triton shrink and expand (minivllm/lora/triton_punica.py) against punica.py.

On a CPU machine the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before Triton is imported), so the shapes are tiny: one row and more rows than a 16-row block, a
rank below, at and past the 16-wide tile's edges (1, 8, 16 in slots of 16 or 32), an output wider
than one 32-column block, and rows of slot -1 among the adapters' rows. float32 throughout: the
kernels sum in float32 with `tl.dot` in IEEE precision, so they differ from the reference in
summation order only (1e-5).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from minivllm.lora import punica
from minivllm.lora.punica_selector import get_punica_ops
from minivllm.lora.triton_punica import (  # after the skip: needs Triton
    lora_expand_triton,
    lora_shrink_triton,
    slot_groups,
)


def test_slot_groups_sort_rows_by_slot_and_leave_out_the_base_rows() -> None:
    rows, starts, counts = slot_groups(torch.tensor([2, -1, 0, 2, -1, 0, 2]), 4)
    assert rows.tolist() == [1, 4, 2, 5, 0, 3, 6]
    assert starts.tolist() == [2, 4, 4, 7] and counts.tolist() == [2, 0, 3, 0]


@pytest.mark.parametrize(
    ("num_rows", "rank", "in_size", "width", "offset"),
    [(1, 8, 40, 24, 0), (19, 16, 24, 40, 5), (6, 32, 16, 8, 3)],
)
def test_shrink_and_expand_equal_punica(
    num_rows: int, rank: int, in_size: int, width: int, offset: int
) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    num_slots = 3
    x = torch.randn(num_rows, in_size, generator=gen)
    lora_a = torch.randn(num_slots, rank, in_size, generator=gen)
    lora_a[1, 1:] = 0  # slot 1 holds a rank-1 adapter
    lora_b = torch.randn(num_slots, width, rank, generator=gen)
    scales = torch.tensor([2.0, 0.5, 0.25])
    slots = torch.randint(-1, num_slots, (num_rows,), generator=gen)
    slots[0] = 0
    if num_rows > 2:
        slots[2] = -1
    y = lora_shrink_triton(x, lora_a, slots)
    torch.testing.assert_close(y, punica.shrink(x, lora_a, slots), rtol=1e-5, atol=1e-5)
    out = torch.randn(width + offset + 2, num_rows, generator=gen).t()  # feature-major
    got, ref = out.clone(), out.clone()
    lora_expand_triton(got, y, lora_b, slots, scales, offset)
    punica.expand(ref, y, lora_b, slots, scales, offset)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[slots == punica.NO_LORA], out[slots == punica.NO_LORA])


def test_the_triton_backend_selects_these_kernels() -> None:
    ops = get_punica_ops("triton")
    assert (ops.name, ops.shrink, ops.expand) == ("triton", lora_shrink_triton, lora_expand_triton)
    assert get_punica_ops("reference").shrink is punica.shrink
