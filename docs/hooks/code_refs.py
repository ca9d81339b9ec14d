"""MkDocs hook: quoted code follows the code. A snippet line under `<!-- def: Name -->` gets the
line range of that definition in the current source, at build time.

Pages quote library code with pymdownx.snippets line ranges (`--8<-- "minivllm/x.py:A:B"`). Line
numbers go stale with the first edit above the quoted function, so each quote names what it shows
(`<!-- def: Class.method -->`) and this hook recomputes A:B from the Python syntax tree before the
snippets extension reads the page. A name that no longer exists stops the build.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
QUOTE = re.compile(
    r'(<!-- def: (?P<name>[\w.]+) -->\n```python\n--8<-- ")(?P<path>minivllm/[\w/]+\.py):\d+:\d+"'
)
ROOT = Path(__file__).resolve().parents[2]


def definition_lines(path: Path, qualname: str) -> tuple[int, int]:
    """First line (decorators included) and last line of `qualname` ("Class.method") in `path`."""
    body: list[ast.stmt] = ast.parse(path.read_text()).body
    node: ast.stmt | None = None
    for name in qualname.split("."):
        node = next((n for n in body if isinstance(n, DEFINITIONS) and n.name == name), None)
        if node is None:
            raise ValueError(f"the docs quote {qualname}, which is not defined in {path}")
        body = node.body  # type: ignore[attr-defined]
    assert isinstance(node, DEFINITIONS) and node.end_lineno is not None
    return min([node.lineno] + [d.lineno for d in node.decorator_list]), node.end_lineno


def resolve_quotes(markdown: str) -> str:
    def fix(m: re.Match[str]) -> str:
        start, end = definition_lines(ROOT / m["path"], m["name"])
        return f'{m.group(1)}{m["path"]}:{start}:{end}"'

    return QUOTE.sub(fix, markdown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return resolve_quotes(markdown)
