"""The rows of `bench throughput`'s tables, shared by the bench's printout and the docs' hook.

One builder per table (each system's speed and memory; each tensor-parallel rank's share), so
that the terminal and the Performance page (docs/hooks/perf_tables.py) always show the same
columns from the same JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from minivllm.benchmarks.common import print_table

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
