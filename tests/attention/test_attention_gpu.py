"""The Triton kernels on a CUDA GPU, compiled for real (`make test-gpu`, `make gpu-check`).

The same cases and tolerances as the interpreter run (tests/attention/test_attention_kernels.py), plus what
only a GPU can show: model shapes at GPU scale with the backend's own split choice, a KV cache of
more than 2**31 elements, tensors on a GPU other than the current one, and each kernel's
registers, spills and shared memory as the driver loaded it.

These tests never run interpreted: with `TRITON_INTERPRET=1` on a CUDA machine the kernels would
run on the CPU and prove nothing about the GPU, so every test here fails instead. Without CUDA
they are skipped in a normal run; but when the `gpu` marker is asked for (`pytest -m gpu`) on a
machine without CUDA they fail too, so a GPU check can never pass by skipping everything.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.attention.abstract import AttentionMetadata
from minivllm.attention.backends.reference import ReferenceBackend
from minivllm.attention.backends.triton import (
    INTERPRETED,
    TritonBackend,
    attend_launches,
    write_kv_launch,
)
from minivllm.attention.backends.triton_plan import LayerShape, kernel_tiles, make_triton_plan
from tests.attention.test_attention_kernels import (
    BF16,
    F16,
    F32,
    GPU_TILE_CASES,
    HEAD_DIM_256_CASES,
    KV_DTYPE_CASES,
    PARITY_GRID,
    ParityCase,
    check_attend_parity,
    check_padded_requests_attend_to_zeros,
    check_write_kv_exact,
)
from tests.attention.test_attention_reference import TOLERANCES, make_paged_batch

pytestmark = pytest.mark.gpu

HOPPER_MAX_SHARED = 227 * 1024  # bytes of shared memory one block may use on sm_90


def why_not_compiled_on_cuda(cuda_available: bool, interpreted: bool) -> str | None:
    """Why the GPU tests cannot run here, or None when the kernels are compiled for a GPU."""
    if not cuda_available:
        return "torch sees no CUDA device"
    if interpreted:
        return (
            "TRITON_INTERPRET=1: the kernels would run in Triton's CPU interpreter, not on the "
            "GPU. Unset it (tests/conftest.py sets it only when there is no CUDA)."
        )
    return None


def _gpu_run_requested(config: pytest.Config) -> bool:
    """Was this session started to check the GPU (`-m gpu`, `-m "gpu and not slow"`, ...)?"""
    expr = config.getoption("markexpr", default="") or ""
    return "gpu" in expr and "not gpu" not in expr


def require_compiled_cuda(config: pytest.Config) -> None:
    """Skip on a CPU machine in a normal run; fail if a GPU run was asked for, or if the kernels
    would run interpreted on a CUDA machine."""
    reason = why_not_compiled_on_cuda(torch.cuda.is_available(), INTERPRETED)
    if reason is None:
        return
    if torch.cuda.is_available() or _gpu_run_requested(config):
        pytest.fail(f"the GPU tests cannot run: {reason}")
    pytest.skip(f"{reason} (run with `make test-gpu`)")


@pytest.fixture(autouse=True)
def _require_compiled_cuda(request: pytest.FixtureRequest) -> None:
    require_compiled_cuda(request.config)


@pytest.mark.parametrize("case", PARITY_GRID, ids=lambda c: c.id)
def test_compiled_triton_matches_reference_on_the_parity_grid(case: ParityCase) -> None:
    check_attend_parity(case, "cuda")


@pytest.mark.parametrize("case", KV_DTYPE_CASES, ids=lambda c: c.id)
def test_compiled_triton_matches_reference_over_a_narrower_cache(case: ParityCase) -> None:
    """kv_cache_dtype="bfloat16" under float32 queries, compiled: K/V widened on load."""
    check_attend_parity(case, "cuda")


@pytest.mark.parametrize("case", GPU_TILE_CASES + HEAD_DIM_256_CASES, ids=lambda c: c.id)
def test_compiled_triton_matches_reference_on_the_tile_and_head_dim_cases(case: ParityCase) -> None:
    check_attend_parity(case, "cuda")


@pytest.mark.parametrize("mode", ["prefill", "extend", "decode", "mixed"])
@pytest.mark.parametrize("window", [None, 19])
def test_compiled_triton_caps_scores_as_the_reference(mode: str, window: int | None) -> None:
    """Gemma 2's soft-cap (a run-time argument of both attention kernels), compiled."""
    from tests.attention.test_attention_softcap import check_capped

    check_capped(TritonBackend(), mode, window, device="cuda")


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
def test_compiled_write_kv_is_exact_and_skips_minus_one(dtype: torch.dtype) -> None:
    check_write_kv_exact(dtype, "cuda")


@pytest.mark.parametrize(("num_splits", "mixed"), [(1, False), (4, False), (3, True)])
def test_compiled_padded_requests_attend_to_zeros(num_splits: int, mixed: bool) -> None:
    check_padded_requests_attend_to_zeros("cuda", num_splits, mixed)


# What the GPU tiles (64-key decode tiles, 128-row prefill tiles) see at model scale: head_dim
# 128 and 256, many splits of a long context, MQA, and the backend's own split count.
GPU_SHAPES = [
    ParityCase("decode", (32, 4), BF16, 128, 16),  # the benchmark's shape, default splits
    ParityCase("decode_split", (32, 4), BF16, 128, 16, 7),
    ParityCase("decode_split", (8, 8), F16, 96, 32, 64),  # more splits than some contexts fill
    ParityCase("decode", (128, 1), F16, 128, 16),  # MQA: 8 warps for a 128-row group
    ParityCase("prefill", (32, 4), BF16, 128, 16),
    ParityCase("extend", (32, 4), F16, 128, 16),
    ParityCase("mixed", (12, 4), BF16, 128, 16),  # decode rows split inside a mixed batch
    ParityCase("mixed", (16, 2), BF16, 256, 16),
]


@pytest.mark.parametrize("case", GPU_SHAPES, ids=lambda c: c.id)
def test_compiled_triton_matches_reference_at_model_shapes(case: ParityCase) -> None:
    check_attend_parity(case, "cuda")


@pytest.mark.parametrize("mode", ["decode", "mixed"])
def test_a_kv_cache_past_two_to_the_31_elements_is_addressed_in_int64(mode: str) -> None:
    """8.6 GB of bfloat16 K and V (2**31 + 64 blocks of 16,384 elements each): the requests'
    blocks lie past element 2**31, where an int32 offset would wrap to another block."""
    h, hkv, d, bs = 32, 8, 128, 16
    per_block = bs * hkv * d
    num_blocks = 2**31 // per_block + 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    k_cache = torch.zeros(num_blocks, bs, hkv, d, dtype=BF16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    seq_lens, query_lens = ([300, 17], [1, 1]) if mode == "decode" else ([300, 40], [1, 33])
    tables = torch.arange(num_blocks - 40, num_blocks, dtype=torch.int32, device="cuda")
    block_tables = tables.view(2, 20)  # [2, 20]: every block past element 2**31
    starts = [0, query_lens[0], sum(query_lens)]
    slots = []  # every token of both requests is written here, the context by earlier "steps"
    for i, s in enumerate(seq_lens):
        slots += [int(block_tables[i, p // bs]) * bs + p % bs for p in range(s)]
    all_slots = torch.tensor(slots, dtype=torch.int64, device="cuda")
    key = torch.randn(len(slots), hkv, d, dtype=BF16, device="cuda", generator=gen)
    value = torch.randn(len(slots), hkv, d, dtype=BF16, device="cuda", generator=gen)
    tri, ref = TritonBackend(num_splits=4), ReferenceBackend()
    tri.write_kv(key, value, k_cache, v_cache, all_slots)
    flat = (-1, hkv, d)
    assert torch.equal(k_cache.view(flat)[all_slots], key)
    assert torch.equal(v_cache.view(flat)[all_slots], value)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=block_tables,
        slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64, device="cuda"),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    query = torch.randn(starts[-1], h, d, dtype=BF16, device="cuda", generator=gen)
    expected = ref.attend(query, k_cache, v_cache, meta, d**-0.5)
    torch.testing.assert_close(
        tri.attend(query, k_cache, v_cache, meta, d**-0.5), expected, **TOLERANCES[BF16]
    )


def test_kernels_run_on_the_device_of_their_tensors_not_the_current_one() -> None:
    """Tensors on the last GPU while device 0 is current: Triton would launch on device 0."""
    if torch.cuda.device_count() < 2:
        pytest.skip(
            "one GPU: tests/attention/test_attention_triton_launch.py checks the device guard on CPU"
        )
    device = f"cuda:{torch.cuda.device_count() - 1}"
    with torch.cuda.device(0):
        check_attend_parity(ParityCase("mixed", (8, 2), BF16, 128, 16, 3), device)


# ===================================================================== resources, as loaded

# Every launch kind, at the benchmark's shape and at the shapes that press on registers.
RESOURCE_SHAPES = [(BF16, 32, 4, 128), (F16, 128, 1, 128), (F32, 6, 2, 80), (BF16, 16, 2, 256)]


def test_compiled_kernels_do_not_spill_and_fit_hoppers_shared_memory() -> None:
    """Registers, spills and shared memory of every kernel variant, as the driver loaded them."""
    rows, problems = [], []
    for dtype, h, hkv, d in RESOURCE_SHAPES:
        b = make_paged_batch([40, 300, 17], [33, 1, 1], h, hkv, d, 16, dtype, "cuda")
        for splits in (1, 4):
            plan = make_triton_plan(b.meta, num_sms=132, num_splits=splits)
            layer = plan.for_layer(LayerShape(h, hkv, d, 16, dtype, gpu_tiles=True, upcast=False))
            out = torch.empty_like(b.query)
            launches = attend_launches(b.query, b.k_cache, b.v_cache, out, b.meta, layer, 0.1)
            tiles = kernel_tiles(True, d, dtype)
            launches.append(
                write_kv_launch(b.key, b.value, b.k_cache, b.v_cache, b.meta.slot_mapping, tiles)
            )
            for launch in launches:
                kernel = (
                    launch()
                )  # the CompiledKernel, loaded: n_regs and n_spills are the driver's
                name = f"{launch.kernel.__name__}[{str(dtype)[6:]} {h}q{hkv}kv d{d} s{splits}]"
                shared = int(kernel.metadata.shared)
                rows.append(f"{name:<60} regs {kernel.n_regs:>3}  spills {kernel.n_spills:>4}  "
                            f"shared {shared:>6} B")  # fmt: skip
                if kernel.n_spills or shared > HOPPER_MAX_SHARED:
                    problems.append(rows[-1])
    torch.cuda.synchronize()
    print("\n" + "\n".join(dict.fromkeys(rows)))
    assert not problems, "kernels that spill or exceed shared memory:\n" + "\n".join(problems)
