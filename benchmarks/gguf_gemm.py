"""Microbenchmark: linears on GGUF's quantized blocks against float32 ones, at a model's shapes.

`gguf_linear` (minivllm/cpu/csrc/cpu_gguf_gemm.cpp) keeps a weight in GGUF's blocks and unpacks each
block where it is used, so that a decode step reads the weight's quantized bytes and nothing
else. Its floor is therefore those bytes at the machine's memory bandwidth. This bench times it
at SmolLM2-135M-Instruct.Q4_1.gguf's shapes (30 layers of Q4_1 qkv, o, gate_up and down, and the
Q8_0 LM head), each shape over as many distinct copies as the model has, so that every call reads
its weight from memory as a step does (one weight timed over and over would sit in cache), and
sets it against:

- `GB/s`: the quantized bytes read per second, and `of copy`: that as a share of the machine's
  copy bandwidth (a torch copy of a 256 MiB tensor, read + write bytes, measured in the same run);
- `skinny` and `mm`: the same product on the float32 weight (`cpu_ops.skinny_gemm`, and
  `torch.mm`, MKL), which reads 4 bytes per weight, the path a dequantize-at-load model takes;
- `deq+mm`: `gguf_dequantize` then `torch.mm` on every call, the dequantize-then-multiply that the
  AVX2 build's integer dots (cpu_gguf_gemm_avx2.cpp) replace.

`--model llama-3.2-1b` takes Llama-3.2-1B's shapes instead, as a Q4_K_M file has them (Q4_K
projections, Q6_K down and head; hidden 2048, FFN 8192, KV 512, vocab 128256). The head is left out
past 32 rows: a prefill computes logits for its last rows only. Which products `gguf_linear` takes
in this build (`gguf_dot_kind()`: float32, or int8 on AVX2 builds) is printed with the results.

The `step` row sums a whole decode step's linears: 30 layers' four and the LM head. Random
weights (quantized by `gguf.quants.quantize`) and activations; no timing is asserted anywhere.
Run it from the checkout's root, on a machine as idle as you can make it:

    python -m benchmarks.gguf_gemm [--tokens 1 4 32] [--layers 30] [--threads 2] [--dot bf16]
        [--model smollm2|llama-3.2-1b]
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

_T = gguf.GGMLQuantizationType
Q4_1, Q8_0, Q4_K, Q6_K = int(_T.Q4_1), int(_T.Q8_0), int(_T.Q4_K), int(_T.Q6_K)
# model: {name: ([out, in], GGML type)}, the head last
MODELS = {
    # SmolLM2-135M-Instruct.Q4_1.gguf: qkv 9 + 2 * 3 heads of 64; a Q8_0 head
    "smollm2": {
        "qkv": ((960, 576), Q4_1),
        "o": ((576, 576), Q4_1),
        "gate_up": ((3072, 576), Q4_1),
        "down": ((576, 1536), Q4_1),
        "lm_head": ((49152, 576), Q8_0),
    },
    # Llama-3.2-1B in Q4_K_M: qkv 2048 + 2 * 512, FFN 8192; a Q6_K down and head
    "llama-3.2-1b": {
        "qkv": ((3072, 2048), Q4_K),
        "o": ((2048, 2048), Q4_K),
        "gate_up": ((16384, 2048), Q4_K),
        "down": ((2048, 8192), Q6_K),
        "lm_head": ((128256, 2048), Q6_K),
    },
}
HEAD_COPIES = {"smollm2": 3, "llama-3.2-1b": 1}  # a SmolLM2 head (30 MB) stays in a 32 MB L3
HEAD_MAX_TOKENS = 32  # past this, the head is left out (a prefill's logits are its last rows')


def random_blocks(n: int, k: int, qtype: int, seed: int) -> np.ndarray:  # uint8 [n, row_bytes]
    """`gguf.quants.quantize` of random normals; for the K-quants, which gguf cannot quantize,
    random bytes with fp16 scales of a similar output size (speed does not depend on values)."""
    rng = np.random.default_rng(seed)
    if qtype not in (Q4_K, Q6_K):
        w = rng.standard_normal((n, k), dtype=np.float32) / k**0.5
        return gguf.quants.quantize(w, _T(qtype))
    block_size, type_size = gguf.GGML_QUANT_SIZES[_T(qtype)]
    blocks = rng.integers(0, 256, size=(n, k // block_size, type_size), dtype=np.uint8)
    scales = np.full((n, k // block_size), 1e-3 / k**0.5, np.float16).view(np.uint8)
    at = 208 if qtype == Q6_K else 0  # Q6_K: | ql | qh | scales | d |; Q4_K: | d | dmin | ...
    blocks[..., at : at + 2] = scales.reshape(n, -1, 2)
    if qtype == Q4_K:
        blocks[..., 2:4] = scales.reshape(n, -1, 2)
    return blocks.reshape(n, -1)


class Weight:
    """One shape's copies, quantized and as float32, all distinct tensors in memory."""

    def __init__(self, n: int, k: int, qtype: int, copies: int, seed: int) -> None:
        q = torch.from_numpy(random_blocks(n, k, qtype, seed))
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


def measure(
    weight: Weight, x: torch.Tensor, dot: str
) -> tuple[float, float, float, float]:  # x: [M, K]
    """(gguf_linear with `dot` products, skinny_gemm, torch.mm, gguf_dequantize + torch.mm)
    microseconds per call; skinny_gemm only up to its row limit (else nan). Past a few rows a
    call is compute-bound, and fewer copies and passes give the same time sooner."""
    copies, repeats = (None, 7) if x.shape[0] <= 32 else (2, 3)
    quantized, dense = weight.quantized[:copies], weight.dense[:copies]
    gguf_us = pass_us(lambda q: cpu_ops.gguf_linear(x, q, weight.qtype, dot), quantized, repeats)
    skinny_us = float("nan")
    if x.shape[0] <= cpu_ops.SKINNY_GEMM_MAX_ROWS:
        skinny_us = pass_us(lambda w: cpu_ops.skinny_gemm(x, w), dense, repeats)
    mm_us = pass_us(lambda w: torch.mm(x, w.t()), dense, repeats)
    deq_us = pass_us(
        lambda q: torch.mm(x, cpu_ops.gguf_dequantize(q, weight.qtype).t()), quantized, repeats
    )
    return gguf_us, skinny_us, mm_us, deq_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument(
        "--dot", choices=["auto", "bf16", "float32", "int8"], default="auto",
        help="gguf_linear's products; auto: what the engine uses here for each block type "
        "(MINIVLLM_CPU_GGUF_DOT)",
    )  # fmt: skip
    args = parser.parse_args()
    from minivllm.cpu.op_forwards import gguf_dot

    def dot_for(qtype: int) -> str:
        return gguf_dot(qtype) if args.dot == "auto" else args.dot

    torch.set_num_threads(args.threads)
    shapes, head_copies = MODELS[args.model], HEAD_COPIES[args.model]
    weights = {
        name: Weight(n, k, qtype, head_copies if name == "lm_head" else args.layers, seed)
        for seed, (name, ((n, k), qtype)) in enumerate(shapes.items())
    }
    copy_bw = measure_copy_bandwidth(torch.device("cpu"), nbytes=2**28)
    step_bytes = sum(
        w.nbytes * (1 if name == "lm_head" else args.layers) for name, w in weights.items()
    )
    dots = ", ".join(sorted({f"{dot_for(w.qtype)} ({name})" for name, w in weights.items()}))
    print(
        f"{args.model}; {dots} products (gguf_dot_kind: {cpu_ops.gguf_dot_kind()}); threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f}; copy bandwidth "
        f"{copy_bw / 1e9:.1f} GB/s; a step's quantized weights {step_bytes / 1e6:.1f} MB "
        f"(floor {step_bytes / copy_bw * 1e3:.2f} ms); µs per call, fastest of 7 passes"
    )
    rows = []
    head_bytes = weights["lm_head"].nbytes
    for m in args.tokens:
        step = [0.0, 0.0, 0.0, 0.0]
        for name, weight in weights.items():
            if name == "lm_head" and m > HEAD_MAX_TOKENS:
                continue
            x = torch.randn(m, weight.k)  # [M, K]
            times = measure(weight, x, dot_for(weight.qtype))
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
        m_bytes = step_bytes - (head_bytes if m > HEAD_MAX_TOKENS else 0)
        rows.append(row("step", m, tuple(step), m_bytes, copy_bw))
    print_table(
        ["linear", "M", "gguf µs", "GB/s", "of copy", "skinny µs", "mm µs", "deq+mm µs",
         "vs best f32", "vs deq+mm"],
        rows,
    )  # fmt: skip


def row(name: str, m: int, times: tuple[float, ...], nbytes: int, copy_bw: float) -> list[object]:
    gguf_us, skinny_us, mm_us, deq_us = times
    gbs = nbytes / gguf_us / 1e3
    best_f32 = min(t for t in (skinny_us, mm_us) if t == t)  # skinny is nan past its rows
    return [name, m, gguf_us, gbs, f"{gbs * 1e9 / copy_bw:.0%}", skinny_us, mm_us, deq_us,
            f"{best_f32 / gguf_us:.2f}x", f"{deq_us / gguf_us:.2f}x"]  # fmt: skip


if __name__ == "__main__":
    main()
