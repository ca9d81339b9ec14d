"""Microbenchmark: `gguf_linear` at decode's few token rows against its memory floor, per level.

At one to eight token rows a GGUF linear should be bound by reading its quantized weight once: its
floor is the weight's bytes at the machine's copy bandwidth (a copy of a 1 GiB tensor, read +
write bytes, measured in the same process). This bench times the two shapes that dominate a
Llama-3.2-1B Q4_K_M decode step, FFN's Q4_K gate/up (8192 rows of 2048) and the tied Q6_K head
(128256 rows of 2048), at M = 1 and M = 8, and prints each time beside that floor. Each shape runs
over enough distinct copies (`--mib` in all) that every call reads its weight from memory, as a
step does, and not from a cache that one weight timed over and over would sit in.

Each instruction-set level runs in its own process (`MINIVLLM_CPU_ISA` is read when the library
loads), with the load average recorded beside its numbers; at a level with AVX512-BF16 the bf16
dot is timed too. Random blocks with small fp16 scales (speed does not depend on values).

    PYTHONPATH=. python benchmarks/gguf_small_m.py [--levels avx2 avx512 avx512_bf16] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

Q4_K, Q6_K = 12, 14
SHAPES = {
    "ffn_up Q4_K 8192x2048": (8192, 2048, Q4_K),
    "head Q6_K 128256x2048": (128256, 2048, Q6_K),
}


def time_call(x: torch.Tensor, qtype: int, dot: str, copies: list[torch.Tensor]) -> float:
    """Microseconds per gguf_linear call, fastest pass over all copies (benchmarks/gguf_gemm.py)."""
    from benchmarks.gguf_gemm import pass_us
    from minivllm.cpu import ops as cpu_ops

    return pass_us(lambda w: cpu_ops.gguf_linear(x, w, qtype, dot), copies)


def one_level(tokens: list[int], threads: int, mib: int) -> dict[str, object]:
    """This process's level: {shape: {dot: {M: microseconds}}}, the copy bandwidth and the load."""
    from benchmarks.gguf_gemm import random_blocks
    from minivllm.benchmarks.machine import measure_copy_bandwidth
    from minivllm.cpu import ops as cpu_ops

    torch.set_num_threads(threads)
    dots = ["float32"] + (["bf16"] if cpu_ops.gguf_has_bf16_dot() else [])
    copy_bw = measure_copy_bandwidth(torch.device("cpu"), nbytes=2**30)
    result: dict[str, object] = {
        "kind": cpu_ops.gguf_dot_kind(), "copy_gbs": copy_bw / 1e9,
        "load": f"{os.getloadavg()[0]:.2f}", "times": {},
    }  # fmt: skip
    for seed, (name, (n, k, qtype)) in enumerate(SHAPES.items()):
        q = torch.from_numpy(random_blocks(n, k, qtype, seed))  # uint8 [n, row_bytes]
        copies = [q.clone() for _ in range(max(1, (mib << 20) // q.numel()))]
        del q
        per_dot = {}
        for dot in dots:
            per_dot[dot] = {m: time_call(torch.randn(m, k), qtype, dot, copies) for m in tokens}
        result["times"][name] = {"bytes": copies[0].numel(), "us": per_dot}  # type: ignore[index]
        del copies
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", nargs="+", default=["avx2", "avx512", "avx512_bf16"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mib", type=int, default=640, help="bytes of distinct copies per shape")
    parser.add_argument("--one-level", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_level:
        print(json.dumps(one_level(args.tokens, args.threads, args.mib)))
        return
    print(
        "level      dot      shape                     M     µs/call   floor µs  x floor  load  copy GB/s"
    )
    for level in args.levels:
        cmd = [sys.executable, __file__, "--one-level", "--threads", str(args.threads),
               "--mib", str(args.mib), "--tokens", *map(str, args.tokens)]  # fmt: skip
        env = {**os.environ, "MINIVLLM_CPU_ISA": level}
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        for name, shape in r["times"].items():
            floor_us = shape["bytes"] / (r["copy_gbs"] * 1e3)
            for dot, by_m in shape["us"].items():
                label = f"{dot}:{r['kind']}" if dot == "float32" else dot
                for m, us in by_m.items():
                    print(f"{level:10s} {label:8s} {name:25s} {m:>2s} {us:10.1f} {floor_us:10.1f}"
                          f" {us / floor_us:7.2f}x  {r['load']:5s} {r['copy_gbs']:6.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
