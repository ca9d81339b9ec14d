"""MkDocs hook: replace `<!-- perf-tables -->` with tables built from docs/perf/*.json.

The JSON files are what `minivllm bench {throughput,memory,prefix} --json FILE` and
`minivllm bench serve --json > FILE` write. No file, no table: the page then says that no
measurements are published, and shows only the commands. Numbers are never typed into the page.
This is the one piece of the site that is specific to MkDocs; everything else is plain Markdown.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from minivllm.benchmarks.report import (
    MEMORY_HEADERS,
    PREFIX_HEADERS,
    RANK_HEADERS,
    SHARING_HEADERS,
    SYSTEM_HEADERS,
    memory_rows,
    prefix_row,
    rank_row,
    sharing_row,
    system_row,
)

MARKER = "<!-- perf-tables -->"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    paths = sorted((Path(config["docs_dir"]) / "perf").glob("*.json"))
    if not paths:
        note = (
            '!!! note "No measurements published yet"\n'
            "    There is no `docs/perf/*.json` in this build, so this page shows the commands "
            "only. Run a benchmark with `--json docs/perf/NAME.json` and rebuild to get its table "
            "here.\n"
        )
        return markdown.replace(MARKER, note)
    sections = [render(path) for path in paths]
    return markdown.replace(MARKER, "\n\n".join(sections))


def render(path: Path) -> str:
    data = json.loads(path.read_text())
    kind = data.get("benchmark", "")
    head = [f"### `{path.name}`", ""]
    note = (
        f'!!! info "Generated from `docs/perf/{path.name}` at build time"\n'
        f"    Machine: {data.get('machine', 'not recorded')}."
        + (f" Arguments: `{_args(data['args'])}`." if "args" in data else "")
        + "\n"
    )
    if kind == "throughput":
        body = _table(SYSTEM_HEADERS, [system_row(r) for r in data["systems"]])
        floor = data.get("matmul_floor") or {}
        if floor:  # the run's matmuls alone, replayed at its steps' shapes
            body += (
                f"\n\nMatmul floor: the run's {_fmt(floor['steps'])} steps' matmuls alone "
                f"({_fmt(floor['tokens'])} rows through the layers, {_fmt(floor['sampled_rows'])} "
                f"through the LM head) take {_fmt(floor['seconds'])} s; minivllm takes "
                f"**{_fmt(floor['minivllm_over_floor'])}x** its floor (issue 16's target: 1.25x)."
            )
        flops = data.get("flops") or {}
        if flops:
            body += (
                f"\n\nminivllm reached {_fmt(flops['fraction_of_matmul_peak'] * 100)} % of the "
                f"measured matmul peak ({_fmt(flops['matmul_peak_flops_per_s'] / 1e9)} GFLOP/s)."
            )
        profile = data.get("profile") or {}
        if profile:  # `--profile`: where minivllm's time went, by op group and op
            body += (
                f"\n\nWhere minivllm's time goes (a second run under the profiler: "
                f"{_fmt(profile['wall_seconds'])} s wall, {_fmt(profile['self_seconds'])} s in "
                "ops):\n\n"
                + _table(
                    ["group", "seconds", "share of op time"],
                    [[g["group"], g["seconds"], _pct(g["share"])] for g in profile["groups"]],
                )
                + "\n\n"
                + _table(
                    ["op", "group", "seconds", "share", "calls"],
                    [
                        [f"`{o['op']}`", o["group"], o["seconds"], _pct(o["share"]), o["calls"]]
                        for o in profile["ops"]
                    ],
                )
            )
        ranks = data.get("ranks") or []
        if ranks:  # what each tensor-parallel rank holds and sends (one row at N = 1)
            body += "\n\n" + _table(RANK_HEADERS, [rank_row(r) for r in ranks])
    elif kind == "memory":
        body = _table(MEMORY_HEADERS, memory_rows(data["results"]))
    elif kind == "prefix":
        body = _table(PREFIX_HEADERS, [prefix_row(r) for r in data["runs"]])
    elif kind == "sharing":
        ranges = data.get("paper_ranges", {})
        body = _table(SHARING_HEADERS, [sharing_row(r, ranges) for r in data["results"]])
    elif kind == "startup":
        phases = ["import", "LLM()", "first token", "total"]
        body = _table(
            ["cache", "runs"] + [f"{p} wall / CPU s" for p in phases] + ["load (1 min)"],
            [
                [r["runs"], r["n"]]
                + [f"{r[p]['wall_s']:.2f} / {r[p]['cpu_s']:.2f}" for p in phases]
                + [", ".join(f"{x:.1f}" for x in r["load"] if x is not None)]
                for r in data["rows"]
            ],
        )
    else:  # e.g. bench serve's flat summary: one row per scalar
        rows = [[k, v] for k, v in data.items() if isinstance(v, int | float | str)]
        body = _table(["metric", "value"], rows)
    return "\n".join(head) + "\n" + note + "\n" + body


def _args(args: dict[str, Any]) -> str:
    """The arguments as a command line: booleans as --flag / --no-flag, as the CLI spells them."""
    words = []
    for k, v in args.items():
        if v in (None, ""):
            continue
        flag = k.replace("_", "-")
        if isinstance(v, bool):
            words.append(f"--{flag}" if v else f"--no-{flag}")
        elif isinstance(v, list | tuple) and len(v) == 2:  # a length range: MIN-MAX
            words.append(f"--{flag} {v[0]}-{v[1]}")
        else:
            words.append(f"--{flag} {v}")
    return " ".join(words)


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"


def _pct(v: float) -> str:
    return f"{v:.1%}"


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
