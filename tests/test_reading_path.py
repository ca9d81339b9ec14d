"""A learner's path through the code, counted honestly and stated in the README.

The README names a reading order (the files between its `<!-- reading-order -->` markers): the core
a learner reads (one model, the reference attention, the block pool, the KV cache manager, the
scheduler, the model runner, the sampler, the engine step). What a reader may have to follow from
there is everything those files import, by any import: at module level, inside functions and under
`TYPE_CHECKING` alike, and every module they load by qualified name (the plug-ins a platform, a
config or a registry names). The test prints both counts and holds the README's sentence to them, so the
README says what the code is; it sets no cap that code would be moved to get under.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_package_layout import FILES, imports_of, loads_by_name

ROOT = Path(__file__).resolve().parents[1]


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
    """The modules, their packages' `__init__`s, and everything any of them imports, by any import
    or by qualified name."""
    seen: set[str] = set()
    todo = list(modules)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # packages run first
        todo += [target for target, _, _ in imports_of(module)]
        todo += [target for target, _ in loads_by_name(module)]
    return seen & FILES.keys()


def stated_counts() -> tuple[int, int, int]:
    """(ordered lines, modules reached, lines reached) as the README's sentence states them."""
    text = re.sub(r"(\d),(\d{3})", r"\1\2", (ROOT / "README.md").read_text())
    found = re.search(
        r"the files above are (\d+) lines; everything they import, by any import, is (\d+) "
        r"modules and (\d+) lines",
        " ".join(text.split()),
    )
    assert found, "README.md must state the reading path's counts (see this test's regex)"
    return int(found.group(1)), int(found.group(2)), int(found.group(3))


def test_the_readme_states_the_reading_path_as_counted() -> None:
    order = reading_order()
    assert len(order) >= 8 and all(m in FILES for m in order), order
    ordered = sum(lines(m) for m in order)
    reached = closure(order)
    total = sum(lines(m) for m in reached)
    rooms: dict[str, int] = {}
    for m in reached:
        room = ".".join(m.split(".")[:2])
        rooms[room] = rooms.get(room, 0) + lines(m)
    print(f"\nreading order: {len(order)} files, {ordered} lines")
    print(f"everything they import, by any import: {len(reached)} modules, {total} lines")
    for room, n in sorted(rooms.items(), key=lambda kv: -kv[1]):
        print(f"  {room:<32} {n:>6}")
    stated = stated_counts()
    # The module count is exact; the line counts may drift by 2 % (a docstring edited) before the
    # README's sentence must be brought up to date.
    assert stated[1] == len(reached), (
        f"README says {stated[1]} modules; the path reaches {len(reached)}"
    )
    assert abs(stated[0] - ordered) <= ordered // 50 and abs(stated[2] - total) <= total // 50, (
        f"README says {stated[0]} / {stated[2]} lines; counted {ordered} / {total}"
    )


def test_the_closure_follows_every_import() -> None:
    """The measure itself: imports inside functions and under TYPE_CHECKING, and loads by
    qualified name, are followed."""
    reached = closure(["minivllm.llm"])
    assert "minivllm.engine.llm_engine" in reached and "minivllm.core.scheduler" in reached
    assert "minivllm.engine.speculator" in reached  # by name and under TYPE_CHECKING in the engine
    assert "minivllm.spec_decode.draft_model_proposer" in reached  # inside Speculator's builder
    assert "minivllm.experiments.reservation" in reached  # by name, in kv_allocation's table
