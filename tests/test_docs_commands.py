"""The commands the docs suggest still show what the docs say they show."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from minivllm.entrypoints.cli import main

DOCS = Path(__file__).resolve().parent.parent / "docs"


def bash_blocks(page: Path) -> list[str]:
    """The ```bash blocks of a page, with line continuations joined."""
    blocks = re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)
    return [b.replace("\\\n", " ") for b in blocks]


def test_trace_page_command_shows_a_preemption_and_a_prefix_hit(tmp_path, capsys):
    (command,) = [b for b in bash_blocks(DOCS / "trace.md") if b.startswith("minivllm trace")]
    argv = shlex.split(command)[1:]
    argv[argv.index("--out") + 1] = str(tmp_path / "my_trace")
    assert main(argv) == 0
    steps = json.loads((tmp_path / "my_trace" / "trace.json").read_text())["steps"]
    preempted = [seq_id for step in steps for seq_id in step["preempted"]]
    hits = [h for step in steps for h in step["cache_hits"] if h["num_cached_tokens"] > 0]
    assert preempted, "the docs promise a preemption"
    assert any(step["copies"] for step in steps), "the docs promise a copy-on-write"
    assert hits and hits[0] in steps[0]["cache_hits"], "a prefix hit in the very first step"
    assert any(h["seq_id"] in preempted for h in hits), "a preempted sample resumes from the cache"
    assert "(0 preemptions)" not in capsys.readouterr().out
