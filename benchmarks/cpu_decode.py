"""Microbenchmark: the CPU paged decode kernel and the fused cache write, at a model's shapes.

Decode attention reads each running request's whole context once per layer and step; the kernel
cannot do better than the memory's speed, so this reports its *effective bandwidth* (bytes of K
and V read / time) next to what the machine can copy (a copy of a 256 MB tensor, counted as bytes read + bytes
written, the way STREAM's copy counts: minivllm/benchmarks/machine.py's probe). The gap between the two is what is
left to win.

The batches are what the throughput bench's decode steps look like: 32 or 64 requests whose
context lengths are drawn from 16..512 (the lengths differ a lot, which is what load balance
between threads is about), plus one of equal lengths for comparison. Shapes are SmolLM2-135M's
(9 query heads, 3 KV heads of 64) or, with `--model Llama-3.2-1B`, 32 query heads and 8 KV heads of
64; blocks of 16 tokens, a float32 cache; the queries are a view of a feature-major qkv, as the
CPU linears return it. Each call reads another layer's cache (`--layers`
of them, with shuffled block tables), as the model's 30 layers do, so a call does not find the
previous call's context in the cache memory of the CPU.

It also times the cache write of one decode step: the reference backend's `index_copy_` (with its
host-side check for skipped slots) against the fused `reshape_and_cache` op.

Not a test (no timing is asserted anywhere); run it as

    python benchmarks/cpu_decode.py [--threads 2] [--dtype float32] [--kv-cache-dtype bfloat16]
                                    [--model Llama-3.2-1B]

`--kv-cache-dtype` stores the caches narrower than the queries, as the engine's option of that name
does (a bfloat16 cache under float32 weights: half the bytes to read).

It times the kernels of the tree it runs in (they are built on first use, one build per version
of the sources and instruction-set level), so a before/after is the same command on the two
commits, and `MINIVLLM_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` times what an
AVX2-only CPU runs. On a machine shared
with other work, compare the "best" columns: a thread that loses its core for a time slice
makes a 1 ms call take several.
"""

from __future__ import annotations

import argparse

import torch

from minivllm.attention.backends.cpu import CpuBackend, paged_decode
from minivllm.attention.backends.reference import ReferenceBackend
from minivllm.benchmarks.machine import measure_copy_bandwidth, timed_us
from minivllm.benchmarks.report import print_table

# (query heads, KV heads, head size) of each model whose decode attention is timed
SHAPES = {"SmolLM2-135M": (9, 3, 64), "Llama-3.2-1B": (32, 8, 64)}
BLOCK_SIZE = 16


class DecodeBatch:
    """One decode step of `len(seq_lens)` requests over `layers` layers' paged caches."""

    def __init__(
        self, seq_lens: list[int], layers: int, dtype: torch.dtype, seed: int,
        cache_dtype: torch.dtype | None = None, shape: tuple[int, int, int] = SHAPES["SmolLM2-135M"],
    ) -> None:  # fmt: skip
        cache_dtype = cache_dtype or dtype
        heads, kv_heads, head_dim = shape
        self.scale = head_dim**-0.5
        gen = torch.Generator().manual_seed(seed)
        b = len(seq_lens)
        blocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
        num_blocks = sum(blocks)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)  # [B]
        self.caches = []  # per layer: (k_cache, v_cache, block_tables)
        for _ in range(layers):
            cache_shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
            k = torch.randn(cache_shape, generator=gen).to(cache_dtype)
            v = torch.randn(cache_shape, generator=gen).to(cache_dtype)
            order = torch.randperm(num_blocks, generator=gen, dtype=torch.int32)
            tables = torch.zeros(b, max(blocks), dtype=torch.int32)  # [B, max_blocks]
            taken = 0
            for i, n in enumerate(blocks):
                tables[i, :n] = order[taken : taken + n]
                taken += n
            self.caches.append((k, v, tables))
        # The model's queries: a view of a feature-major qkv ([N, T] stored, read as [T, N]).
        qkv = torch.randn((heads + 2 * kv_heads) * head_dim, b, generator=gen).to(dtype).t()
        self.query = qkv[:, : heads * head_dim].view(b, heads, head_dim)  # [B, heads, head_dim]
        self.rows = torch.arange(b, dtype=torch.int64)  # [B]
        self.out = torch.empty(b, heads, head_dim)  # float32 [B, heads, head_dim]
        self.layer = 0
        self.bytes_read = 2 * sum(seq_lens) * kv_heads * head_dim * k.element_size()

    def step(self) -> None:
        """One layer's decode attention; the next call reads the next layer's cache."""
        k, v, tables = self.caches[self.layer]
        self.layer = (self.layer + 1) % len(self.caches)
        paged_decode(
            self.query, k, v, tables, self.seq_lens, self.rows, self.scale, self.out
        )  # fmt: skip


def bench_write_kv(
    tokens: int, dtype: torch.dtype, cache_dtype: torch.dtype, shape: tuple[int, int, int]
) -> dict[str, float]:
    """One layer's cache write of a decode step: `tokens` new K/V rows, token-major views of a
    feature-major qkv (strides (1, head_dim * T, T)), scattered into 4096 blocks' worth of cache."""
    heads, kv_heads, head_dim = shape
    k_cache = torch.zeros(4096, BLOCK_SIZE, kv_heads, head_dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn((heads + 2 * kv_heads) * head_dim, tokens).to(dtype).t()  # [T, N]
    key = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    value = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(4096 * BLOCK_SIZE)[:tokens]  # int64 [T]
    ref, cpu = ReferenceBackend(), CpuBackend()
    return {  # best runs
        "reference index_copy_": timed_us(
            lambda: ref.write_kv(key, value, k_cache, v_cache, slots)
        )[1],
        "cpu reshape_and_cache": timed_us(
            lambda: cpu.write_kv(key, value, k_cache, v_cache, slots)
        )[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="SmolLM2-135M", choices=list(SHAPES))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--layers", type=int, default=30, help="caches the calls rotate through")
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help="the caches' dtype; auto: --dtype",
    )  # fmt: skip
    args = parser.parse_args()
    shape = SHAPES[args.model]
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cache_dtype = dtype if args.kv_cache_dtype == "auto" else getattr(torch, args.kv_cache_dtype)

    gen = torch.Generator().manual_seed(0)
    workloads = {
        "32 req, 16..512": torch.randint(16, 513, (32,), generator=gen).tolist(),
        "64 req, 16..512": torch.randint(16, 513, (64,), generator=gen).tolist(),
        # The scheduler's running list is in arrival order, oldest (longest context) first:
        # one contiguous half of the batch holds most of the work.
        "32 req, sorted": sorted(torch.randint(16, 513, (32,), generator=gen).tolist())[::-1],
        "64 req, all 256": [256] * 64,
        "32 req, all 512": [512] * 32,
        "8 req, 16..512": torch.randint(16, 513, (8,), generator=gen).tolist(),
    }
    copy_gbs = measure_copy_bandwidth(torch.device("cpu"), nbytes=256 * 2**20) / 1e9
    print(
        f"{args.model} (heads, KV heads, head size {shape}); threads={args.threads} "
        f"dtype={args.dtype} kv_cache_dtype={cache_dtype}; "
        f"copy of 256 MB: {copy_gbs:.1f} GB/s"
    )
    rows = []
    for name, lens in workloads.items():
        batch = DecodeBatch(lens, args.layers, dtype, seed=1, cache_dtype=cache_dtype, shape=shape)
        median, best = timed_us(batch.step)
        gbs = batch.bytes_read / (best * 1e-6) / 1e9
        rows.append(
            [name, sum(lens), f"{batch.bytes_read / 1e6:.1f}", f"{median:.1f}", f"{best:.1f}",
             f"{gbs:.1f}", f"{gbs / copy_gbs:.0%}"]
        )  # fmt: skip
    headers = [
        "paged_decode",
        "tokens",
        "MB read",
        "median us",
        "best us",
        "GB/s (best)",
        "of copy",
    ]
    print_table(headers, rows)
    for tokens in (32, 64):
        times = bench_write_kv(tokens, dtype, cache_dtype, shape)
        cells = "  ".join(f"{name} {us:.1f} us" for name, us in times.items())
        print(f"write_kv, {tokens} tokens: {cells}")


if __name__ == "__main__":
    main()
