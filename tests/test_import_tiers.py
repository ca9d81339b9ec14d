"""The package's import tiers, held by a test: every import, at module level, inside a function or
under `TYPE_CHECKING`, goes to the importer's own tier or a lower one, and no import circle exists.

The tiers (docs/architecture.md draws them), lowest first. A module belongs to the tier of the
longest entry that names it or a package above it; a module no entry names fails the test, so a new
file must be placed before it lands.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "minivllm"

TIERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "leaves",  # configs, the attention contract, the custom-op base, platform facts
        (
            "minivllm.config",
            "minivllm.envs",
            "minivllm.exceptions",
            "minivllm.sampling_params",
            "minivllm.structured_output.params",
            "minivllm.structured_output.backend",
            "minivllm.spec_decode.config",
            "minivllm.attention",
            "minivllm.model.custom_op",
            "minivllm.model.config",
            "minivllm.model.errors",
            "minivllm.model.source",
            "minivllm.platforms",
        ),
    ),
    (
        "core",  # KV and request bookkeeping, no torch
        (
            "minivllm.core",
            "minivllm.sequence",
            "minivllm.detokenizer",
            "minivllm.stop_checker",
            "minivllm.outputs",
        ),
    ),
    (
        "model",  # the model's math and the portable attention backends
        (
            "minivllm.model",
            "minivllm.attention.reference",
            "minivllm.attention.triton",
            "minivllm.attention.triton_plan",
            "minivllm.attention.triton_kernels",
            "minivllm.attention.triton_decode_kernels",
            "minivllm.distributed.parallel_state",
        ),
    ),
    ("platform plug-ins", ("minivllm.cpu",)),  # all CPU-compiled code, registered by name
    (
        "engine",  # runner, loader, sampler, outputs, executors
        (
            "minivllm.engine",
            "minivllm.engine_args",
            "minivllm.executor",
            "minivllm.worker",
            "minivllm.model_runner",
            "minivllm.hybrid_model_runner",
            "minivllm.prompt_logprobs",
            "minivllm.attention.selector",
            "minivllm.sampler",
            "minivllm.sampling_metadata",
            "minivllm.logits_processors",
            "minivllm.structured_output",
            "minivllm.inputs",
            "minivllm.input_processor",
            "minivllm.logprobs_limit",
            "minivllm.output_processor",
            "minivllm.after_sampling",
            "minivllm.stats",
            "minivllm.step_listener",
            "minivllm.spec_decode",
            "minivllm.distributed",
        ),
    ),
    (
        "api and extras",  # the offline API and what plugs into the engine from outside
        ("minivllm.llm", "minivllm.beam_search", "minivllm.trace", "minivllm.experiments"),
    ),
    ("frontends", ("minivllm.entrypoints", "minivllm.engine_core", "minivllm.benchmarks")),
    ("package", ("minivllm",)),  # minivllm/__init__.py alone: the public names, loaded lazily
]
TIER_NAMES = [name for name, _ in TIERS]
NO_TORCH_TIERS = ("core",)  # bookkeeping a reader follows without knowing torch


def module_files() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its own name)."""
    files = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


FILES = module_files()


def tier_of(module: str) -> int | None:
    best, tier = -1, None
    for i, (_, prefixes) in enumerate(TIERS):
        for prefix in prefixes:
            covers = module == prefix or (prefix != "minivllm" and module.startswith(prefix + "."))
            if covers and len(prefix) > best:
                best, tier = len(prefix), i
    return tier


def resolve(name: str) -> str | None:
    """The package module an imported name lands in (`a.b.C` -> `a.b`), or None outside it."""
    while name and name not in FILES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level?) for every import in `module`'s file: module
    level, inside functions and under TYPE_CHECKING alike (the last two are not "module level")."""
    path = FILES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in child.names]
            for name in names:
                target = resolve(name) if name.split(".")[0] == "minivllm" else None
                if target and target != module and (target, child.lineno, top) not in found:
                    found.append((target, child.lineno, top))
            type_checking = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.dump(child.test)
            functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            visit(child, top and not type_checking and not isinstance(child, functions))

    visit(ast.parse(path.read_text()), True)
    return found


def graph() -> dict[str, set[str]]:
    return {m: {t for t, _, _ in imports_of(m)} for m in FILES}


def test_every_module_has_a_tier() -> None:
    unplaced = [m for m in FILES if tier_of(m) is None]
    assert not unplaced, f"place these modules in a tier of tests/test_import_tiers.py: {unplaced}"


def test_imports_go_down_the_tiers() -> None:
    upward = []
    for module in FILES:
        mine = tier_of(module)
        for target, line, _ in imports_of(module):
            theirs = tier_of(target)
            if mine is not None and theirs is not None and theirs > mine:
                upward.append(
                    f"{FILES[module].relative_to(PACKAGE.parent)}:{line}: {module} "
                    f"({TIER_NAMES[mine]}) imports {target} ({TIER_NAMES[theirs]})"
                )
    assert not upward, "imports that go up a tier:\n" + "\n".join(upward)


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the list of modules around it, or None."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(g[m]):
            if state.get(t) == 1:
                return [*path[path.index(t) :], t]
            if t not in state and (cycle := walk(t)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (cycle := walk(m)):
            return cycle
    return None


def test_no_import_circle() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("tier", NO_TORCH_TIERS)
def test_core_imports_no_torch(tier: str) -> None:
    index = TIER_NAMES.index(tier)
    offenders = []
    for module, path in FILES.items():
        if tier_of(module) != index:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(n.split(".")[0] == "torch" for n in names):
                offenders.append(f"{module}:{node.lineno}")
    assert not offenders, f"the {tier} tier imports torch: {offenders}"


def test_contract_catches_a_planted_upward_import(tmp_path: Path) -> None:
    """The checker itself fails on an upward import (so the tests above can fail)."""
    g = graph()
    g["minivllm.config"] = g["minivllm.config"] | {"minivllm.engine"}
    assert tier_of("minivllm.engine") > tier_of("minivllm.config")  # type: ignore[operator]
    g["minivllm.engine"] = g["minivllm.engine"] | {"minivllm.config"}
    assert find_cycle(g) is not None


def reached_from(module: str) -> set[str]:
    """Every module `module` imports, directly or not, inside functions and TYPE_CHECKING too."""
    g = graph()
    reached: set[str] = set()
    todo = [module]
    while todo:
        for nxt in g[todo.pop()] - reached:
            reached.add(nxt)
            todo.append(nxt)
    return reached


def test_the_cache_folder_module_imports_nothing_of_minivllm() -> None:
    """Every module that caches something may import it, so it must depend on nothing."""
    assert imports_of("minivllm.envs") == []


MATH_FILES = (
    "model/llama.py",
    "model/layers.py",
    "model/qwen2.py",
    "model/qwen3.py",
    "model/phi3.py",
    "model/parallel_layers.py",
    "model/rope.py",
)


def test_the_model_s_math_files_import_no_kernel_and_branch_on_no_platform() -> None:
    """What a learner reads as the model is the math: no import of the compiled code
    (minivllm.cpu) or the platforms, no private torch op, no test of the device."""
    for relative in MATH_FILES:
        module = "minivllm." + relative.removesuffix(".py").replace("/", ".")
        targets = [t for t, _, _ in imports_of(module)]
        assert not [t for t in targets if t.startswith(("minivllm.cpu", "minivllm.platforms"))]
        source = (PACKAGE / relative).read_text()
        for banned in ("torch.ops.", "mkldnn", "device.type", ".is_cpu", ".is_cuda"):
            assert banned not in source, f"{relative} contains {banned!r}"


def test_the_engine_depends_on_neither_the_trace_nor_beam_search_nor_an_experiment() -> None:
    """The step trace, beam search and the paper's experiments plug into the engine (a step
    listener, a hook after sampling, a KV cache manager or an executor it is given): nothing the
    engine imports, directly or not, TYPE_CHECKING included, names them."""
    named = {
        m
        for m in reached_from("minivllm.engine")
        if m.startswith(("minivllm.trace", "minivllm.experiments")) or m == "minivllm.beam_search"
    }
    assert not named, f"the engine reaches {sorted(named)}"


def test_the_single_device_engine_loads_no_tensor_parallel_code_at_import() -> None:
    """minivllm/distributed/ beyond the group type is imported only when tensor parallelism asks."""
    top = {"minivllm.engine"}
    todo = ["minivllm.engine"]
    while todo:
        for target, _, at_top in imports_of(todo.pop()):
            if at_top and target not in top:
                top.add(target)
                todo.append(target)
    assert {m for m in top if m.startswith("minivllm.distributed")} <= {
        "minivllm.distributed",
        "minivllm.distributed.parallel_state",
    }
