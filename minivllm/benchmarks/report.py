"""How the `minivllm bench` commands report: the one table printer, the JSON file, the machine's
load beside every timing, and the rows of the benches' tables.

The row builders (throughput: each system's speed and memory, each tensor-parallel rank's share;
memory, prefix and sharing: their one table each) are shared by the bench's printout and the docs'
hook (docs/hooks/perf_tables.py), so that the terminal and the Performance page always show the
same columns from the same JSON.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from minivllm.cpu import isa


# ---------------------------------------------------------------------------------- tables, JSON
def format_cell(v: object) -> str:
    """Thousands separators; floats with 3 decimals under 10, 1 above."""
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain-text table: the first column left-aligned, the others right-aligned, under a rule.
    Cells are formatted by `format_cell`; pass a string to format one yourself."""
    cells = [[format_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths))
        )

    head = line(headers)
    print(head)
    print("-" * len(head))
    for row in cells:
        print(line(row))


def write_json(path: Path | None, data: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"results written to {path}")


# The CPU features a speed depends on: which kernels run (minivllm/cpu/isa.py) and PyTorch's own.
SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "asimd", "sve")


def cpu_description() -> str:
    """The CPU model, its speed-relevant flags and the instruction-set level minivllm runs at:
    a figure measured on an AVX-512 CPU says little about an AVX2 one."""
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(("model name", "Model", "CPU part")):
                model = line.partition(":")[2].strip()
                break
    have = isa.cpu_features()
    flags = " ".join(f for f in SPEED_FLAGS if f in have) or "no SIMD flags read"
    try:
        level = isa.selected_level().name
    except isa.CpuIsaUnsupported as e:
        level = f"unsupported ({e})"
    return f"{model} ({flags}); minivllm CPU level {level}"


def machine_load() -> str:
    """The 1-minute load average, core count and CPU: timings on a shared machine need them
    beside them."""
    try:
        load = f"load {os.getloadavg()[0]:.2f} on "
    except OSError:
        load = ""
    return (
        f"{load}{os.cpu_count()} cores, torch threads {torch.get_num_threads()}; "
        f"{cpu_description()}"
    )


# ---------------------------------------------------------------------------------- bench throughput
SYSTEM_HEADERS = [
    "system",
    "output tokens",
    "seconds",
    "output tok/s",
    "minivllm is x faster",
    "at its matmul floor",
    "peak RSS MiB",
]


def system_row(r: dict[str, Any]) -> list[Any]:
    """One system's throughput result as a table row, under SYSTEM_HEADERS (the bench's table
    and the docs'; a report from before RSS was measured shows an empty cell). "at its matmul
    floor" is how much faster minivllm would be if its run took only its matmul floor: the most
    that removing everything else could give, against that system."""
    rss = r.get("peak_rss_bytes")
    return [
        r["system"],
        r["output_tokens"],
        r["seconds"],
        r["output_tokens_per_s"],
        r.get("minivllm_speedup"),
        r.get("speedup_at_floor"),
        None if rss is None else rss / 2**20,
    ]


RANK_HEADERS = [
    "rank",
    "weights MiB",
    "KV cache MiB",
    "KV blocks",
    "heads",
    "KV heads",
    "all-reduce B/token",
    "gather B/sampled token",
]


def rank_row(r: dict[str, Any]) -> list[Any]:
    """One rank's report as a table row, under RANK_HEADERS (the bench's table and the docs')."""
    return [
        r["rank"],
        r["weight_bytes"] / 2**20,
        r["kv_cache_bytes"] / 2**20,
        r["kv_blocks"],
        r["heads"],
        r["kv_heads"],
        r["all_reduce_bytes_per_token"],
        r["gather_bytes_per_sampled_token"],
    ]


def print_rank_rows(rows: Sequence[dict[str, Any]]) -> None:
    print_table(RANK_HEADERS, [rank_row(r) for r in rows])


# ---------------------------------------------------------------------------------- the other benches
MEMORY_HEADERS = ["allocator", "token states", "reserved", "fragmented", "peak concurrent", "steps"]


def memory_rows(results: dict[str, dict[str, Any]]) -> list[list[Any]]:
    """`bench memory`'s results, two rows per allocator: at its peak step and over the whole run."""
    rows = []
    for name, r in results.items():
        for when in ("at_peak", "over_run"):
            s = r[when]
            rows.append(
                [
                    f"{name} ({when.replace('_', ' ')})",
                    f"{s['token_states']:.1%}",
                    f"{s['reserved']:.1%}",
                    f"{s['fragmented']:.1%}",
                    r["peak_concurrent_requests"],
                    r["steps"],
                ]
            )
    return rows


PREFIX_HEADERS = ["run", "prompt tokens", "computed", "peak KV blocks", "output tok/s", "speedup"]


def prefix_row(r: dict[str, Any]) -> list[Any]:
    """One run of `bench prefix`; the speed-up is against the run without sharing before it."""
    speedup = r.get("speedup")
    return [
        r["run"],
        r["prompt_tokens"],
        r["prompt_tokens_computed"],
        r["peak_kv_blocks_used"],
        r["output_tokens_per_s"],
        "" if speedup is None else f"{speedup:.2f}x",
    ]


SHARING_HEADERS = ["workload", "method", "n / beam width", "steps", "KV blocks (mean)",
                   "without sharing", "saved", "saved at peak", "paper (§6.3)"]  # fmt: skip


def sharing_row(r: dict[str, Any], paper_ranges: dict[str, Any]) -> list[Any]:
    """One run of `bench sharing` (`SharingResult.row()`), beside the paper's range for its method."""
    lo, hi = paper_ranges.get(r["method"], ("?", "?"))
    return [
        r["workload"], r["method"], r["width"], r["steps"], f"{r['mean_blocks_shared']:.1f}",
        f"{r['mean_blocks_private']:.1f}", f"{r['saving']:.1%}", f"{r['peak_saving']:.1%}",
        f"{lo}-{hi} %",
    ]  # fmt: skip
