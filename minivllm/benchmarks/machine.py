"""The machine's limits, measured in the bench's own run: dense matmul FLOP/s and copy bandwidth.

A speed means little alone; against what the hardware can do at best it says how much is left.
Compute-bound work (a few CPU cores, a prefill) is set against `measure_matmul_flops`;
memory-bound work (a GPU's decode step, the paged decode kernel) against `measure_copy_bandwidth`,
the one bandwidth probe of the benches and of the microbenchmarks in the top-level `benchmarks/`.
Both are timed with `synchronize` around them, so that a GPU's asynchronous launches are counted
to their end. `timed_us` is the microbenchmarks' timer for short host-side (CPU) calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def timed(device: torch.device, into: dict[str, float], key: str = "seconds") -> Iterator[None]:
    """Wall seconds of the block, into `into[key]`, the device's queued work included."""
    synchronize(device)
    start = time.perf_counter()
    yield
    synchronize(device)
    into[key] = time.perf_counter() - start


def measure_matmul_flops(
    dtype: torch.dtype, device: torch.device, size: int = 2048, repeats: int = 5
) -> float:
    """Dense FLOP/s of the machine for `dtype`: the best of several large square matmuls, by
    torch's matmul and, on a CPU with oneDNN, by oneDNN on a prepacked weight (the GEMM minivllm's
    CPU linears run, minivllm/cpu/op_forwards.py; faster than MKL's here, so a peak taken from
    MKL alone would be one minivllm exceeds)."""
    if device.type == "cuda":
        size = max(size, 8192)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    gemms = [lambda: torch.matmul(a, b)]
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        from minivllm.cpu.op_forwards import onednn_packs, packed_linear

        if onednn_packs(b):
            packed = torch.ops.mkldnn._reorder_linear_weight(b, 64)
            gemms.append(lambda: packed_linear(a, packed))
    best = float("inf")
    inner = 3
    for gemm in gemms:
        gemm()  # warm-up
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            for _ in range(inner):
                gemm()
            synchronize(device)
            best = min(best, (time.perf_counter() - start) / inner)
    return 2.0 * size**3 / best


def measure_copy_bandwidth(device: torch.device, nbytes: int = 2**30, repeats: int = 5) -> float:
    """Bytes/s a copy of `nbytes` moves, counted as bytes read + bytes written (as STREAM's copy
    counts): the best of `repeats` runs of 3 copies (so that a launch and a synchronize are a
    small share of a GPU's run). Take `nbytes` far past the last-level cache (the default 1 GiB
    is 20x an H100's L2; 256 MiB suffices on a CPU). The copy goes into a tensor allocated once:
    `clone()` would allocate fresh pages every call and time the kernel's page faults rather than
    the memory, a fraction of the copy's bandwidth."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: the pages of both are touched before anything is timed
    best = float("inf")
    inner = 3
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(inner):
            dst.copy_(src)
        synchronize(device)
        best = min(best, (time.perf_counter() - start) / inner)
    return 2.0 * nbytes / best


def timed_us(fn: Callable[[], object], repeats: int = 7, min_s: float = 0.1) -> tuple[float, float]:
    """(median, best) over `repeats` runs of the mean time of one call, in microseconds, each run
    at least `min_s` long. The best run is the one least disturbed by other processes on a shared
    machine. Host time: for CPU ops (a GPU's calls would need a synchronize)."""
    fn()
    calls = 1
    while True:  # calls per run, so that a run is long enough to time
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if time.perf_counter() - start >= min_s:
            break
        calls *= 2
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(runs)[repeats // 2], min(runs)
