"""minivllm/cpu/csrc/cpu_attention.cpp (paged attention, the cache write) through the CPU backend,
against the reference backend.

The kernel is cheap enough on a CPU to run the full product of the factors rather than a pairwise
grid: every batch mix of `batch_shape` (decodes at block edges, long contexts, prompt chunks and
decodes in one step) x MHA / GQA 2:1, 3:1 (SmolLM2's), 8:1 x three dtypes x two head sizes x two
block sizes, each with shuffled block tables and stale values in every slot a request does not own.
float32's loops written per instruction set (cpu_attention_avx512.cpp, cpu_attention_avx2.cpp)
have their own grid in tests/cpu/test_kernels_cpu_attention_avx512.py.
"""

from __future__ import annotations

import itertools
import logging
import zlib

import pytest
import torch

from minivllm.attention.backends import cpu as cpu_module
from minivllm.attention.backends.cpu import CpuBackend, CpuKernelUnavailable
from minivllm.attention.backends.reference import ReferenceBackend
from minivllm.attention.selector import get_attention_backend, resolve_backend_name
from minivllm.cpu.ops import paged_decode, reshape_and_cache
from tests.attention.test_attention_reference import TOLERANCES, batch_shape, make_paged_batch

pytestmark = pytest.mark.cpu_isa  # run again at each lower instruction-set level (make test)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
MODES = ["decode", "decode_split", "prefill", "extend", "mixed"]
HEADS = [(4, 4), (4, 2), (9, 3), (8, 1)]
CASES = list(itertools.product(MODES, HEADS, [F32, F16, BF16], [64, 80], [16, 32]))


def case_id(case: tuple) -> str:
    mode, (h, hkv), dtype, head_dim, block_size = case
    return f"{mode}-{h}q{hkv}kv-{str(dtype).removeprefix('torch.')}-d{head_dim}-bs{block_size}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cpu_backend_matches_reference(case: tuple) -> None:
    check_cpu_backend_matches_reference(case)


def check_cpu_backend_matches_reference(case: tuple) -> None:
    """Write and attend one paged batch with both backends; the outputs agree to the dtype's
    tolerance."""
    mode, (h, hkv), dtype, head_dim, block_size = case
    seq_lens, query_lens = batch_shape(mode, block_size)
    b = make_paged_batch(
        seq_lens, query_lens, h, hkv, head_dim, block_size, dtype, seed=zlib.crc32(case_id(case).encode())
    )  # fmt: skip
    # Q, K and V as views of one fused projection, as the model produces them.
    qkv = torch.cat([b.query, b.key, b.value], dim=1)  # [T, h + 2 * hkv, head_dim]
    query, key, value = qkv[:, :h], qkv[:, h : h + hkv], qkv[:, h + hkv :]
    ref, cpu = ReferenceBackend(), CpuBackend()
    ref_k, ref_v = b.k_cache.clone(), b.v_cache.clone()
    ref.write_kv(key, value, ref_k, ref_v, b.meta.slot_mapping)
    cpu.write_kv(key, value, b.k_cache, b.v_cache, b.meta.slot_mapping)
    expected = ref.attend(query, ref_k, ref_v, b.meta, b.scale)
    out = cpu.attend(query, b.k_cache, b.v_cache, b.meta, b.scale)
    assert out.dtype == query.dtype and out.shape == query.shape
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def test_decode_never_reads_outside_the_request_s_blocks() -> None:
    """NaN in every slot past each request's length, and in blocks nobody owns: none may leak."""
    bs = 16
    seq_lens = [1, bs - 1, bs, bs + 1, 70]
    b = make_paged_batch(seq_lens, [1] * 5, 6, 2, 64, bs, seed=3)
    poisoned_k, poisoned_v = (
        torch.full_like(b.k_cache, float("nan")),
        torch.full_like(b.v_cache, float("nan")),
    )
    for i, n in enumerate(seq_lens):
        for pos in range(n):
            blk, off = int(b.meta.block_tables[i, pos // bs]), pos % bs
            poisoned_k[blk, off], poisoned_v[blk, off] = b.k_cache[blk, off], b.v_cache[blk, off]
    out = torch.full(b.query.shape, float("nan"))
    rows = b.meta.query_start_loc[:-1].long()
    paged_decode(
        b.query, poisoned_k, poisoned_v, b.meta.block_tables, b.meta.seq_lens, rows, b.scale, out
    )
    expected = ReferenceBackend().attend(b.query, b.k_cache, b.v_cache, b.meta, b.scale)
    torch.testing.assert_close(out, expected, **TOLERANCES[F32])


def test_decode_kernel_reads_a_query_with_any_row_stride() -> None:
    """The queries as the model hands them over: a view of the fused qkv output, each row longer
    than the query heads. NaN fills the rest of every row, so a kernel that stepped from row to
    row by num_heads * head_dim would read it."""
    b = make_paged_batch([1, 17, 70], [1, 1, 1], 6, 2, 64, 16, seed=5)
    wide = torch.full((b.query.shape[0], 6 + 2 * 2, 64), float("nan"))
    wide[:, :6] = b.query
    query = wide[:, :6]  # [T, 6, 64], rows 10 * 64 apart
    out = torch.full(b.query.shape, float("nan"))
    rows = b.meta.query_start_loc[:-1].long()
    cpu_module.load_cpu_kernels()
    torch.ops.minivllm_cpu.paged_decode(
        out, query, b.k_cache, b.v_cache, b.meta.block_tables, b.meta.seq_lens, rows, b.scale
    )
    expected = ReferenceBackend().attend(b.query, b.k_cache, b.v_cache, b.meta, b.scale)
    torch.testing.assert_close(out, expected, **TOLERANCES[F32])


def feature_major_qkv(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K and V as views of one feature-major qkv output, the layout a CPU linear returns
    ((W · xᵀ)ᵀ: a [T, N] view of a contiguous [N, T]); each has strides (1, head_dim * T, T)."""
    t, h, d = query.shape
    hkv = key.shape[1]
    flat = torch.cat([query, key, value], dim=1).reshape(t, -1)  # [T, (h + 2 * hkv) * d]
    qkv = flat.t().contiguous().t()  # the same values, feature-major
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(t, hkv, d)
    v = qkv[:, (h + hkv) * d :].view(t, hkv, d)
    assert t == 1 or q.stride() == k.stride() == v.stride() == (1, d * t, t)
    return q, k, v


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=lambda d: str(d).removeprefix("torch."))
def test_cpu_backend_takes_q_k_v_of_a_feature_major_qkv_as_they_are(
    mode: str, dtype: torch.dtype
) -> None:
    """The cache write, the prompt chunks' SDPA and the decode kernel on the model's CPU layout,
    against the reference backend on contiguous copies."""
    seq_lens, query_lens = batch_shape(mode, 16)
    b = make_paged_batch(seq_lens, query_lens, 9, 3, 64, 16, dtype, seed=zlib.crc32(mode.encode()))
    query, key, value = feature_major_qkv(b.query, b.key, b.value)
    ref, cpu = ReferenceBackend(), CpuBackend()
    ref_k, ref_v = b.k_cache.clone(), b.v_cache.clone()
    ref.write_kv(b.key, b.value, ref_k, ref_v, b.meta.slot_mapping)
    cpu.write_kv(key, value, b.k_cache, b.v_cache, b.meta.slot_mapping)
    assert torch.equal(b.k_cache, ref_k) and torch.equal(b.v_cache, ref_v)
    expected = ref.attend(b.query, ref_k, ref_v, b.meta, b.scale)
    out = cpu.attend(query, b.k_cache, b.v_cache, b.meta, b.scale)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def test_decode_kernel_reads_a_feature_major_query_and_nothing_past_it() -> None:
    """A feature-major query is the first num_heads * head_dim * T values of the qkv storage,
    keys and values after it: NaN there shows any read past the query's own values."""
    b = make_paged_batch([1, 17, 70, 33], [1, 1, 1, 1], 6, 2, 64, 16, seed=13)
    nan = torch.full_like(b.key, float("nan"))
    query, _, _ = feature_major_qkv(b.query, nan, nan)
    out = torch.full(b.query.shape, float("nan"))
    rows = b.meta.query_start_loc[:-1].long()
    paged_decode(
        query, b.k_cache, b.v_cache, b.meta.block_tables, b.meta.seq_lens, rows, b.scale, out
    )
    expected = ReferenceBackend().attend(b.query, b.k_cache, b.v_cache, b.meta, b.scale)
    torch.testing.assert_close(out, expected, **TOLERANCES[F32])


@pytest.mark.parametrize("layout", ["qkv-view", "feature-major", "heads-apart"])
def test_the_kernel_reads_the_query_where_it_lies_in_any_layout(
    monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    b = make_paged_batch([5, 40], [1, 1], 4, 2, 32, 16, seed=9)
    if layout == "qkv-view":  # rows longer than the queries
        query = torch.cat([b.query, b.query[:, :4]], dim=1)[:, :4]
    elif layout == "feature-major":  # a CPU linear's transposed output
        query, _, _ = feature_major_qkv(b.query, b.key, b.value)
    else:  # [T, head_dim, heads] transposed: a head's values are not adjacent
        query = b.query.transpose(1, 2).contiguous().transpose(1, 2)
    cpu_module.load_cpu_kernels()
    kernel = torch.ops.minivllm_cpu.paged_decode
    handed: list[torch.Tensor] = []

    def spy(out: torch.Tensor, q: torch.Tensor, *args: object) -> None:
        handed.append(q)
        kernel(out, q, *args)

    monkeypatch.setattr(torch.ops.minivllm_cpu, "paged_decode", spy)
    out = torch.empty(b.query.shape)
    rows = b.meta.query_start_loc[:-1].long()
    paged_decode(
        query, b.k_cache, b.v_cache, b.meta.block_tables, b.meta.seq_lens, rows, b.scale, out
    )
    [q] = handed
    assert q is query  # no copy, whatever the strides
    expected = ReferenceBackend().attend(b.query, b.k_cache, b.v_cache, b.meta, b.scale)
    torch.testing.assert_close(out, expected, **TOLERANCES[F32])


def mixed_lengths(block_size: int, seed: int) -> list[int]:
    """A decode batch as the engine runs it: 1..600 tokens of context, every block edge
    (1, bs - 1, bs, bs + 1, 2 * bs) among them, in no particular order."""
    gen = torch.Generator().manual_seed(seed)
    edges = [1, block_size - 1, block_size, block_size + 1, 2 * block_size, 600]
    lens = edges + torch.randint(1, 601, (26,), generator=gen).tolist()
    return [lens[i] for i in torch.randperm(len(lens), generator=gen).tolist()]


DECODE_HEADS = {"gqa-9q3kv": (9, 3), "mha-4q4kv": (4, 4), "mqa-8q1kv": (8, 1)}


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128])  # 32/64/128 compiled for; 80 is not
@pytest.mark.parametrize("heads", DECODE_HEADS, ids=str)
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=lambda d: str(d).removeprefix("torch."))
def test_decode_kernel_matches_reference_on_a_batch_of_mixed_lengths(
    dtype: torch.dtype, heads: str, head_dim: int, block_size: int
) -> None:
    """32 requests of 1..600 tokens, shared out longest first between the threads: each gets
    its own attention in its own output row."""
    h, hkv = DECODE_HEADS[heads]
    lens = mixed_lengths(block_size, seed=head_dim + block_size)
    b = make_paged_batch(lens, [1] * len(lens), h, hkv, head_dim, block_size, dtype, seed=h * hkv)
    query, _, _ = feature_major_qkv(b.query, b.key, b.value)  # the model's layout
    out = torch.full(b.query.shape, float("nan"))
    rows = b.meta.query_start_loc[:-1].long()
    paged_decode(
        query, b.k_cache, b.v_cache, b.meta.block_tables, b.meta.seq_lens, rows, b.scale, out
    )
    expected = ReferenceBackend().attend(b.query, b.k_cache, b.v_cache, b.meta, b.scale)
    torch.testing.assert_close(out.to(dtype), expected, **TOLERANCES[dtype])


def test_decode_is_bit_for_bit_the_same_on_one_thread_and_on_two() -> None:
    """A request is computed whole by whichever thread takes it, so how requests are shared out
    changes nothing in the result."""
    lens = mixed_lengths(16, seed=7)
    b = make_paged_batch(lens, [1] * len(lens), 9, 3, 64, 16, seed=7)
    rows = b.meta.query_start_loc[:-1].long()
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = torch.empty(b.query.shape)
            paged_decode(
                b.query, b.k_cache, b.v_cache, b.meta.block_tables, b.meta.seq_lens, rows,
                b.scale, out,
            )  # fmt: skip
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_decode_of_one_long_request_spans_many_blocks() -> None:
    b = make_paged_batch([2000], [1], 9, 3, 64, 16, seed=11)
    expected = ReferenceBackend().attend(b.query, b.k_cache, b.v_cache, b.meta, b.scale)
    out = CpuBackend().attend(b.query, b.k_cache, b.v_cache, b.meta, b.scale)
    torch.testing.assert_close(out, expected, **TOLERANCES[F32])


def test_auto_is_the_cpu_backend_on_a_cpu() -> None:
    assert resolve_backend_name("auto", torch.device("cpu")) == "cpu"
    assert get_attention_backend("auto").name == "cpu"
    assert get_attention_backend("cpu").name == "cpu"


def test_cpu_backend_refuses_a_cuda_device() -> None:
    with pytest.raises(ValueError, match='"cpu" needs device "cpu"'):
        get_attention_backend("cpu", torch.device("cuda"))


def test_auto_falls_back_to_reference_when_the_kernel_cannot_build(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_compiler() -> None:
        raise CpuKernelUnavailable("could not build the CPU attention kernel (no compiler)")

    monkeypatch.setattr(cpu_module, "load_cpu_kernels", no_compiler)
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        backend = get_attention_backend("auto")
    assert backend.name == "reference"
    assert "no compiler" in caplog.text and "using the reference backend" in caplog.text
    with pytest.raises(CpuKernelUnavailable, match="no compiler"):
        get_attention_backend("cpu")


# ---------------------------------------------------------------------------------- cache write
def index_copy_write(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [T]
) -> None:
    """The specification: index_copy_ of the tokens whose slot is not -1."""
    keep = slot_mapping >= 0
    for src, cache in ((key, k_cache), (value, v_cache)):
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping[keep], src[keep])


@pytest.mark.parametrize("layout", ["token-major", "qkv-view", "feature-major"])
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("num_tokens", [1, 37, 300])  # 300: shared out between threads
def test_reshape_and_cache_equals_index_copy_and_skips_slots_of_minus_one(
    layout: str, dtype: torch.dtype, num_tokens: int
) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    hkv, d, num_blocks, bs = 3, 64, 40, 16
    query = torch.randn(num_tokens, 9, d, generator=gen).to(dtype)
    key = torch.randn(num_tokens, hkv, d, generator=gen).to(dtype)
    value = torch.randn(num_tokens, hkv, d, generator=gen).to(dtype)
    if layout == "qkv-view":  # rows of one fused token-major qkv
        qkv = torch.cat([query, key, value], dim=1)
        key, value = qkv[:, 9 : 9 + hkv], qkv[:, 9 + hkv :]
    elif layout == "feature-major":  # a CPU linear's transposed output
        _, key, value = feature_major_qkv(query, key, value)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:num_tokens]  # int64 [T]
    slots[::3] = -1  # prefix hits: K/V already in cache
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    index_copy_write(key, value, expected_k, expected_v, slots)
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_reshape_and_cache_refuses_a_slot_past_the_cache_and_writes_nothing() -> None:
    k_cache, v_cache = torch.zeros(2, 16, 3, 64), torch.zeros(2, 16, 3, 64)
    key = value = torch.ones(3, 3, 64)
    slots = torch.tensor([0, 5, 32])  # 32 slots in all: 32 is one too far
    with pytest.raises(IndexError, match=r"slot_mapping\[2\] = 32 is not in \[-1, 32\)"):
        reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert not k_cache.any() and not v_cache.any()


def test_cpu_write_kv_is_one_reshape_and_cache_call_on_the_views_as_they_are(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CPU backend's cache write: no host-side check of the slots, no copy of k and v."""
    b = make_paged_batch([5, 40], [5, 1], 9, 3, 64, 16, seed=17)
    _, key, value = feature_major_qkv(b.query, b.key, b.value)
    cpu_module.load_cpu_kernels()
    op = torch.ops.minivllm_cpu.reshape_and_cache
    handed: list[tuple[torch.Tensor, torch.Tensor]] = []

    def spy(k: torch.Tensor, v: torch.Tensor, *args: torch.Tensor) -> None:
        handed.append((k, v))
        op(k, v, *args)

    monkeypatch.setattr(torch.ops.minivllm_cpu, "reshape_and_cache", spy)
    expected_k, expected_v = b.k_cache.clone(), b.v_cache.clone()
    ReferenceBackend().write_kv(b.key, b.value, expected_k, expected_v, b.meta.slot_mapping)
    CpuBackend().write_kv(key, value, b.k_cache, b.v_cache, b.meta.slot_mapping)
    [(k, v)] = handed
    assert k is key and v is value
    assert torch.equal(b.k_cache, expected_k) and torch.equal(b.v_cache, expected_v)
