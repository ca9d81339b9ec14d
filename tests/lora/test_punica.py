"""punica.py's batched shrink and expand are, row for row, the Punica definition: a loop over
rows, each with its own adapter's A and B, and rows without an adapter (slot -1) untouched."""

from __future__ import annotations

import pytest
import torch

from minivllm.lora.punica import NO_LORA, expand, shrink


def per_row_loop(x, out, lora_a, lora_b, slots, scales, offset):
    out = out.clone()
    width = lora_b.shape[1]
    for t, slot in enumerate(slots.tolist()):
        if slot == NO_LORA:
            continue
        y = lora_a[slot] @ x[t]  # [R]
        out[t, offset : offset + width] += (lora_b[slot] @ y) * scales[slot]
    return out


@pytest.mark.parametrize("num_rows", [1, 7, 33])
@pytest.mark.parametrize("offset", [0, 5])
def test_shrink_then_expand_equals_a_loop_over_rows(num_rows: int, offset: int) -> None:
    gen = torch.Generator().manual_seed(num_rows + offset)
    L, R, d_in, width, total = 3, 8, 24, 10, 20
    x = torch.randn(num_rows, d_in, generator=gen, dtype=torch.float64)
    out = torch.randn(num_rows, total, generator=gen, dtype=torch.float64)
    lora_a = torch.randn(L, R, d_in, generator=gen, dtype=torch.float64)
    lora_b = torch.randn(L, width, R, generator=gen, dtype=torch.float64)
    scales = torch.tensor([0.5, 2.0, 1.5], dtype=torch.float64)
    slots = torch.randint(-1, L, (num_rows,), generator=gen)
    expected = per_row_loop(x, out, lora_a, lora_b, slots, scales, offset)
    y = shrink(x, lora_a, slots)
    assert y.shape == (num_rows, R)
    assert torch.all(y[slots == NO_LORA] == 0)
    got = out.clone()
    expand(got, y, lora_b, slots, scales, offset)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_rows_without_an_adapter_are_left_bit_for_bit() -> None:
    x = torch.randn(4, 6)
    out = torch.randn(4, 9)
    before = out.clone()
    slots = torch.tensor([-1, 0, -1, 0])
    lora_a, lora_b = torch.randn(1, 2, 6), torch.randn(1, 9, 2)
    expand(out, shrink(x, lora_a, slots), lora_b, slots, torch.ones(1))
    assert torch.equal(out[[0, 2]], before[[0, 2]])
    assert not torch.equal(out[[1, 3]], before[[1, 3]])
    all_base = torch.full((4,), NO_LORA)
    expand(out, shrink(x, lora_a, all_base), lora_b, all_base, torch.ones(1))
    assert torch.equal(out[[0, 2]], before[[0, 2]])
