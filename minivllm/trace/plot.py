"""A whole trace in one picture: which request holds each physical block at every step.

The page (page.py) shows one step at a time; this draws all of them at once with matplotlib, as
the paper's figures do for a few blocks: x is the engine step, y the physical block, the colour
the request whose sequence holds the block (light grey: free but still in the prefix cache;
white: free); black dots mark blocks shared by several sequences (reference count > 1). A trace
of one request with several samples (`n > 1`) is coloured by sample instead, with the blocks the
samples share in dark grey, so that each sample's private tail shows. Only the blocks the run
used are drawn, and the axes count whole blocks and steps. Preemptions are red lines,
copy-on-write copies yellow stars, forks black ticks.
The tutorials end with it, so that each run draws its own picture without a browser. The trace
format is on the docs' Trace page; see the architecture page (docs/architecture.md) for where the
trace comes from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FREE, CACHED, SHARED = 0, 1, 2  # colour indices below the owners'


def by_sample(trace: dict[str, Any]) -> bool:
    """One request with several samples: colour the samples, not the (single) request."""
    return len({info["request_id"] for info in trace["sequences"].values()}) == 1 and (
        len(trace["sequences"]) > 1
    )


def owner_name(trace: dict[str, Any], seq: str) -> str:
    info = trace["sequences"][seq]
    if by_sample(trace):
        return f"seq {seq} (sample #{info.get('index', 0)})"
    return f"request {info['request_id']}"


def block_owner_matrix(trace: dict[str, Any]) -> tuple[list[list[int]], list[str]]:
    """[num_blocks][num_steps] colour indices, and the owners (requests, or the samples of one
    request) behind indices 3, 4, ...; a block of several samples is SHARED."""
    owners: list[str] = []
    grid = [[FREE] * len(trace["steps"]) for _ in range(trace["num_blocks"])]
    for x, step in enumerate(trace["steps"]):
        for b in step["cached_blocks"]:
            grid[b][x] = CACHED
        holders: dict[int, set[str]] = {}
        for seq, table in sorted(step["block_tables"].items(), key=lambda kv: int(kv[0])):
            owner = owner_name(trace, seq)
            if owner not in owners:
                owners.append(owner)
            for b in table:
                holders.setdefault(b, set()).add(owner)
        for b, who in holders.items():
            grid[b][x] = SHARED if len(who) > 1 else 3 + owners.index(next(iter(who)))
    return grid, owners


def owner_colours(num_owners: int) -> list[Any]:
    """Free, cached-free, shared, then one colour per owner. Red is kept for preemptions: no
    owner is drawn in tab10's red (index 3) or tab20's (6, 7)."""
    import matplotlib.pyplot as plt

    big = num_owners > 9
    palette = [
        c
        for i, c in enumerate(plt.get_cmap("tab20" if big else "tab10").colors)  # type: ignore[attr-defined]
        if i not in ((6, 7) if big else (3,))
    ]
    return ["#ffffff", "#cfd8dc", "#546e7a"] + [
        palette[i % len(palette)] for i in range(num_owners)
    ]


def draw_events(ax: Any, usage: Any, steps: list[dict[str, Any]], star: float) -> bool:
    """Sharing, preemptions, copy-on-write copies and forks over the map; whether any block was
    shared."""
    shared = [(s["step"], int(b)) for s in steps for b, n in s["ref_counts"].items() if n > 1]
    if shared:
        ax.scatter(*zip(*shared), s=3, color="black", marker=".")
    for step in steps:
        k = step["step"]
        if step["preempted"]:
            for a in (usage, ax):
                a.axvline(k, color="#c62828", linewidth=1.2)
        for _src, dst in step["copies"]:
            ax.plot(k, dst, "*", color="#ffeb3b", markersize=star, markeredgecolor="black")
        for child in step["forked"]:
            for b in step["block_tables"][str(child)]:
                ax.plot(k, b, "|", color="black", markersize=7)
    return bool(shared)


def legend_handles(
    trace: dict[str, Any], owners: list[str], colours: list[Any], grid: Any, shared: bool
) -> list[Any]:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    steps = trace["steps"]
    handles: list[Any] = [Patch(color=colours[3 + i], label=o) for i, o in enumerate(owners)]
    if any(SHARED in row for row in grid):
        whose = "samples" if by_sample(trace) else "requests"
        handles.append(Patch(facecolor=colours[SHARED], label=f"shared by several {whose}"))
    handles.append(Patch(facecolor=colours[CACHED], label="free, prefix-cached"))
    marks: list[tuple[str, bool, dict[str, Any]]] = [
        ("shared (ref count > 1)", shared, {"marker": ".", "color": "black"}),
        ("preemption", any(s["preempted"] for s in steps), {"color": "#c62828", "linestyle": "-"}),
        ("copy-on-write", any(s["copies"] for s in steps),
         {"marker": "*", "color": "#ffeb3b", "markeredgecolor": "black", "markersize": 10}),
        ("fork (n > 1)", any(s["forked"] for s in steps), {"marker": "|", "color": "black"}),
    ]  # fmt: skip
    for label, present, style in marks:
        if present:
            style.setdefault("linestyle", "none")  # a marker only; the preemption is a line
            handles.append(Line2D([], [], label=label, **style))
    return handles


def plot_block_map(trace: dict[str, Any], path: str | Path, title: str | None = None) -> Path:
    """Write the picture as a PNG (or any format matplotlib knows from the suffix)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.ticker import MaxNLocator

    grid, owners = block_owner_matrix(trace)
    steps = trace["steps"]
    colours = owner_colours(len(owners))
    # Only the blocks the run touched: a 128-block pool of which 20 were used draws 20 rows.
    rows = 1 + max((b for b in range(len(grid)) if any(grid[b])), default=0)
    grid = grid[:rows]
    fig, (usage, ax) = plt.subplots(
        2, 1, figsize=(9, 5.5), sharex=True, gridspec_kw={"height_ratios": [1, 4]}
    )
    used = [trace["num_blocks"] - s["num_free_blocks"] for s in steps]
    xs = [s["step"] for s in steps]
    usage.fill_between(xs, used, step="mid", color="#81d4fa")
    usage.set_ylim(0, max(used) + 1)
    usage.set_ylabel("blocks held", fontsize=8)
    ax.imshow(
        grid,
        aspect="auto",
        interpolation="nearest",
        cmap=ListedColormap(colours),
        vmin=0,
        vmax=len(colours) - 1,
        origin="lower",
        extent=(xs[0] - 0.5, xs[-1] + 0.5, -0.5, rows - 0.5),
    )
    for a in (usage, ax):
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
        a.yaxis.set_major_locator(MaxNLocator(integer=True))
    # A star fits in its block's row, so that stars in neighbouring blocks do not overlap.
    row_points = 72 * fig.get_size_inches()[1] * 0.7 / rows
    shared = draw_events(ax, usage, steps, star=max(4.0, min(11.0, 0.9 * row_points)))
    ax.set_xlabel("engine step")
    unused = trace["num_blocks"] - rows
    ax.set_ylabel("physical block" + (f"\n(the other {unused} never used)" if unused else ""))
    handles = legend_handles(trace, owners, colours, grid, shared)
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    whose = "sample" if by_sample(trace) else "request"
    usage.set_title(title or f"KV blocks held, by {whose}, step by step", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
