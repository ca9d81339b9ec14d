"""The figures of `minivllm bench paper`: Fig. 12 (normalized latency against request rate) and
Fig. 13 (the mean number of requests in a step), drawn from its results with matplotlib (the
`bench` extra)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from minivllm.benchmarks.paper_sweep import PointResult
from minivllm.config import KV_ALLOCATIONS

COLORS = {
    "paged": "tab:red",
    "orca-oracle": "tab:blue",
    "orca-pow2": "tab:green",
    "orca-max": "tab:purple",
}


def plot_latency(results: Sequence[PointResult], bound: float, path: Path, title: str) -> None:
    """Fig. 12: normalized latency against request rate, a panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in results))
    fig, axes = plt.subplots(
        1, len(workloads), figsize=(max(6.5, 5 * len(workloads)), 3.8), squeeze=False
    )
    for ax, workload in zip(axes[0], workloads):
        for policy in KV_ALLOCATIONS:
            pts = sorted(
                (r for r in results if r.workload == workload and r.policy == policy),
                key=lambda r: r.rate,
            )
            if pts:
                ax.plot([p.rate for p in pts], [p.normalized_latency for p in pts], "o-", ms=3,
                        label=policy, color=COLORS[policy])  # fmt: skip
        ax.axhline(bound, color="gray", ls="--", lw=0.8, label=f"bound {bound:g} s/token")
        ax.set_ylim(0, bound * 3)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("normalized latency (s/token)")
        ax.set_title(f"{workload}")
        ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 70), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_batch(summary: dict[str, dict[str, dict[str, Any]]], path: Path, title: str) -> None:
    """Fig. 13: the mean number of requests in a step, per policy, at each workload's rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(summary), figsize=(max(6.5, 4.5 * len(summary)), 3.6), squeeze=False
    )
    for ax, (workload, rows) in zip(axes[0], summary.items()):
        names = [p for p in KV_ALLOCATIONS if p in rows]
        values = [rows[p]["mean_batched_requests"] for p in names]
        bars = ax.bar(names, values, color=[COLORS[p] for p in names])
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        rate = next(iter(rows.values()))["batch_rate"]
        ax.set_title(f"{workload} at {rate:g} req/s")
        ax.set_ylabel("mean batched requests")
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(textwrap.fill(title, 70), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
