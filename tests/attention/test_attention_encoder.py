"""Encoder-only attention (`attend_encoder`, no KV cache) of every backend against the math.

The specification is block-diagonal softmax attention in float64: row t of request r sees every
row of r and nothing else, `softmax(q kᵀ · scale) v` with no mask inside a request. Each backend
(reference: SDPA per request; cpu: the same; triton: the variable-length kernel, in Triton's
interpreter) is held to it and to the reference backend, over a step of prompts of different
lengths (one of a single token; lengths that cross the kernels' 32- and 64-key tiles), with MHA
and GQA, in float32 and bfloat16, on q/k/v that are strided views of one fused QKV projection
(what BERT hands the backend).
"""

from __future__ import annotations

import pytest
import torch

from minivllm.attention.abstract import AttentionMetadata
from minivllm.attention.backends.reference import ReferenceBackend
from minivllm.attention.selector import get_attention_backend
from tests.attention.test_attention_reference import TOLERANCES

LENS = [7, 1, 70, 33]  # a single-token prompt; 70 crosses the 32- and 64-key tiles


def encoder_step(
    lens: list[int], heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """q [T, heads, dim], k/v [T, kv_heads, dim] as views of one [T, (heads + 2 kv_heads) dim]
    projection, and the step's metadata (no blocks: an encoder holds none)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    qkv = torch.randn(total, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    starts = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=starts,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.zeros((len(lens), 0), dtype=torch.int32),
        slot_mapping=torch.empty(0, dtype=torch.int64),
        max_query_len=max(lens),
        max_seq_len=max(lens),
    )
    shape = (total, -1, dim)
    return q.view(shape), k.view(shape), v.view(shape), meta


def block_diagonal_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    lens: list[int],
    scale: float,
) -> torch.Tensor:  # float64 [T, H, D]
    """The math over the whole flat batch at once: a row sees exactly its own request's rows."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (
        q.double(),
        k.double().repeat_interleave(group, 1),
        v.double().repeat_interleave(group, 1),
    )
    request = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))  # [T]
    same = request[:, None] == request[None, :]  # [T, T]
    scores = torch.einsum("thd,shd->hts", q, k) * scale  # [H, T, T]
    probs = scores.masked_fill(~same, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v)


MHA, GQA3 = (4, 4), (6, 2)  # (query heads, KV heads)
F32, BF16 = torch.float32, torch.bfloat16
# Each backend meets both head layouts and both dtypes, each pair once (not the full product).
CASES = [
    (name, heads, dtype)
    for name in ("reference", "cpu", "triton")
    for heads, dtype in ((MHA, F32), (GQA3, BF16))
] + [("cpu", MHA, BF16), ("triton", GQA3, F32)]


@pytest.mark.parametrize(
    ("name", "heads", "dtype"),
    CASES,
    ids=[f"{n}-{'mha' if h == MHA else 'gqa3'}-{str(d)[6:]}" for n, h, d in CASES],
)
def test_encoder_attention_equals_block_diagonal_softmax(
    name: str, heads: tuple[int, int], dtype: torch.dtype
) -> None:
    h, hkv = heads
    d = 16
    q, k, v, meta = encoder_step(LENS, h, hkv, d, dtype, seed=h)
    backend = get_attention_backend(name)
    meta.plan = backend.plan(meta, 16)
    out = backend.attend_encoder(q, k, v, meta, d**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    expected = block_diagonal_attention(q, k, v, LENS, d**-0.5)
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[dtype])
    ref = ReferenceBackend().attend_encoder(q, k, v, meta, d**-0.5)
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])


def test_triton_encoder_kernel_with_the_gpu_tiles() -> None:
    """The sm_90 tiles (32 keys per tile in float32, query blocks of 32 rows) in the interpreter:
    several key tiles and query blocks per request, a tail tile of one key."""
    from minivllm.attention.backends.triton import TritonBackend

    lens = [65, 3, 40]
    q, k, v, meta = encoder_step(lens, 2, 2, 16, torch.float32, seed=5)
    out = TritonBackend(gpu_tiles=True).attend_encoder(q, k, v, meta, 0.3)
    expected = block_diagonal_attention(q, k, v, lens, 0.3)
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[torch.float32])


def test_encoder_attention_touches_no_cache_and_ignores_block_tables() -> None:
    """No cache argument exists, and the metadata's block tables and slots are not read: the
    same step with garbage in them gives the same output."""
    q, k, v, meta = encoder_step([5, 9], 2, 2, 8, torch.float32)
    backend = get_attention_backend("cpu")
    out = backend.attend_encoder(q, k, v, meta, 0.5)
    meta.block_tables = torch.full((2, 3), 10**6, dtype=torch.int32)
    meta.slot_mapping = torch.full((14,), 10**9, dtype=torch.int64)
    torch.testing.assert_close(backend.attend_encoder(q, k, v, meta, 0.5), out, rtol=0, atol=0)


def test_cpu_encoder_attention_reads_feature_major_views() -> None:
    """A float16 model's linears on a CPU without AVX512-FP16 return (W · xᵀ)ᵀ, a transposed view (minivllm/cpu/op_forwards.py):
    the CPU backend takes q/k/v in that layout too (copied token-major for its kernel)."""
    lens = [6, 11]
    q, k, v, meta = encoder_step(lens, 2, 2, 8, torch.float32, seed=9)
    qkv_t = torch.cat([q, k, v], dim=1).reshape(sum(lens), -1).t().contiguous().t()  # [T, 3HD]
    fq, fk, fv = (x.reshape(sum(lens), 2, 8) for x in qkv_t.split(16, dim=-1))
    assert fq.stride(-1) != 1
    out = get_attention_backend("cpu").attend_encoder(fq, fk, fv, meta, 0.4)
    expected = block_diagonal_attention(q, k, v, lens, 0.4)
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[torch.float32])
