"""Microbenchmark: decode's linears over a whole model's weights, MKL against the skinny GEMM.

A decode step multiplies T token rows (T = the running requests) by every layer's weights, which
together are far larger than the caches (SmolLM2-135M: 30 layers, 425 MB of float32), so each
step streams them from memory once. Timing one weight over and over would keep it in cache and
measure something the engine never sees; this bench runs all the layers' four projections in
turn, as a step does, with fresh random weights of the model's shapes:

- `mkl`: `parallel_layers.linear`, (W · xᵀ)ᵀ by MKL (the plain path, and the fast path above
  `SKINNY_GEMM_MAX_ROWS`);
- `skinny`: `cpu_ops.skinny_gemm`, the kernel of `minivllm/cpu/csrc/cpu_skinny_gemm.cpp`.

It also prints the two bounds: the weights' bytes at the machine's copy bandwidth, and the
arithmetic at the float32 matmul peak, both measured in the same run. Shapes default to
SmolLM2-135M's. Not a test (no timing is asserted anywhere); run it as

    python benchmarks/skinny_gemm.py [--tokens 1 2 4 8 16 32 64] [--layers 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from minivllm.benchmarks.machine import measure_copy_bandwidth, measure_matmul_flops
from minivllm.benchmarks.report import print_table
from minivllm.cpu import ops as cpu_ops
from minivllm.cpu.op_forwards import linear

# SmolLM2-135M's projections, [out, in]: qkv (9 + 2 * 3 heads of 64), o, gate_up, down.
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def step_ms(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    weights: list[torch.Tensor],
    rows: dict[int, torch.Tensor],  # input width -> [T, width]
    repeats: int = 7,
) -> float:
    """Median milliseconds of one pass over every weight (after one warm-up pass)."""

    def one_pass() -> None:
        for w in weights:
            fn(rows[w.shape[1]], w)

    one_pass()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 24, 32, 48, 64])
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    weights = [torch.randn(o, i) / i**0.5 for _ in range(args.layers) for o, i in SHAPES]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    copy_bw = measure_copy_bandwidth(torch.device("cpu"), nbytes=2**28)
    peak = measure_matmul_flops(torch.float32, torch.device("cpu"), size=2048)
    if not cpu_ops.skinny_gemm_fast():
        print("note: this CPU has no AVX-512; skinny_gemm calls MKL here and the model keeps MKL")
    print(
        f"threads {torch.get_num_threads()}; {args.layers} layers, {nbytes / 2**20:.0f} MiB of "
        f"float32 weights; copy bandwidth {copy_bw / 1e9:.1f} GB/s, matmul peak "
        f"{peak / 1e9:.0f} GFLOP/s; ms per pass over every weight (median of 7)"
    )
    table = []
    for t in args.tokens:
        rows = {i: torch.randn(t, i) for i in {i for _, i in SHAPES}}  # width -> [T, width]
        mkl = step_ms(lambda x, w: linear(x, w), weights, rows)
        skinny = step_ms(cpu_ops.skinny_gemm, weights, rows)
        bytes_ms = nbytes / copy_bw * 1e3
        flops_ms = 2 * t * sum(w.numel() for w in weights) / peak * 1e3
        table.append(
            [t, f"{mkl:.1f}", f"{skinny:.1f}", f"{mkl / skinny:.2f}x", f"{bytes_ms:.1f}",
             f"{flops_ms:.1f}"]
        )  # fmt: skip
    print_table(["T", "mkl", "skinny", "speedup", "bytes bound", "flops bound"], table)


if __name__ == "__main__":
    main()
