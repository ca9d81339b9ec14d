"""Triton decode kernel vs the GPU's memory bandwidth: `python benchmarks/kernels.py`.

Decode attention reads every cached K and V of every request to produce one token per request,
and does ~2 FLOPs per byte read: it is bound by memory bandwidth, so its figure of merit is
bytes of K/V read per call ÷ time. This script reports that bandwidth
- in GB/s,
- as a share of the device's peak (a table of datasheet values; omitted for unknown devices),
- as a share of a device-to-device copy of 1 GiB measured in the same run (`Tensor.copy_`, which
  reads and writes: the bandwidth a well-written streaming kernel can actually reach).
The target is >= 85% of the measured copy bandwidth once the KV read is >= 1 GB.

Peers, timed on the same inputs: the reference backend (gathers each context through the block
table, then SDPA), and `scaled_dot_product_attention` on an unpaged, contiguous copy of the cache.
Paged Triton vs contiguous SDPA is the price (or not) of paging.

The default shape is a Llama-3-8B-like layer: 32 query heads, 8:1 GQA (4 KV heads), head_dim 128,
bfloat16, 16-token blocks, with shuffled block tables. A parity check against the reference runs
before any timing. Needs a CUDA GPU (prepared for an H200; ~1 minute there); `--quick` runs
fewer shapes. It exits with status 1 when the target is missed, and without CUDA (saying so).

`--overhead` measures what is not bandwidth instead: the first call's time (a compile, if the
kernels compile on the serving path) as the context grows from 128 to 4,096 tokens; a 1,984-token
prompt chunk alone, 64 decodes alone, and both in one batch; host time per call over 1,000 tiny
decode calls.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minivllm.attention.abstract import AttentionMetadata
from minivllm.benchmarks.machine import measure_copy_bandwidth
from minivllm.benchmarks.report import print_table
from minivllm.entrypoints.cli import HelpFormatter

# Datasheet HBM bandwidth in TB/s, matched against torch.cuda.get_device_name() in this order.
PEAK_TBS = [
    ("H200", 4.8),
    ("H100 NVL", 3.9),
    ("H100 PCIe", 2.0),
    ("H100", 3.35),  # SXM5, named "NVIDIA H100 80GB HBM3"
    ("A100-SXM4-80GB", 2.039),
    ("A100-SXM4-40GB", 1.555),
    ("A100 80GB PCIe", 1.935),
]

COPY_BYTES = 1 << 30  # >= 1 GB, far past the L2 cache (50 MB on H100/H200)


@dataclass(frozen=True)
class DecodeShape:
    batch: int  # requests, one new token each
    context: int  # tokens in cache per request
    num_heads: int = 32
    num_kv_heads: int = 4
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V one decode call must read."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_dim * elem


FULL = [
    DecodeShape(1, 4096),
    DecodeShape(8, 4096),
    DecodeShape(32, 2048),
    DecodeShape(64, 4096),  # 0.5 GiB
    DecodeShape(128, 4096),  # 1 GiB
    DecodeShape(32, 16384),  # 1 GiB, few long contexts: split-KV matters most here
    DecodeShape(256, 2048),  # 1 GiB, many short contexts
    DecodeShape(64, 4096, num_heads=32, num_kv_heads=8),  # 4:1 GQA, 1 GiB
]
QUICK = [DecodeShape(8, 2048), DecodeShape(64, 4096), DecodeShape(128, 4096)]


def device_peak_tbs(name: str) -> float | None:
    return next((tbs for key, tbs in PEAK_TBS if key in name), None)


def time_ms(fn: Callable[[], object]) -> float:
    """Median time of `fn` on the GPU; Triton's do_bench flushes the L2 cache between calls."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def build_paged_step(
    shape: DecodeShape, seq_lens: list[int], query_lens: list[int], device: torch.device,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:  # fmt: skip
    """One step over a paged cache with shuffled block tables: request i has seq_lens[i] tokens in
    cache, the last query_lens[i] of them new. Returns query, k_cache, v_cache, metadata."""
    gen = torch.Generator(device=device).manual_seed(seed)
    bs = shape.block_size
    blocks_per_seq = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(blocks_per_seq)
    cache_shape = (num_blocks, bs, shape.num_kv_heads, shape.head_dim)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, dtype=shape.dtype, device=device, generator=gen)

    k_cache = randn(*cache_shape)  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache = randn(*cache_shape)
    # Fragmented like a long-running server's cache: blocks handed out in random order.
    order = torch.randperm(num_blocks, device=device, generator=gen).int()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device=device)
    taken = 0
    for i, n in enumerate(blocks_per_seq):  # [B, max_blocks_per_seq], padded with 0
        block_tables[i, :n] = order[taken : taken + n]
        taken += n
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables,
        slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return randn(starts[-1], shape.num_heads, shape.head_dim), k_cache, v_cache, meta


def build_decode_batch(
    shape: DecodeShape, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, torch.Tensor]:
    """A decode step over a paged cache with shuffled block tables, and its unpaged twin."""
    b, ctx = shape.batch, shape.context
    query, k_cache, v_cache, meta = build_paged_step(shape, [ctx] * b, [1] * b, device, seed)

    def unpaged(cache: torch.Tensor) -> torch.Tensor:  # [B, num_kv_heads, ctx, head_dim]
        dense = cache[meta.block_tables.long()].flatten(1, 2)[:, :ctx]  # [B, ctx, Hkv, D]
        return dense.transpose(1, 2).contiguous()

    return query, k_cache, v_cache, meta, unpaged(k_cache), unpaged(v_cache)


def bench_shape(
    shape: DecodeShape, device: torch.device, copy_gbs: float, peak_tbs: float | None
) -> dict:
    """Parity, then the time of the Triton decode, the reference and dense SDPA on one shape."""
    from minivllm.attention.backends.reference import ReferenceBackend
    from minivllm.attention.backends.triton import TritonBackend

    query, k_cache, v_cache, meta, k_dense, v_dense = build_decode_batch(shape, device)
    scale = shape.head_dim**-0.5
    triton_be, ref_be = TritonBackend(), ReferenceBackend()
    q4 = query.unsqueeze(2)  # [B, num_heads, 1, head_dim]

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q4, k_dense, v_dense, scale=scale, enable_gqa=True)

    # Parity before timing: a fast wrong kernel is not a result.
    ref = ref_be.attend(query, k_cache, v_cache, meta, scale)
    meta.plan = plan = triton_be.plan(meta, shape.block_size)  # once per step, as the runner does
    out = triton_be.attend(query, k_cache, v_cache, meta, scale)
    dense = sdpa()[:, :, 0]
    err = max(
        (out.float() - ref.float()).abs().max().item(),
        (out.float() - dense.float()).abs().max().item(),
    )
    if err > 2e-2:
        raise SystemExit(f"parity check failed for {shape}: max abs error {err:.3g} > 2e-2")

    t_triton = time_ms(lambda: triton_be.attend(query, k_cache, v_cache, meta, scale))
    t_ref = time_ms(lambda: ref_be.attend(query, k_cache, v_cache, meta, scale))
    t_sdpa = time_ms(sdpa)
    gbs = shape.kv_bytes / (t_triton * 1e-3) / 1e9
    (layer,) = plan.layers.values()
    return dict(
        shape=f"{shape.batch}x{shape.context} {shape.num_heads}q/{shape.num_kv_heads}kv",
        kv_gb=shape.kv_bytes / 1e9,
        splits=layer.num_splits,
        err=err,
        triton_us=t_triton * 1e3,
        gbs=gbs,
        pct_peak=None if peak_tbs is None else 100 * gbs / (peak_tbs * 1e3),
        pct_copy=100 * gbs / copy_gbs,
        ref_us=t_ref * 1e3,
        sdpa_us=t_sdpa * 1e3,
    )


TABLE_HEADERS = ["shape", "KV GB", "splits", "err", "triton us", "GB/s", "%peak", "%copy",
                 "ref us", "sdpa us", "paged/dense"]  # fmt: skip


def table_row(r: dict) -> list[str]:
    peak = "-" if r["pct_peak"] is None else f"{r['pct_peak']:.0f}"
    return [
        r["shape"], f"{r['kv_gb']:.2f}", str(r["splits"]), f"{r['err']:.1e}",
        f"{r['triton_us']:.1f}", f"{r['gbs']:.0f}", peak, f"{r['pct_copy']:.0f}",
        f"{r['ref_us']:.1f}", f"{r['sdpa_us']:.1f}", f"{r['triton_us'] / r['sdpa_us']:.2f}",
    ]  # fmt: skip


def target_status(rows: list[dict]) -> tuple[int, str]:
    """Exit status (0: met) and the verdict line for the >= 85%-of-copy target at >= 1 GB."""
    big = [r for r in rows if r["kv_gb"] >= 1.0]
    if not big:
        return 1, "target >= 85% of copy bandwidth at >= 1 GB of KV: no shape that large was run"
    worst = min(r["pct_copy"] for r in big)
    verdict = "met" if worst >= 85 else "NOT met"
    line = f"target >= 85% of copy bandwidth at >= 1 GB of KV: {verdict} (worst {worst:.0f}%)"
    return (0 if worst >= 85 else 1), line


# ===================================================================================== overhead
# What costs time outside the kernels' memory traffic: programs with no work, compiles on the
# serving path, and Python between launches.


def bench_overhead(device: torch.device) -> None:
    from minivllm.attention.backends.triton import TritonBackend

    backend = TritonBackend()
    shape = DecodeShape(batch=1, context=1)  # the Llama-3-8B-like layer; lengths set per step
    scale = shape.head_dim**-0.5

    def attend_fn(seq_lens: list[int], query_lens: list[int]) -> Callable[[], torch.Tensor]:
        query, k_cache, v_cache, meta = build_paged_step(shape, seq_lens, query_lens, device)
        meta.plan = backend.plan(meta, shape.block_size)
        return lambda: backend.attend(query, k_cache, v_cache, meta, scale)

    # 1. The first call at each context length: a compile on the serving path shows up here.
    # Run first, in a fresh Triton cache (main sets TRITON_CACHE_DIR), so compiles are real.
    print("first call (compile included) vs a warm call, 8 decodes, by context length:")
    for ctx in (128, 256, 512, 1024, 2048, 4096):
        fn = attend_fn([ctx] * 8, [1] * 8)
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        first_ms = (time.perf_counter() - start) * 1e3
        print(
            f"  max_seq_len {ctx:>5}: first {first_ms:>9.1f} ms   warm {time_ms(fn) * 1e3:>8.1f} us"
        )

    # 2. Mixed batches: the decodes should cost what they cost alone, the chunk likewise.
    chunk = attend_fn([1984], [1984])
    decodes = attend_fn([4096] * 64, [1] * 64)
    mixed = attend_fn([4096] * 64 + [1984], [1] * 64 + [1984])
    t_chunk, t_dec, t_mixed = time_ms(chunk), time_ms(decodes), time_ms(mixed)
    print("a 1,984-token chunk and 64 decodes over 4,096 tokens, one layer:")
    print(f"  chunk alone {t_chunk * 1e3:.1f} us; 64 decodes alone {t_dec * 1e3:.1f} us; "
          f"chunk + 64 decodes {t_mixed * 1e3:.1f} us "
          f"({t_mixed / (t_chunk + t_dec):.2f}x the sum)")  # fmt: skip

    # 3. Host time per call for the smallest decode (one request, 16 tokens): launch overhead.
    tiny = attend_fn([16], [1])
    query, k_cache, v_cache, meta = build_paged_step(shape, [16], [1], device)
    for label, fn in [
        ("attend, step plan reused (a layer)", tiny),
        ("plan + attend (a step of one layer)", lambda: backend.attend(
            query, k_cache, v_cache, meta, scale)),
    ]:  # fmt: skip
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(1000):
            fn()
        host_us = (time.perf_counter() - start) * 1e3
        torch.cuda.synchronize()
        print(f"  1,000 tiny decode calls, {label}: {host_us:.1f} us of host time per call")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None, formatter_class=HelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="three shapes instead of eight")
    parser.add_argument(
        "--overhead",
        action="store_true",
        help="instead of bandwidth: first-call (compile) times by context length, a chunk with "
        "and without 64 decodes, and host time per tiny decode call",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU; torch sees none. Nothing was measured.")
        return 1
    if args.overhead and "TRITON_CACHE_DIR" not in os.environ:
        # First calls must compile for real, not load an earlier run's kernels from disk.
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="minivllm-triton-cache-")
    from minivllm.attention.backends import triton as triton_backend

    if triton_backend.INTERPRETED:
        print(
            "TRITON_INTERPRET=1 is set: the kernels would run in Triton's CPU interpreter. Unset it."
        )
        return 1
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    if args.overhead:
        print(f"device: {name}")
        bench_overhead(device)
        return 0
    peak = device_peak_tbs(name)
    copy_gbs = measure_copy_bandwidth(device, COPY_BYTES) / 1e9
    print(f"device: {name}; peak {'unknown' if peak is None else f'{peak} TB/s'}; "
          f"measured copy (1 GiB, read + write): {copy_gbs:.0f} GB/s")  # fmt: skip
    print("decode attention, one token per request, bfloat16, head_dim 128, 16-token blocks")
    rows = []
    for shape in QUICK if args.quick else FULL:
        rows.append(bench_shape(shape, device, copy_gbs, peak))
        torch.cuda.empty_cache()
    print_table(TABLE_HEADERS, [table_row(r) for r in rows])
    status, line = target_status(rows)
    print(line)
    return status


if __name__ == "__main__":
    sys.exit(main())
