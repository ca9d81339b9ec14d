"""How the Triton backend launches its kernels, checked on a CPU: plans, grids, devices, builds.

- The step's plan: prompt requests become a flat list of query blocks (exactly the blocks that
  exist), decode rows go to the split-KV kernels in mixed batches too, one split launches no
  merge, and a layer plan (with its buffers) is built once per step and shape.
- CUDA's limits: no grid dimension past what a launch accepts, even for 70,000-token MQA prompts.
- Devices: every launch runs under the CUDA device of its tensors, not the current one.
- Compile-only for sm_90 (Hopper): every kernel variant is built from the very `KernelLaunch`
  values the backend runs, with the argument specialisation (16-byte alignment, divisibility)
  a real launch would compute, and its registers, spills and shared memory are reported; a
  variant that spills or exceeds Hopper's shared memory fails. A new batch size, context length
  or split count must reuse the compiled kernels.
- The GPU suite refuses to run interpreted, and the kernel benchmark fails when it misses.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from minivllm.attention.abstract import AttentionMetadata
from minivllm.attention.backends import triton as backend_module
from minivllm.attention.backends.triton import (
    KernelLaunch,
    TritonBackend,
    attend_launches,
    device_guard,
    write_kv_launch,
)
from minivllm.attention.backends.triton_plan import (
    MAX_GRID,
    LayerShape,
    check_grid,
    flatten_query_blocks,
    kernel_tiles,
    make_triton_plan,
)
from tests.attention.test_attention_gpu import HOPPER_MAX_SHARED, why_not_compiled_on_cuda
from tests.attention.test_attention_reference import make_paged_batch
from tests.utils.engine_utils import import_benchmark

BF16 = torch.bfloat16


def step_meta(seq_lens: list[int], query_lens: list[int], device: str = "cpu") -> AttentionMetadata:
    """A step's metadata with no cache behind it: the plan reads only these numbers."""
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    width = max(-(-s // 16) for s in seq_lens)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros(len(seq_lens), width, dtype=torch.int32, device=device),
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def gpu_launches(
    meta: AttentionMetadata, heads: int, kv_heads: int, head_dim: int, num_splits: int | None
) -> list[KernelLaunch]:
    """The launches an H200 (132 SMs) would make for this step, built on shape-only tensors."""
    plan = make_triton_plan(meta, num_sms=132, num_splits=num_splits)
    layer = plan.for_layer(LayerShape(heads, kv_heads, head_dim, 16, BF16, True, False))
    num_tokens = meta.slot_mapping.shape[0]
    query = torch.empty(num_tokens, heads, head_dim, dtype=BF16, device="meta")
    cache = torch.empty(1, 16, kv_heads, head_dim, dtype=BF16, device="meta")
    return attend_launches(query, cache, cache, torch.empty_like(query), meta, layer, 0.1)


def kernel_names(launches: list[KernelLaunch]) -> list[str]:
    return [launch.kernel.__name__ for launch in launches]


# ===================================================================================== the plan


def test_flatten_query_blocks_lists_each_block_of_each_prompt_once() -> None:
    blocks = flatten_query_blocks([(0, 33), (2, 5), (3, 16)], 16, torch.device("cpu"))
    assert blocks.tolist() == [[0, 0], [0, 1], [0, 2], [2, 0], [3, 0]]


def test_prefill_grid_covers_exactly_the_query_blocks_that_exist() -> None:
    """64 decodes and one 1,984-token chunk: the old grid (65 × 124 blocks × 4 KV heads) was
    ~98% programs with nothing to do; now the prefill grid is the chunk's 124 blocks, and the
    decodes are the split kernel's rows."""
    meta = step_meta([4096] * 64 + [1984], [1] * 64 + [1984])
    launches = gpu_launches(meta, 32, 4, 128, None)
    assert kernel_names(launches)[:2] == ["paged_prefill_kernel", "paged_decode_split_kernel"]
    block_q = launches[0].settings["BLOCK_Q"]  # 128 rows / a group of 8 heads = 16 tokens
    assert launches[0].grid == (-(-1984 // block_q), 4)
    assert launches[1].grid[:2] == (64, 4)


def test_long_mqa_prompt_grid_stays_within_cuda_limits() -> None:
    """MQA, 128 query heads on one KV head: one query token per block (128 rows). A 70,000-token
    prompt has 70,000 blocks, past the 65,535 of grid dimensions 1 and 2; it is dimension 0."""
    meta = step_meta([70_000, 500], [70_000, 1])
    launches = gpu_launches(meta, 128, 1, 128, 4)
    assert launches[0].settings["BLOCK_Q"] == 1 and launches[0].grid == (70_000, 1)
    for launch in launches:
        assert all(0 <= n <= limit for n, limit in zip(launch.grid, MAX_GRID)), launch.grid


def test_check_grid_refuses_what_cuda_would_refuse() -> None:
    assert check_grid((2**31 - 1, 65535, 65535)) == (2**31 - 1, 65535, 65535)
    with pytest.raises(ValueError, match=r"grid dimension 1 must be in \[0, 65535\], got 65536"):
        check_grid((1, 65536))


def test_decode_rows_of_a_mixed_batch_get_the_split_kernel() -> None:
    meta = step_meta([40, 3000, 17], [33, 1, 1])
    launches = gpu_launches(meta, 32, 4, 128, 3)
    names = ["paged_prefill_kernel", "paged_decode_split_kernel", "paged_decode_merge_kernel"]
    assert kernel_names(launches) == names
    split = launches[1]
    assert split.grid == (2, 4, 3) and split.args[6].tolist() == [1, 2]  # decode_seqs


def test_the_default_split_count_splits_long_decodes_in_a_mixed_batch() -> None:
    """Two decodes over 8,192 tokens next to a chunk: 2 × 4 programs could not fill 132 SMs."""
    meta = step_meta([8192, 8192, 600], [1, 1, 300])
    launches = gpu_launches(meta, 32, 4, 128, None)
    assert launches[1].grid[2] > 1 and kernel_names(launches)[-1] == "paged_decode_merge_kernel"


def test_one_split_writes_the_output_directly_with_no_merge_launch() -> None:
    launches = gpu_launches(step_meta([300, 17], [1, 1]), 32, 4, 128, 1)
    assert kernel_names(launches) == ["paged_decode_split_kernel"]
    assert launches[0].settings["DIRECT"] is True


def test_the_split_count_is_a_run_time_argument() -> None:
    """Every split count the backend picks (2..64) has the same kernel settings: the count is an
    argument, and only the one-split variant (no merge) is compiled apart."""
    meta = step_meta([3000, 17], [1, 1])
    split2, merge2 = gpu_launches(meta, 32, 4, 128, 2)
    split64, merge64 = gpu_launches(meta, 32, 4, 128, 64)
    assert split2.settings == split64.settings and merge2.settings == merge64.settings
    assert (split2.args[10], split64.args[10]) == (2, 64)  # num_splits, at run time


def test_a_decode_only_step_is_planned_without_reading_the_metadata() -> None:
    """No device-to-host copy for decodes: the plan works on tensors that hold no data at all."""
    plan = make_triton_plan(step_meta([300, 17, 5], [1, 1, 1], device="meta"), num_sms=132)
    assert plan.num_decodes == 3 and plan.prompts == []


def test_one_layer_plan_and_its_buffers_serve_every_layer_of_a_step() -> None:
    b = make_paged_batch([40, 300, 17], [33, 1, 1], 4, 2, 64, 16, torch.float32, seed=1)
    backend = TritonBackend(num_splits=3)
    b.meta.plan = plan = backend.plan(b.meta, 16)
    outs = [backend.attend(b.query, b.k_cache, b.v_cache, b.meta, b.scale) for _ in range(2)]
    assert torch.equal(outs[0], outs[1]) and len(plan.layers) == 1
    (layer,) = plan.layers.values()
    assert layer.part_out is not None and layer.part_out.shape == (2, 3, 4, 64)
    shape = backend.layer_shape(b.query, b.k_cache)
    assert plan.for_layer(shape) is layer


# ====================================================================================== devices


def test_device_guard_makes_the_tensors_gpu_the_current_one() -> None:
    guard = device_guard(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert isinstance(device_guard(torch.device("cpu")), contextlib.nullcontext)


def test_every_launch_runs_inside_the_guard_of_its_tensors_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    current: list[torch.device] = []
    launched: list[tuple[str, torch.device | None]] = []

    @contextlib.contextmanager
    def recording_guard(device: torch.device) -> Iterator[None]:
        current.append(device)
        yield
        current.pop()

    def recording_call(self: KernelLaunch) -> Any:
        launched.append((self.kernel.__name__, current[-1] if current else None))
        return original_call(self)

    original_call = KernelLaunch.__call__
    monkeypatch.setattr(backend_module, "device_guard", recording_guard)
    monkeypatch.setattr(KernelLaunch, "__call__", recording_call)
    b = make_paged_batch([40, 300, 17], [33, 1, 1], 4, 2, 64, 16, torch.float32, seed=2)
    backend = TritonBackend(num_splits=2)
    backend.write_kv(b.key, b.value, b.k_cache, b.v_cache, b.meta.slot_mapping)
    backend.attend(b.query, b.k_cache, b.v_cache, b.meta, b.scale)
    assert [name for name, _ in launched] == [
        "write_kv_kernel", "paged_prefill_kernel",
        "paged_decode_split_kernel", "paged_decode_merge_kernel",
    ]  # fmt: skip
    assert all(device == b.k_cache.device for _, device in launched)


def test_inputs_on_another_device_than_the_cache_are_refused() -> None:
    b = make_paged_batch([20], [1], 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="every input must be on the KV cache's cpu, got meta"):
        TritonBackend().attend(b.query.to("meta"), b.k_cache, b.v_cache, b.meta, b.scale)


# ============================================================================ GPU suite, bench


def test_the_gpu_tests_refuse_to_run_interpreted() -> None:
    assert why_not_compiled_on_cuda(cuda_available=True, interpreted=False) is None
    assert "TRITON_INTERPRET=1" in str(why_not_compiled_on_cuda(True, interpreted=True))
    assert "no CUDA" in str(why_not_compiled_on_cuda(False, interpreted=True))


def test_the_kernel_benchmark_fails_when_it_misses_its_target() -> None:
    kernel_bench = import_benchmark("kernels")

    def row(kv_gb: float, pct_copy: float) -> dict:
        return dict(kv_gb=kv_gb, pct_copy=pct_copy)

    assert kernel_bench.target_status([row(0.5, 40), row(1.1, 86), row(1.1, 90)])[0] == 0
    status, line = kernel_bench.target_status([row(1.1, 86), row(1.1, 84)])
    assert status == 1 and "NOT met" in line and "84%" in line
    assert kernel_bench.target_status([row(0.5, 99)])[0] == 1  # nothing large enough to judge


# ====================================================================== compile-only, sm_90

# (dtype, query heads, KV heads, head_dim): the benchmark's shape, MQA (a 128-row GQA group),
# float32 with head_dim 80 (masked lanes, FMA dots), head_dim 256.
COMPILE_SHARDS = [
    [["bfloat16", 32, 4, 128], ["float32", 6, 2, 80]],
    [["float16", 128, 1, 128], ["bfloat16", 16, 2, 256]],
]


class Sm90Driver:
    """Stands in for the CUDA driver where there is no GPU: Triton asks it for the target only."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers, stack (spills) and static shared memory of a cubin, read by `cuobjdump`."""
    import tempfile

    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    tool = str(bundled) if bundled.exists() else "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        report = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    line = next(x for x in report.splitlines() if "REG:" in x)
    fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
    return {k: int(fields[k]) for k in ("REG", "STACK", "LOCAL", "SHARED")}


def compile_shard(shard: list[list[Any]]) -> list[dict[str, Any]]:
    """Compile every launch of a mixed step (and of a decode step with one split) for sm_90.

    `kernel.warmup` runs Triton's own launch path up to the compiled kernel: it specialises the
    arguments exactly as a launch does (16-byte aligned pointers, strides divisible by 16), then
    compiles. A second step where every per-step number changes, and lands on a value Triton
    would specialise (48 tokens, 64 block-table columns, 16 splits: multiples of 16), must
    return the kernels already compiled.
    """
    import triton

    if not torch.cuda.is_available():
        triton.runtime.driver.set_active(Sm90Driver())
    rows = []
    for dtype_name, h, hkv, d in shard:
        dtype = getattr(torch, dtype_name)
        compiled: dict[tuple[str, bool], Any] = {}
        steps = [
            ([40, 300, 17], [33, 1, 1], 4),
            ([300, 17], [1, 1], 1),
            ([70, 1024, 5], [46, 1, 1], 16),
        ]
        for step, (seq_lens, query_lens, splits) in enumerate(steps):
            b = make_paged_batch(seq_lens, query_lens, h, hkv, d, 16, dtype)
            qkv = torch.cat([b.query, b.key, b.value], dim=1)  # views, as the model passes them
            query, key, value = qkv[:, :h], qkv[:, h : h + hkv], qkv[:, h + hkv :]
            plan = make_triton_plan(b.meta, num_sms=132, num_splits=splits)
            layer = plan.for_layer(LayerShape(h, hkv, d, 16, dtype, gpu_tiles=True, upcast=False))
            tiles = kernel_tiles(True, d, dtype)
            launches = [
                write_kv_launch(key, value, b.k_cache, b.v_cache, b.meta.slot_mapping, tiles)
            ]
            launches += attend_launches(
                query, b.k_cache, b.v_cache, torch.empty_like(query), b.meta, layer, 0.1
            )
            for launch in launches:
                kernel = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.settings)
                variant = (launch.kernel.__name__, bool(launch.settings.get("DIRECT")))
                if step == 2:  # a new step: the same compiled kernel, or a recompile to report
                    rows.append(dict(kernel=variant[0], recompiled=kernel is not compiled[variant]))
                    continue
                if variant in compiled:
                    continue
                compiled[variant] = kernel
                usage = resource_usage(kernel.asm["cubin"])
                name = f"{variant[0]}{'[direct]' if variant[1] else ''}"
                rows.append(dict(
                    kernel=name, variant=f"{dtype_name} {h}q/{hkv}kv d{d}", regs=usage["REG"],
                    spill_bytes=usage["STACK"] + usage["LOCAL"],
                    shared_bytes=usage["SHARED"] + int(kernel.metadata.shared),
                    warps=kernel.metadata.num_warps, stages=kernel.metadata.num_stages,
                ))  # fmt: skip
    return rows


def test_every_kernel_variant_compiles_for_sm90_without_spills_or_recompiles() -> None:
    env = {
        **os.environ,
        "TRITON_INTERPRET": "0",
        # run as a script, this file imports its sibling tests as the package `tests`
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]
        ),
    }  # set, so that importing the backend leaves it off
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the current default; silences Triton's warning
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, json.dumps(shard)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for shard in COMPILE_SHARDS
    ]  # fmt: skip
    rows = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-4000:]
        rows += json.loads(stdout.strip().splitlines()[-1])
    built = [r for r in rows if "recompiled" not in r]
    table = "\n".join(
        f"{r['kernel']:<34} {r['variant']:<24} regs {r['regs']:>3}  spills {r['spill_bytes']:>4} B"
        f"  shared {r['shared_bytes']:>6} B  warps {r['warps']}  stages {r['stages']}"
        for r in built
    )
    print("\nsm_90 builds, as a launch specialises them:\n" + table)
    assert len(built) == 5 * 4  # write, prefill, split, split[direct], merge × 4 shapes
    bad = [r for r in built if r["spill_bytes"] or r["shared_bytes"] > HOPPER_MAX_SHARED]
    assert not bad, f"variants that spill or exceed 227 KiB of shared memory:\n{table}"
    recompiled = [r["kernel"] for r in rows if r.get("recompiled")]
    assert not recompiled, f"a new batch and split count recompiled {recompiled}"


if __name__ == "__main__":  # the compile-only test's worker: python this_file.py SHARD_JSON
    print(json.dumps(compile_shard(json.loads(sys.argv[1]))))
