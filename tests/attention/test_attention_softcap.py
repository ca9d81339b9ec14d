"""Attention soft-capping (Gemma 2) in every backend, against a dense capped softmax in float64.

transformers' Gemma 2 (`eager_attention_forward`) caps each scaled score before the mask:
`score = cap * tanh(q·k·scale / cap)`. Each backend (the reference, the CPU's C++ kernel, Triton
in its interpreter) must give that on prefill, chunked prefill, decode and a mixed step, with
and without a sliding window (Gemma's windowed layers are capped too), and must be unchanged
when the cap is 0 (off). The queries are scaled up so that most scores pass the cap: a backend
that ignored it would be far off.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from minivllm.attention.backends.cpu import CpuBackend
from minivllm.attention.backends.reference import ReferenceBackend
from minivllm.attention.backends.triton import TritonBackend
from tests.attention.test_attention_sliding_window import MODES, close, windowed_batch

CAP = 2.0
NO_WINDOW = 10**6


def naive_capped_attention(batch: object, window: int, cap: float) -> torch.Tensor:
    """Float64 dense masked softmax of capped scores, a request at a time: [T, num_heads, head_dim]."""
    meta, k_cache, v_cache = batch.meta, batch.k_cache, batch.v_cache  # type: ignore[attr-defined]
    query, scale = batch.query, batch.scale  # type: ignore[attr-defined]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float64)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        pos = torch.arange(seq_len)
        blocks = meta.block_tables[i, pos // block_size].long()
        # [seq_len, num_heads, head_dim], each KV head repeated for its query heads
        k = k_cache[blocks, pos % block_size].double().repeat_interleave(group, dim=1)
        v = v_cache[blocks, pos % block_size].double().repeat_interleave(group, dim=1)
        # A window's freed blocks hold NaN: zero what no row sees, so 0-weights stay 0.
        first = max(0, seq_len - (starts[i + 1] - starts[i]) - window + 1)
        k[:first], v[:first] = 0, 0
        rows = slice(starts[i], starts[i + 1])
        q_pos = torch.arange(seq_len - (rows.stop - rows.start), seq_len)[:, None]
        visible = (pos[None, :] <= q_pos) & (q_pos - pos[None, :] < window)  # [L, seq_len]
        scores = torch.einsum("lhd,phd->hlp", query[rows].double(), k) * scale
        if cap > 0:
            scores = torch.tanh(scores / cap) * cap
        scores = scores.masked_fill(~visible, float("-inf"))
        out[rows] = torch.einsum("hlp,phd->lhd", scores.softmax(-1), v)
    return out


def check_capped(
    backend: object, mode: str, window: int | None, head_dim: int = 16, device: str = "cpu"
) -> None:
    """The backend's capped and uncapped attention against the float64 oracle (computed on the
    CPU), the batch moved to `device` for the backend (tests/attention/test_attention_gpu.py: "cuda")."""
    block_size = 16
    b = windowed_batch(mode, window or NO_WINDOW, 4, 2, head_dim, block_size)
    b.query.mul_(4.0)  # scores of a few units: tanh's bend, where the cap matters
    expected = naive_capped_attention(b, window or NO_WINDOW, CAP)
    uncapped = naive_capped_attention(b, window or NO_WINDOW, 0.0)
    assert (expected - uncapped).abs().max() > 0.05  # the cap changes the answer
    m = b.meta
    meta = replace(
        m,
        **{
            f: getattr(m, f).to(device)
            for f in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping")
        },
    )
    query, k_cache, v_cache = (t.to(device) for t in (b.query, b.k_cache, b.v_cache))
    meta.plan = backend.plan(meta, block_size)  # type: ignore[attr-defined]
    for cap, want in ((CAP, expected), (0.0, uncapped)):
        out = backend.attend(  # type: ignore[attr-defined]
            query, k_cache, v_cache, meta, b.scale, sliding_window=window, softcap=cap
        )
        assert not out.isnan().any()
        close(out.cpu(), want)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", [None, 5])
def test_reference_backend_caps_scores_before_the_mask(mode: str, window: int | None) -> None:
    check_capped(ReferenceBackend(), mode, window)


# head_dim 16 runs the portable loops of cpu_attention.cpp, 64 the AVX-512 ones where the CPU has
# them: the cap is applied to the scores either loop wrote, before the softmax.
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_cpu_kernel_caps_scores_as_the_reference(
    mode: str, window: int | None, head_dim: int
) -> None:
    check_capped(CpuBackend(), mode, window, head_dim)


def test_cpu_kernel_refuses_a_negative_cap() -> None:
    b = windowed_batch("decode", NO_WINDOW, 4, 2, 16, 16)
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        CpuBackend().attend(b.query, b.k_cache, b.v_cache, b.meta, b.scale, softcap=-1.0)


@pytest.mark.parametrize(("mode", "num_splits"), [("prefill", 1), ("extend", 1), ("mixed", 3)])
@pytest.mark.parametrize("window", [None, 19])
def test_triton_kernels_cap_scores_as_the_reference(
    mode: str, num_splits: int, window: int | None
) -> None:
    check_capped(TritonBackend(num_splits=num_splits), mode, window)
