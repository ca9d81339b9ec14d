"""Where a run's time goes: its ops by self CPU time, in groups (`python -m benchmarks.throughput_vs_peers --profile`).

The matmul floor (floor.py) says how much of a run is *not* matmul; this says what that is. The
same workload runs once more under `torch.profiler`, after the timed run (the profiler slows every
op down, so its run is never the one timed) and with the prefix cache emptied first (so that it
computes the same prompts again), and each op's *self* time, the time spent in the op
itself and not in the ops it called, is summed by name. Ops are then put into the groups a reader
of the model recognises:

  matmul            the linears and the LM head (aten::mm / addmm, oneDNN's prepacked linear,
                    the skinny GEMM of decode's few rows)
  attention         the CPU backend's paged kernel (decode rows and prompt rows alike) and the
                    reference backend's SDPA
  fused layer ops   the CPU fast path's other C++ ops: the fused RMSNorm, SiLU·mul and RoPE
                    kernels (custom_op.py) and the KV-cache write (reshape_and_cache)
  elementwise       everything else that computes: plain-PyTorch norms, activations, RoPE, sampling
  copies            moving bytes without arithmetic: copy_, cat, index_copy_ (the KV write), ...
  bookkeeping       creating tensors and views: empty, as_strided, view, slice, transpose, ...,
                    and the host work of the C++ loop over a decode step's layers

Shares are of the summed self time, which leaves out the Python between ops: the wall time of the
profiled run is reported beside it so that gap shows too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

TOP_OPS = 15  # ops listed one by one; the groups cover every op
GROUPS: dict[str, tuple[str, ...]] = {
    "matmul": (
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::matmul",
        "mkldnn::_linear_pointwise",
        "minivllm_cpu::skinny_gemm",
    ),
    "attention": (
        "minivllm_cpu::paged_decode",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_attention_math",
    ),
    "copies": (
        "aten::copy_",
        "aten::clone",
        "aten::cat",
        "aten::index_copy_",
        "aten::index_select",
        "aten::index",
        "aten::embedding",
        "aten::_to_copy",
        "aten::contiguous",
    ),
    "bookkeeping": (
        "aten::empty",
        "aten::empty_strided",
        "aten::empty_like",
        "aten::as_strided",
        "aten::view",
        "aten::reshape",
        "aten::slice",
        "aten::select",
        "aten::split",
        "aten::split_with_sizes",
        "aten::chunk",
        "aten::narrow",
        "aten::transpose",
        "aten::t",
        "aten::unsqueeze",
        "aten::to",
        "aten::detach",
        "aten::lift_fresh",
        "aten::alias",
        "aten::resolve_conj",
        "aten::resolve_neg",
        # The C++ loop over a decode step's layers: its own time is the host work between its
        # kernels, which are counted under their own names.
        "minivllm_cpu::decode_layers",
    ),
}
GROUP_ORDER = ("matmul", "attention", "fused layer ops", "elementwise", "copies", "bookkeeping")


def group_of(op: str) -> str:
    for group, names in GROUPS.items():
        if op in names:
            return group
    if op.startswith("minivllm_cpu::"):
        return "fused layer ops"
    return "elementwise"


def summarize(self_seconds: dict[str, tuple[float, int]], wall_seconds: float) -> dict[str, Any]:
    """The report: `self_seconds` maps op name -> (self seconds, calls)."""
    total = sum(s for s, _ in self_seconds.values()) or 1e-12
    groups = {g: 0.0 for g in GROUP_ORDER}
    for op, (seconds, _) in self_seconds.items():
        groups[group_of(op)] += seconds
    ranked = sorted(self_seconds.items(), key=lambda kv: -kv[1][0])[:TOP_OPS]
    return {
        "wall_seconds": wall_seconds,
        "self_seconds": total,
        "groups": [
            {"group": g, "seconds": s, "share": s / total} for g, s in groups.items() if s > 0
        ],
        "ops": [
            {"op": op, "group": group_of(op), "seconds": s, "share": s / total, "calls": n}
            for op, (s, n) in ranked
        ],
    }


def profile_run(run: Callable[..., object], *args: Any) -> dict[str, Any]:
    """Call `run(*args)` (the workload, once more) under the profiler; the summarised report."""
    start = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run(*args)
    wall = time.perf_counter() - start
    ops = {e.key: (e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()}
    return summarize(ops, wall)


def print_profile(report: dict[str, Any]) -> None:
    print(
        f"\nwhere minivllm's time goes (a second, profiled run: {report['wall_seconds']:.1f} s wall, "
        f"{report['self_seconds']:.1f} s in ops; shares of the time in ops)"
    )
    print("  " + "   ".join(f"{g['group']} {g['share']:.1%}" for g in report["groups"]))
    for op in report["ops"]:
        print(
            f"  {op['op']:<52} {op['seconds']:7.2f} s {op['share']:6.1%}  "
            f"{op['calls']:>7,} calls  ({op['group']})"
        )
