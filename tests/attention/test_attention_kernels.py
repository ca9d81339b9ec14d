"""The Triton kernels against the reference backend, in Triton's CPU interpreter.

The parity grid is pairwise, not a cartesian product: every pair of values of any two factors
(mode × heads × dtype × head_dim × block_size) appears in at least one case, which catches the
bugs that need two factors to meet (e.g. GQA 3:1 with head_dim 80 masking) in 20 cases instead
of 240. Every case also runs several requests of different lengths in one call, with the lengths
that probe block edges: 1, block_size − 1, block_size, block_size + 1 and a few hundred.

The interpreter's own tiles are large (256 keys per decode tile) to keep it fast, so a few cases
run the sm_90 tiles instead (`gpu_tiles`): 32- and 64-key tiles, several non-empty KV splits,
head_dim 256. tests/attention/test_attention_gpu.py runs all of it on a GPU with the kernels compiled;
tests/attention/test_attention_triton_launch.py checks the launches themselves (grids, plans, sm_90 builds).

Also here: exact cache writes, padded requests with nothing in cache, the int64 cache offsets.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
import zlib
from dataclasses import dataclass

import pytest
import torch
import triton
import triton.language as tl

from minivllm.attention.abstract import AttentionMetadata
from minivllm.attention.backends import triton_kernels as K
from minivllm.attention.backends.reference import ReferenceBackend
from minivllm.attention.backends.triton import INTERPRETED, TritonBackend
from minivllm.attention.selector import get_attention_backend
from tests.attention.test_attention_reference import TOLERANCES, batch_shape, make_paged_batch

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@dataclass(frozen=True)
class ParityCase:
    mode: str  # decode | decode_split | prefill | extend | mixed (see `batch_shape`)
    heads: tuple[int, int]  # (query heads, KV heads): MHA, GQA 2:1, 3:1, 8:1
    dtype: torch.dtype
    head_dim: int  # 64, and 80 (not a power of two: masked lanes)
    block_size: int
    num_splits: int | None = None  # decode kernel's KV splits; None = the backend's choice
    gpu_tiles: bool = False  # the sm_90 tile sizes, even in the interpreter
    cache_dtype: torch.dtype | None = None  # kv_cache_dtype narrower than dtype; None: dtype

    @property
    def id(self) -> str:
        h, hkv = self.heads
        dt = str(self.dtype).removeprefix("torch.")
        splits = f"-s{self.num_splits}" if self.num_splits else ""
        tiles = "-gputiles" if self.gpu_tiles else ""
        cache = f"-{str(self.cache_dtype).removeprefix('torch.')}cache" if self.cache_dtype else ""
        return (
            f"{self.mode}-{h}q{hkv}kv-{dt}-d{self.head_dim}-bs{self.block_size}{splits}{tiles}"
            f"{cache}"
        )


# Pairwise covering grid over mode(5) × heads(4) × dtype(3) × head_dim(2) × block_size(2):
# every (mode, heads) pair once, the other factors chosen so that every pair of values of any
# two factors occurs (checked by test_parity_grid_covers_every_pair).
PARITY_GRID = [
    ParityCase("decode", (4, 4), F16, 64, 16, 1),
    ParityCase("decode", (4, 2), BF16, 80, 16, 1),
    ParityCase("decode", (6, 2), F32, 80, 32, 1),
    ParityCase("decode", (8, 1), F32, 80, 16),
    ParityCase("decode_split", (4, 4), F16, 64, 32, 3),
    ParityCase("decode_split", (4, 2), BF16, 64, 32, 5),
    ParityCase("decode_split", (6, 2), F32, 80, 32, 16),
    ParityCase("decode_split", (8, 1), F32, 64, 16, 4),
    ParityCase("prefill", (4, 4), F32, 80, 16),
    ParityCase("prefill", (4, 2), F16, 64, 16),
    ParityCase("prefill", (6, 2), F32, 80, 32),
    ParityCase("prefill", (8, 1), BF16, 64, 16),
    ParityCase("extend", (4, 4), BF16, 64, 16),
    ParityCase("extend", (4, 2), F32, 64, 32),
    ParityCase("extend", (6, 2), F16, 64, 16),
    ParityCase("extend", (8, 1), F16, 80, 32),
    ParityCase("mixed", (4, 4), F16, 64, 32),
    ParityCase("mixed", (4, 2), F32, 64, 32),
    ParityCase("mixed", (6, 2), BF16, 64, 32),
    ParityCase("mixed", (8, 1), F16, 80, 16),
]
GRID_FACTORS = {
    "mode": ["decode", "decode_split", "prefill", "extend", "mixed"],
    "heads": [(4, 4), (4, 2), (6, 2), (8, 1)],
    "dtype": [F32, F16, BF16],
    "head_dim": [64, 80],
    "block_size": [16, 32],
}

# What a GPU runs and the interpreter's 256-key tiles hide: decode tiles of 64 keys (32 in float32
# and for head_dim 256), so a 600-token context really is cut into 3-7 non-empty splits; 128-row
# prefill tiles; head_dim 256 with its halved tiles; the decode rows of a mixed batch split too.
GPU_TILE_CASES = [
    ParityCase("decode_split", (8, 1), BF16, 128, 16, 5, gpu_tiles=True),
    ParityCase("decode_split", (4, 2), F32, 64, 16, 7, gpu_tiles=True),
    ParityCase("decode_split", (8, 2), BF16, 256, 16, 4, gpu_tiles=True),
    ParityCase("mixed", (6, 2), F16, 64, 16, 3, gpu_tiles=True),
    ParityCase("prefill", (4, 4), BF16, 128, 32, gpu_tiles=True),
    ParityCase("extend", (8, 2), F16, 256, 16, gpu_tiles=True),
]
HEAD_DIM_256_CASES = [ParityCase("mixed", (4, 2), F32, 256, 16, 2)]  # the interpreter's tiles
# kv_cache_dtype="bfloat16" (and float16) under float32 queries: small shapes for the interpreter,
# GQA, partial and several blocks, several sequences of different lengths, split decodes.
KV_DTYPE_CASES = [
    ParityCase("decode", (4, 2), F32, 64, 16, 1, cache_dtype=BF16),
    ParityCase("decode_split", (6, 2), F32, 80, 16, 3, cache_dtype=BF16),
    ParityCase("mixed", (4, 2), F32, 64, 16, 2, cache_dtype=BF16),
    ParityCase("extend", (8, 1), F32, 64, 32, cache_dtype=F16),
    ParityCase("decode_split", (4, 2), F32, 64, 16, 4, gpu_tiles=True, cache_dtype=BF16),
]


def check_attend_parity(case: ParityCase, device: str, use_plan: bool = True) -> float:
    """Write K/V and attend with both backends on the same batch; returns the max abs error.

    With `use_plan` the step's plan is built once and put in the metadata, as the model runner
    does; without, `attend` builds its own.
    """
    h, hkv = case.heads
    seq_lens, query_lens = batch_shape(case.mode, case.block_size)
    b = make_paged_batch(
        seq_lens, query_lens, h, hkv, case.head_dim, case.block_size, case.dtype, device,
        seed=zlib.crc32(case.id.encode()), cache_dtype=case.cache_dtype,
    )  # fmt: skip
    # Q, K and V as views of one fused projection output, as the model produces them: the kernels
    # must honour the token stride rather than assume contiguous inputs.
    qkv = torch.cat([b.query, b.key, b.value], dim=1)  # [T, h + 2 * hkv, head_dim]
    query, key, value = qkv[:, :h], qkv[:, h : h + hkv], qkv[:, h + hkv :]
    ref = ReferenceBackend()
    tri = TritonBackend(num_splits=case.num_splits, gpu_tiles=case.gpu_tiles or None)
    ref_k, ref_v = b.k_cache.clone(), b.v_cache.clone()
    ref.write_kv(key, value, ref_k, ref_v, b.meta.slot_mapping)
    tri.write_kv(key, value, b.k_cache, b.v_cache, b.meta.slot_mapping)
    assert torch.equal(b.k_cache, ref_k) and torch.equal(b.v_cache, ref_v)
    expected = ref.attend(query, ref_k, ref_v, b.meta, b.scale)
    if use_plan:
        b.meta.plan = tri.plan(b.meta, case.block_size)
    out = tri.attend(query, b.k_cache, b.v_cache, b.meta, b.scale)
    assert out.dtype == query.dtype and out.shape == query.shape
    torch.testing.assert_close(out, expected, **TOLERANCES[case.dtype])
    return float((out.float() - expected.float()).abs().max())


def check_write_kv_exact(dtype: torch.dtype, device: str) -> None:
    """Cache writes are bit-exact, and a -1 slot leaves its (and every unwritten) slot untouched."""
    b = make_paged_batch([5, 40, 17], [5, 33, 1], 4, 2, 80, 16, dtype, device, seed=7)
    slots = b.meta.slot_mapping.clone()
    slots[::4] = -1
    k_before, v_before = b.k_cache.clone(), b.v_cache.clone()
    TritonBackend().write_kv(b.key, b.value, b.k_cache, b.v_cache, slots)
    kept = slots >= 0
    flat = (-1, 2, 80)  # the cache viewed as [slots, num_kv_heads, head_dim]
    assert torch.equal(b.k_cache.view(flat)[slots[kept]], b.key[kept])
    assert torch.equal(b.v_cache.view(flat)[slots[kept]], b.value[kept])
    untouched = torch.ones(b.k_cache.view(flat).shape[0], dtype=torch.bool, device=device)
    untouched[slots[kept]] = False
    assert torch.equal(b.k_cache.view(flat)[untouched], k_before.view(flat)[untouched])
    assert torch.equal(b.v_cache.view(flat)[untouched], v_before.view(flat)[untouched])


def check_padded_requests_attend_to_zeros(device: str, num_splits: int, mixed: bool) -> None:
    """Padded requests between real ones: seq_len 0 with a token (output defined as zeros) and
    seq_len 0 without one (nothing written, no neighbour overwritten). The real requests keep the
    reference's output."""
    h, hkv, d, bs = 4, 2, 64, 16
    seq_lens, query_lens = ([40, 300], [33, 1]) if mixed else ([17, 300], [1, 1])
    b = make_paged_batch(seq_lens, query_lens, h, hkv, d, bs, F32, device, seed=3)
    expected = ReferenceBackend().attend(b.query, b.k_cache, b.v_cache, b.meta, b.scale)
    # Requests: padded (1 token, seq_len 0), real 0, padded (no token), real 1, padded (1 token).
    q_lens = [1, query_lens[0], 0, query_lens[1], 1]
    pad_row = torch.randn(1, h, d, device=device)
    query = torch.cat([pad_row, b.query[: query_lens[0]], b.query[query_lens[0] :], pad_row])
    starts = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
    tables = torch.zeros(5, b.meta.block_tables.shape[1], dtype=torch.int32, device=device)
    tables[1], tables[3] = b.meta.block_tables[0], b.meta.block_tables[1]
    padded = AttentionMetadata(
        query_start_loc=starts,
        seq_lens=torch.tensor([0, seq_lens[0], 0, seq_lens[1], 0], dtype=torch.int32).to(device),
        block_tables=tables,
        slot_mapping=torch.full((query.shape[0],), -1, dtype=torch.int64, device=device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    out = TritonBackend(num_splits=num_splits).attend(query, b.k_cache, b.v_cache, padded, b.scale)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[-1], out[0])
    torch.testing.assert_close(out[1:-1], expected, **TOLERANCES[F32])


# ================================================================ CPU, Triton's interpreter

interpreter_only = pytest.mark.skipif(
    not INTERPRETED,
    reason="Triton compiles for the GPU in this session: tests/attention/test_attention_gpu.py runs the grid",
)


@interpreter_only
@pytest.mark.parametrize("case", PARITY_GRID, ids=lambda c: c.id)
def test_triton_matches_reference_on_the_parity_grid(case: ParityCase) -> None:
    check_attend_parity(case, "cpu")


@interpreter_only
@pytest.mark.parametrize("case", GPU_TILE_CASES + HEAD_DIM_256_CASES, ids=lambda c: c.id)
def test_triton_matches_reference_with_the_gpu_tiles_and_head_dim_256(case: ParityCase) -> None:
    check_attend_parity(case, "cpu")


@interpreter_only
@pytest.mark.parametrize("case", KV_DTYPE_CASES, ids=lambda c: c.id)
def test_triton_matches_reference_over_a_cache_narrower_than_the_query(case: ParityCase) -> None:
    """Both backends round K/V into the same bits; over them, the float32 queries' attention
    agrees to float32's tolerance (the reference widens the cache, the kernels widen on load)."""
    check_attend_parity(case, "cpu")


@interpreter_only
def test_triton_attend_without_a_plan_builds_its_own() -> None:
    check_attend_parity(ParityCase("mixed", (4, 2), F16, 64, 16, 2), "cpu", use_plan=False)


@interpreter_only
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
def test_triton_write_kv_is_exact_and_skips_minus_one(dtype: torch.dtype) -> None:
    check_write_kv_exact(dtype, "cpu")


@interpreter_only
def test_triton_write_kv_casts_like_the_reference() -> None:
    """float32 K/V into a bfloat16 cache: the same rounding as the reference's `.to`."""
    b = make_paged_batch([9, 20], [9, 4], 2, 2, 64, 16, F32, seed=5)
    caches = [(b.k_cache.to(BF16), b.v_cache.to(BF16)) for _ in range(2)]
    for backend, (kc, vc) in zip((ReferenceBackend(), TritonBackend()), caches):
        backend.write_kv(b.key, b.value, kc, vc, b.meta.slot_mapping)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@interpreter_only
def test_triton_decode_default_splits_match_reference() -> None:
    """The backend's own split choice (num_splits=None) on a decode batch."""
    check_attend_parity(ParityCase("decode", (4, 2), BF16, 64, 16), "cpu")


@interpreter_only
@pytest.mark.parametrize(
    ("num_splits", "mixed"), [(1, False), (4, False), (3, True)], ids=["1split", "4splits", "mixed"]
)
def test_padded_requests_with_nothing_in_cache_attend_to_zeros(
    num_splits: int, mixed: bool
) -> None:
    """seq_len 0 used to merge -inf with -inf into NaN; it is defined as zeros."""
    check_padded_requests_attend_to_zeros("cpu", num_splits, mixed)


@triton.jit
def _cache_offsets_probe(  # type: ignore[no-untyped-def]  # a Triton kernel
    block_ptr, pos_ptr, out_ptr, kv_head, stride_cb, stride_cs, stride_ch, N: tl.constexpr
):
    offs = tl.arange(0, N)
    block = tl.load(block_ptr + offs)  # int32, as the block tables hold them
    pos = tl.load(pos_ptr + offs)
    tl.store(out_ptr + offs, K.cache_offsets(block, pos, kv_head, stride_cb, stride_cs, stride_ch))


@interpreter_only
def test_cache_offsets_do_not_wrap_past_two_to_the_31_elements() -> None:
    """A bfloat16 cache of 8 GiB has 2**32 elements: block ids times the block stride must be
    computed in int64. (The interpreter wraps int32 products as a GPU does, so a narrowing would
    show here; tests/attention/test_attention_gpu.py reads such a cache for real.)"""
    block_size, num_kv_heads, head_dim = 16, 8, 128
    stride_ch, stride_cs = head_dim, num_kv_heads * head_dim
    stride_cb = block_size * stride_cs  # 16,384 elements per block
    blocks = torch.tensor([0, 1, 131_071, 131_072, 262_143, 2**31 - 1], dtype=torch.int32)
    blocks = torch.cat([blocks, blocks[:2]])  # N = 8, a power of two
    pos = torch.tensor([0, 15, 3, 0, 15, 7, 1, 2], dtype=torch.int32)
    out = torch.empty(8, dtype=torch.int64)
    kv_head = 7
    _cache_offsets_probe[(1,)](blocks, pos, out, kv_head, stride_cb, stride_cs, stride_ch, N=8)
    expected = [
        b * stride_cb + p * stride_cs + kv_head * stride_ch
        for b, p in zip(blocks.tolist(), pos.tolist())
    ]
    assert max(expected) > 2**31 and out.tolist() == expected


def test_parity_grid_covers_every_pair() -> None:
    names = list(GRID_FACTORS)
    for a, b in itertools.combinations(names, 2):
        seen = {(getattr(c, a), getattr(c, b)) for c in PARITY_GRID}
        missing = set(itertools.product(GRID_FACTORS[a], GRID_FACTORS[b])) - seen
        assert not missing, f"no parity case has ({a}, {b}) in {sorted(map(str, missing))}"


def test_triton_backend_is_registered_as_triton() -> None:
    backend = get_attention_backend("triton")
    assert isinstance(backend, TritonBackend) and backend.name == "triton"


def test_importing_the_backend_turns_on_the_interpreter_without_cuda() -> None:
    """A user on CPU sets nothing: importing the backend switches Triton's interpreter on."""
    if torch.cuda.is_available():
        pytest.skip("with CUDA the kernels are compiled, not interpreted")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import os, minivllm.attention.backends.triton as t; print(os.environ['TRITON_INTERPRET'], t.INTERPRETED)"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["1", "True"]


ERRORS_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["triton"] = None  # as if Triton were not installed
    try:
        import minivllm.attention.backends.triton
    except ImportError as e:
        print("ImportError:", e)
    del sys.modules["triton"]
    import minivllm.attention.backends.triton as t
    try:
        t.TritonBackend()
    except RuntimeError as e:
        print("RuntimeError:", e)
    """
)


def test_backend_errors_say_what_to_do() -> None:
    """No Triton: how to install it. Interpreter explicitly off without CUDA: how to turn it on."""
    if torch.cuda.is_available():
        pytest.skip("with CUDA, compiled kernels are the normal case")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run(
        [sys.executable, "-c", ERRORS_SCRIPT], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    import_error, runtime_error = run.stdout.strip().splitlines()
    assert 'pip install "minivllm[triton]"' in import_error
    assert "TRITON_INTERPRET=1" in runtime_error and "no CUDA" in runtime_error
