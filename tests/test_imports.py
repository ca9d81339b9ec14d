"""minivllm's modules import each other without a cycle.

The import graph is read from the source with `ast`, so no module is imported (or compiled)
here. An edge is every `import` of a minivllm module, at the top of a file or deferred inside a
function alike: a deferred import only postpones a cycle to the first call, and a cycle means
two modules that cannot be read, tested or moved apart. Two kinds of import are not edges:
those under `if TYPE_CHECKING:` (never run), and a package's `__init__` importing one of its own
submodules from inside a function (the factory that picks a backend by name): every submodule
imports its package first anyway, so that pair is an order, not a tangle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "minivllm"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(tree: ast.Module, type_checking: bool = False) -> list[tuple[str, bool]]:
    """(module or module.attribute, deferred) for every absolute import outside TYPE_CHECKING,
    and inside it too when `type_checking`."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, deferred: bool) -> None:
        if (
            not type_checking
            and isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.unparse(node.test)
        ):
            for child in node.orelse:
                visit(child, deferred)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, deferred) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, deferred))
            found.extend((f"{node.module}.{alias.name}", deferred) for alias in node.names)
        inside = deferred or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(tree, False)
    return found


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        is_package = path.name == "__init__.py"
        graph[name] = set()
        for target, deferred in imported_names(ast.parse(path.read_text()), type_checking):
            if target not in paths or target == name:
                continue  # another library, or `from pkg import name` naming a non-module
            if is_package and deferred and target.startswith(name + "."):
                continue  # a package's factory importing its own submodule (see the docstring)
            graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, str] = {}  # "open" while on the search path, "done" after
    path: list[str] = []

    def search(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := search(nxt)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := search(node)):
            return cycle
    return None


def test_the_package_s_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    assert "minivllm.cpu.attention" in graph and "minivllm.model.loader" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_deferred_cycle() -> None:
    """The check itself can fail: a function-level import closing a loop is reported."""
    code = "import minivllm.b\ndef f():\n    from minivllm.a import x\n"
    assert imported_names(ast.parse(code)) == [
        ("minivllm.b", False),
        ("minivllm.a", True),
        ("minivllm.a.x", True),
    ]
    graph = {"minivllm.a": {"minivllm.b"}, "minivllm.b": {"minivllm.a"}, "minivllm.c": set()}
    assert find_cycle(graph) == ["minivllm.a", "minivllm.b", "minivllm.a"]
    assert find_cycle({"minivllm.a": {"minivllm.b"}, "minivllm.b": set()}) is None


def test_the_cache_folder_module_imports_nothing_of_minivllm() -> None:
    """Every module that caches something may import it, so it must depend on nothing."""
    assert import_graph()["minivllm.envs"] == set()


MATH_FILES = ("model/llama.py", "model/parallel_layers.py", "model/rope.py")


def test_the_model_s_math_files_import_no_kernel_and_branch_on_no_platform() -> None:
    """What a learner reads as the model is the math: no import from the compiled code
    (minivllm.kernels) or the platforms, no private torch op, no test of the device."""
    for relative in MATH_FILES:
        path = PACKAGE_DIR / relative
        source = path.read_text()
        imports = [name for name, _ in imported_names(ast.parse(source))]
        assert not [n for n in imports if n.startswith(("minivllm.kernels", "minivllm.platforms"))]
        for banned in ("torch.ops.", "mkldnn", "device.type", ".is_cpu", ".is_cuda"):
            assert banned not in source, f"{relative} contains {banned!r}"


def test_no_import_cycle_hides_behind_type_checking() -> None:
    """An import under `if TYPE_CHECKING:` never runs, but it is still a dependency a reader must
    follow: two modules that name each other's types cannot be read or moved apart either."""
    graph = import_graph(type_checking=True)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle through TYPE_CHECKING: " + " -> ".join(cycle or [])
    code = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import minivllm.a\n"
    assert imported_names(ast.parse(code)) == [("typing", False), ("typing.TYPE_CHECKING", False)]
    assert ("minivllm.a", False) in imported_names(ast.parse(code), type_checking=True)


def test_the_engine_depends_on_neither_the_trace_nor_beam_search() -> None:
    """The step trace and beam search plug into the engine (a step listener, a hook after
    sampling); nothing the engine imports, directly or not, TYPE_CHECKING included, names them."""
    graph = import_graph(type_checking=True)
    reached, todo = set(), ["minivllm.engine"]
    while todo:
        for nxt in graph[todo.pop()] - reached:
            reached.add(nxt)
            todo.append(nxt)
    named = {m for m in reached if m.startswith("minivllm.trace") or m == "minivllm.beam_search"}
    assert not named, f"the engine reaches {sorted(named)}"
