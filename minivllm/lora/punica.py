"""Punica's batched LoRA ops in plain PyTorch: the specification every faster kernel is held to.

Punica (Chen et al., 2023) and S-LoRA (Sheng et al., 2023) serve many adapters in one batch: a
row's adapter is a per-row attribute of the batch, like its block table. Each adapted linear keeps
the A and B of every resident adapter stacked by slot, and two ops run over the whole batch:

    shrink   y[t]  = x[t] · A[slot[t]]ᵀ                       [T, in]  -> [T, R]
    expand   out[t, offset : offset + out_i] += (y[t] · B[slot[t]]ᵀ) · scale[slot[t]]

A row with `slot[t] == -1` runs the base model: shrink leaves its y at zero and expand leaves
its output untouched. vLLM's `PunicaWrapper` (vllm/lora/punica_wrapper/) calls the same two ops
(`add_shrink`, `add_expand`) on its Triton kernels; `torch_ops.py` there is their reference too.

This reference groups the rows by slot (one matmul per resident adapter, at most `max_loras`),
which is the per-row definition above computed in blocks: tests/lora/test_punica.py holds it to a
loop over rows. The stacked layouts are vLLM's (peft's [r, in] and [out, r] per slot, so a slot's
matmul is transformers' `nn.Linear` of the same weights):

    lora_a   [L, R, in]    slot s: the adapter's A, rows r..R-1 zero where its rank r < R
    lora_b   [L, out, R]   slot s: the adapter's B, columns r..R-1 zero
    scales   [L]           lora_alpha / r (or / sqrt(r) under rsLoRA)

L = max_loras slots, R = max_lora_rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NO_LORA = -1  # a row's slot when its request runs the base model


def _rows_by_slot(token_slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, int64 [rows]) for each slot that some row uses, in slot order; -1 rows left out."""
    groups = []
    for slot in torch.unique(token_slots).tolist():
        if slot != NO_LORA:
            groups.append((slot, torch.nonzero(token_slots == slot).squeeze(1)))
    return groups


def shrink(
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [L, R, in]
    token_slots: torch.Tensor,  # int64 [T]: each row's slot, -1 for none
) -> torch.Tensor:  # [T, R]
    """y = x · A[slot]ᵀ per row; zero for a row without an adapter."""
    y = x.new_zeros(x.shape[0], lora_a.shape[1])
    for slot, rows in _rows_by_slot(token_slots):
        y[rows] = F.linear(x[rows], lora_a[slot])  # [rows, in] -> [rows, R]
    return y


def expand(
    out: torch.Tensor,  # [T, out_total], added to in place
    y: torch.Tensor,  # [T, R], shrink's result
    lora_b: torch.Tensor,  # [L, out_i, R]
    token_slots: torch.Tensor,  # int64 [T]
    scales: torch.Tensor,  # [L]
    offset: int = 0,  # where this slice's out_i columns start in `out` (packed q/k/v, gate/up)
) -> None:
    """out[:, offset : offset + out_i] += (y · B[slot]ᵀ) · scale[slot] per row; rows of slot -1
    are left as they are."""
    width = lora_b.shape[1]
    for slot, rows in _rows_by_slot(token_slots):
        delta = F.linear(y[rows], lora_b[slot]) * scales[slot]  # [rows, out_i]
        out[rows, offset : offset + width] += delta
