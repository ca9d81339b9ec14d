"""A learner's path through the code fits in one sitting, and every file and function stays short.

The README names a reading order (the files between its `<!-- reading-order -->` markers). What a
reader must follow to understand them is the files themselves plus everything they import at module
level, transitively (imports inside functions and under `TYPE_CHECKING` are left for later: they
name optional machinery, loaded when used). Both are held to the bounds the README states.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_import_tiers import FILES, imports_of

ROOT = Path(__file__).resolve().parents[1]
ORDERED_MAX_LINES = 2_300  # the ordered files themselves
CLOSURE_MAX_LINES = 6_100  # with what they import at module level
FILE_MAX_LINES = 400
FUNCTION_MAX_LINES = 80


def lines(module: str) -> int:
    return len(FILES[module].read_text().splitlines())


def reading_order() -> list[str]:
    """The modules the README's reading order names, in order."""
    text = (ROOT / "README.md").read_text()
    section = re.search(r"<!-- reading-order -->(.*?)<!-- /reading-order -->", text, re.S)
    assert section, "README.md must mark its reading order with <!-- reading-order --> markers"
    paths = re.findall(r"`([\w/]+\.py)`", section.group(1))
    modules = []
    for path in paths:
        parts = ["minivllm", *Path(path).with_suffix("").parts]
        modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return modules


def closure(modules: list[str]) -> set[str]:
    """The modules, their packages' `__init__`s, and what any of them imports at module level."""
    seen: set[str] = set()
    todo = list(modules)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # packages run first
        todo += [target for target, _, top in imports_of(module) if top]
    return seen & FILES.keys()


def test_the_readme_s_reading_order_fits_its_bounds() -> None:
    order = reading_order()
    assert len(order) >= 8 and all(m in FILES for m in order), order
    ordered = sum(lines(m) for m in order)
    reached = closure(order)
    total = sum(lines(m) for m in reached)
    biggest = sorted(reached, key=lines, reverse=True)[:8]
    assert ordered <= ORDERED_MAX_LINES, f"the ordered files have {ordered} lines"
    assert total <= CLOSURE_MAX_LINES, (
        f"the reading path reaches {len(reached)} modules, {total} lines; the largest: "
        + ", ".join(f"{m} ({lines(m)})" for m in biggest)
    )


def test_the_closure_follows_module_level_imports_only() -> None:
    """The measure itself: a function-level import is not followed, a module-level one is."""
    reached = closure(["minivllm.llm"])
    assert "minivllm.engine" in reached and "minivllm.core.scheduler" in reached
    assert "minivllm.beam_search" not in reached  # imported inside LLM.beam_search
    assert "minivllm.trace.recorder" not in reached  # imported inside LLM.trace
    assert "minivllm.distributed.multiproc" not in reached  # tensor parallelism only


def test_no_file_over_the_limit() -> None:
    long = {m: lines(m) for m in FILES if lines(m) > FILE_MAX_LINES}
    assert not long, f"files over {FILE_MAX_LINES} lines (one concept per file): {long}"


def is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A `@triton.jit` kernel is one GPU program: its length is its tile loop, not two ideas."""
    return any("triton.jit" in ast.unparse(d) for d in node.decorator_list)


def test_no_function_over_the_limit() -> None:
    long = []
    for module, path in FILES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > FUNCTION_MAX_LINES and not is_triton_kernel(node):
                    long.append(f"{module}.{node.name} ({length})")
    assert not long, f"functions over {FUNCTION_MAX_LINES} lines: {long}"
