"""A whole trace in one picture: which request holds each physical block at every step.

The page (page.py) shows one step at a time; this draws all of them at once with matplotlib, as
the paper's figures do for a few blocks: x is the engine step, y the physical block, the colour
the request whose sequence holds the block (hatched grey: free but still in the prefix cache;
white: free); black dots mark blocks shared by several sequences (reference count > 1).
Preemptions are red lines, copy-on-write copies yellow stars, forks black ticks.
The tutorials end with it, so that each run draws its own picture without a browser. The trace
format is on the docs' Trace page; see the architecture page (docs/architecture.md) for where the
trace comes from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FREE, CACHED = 0, 1  # colour indices below the requests'


def block_owner_matrix(trace: dict[str, Any]) -> tuple[list[list[int]], list[str]]:
    """[num_blocks][num_steps] colour indices, and the request ids behind indices 2, 3, ..."""
    requests: list[str] = []
    grid = [[FREE] * len(trace["steps"]) for _ in range(trace["num_blocks"])]
    for x, step in enumerate(trace["steps"]):
        for b in step["cached_blocks"]:
            grid[b][x] = CACHED
        for seq, table in sorted(step["block_tables"].items(), key=lambda kv: int(kv[0])):
            request = trace["sequences"][seq]["request_id"]
            if request not in requests:
                requests.append(request)
            for b in table:
                grid[b][x] = 2 + requests.index(request)
    return grid, requests


def plot_block_map(trace: dict[str, Any], path: str | Path, title: str | None = None) -> Path:
    """Write the picture as a PNG (or any format matplotlib knows from the suffix)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    grid, requests = block_owner_matrix(trace)
    steps = trace["steps"]
    palette = plt.get_cmap("tab10" if len(requests) <= 10 else "tab20")
    colours = ["#ffffff", "#cfd8dc"] + [palette(i % palette.N) for i in range(len(requests))]
    fig, (usage, ax) = plt.subplots(
        2, 1, figsize=(9, 5.5), sharex=True, gridspec_kw={"height_ratios": [1, 4]}
    )
    used = [trace["num_blocks"] - s["num_free_blocks"] for s in steps]
    xs = [s["step"] for s in steps]
    usage.fill_between(xs, used, step="mid", color="#81d4fa")
    usage.set_ylim(0, trace["num_blocks"])
    usage.set_ylabel("blocks held", fontsize=8)
    ax.imshow(
        grid,
        aspect="auto",
        interpolation="nearest",
        cmap=ListedColormap(colours),
        vmin=0,
        vmax=len(colours) - 1,
        origin="lower",
        extent=(xs[0] - 0.5, xs[-1] + 0.5, -0.5, trace["num_blocks"] - 0.5),
    )
    shared = [(s["step"], int(b)) for s in steps for b, n in s["ref_counts"].items() if n > 1]
    if shared:
        ax.scatter(*zip(*shared), s=3, color="black", marker=".")
    for step in steps:
        k = step["step"]
        if step["preempted"]:
            for a in (usage, ax):
                a.axvline(k, color="#c62828", linewidth=1.2)
        for _src, dst in step["copies"]:
            ax.plot(k, dst, "*", color="#ffeb3b", markersize=11, markeredgecolor="black")
        for child in step["forked"]:
            for b in step["block_tables"][str(child)]:
                ax.plot(k, b, "|", color="black", markersize=7)
    ax.set_xlabel("engine step")
    ax.set_ylabel("physical block")
    handles: list[Any] = [
        Patch(color=colours[2 + i], label=f"request {r}") for i, r in enumerate(requests)
    ]
    handles.append(Patch(facecolor=colours[CACHED], label="free, prefix-cached"))
    marks: list[tuple[str, bool, dict[str, Any]]] = [
        ("shared (ref count > 1)", bool(shared), {"marker": ".", "color": "black"}),
        ("preemption", any(s["preempted"] for s in steps), {"color": "#c62828", "linestyle": "-"}),
        ("copy-on-write", any(s["copies"] for s in steps),
         {"marker": "*", "color": "#ffeb3b", "markeredgecolor": "black", "markersize": 10}),
        ("fork (n > 1)", any(s["forked"] for s in steps), {"marker": "|", "color": "black"}),
    ]  # fmt: skip
    for label, present, style in marks:
        if present:
            style.setdefault("linestyle", "none")  # a marker only; the preemption is a line
            handles.append(Line2D([], [], label=label, **style))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    usage.set_title(title or "KV blocks held, by request, step by step", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
