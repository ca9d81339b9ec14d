"""Microbenchmark: linears on GGUF's quantized blocks against float32 ones, at SmolLM2's shapes.

`gguf_linear` (minivllm/cpu/cpu_gguf_gemm.cpp) keeps a weight in GGUF's blocks and unpacks each
block where it is used, so that a decode step reads the weight's quantized bytes and nothing
else. Its floor is therefore those bytes at the machine's memory bandwidth. This bench times it
at SmolLM2-135M-Instruct.Q4_1.gguf's shapes (30 layers of Q4_1 qkv, o, gate_up and down, and the
Q8_0 LM head), each shape over as many distinct copies as the model has, so that every call reads
its weight from memory as a step does (one weight timed over and over would sit in cache), and
sets it against:

- `GB/s`: the quantized bytes read per second, and `of copy`: that as a share of the machine's
  copy bandwidth (a torch copy of a 256 MiB tensor, read + write bytes, measured in the same run);
- `skinny` and `mm`: the same product on the float32 weight (`cpu_ops.skinny_gemm`, and
  `torch.mm`, MKL), which reads 4 bytes per weight, the path a dequantize-at-load model takes.

The `step` row sums a whole decode step's linears: 30 layers' four and the LM head. Random
weights (quantized by `gguf.quants.quantize`) and activations; no timing is asserted anywhere.
Run it from the checkout's root, on a machine as idle as you can make it:

    python -m benchmarks.gguf_gemm [--tokens 1 4 32] [--layers 30] [--threads 2] [--dot bf16]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import gguf
import numpy as np
import torch

from minivllm.benchmarks.machine import measure_copy_bandwidth
from minivllm.benchmarks.report import print_table
from minivllm.cpu import ops as cpu_ops

Q4_1, Q8_0 = int(gguf.GGMLQuantizationType.Q4_1), int(gguf.GGMLQuantizationType.Q8_0)
# name: ([out, in], GGML type); SmolLM2-135M's projections (qkv: 9 + 2 * 3 heads of 64) and head.
SHAPES = {
    "qkv": ((960, 576), Q4_1),
    "o": ((576, 576), Q4_1),
    "gate_up": ((3072, 576), Q4_1),
    "down": ((576, 1536), Q4_1),
    "lm_head": ((49152, 576), Q8_0),
}
HEAD_COPIES = 3  # one head (30 MB) would stay in the 32 MB L3; three do not


class Weight:
    """One shape's copies, quantized and as float32, all distinct tensors in memory."""

    def __init__(self, n: int, k: int, qtype: int, copies: int, seed: int) -> None:
        w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32) / k**0.5
        q = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype)))
        self.qtype, self.k = qtype, k
        self.quantized = [q.clone() for _ in range(copies)]  # uint8 [n, row_bytes] each
        dense = cpu_ops.gguf_dequantize(q, qtype)  # [n, k] float32
        self.dense = [dense.clone() for _ in range(copies)]
        self.nbytes = q.numel()  # per copy


def pass_us(
    fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor], repeats: int = 7
) -> float:
    """Microseconds per call in the fastest of `repeats` passes through every copy (after one
    warm-up pass): the pass least disturbed by other processes on a shared machine, where a
    thread that loses its core makes a whole pass wait for it."""

    def one_pass() -> None:
        for w in weights:
            fn(w)

    one_pass()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - start)
    return min(times) / len(weights) * 1e6


def measure(weight: Weight, x: torch.Tensor, dot: str) -> tuple[float, float, float]:  # x: [M, K]
    """(gguf_linear with `dot` products, skinny_gemm, torch.mm) microseconds per call."""
    gguf_us = pass_us(lambda q: cpu_ops.gguf_linear(x, q, weight.qtype, dot), weight.quantized)
    skinny_us = pass_us(lambda w: cpu_ops.skinny_gemm(x, w), weight.dense)
    mm_us = pass_us(lambda w: torch.mm(x, w.t()), weight.dense)
    return gguf_us, skinny_us, mm_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--dot", choices=["auto", "bf16", "float32"], default="auto",
        help="gguf_linear's products; auto: what the engine uses here (MINIVLLM_CPU_GGUF_DOT)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.dot == "auto":
        from minivllm.cpu.op_forwards import gguf_dot

        args.dot = gguf_dot()
    torch.set_num_threads(args.threads)
    weights = {
        name: Weight(n, k, qtype, HEAD_COPIES if name == "lm_head" else args.layers, seed)
        for seed, (name, ((n, k), qtype)) in enumerate(SHAPES.items())
    }
    copy_bw = measure_copy_bandwidth(torch.device("cpu"), nbytes=2**28)
    step_bytes = sum(
        w.nbytes * (1 if name == "lm_head" else args.layers) for name, w in weights.items()
    )
    print(
        f"{args.dot} products; threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f}; copy bandwidth "
        f"{copy_bw / 1e9:.1f} GB/s; a step's quantized weights {step_bytes / 1e6:.1f} MB "
        f"(floor {step_bytes / copy_bw * 1e3:.2f} ms); µs per call, fastest of 7 passes"
    )
    rows = []
    for m in args.tokens:
        step = [0.0, 0.0, 0.0]
        for name, weight in weights.items():
            x = torch.randn(m, weight.k)  # [M, K]
            times = measure(weight, x, args.dot)
            calls = 1 if name == "lm_head" else args.layers
            step = [s + t * calls for s, t in zip(step, times)]
            rows.append(
                row(
                    f"{name} {weight.quantized[0].shape[0]}x{weight.k}",
                    m,
                    times,
                    weight.nbytes,
                    copy_bw,
                )
            )
        rows.append(row("step", m, tuple(step), step_bytes, copy_bw))
    print_table(
        ["linear", "M", "gguf µs", "GB/s", "of copy", "skinny µs", "mm µs", "vs best f32"], rows
    )


def row(name: str, m: int, times: tuple[float, ...], nbytes: int, copy_bw: float) -> list[object]:
    gguf_us, skinny_us, mm_us = times
    gbs = nbytes / gguf_us / 1e3
    return [name, m, gguf_us, gbs, f"{gbs * 1e9 / copy_bw:.0%}", skinny_us, mm_us,
            f"{min(skinny_us, mm_us) / gguf_us:.2f}x"]  # fmt: skip


if __name__ == "__main__":
    main()
