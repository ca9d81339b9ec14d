"""How the `minivllm bench` commands report: the one table printer, the JSON file, the machine's
load beside every timing, and the rows of `bench throughput`'s tables.

The row builders (each system's speed and memory; each tensor-parallel rank's share) are shared by
the bench's printout and the docs' hook (docs/hooks/perf_tables.py), so that the terminal and the
Performance page always show the same columns from the same JSON.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


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


def machine_load() -> str:
    """The 1-minute load average and core count: timings on a shared machine need it beside them."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return f"{os.cpu_count()} cores"
    return f"load {load:.2f} on {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"


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
