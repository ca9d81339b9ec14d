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
dot is timed too, and on an AVX-512 build whose CPU has AVX512-VNNI the int8 dot (the AVX2 build's
own product). The dots of a level take turns: `--rounds` rounds, each timing every shape, M and
dot once, and the median round is printed, so that a machine shared with other work slows each
dot alike. `--shapes` adds Llama-3.2-1B's Q4_K down (2048 rows of 8192), SmolLM2's Q4_1
linears and its Q8_0 head (`head_q8`). Random blocks with small fp16 scales (speed does not
depend on values).

    PYTHONPATH=. python benchmarks/gguf_small_m.py [--levels avx2 avx512 avx512_bf16] [--threads 2]
        [--shapes ffn_up head ...] [--rounds 5] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

Q4_1, Q8_0, Q4_K, Q6_K = 3, 8, 12, 14
SHAPES = {  # name: (rows, K, GGML type)
    "ffn_up Q4_K 8192x2048": (8192, 2048, Q4_K),
    "head Q6_K 128256x2048": (128256, 2048, Q6_K),
    "down Q4_K 2048x8192": (2048, 8192, Q4_K),
    "qkv Q4_1 960x576": (960, 576, Q4_1),
    "o Q4_1 576x576": (576, 576, Q4_1),
    "gate_up Q4_1 3072x576": (3072, 576, Q4_1),
    "down Q4_1 576x1536": (576, 1536, Q4_1),
    "head_q8 Q8_0 49152x576": (49152, 576, Q8_0),  # SmolLM2's tied head
}
DEFAULT_SHAPES = ("ffn_up", "head")


def time_call(
    x: torch.Tensor, qtype: int, dot: str, copies: list[torch.Tensor], clock: str
) -> float:
    """Microseconds per gguf_linear call, the faster of two passes over all copies after a warm-up
    pass; `--rounds` repeats it, interleaved with the other dots. clock="cpu" counts the process's
    CPU seconds instead of wall seconds: on a machine shared past its cores a call mostly waits
    for one, and at --threads 1 its CPU time is what the kernel itself costs."""
    from minivllm.cpu import ops as cpu_ops

    now = time.process_time if clock == "cpu" else time.perf_counter
    best = float("inf")
    for i in range(3):  # a warm-up pass, then two
        start = now()
        for w in copies:
            cpu_ops.gguf_linear(x, w, qtype, dot)
        if i:
            best = min(best, now() - start)
    return best / len(copies) * 1e6


def one_level(
    tokens: list[int], threads: int, mib: int, shapes: list[str], rounds: int, clock: str
) -> dict[str, object]:
    """This process's level: {shape: {dot: {M: microseconds}}} (each the median of `rounds`
    interleaved rounds), the copy bandwidth and the load before and after."""
    from benchmarks.gguf_gemm import random_blocks
    from minivllm.benchmarks.machine import measure_copy_bandwidth
    from minivllm.cpu import ops as cpu_ops

    torch.set_num_threads(threads)
    dots = ["float32"] + (["bf16"] if cpu_ops.gguf_has_bf16_dot() else [])
    if cpu_ops.gguf_dot_kind() != "int8" and cpu_ops.gguf_has_int8_dot():
        dots.append("int8")
    copy_bw = measure_copy_bandwidth(torch.device("cpu"), nbytes=2**30)
    load = f"{os.getloadavg()[0]:.1f}"
    chosen = {name: v for name, v in SHAPES.items() if name.split()[0] in shapes}
    weights = {}  # name: distinct copies of the weight, `mib` in all
    for seed, (name, (n, k, qtype)) in enumerate(chosen.items()):
        q = torch.from_numpy(random_blocks(n, k, qtype, seed))  # uint8 [n, row_bytes]
        weights[name] = [q.clone() for _ in range(max(1, (mib << 20) // q.numel()))]
    samples: dict[str, dict[str, dict[int, list[float]]]] = {
        name: {dot: {m: [] for m in tokens} for dot in dots} for name in chosen
    }
    for _ in range(rounds):
        for name, (_, k, qtype) in chosen.items():
            for m in tokens:
                x = torch.randn(m, k)
                for dot in dots:
                    samples[name][dot][m].append(time_call(x, qtype, dot, weights[name], clock))
                    print(name, m, dot, f"{samples[name][dot][m][-1]:.1f}", file=sys.stderr)
    times = {
        name: {
            "bytes": weights[name][0].numel(),
            "us": {
                d: {m: statistics.median(v) for m, v in by_m.items()} for d, by_m in per.items()
            },
        }
        for name, per in samples.items()
    }
    kind = cpu_ops.gguf_dot_kind()
    load += f"-{os.getloadavg()[0]:.1f}"
    return {"kind": kind, "copy_gbs": copy_bw / 1e9, "load": load, "times": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", nargs="+", default=["avx2", "avx512", "avx512_bf16"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mib", type=int, default=640, help="bytes of distinct copies per shape")
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES),
                        help=f"first words of {', '.join(SHAPES)}")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--one-level", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_level:
        r = one_level(args.tokens, args.threads, args.mib, args.shapes, args.rounds, args.clock)
        print(json.dumps(r))
        return
    print(
        "level      dot      shape                     M     µs/call   floor µs  x floor  load      copy GB/s"
    )
    for level in args.levels:
        cmd = [sys.executable, __file__, "--one-level", "--threads", str(args.threads),
               "--mib", str(args.mib), "--rounds", str(args.rounds), "--clock", args.clock, "--tokens",
               *map(str, args.tokens), "--shapes", *args.shapes]  # fmt: skip
        env = {**os.environ, "MINIVLLM_CPU_ISA": level}
        out = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        for name, shape in r["times"].items():
            floor_us = shape["bytes"] / (r["copy_gbs"] * 1e3)
            for dot, by_m in shape["us"].items():
                label = f"{dot}:{r['kind']}" if dot == "float32" else dot
                for m, us in by_m.items():
                    print(f"{level:10s} {label:8s} {name:25s} {m:>2s} {us:10.1f} {floor_us:10.1f}"
                          f" {us / floor_us:7.2f}x  {r['load']:9s} {r['copy_gbs']:6.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
