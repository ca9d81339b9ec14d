"""The package's layout is its architecture: vLLM v1's rooms as folders, imports one way between
them, every import counted.

The rooms and their order are declared once, in pyproject.toml's `[tool.importlinter]` (the layers
contract that `make lint` runs with `lint-imports`, counting imports at module level, inside
functions and under `TYPE_CHECKING` alike). These tests hold what that contract does not say:
the contract itself can fail, no module-level import circle hides inside a room, the core needs no
torch, the top level stays a handful of modules a user imports, and an import that is deferred
(inside a function, under `TYPE_CHECKING`, or by a qualified name) is a declared plug-in or
optional dependency, never a way round the layers.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minivllm"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


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


def resolve(name: str) -> str | None:
    """The package module an imported name lands in (`a.b.C` -> `a.b`), or None outside it."""
    while name and name not in FILES:
        name = name.rpartition(".")[0]
    return name or None


@functools.cache
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


def graph(module_level_only: bool = False) -> dict[str, set[str]]:
    return {m: {t for t, _, top in imports_of(m) if top or not module_level_only} for m in FILES}


def run_lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True
    )


def test_lint_imports_keeps_the_rooms_and_fails_on_a_planted_upward_import(tmp_path: Path) -> None:
    """`lint-imports` passes on the package, and fails on a copy where the configs (a low room)
    import the engine inside a function: a deferred import counts like any other."""
    kept = run_lint_imports(ROOT)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    shutil.copytree(PACKAGE, tmp_path / "minivllm", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    planted = tmp_path / "minivllm" / "config" / "__init__.py"
    planted.write_text(
        planted.read_text() + "\n\ndef _upward():\n    import minivllm.engine.llm_engine  # noqa\n"
    )
    broken = run_lint_imports(tmp_path)
    assert broken.returncode != 0
    assert "minivllm.config -> minivllm.engine.llm_engine" in broken.stdout, broken.stdout


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


def test_no_import_circle_between_modules() -> None:
    """Inside a room too (the layers contract only orders rooms), counting every import; a
    package's `__init__` is left out as an importer when it only names its submodules."""
    cycle = find_cycle(graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_planted_circle() -> None:
    g = graph()
    g["minivllm.config"] = g["minivllm.config"] | {"minivllm.engine.llm_engine"}
    assert find_cycle(g) is not None


def test_the_core_imports_no_torch() -> None:
    """Which token of which request sits in which block is plain Python: no module of
    minivllm/core/ imports torch at module level (a type under TYPE_CHECKING may name one that
    does)."""
    offenders = []
    for module, path in FILES.items():
        if not module.startswith("minivllm.core"):
            continue
        for node in ast.parse(path.read_text()).body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(n.split(".")[0] == "torch" for n in names):
                offenders.append(f"{module}:{node.lineno}")
    assert not offenders, f"the core imports torch: {offenders}"


TOP_LEVEL_MODULES = {
    "__init__.py": "the public names: LLM, SamplingParams, RequestOutput, EngineArgs, ...",
    "llm.py": "LLM, the offline API",
    "sampling_params.py": "SamplingParams",
    "inputs.py": "the prompt types a caller hands the engine",
    "envs.py": "the environment variables minivllm reads",
    "exceptions.py": "the errors a caller catches",
}


def test_the_top_level_is_a_handful_of_modules_a_user_imports() -> None:
    """Everything else lives in a room (a folder); the configs are the `config/` package."""
    found = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert found == sorted(TOP_LEVEL_MODULES), found
    assert len(found) <= 8


# Imports that are deferred (inside a function or under TYPE_CHECKING), each with its reason. A
# deferred import is for a plug-in (named by the platform or a config, loaded when chosen), an
# optional dependency or extra (loaded when used), or a type only (an annotation of a module that
# imports torch, named by a module that does not). Anything else goes at module level.
DEFERRED = {
    "minivllm": "the public names, loaded when first touched (PEP 562), so `import minivllm` is cheap",
    "minivllm.config": "types only: the configs name the model's and the speculative config",
    "minivllm.core": "types only: the core names tensor-holding types without loading torch",
    "minivllm.platforms": "plug-ins: the one platform of this machine",
    "minivllm.model.loader": "plug-ins by checkpoint kind: GGUF, a registry family, a tokenizer",
    "minivllm.model.resolver": "plug-in: the GGUF reader, when the file is a GGUF",
    "minivllm.model.weights": "plug-in: fused checkpoints (Phi-3) only",
    "minivllm.model.models.registry": "plug-ins: each family loaded when its architecture is asked",
    "minivllm.cpu": "plug-in: the GGUF parts of a quantized linear, when the model has them",
    "minivllm.worker": "plug-ins: tensor parallelism's group, the GGUF parts, the CPU forwards",
    "minivllm.executor": "plug-in: tensor parallelism, when its size is above 1",
    "minivllm.sample": "types and plug-in: the grammar backend, when a request has a grammar",
    "minivllm.spec_decode": "types only: the sequence the proposers read",
    "minivllm.structured_output": "optional dependency: xgrammar, when a grammar is asked",
    "minivllm.engine": "plug-ins: speculative decoding, structured outputs, the in-process engine",
    "minivllm.experiments": "the engine, built when an experiment runs",
    "minivllm.trace": "the engine type, and the page, written when asked",
    "minivllm.llm": "extras: beam search and the step trace, loaded when called",
    "minivllm.entrypoints": "the server's optional parts: chosen by the command and its flags",
    "minivllm.benchmarks": "each bench's own machinery, loaded when that bench runs",
}


def test_every_deferred_import_is_declared() -> None:
    undeclared = []
    for module in FILES:
        room = next(
            (
                r
                for r in sorted(DEFERRED, key=len, reverse=True)
                if module == r or module.startswith(r + ".")
            ),
            None,
        )
        for target, line, top in imports_of(module):
            if not top and room is None:
                undeclared.append(f"{module}:{line} -> {target}")
    assert not undeclared, "deferred imports outside the declared rooms:\n" + "\n".join(undeclared)


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
    "model/models/llama.py",
    "model/models/qwen2.py",
    "model/models/qwen3.py",
    "model/models/phi3.py",
    "model/layers/layernorm.py",
    "model/layers/linear.py",
    "model/layers/rotary_embedding.py",
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
        for m in reached_from("minivllm.engine.llm_engine")
        if m.startswith(("minivllm.trace", "minivllm.experiments"))
        or m == "minivllm.engine.beam_search"
    }
    assert not named, f"the engine reaches {sorted(named)}"


def test_the_single_device_engine_loads_no_tensor_parallel_code_at_import() -> None:
    """Tensor parallelism's executors and process groups are imported only when its size asks."""
    top = {"minivllm.engine.llm_engine"}
    todo = ["minivllm.engine.llm_engine"]
    while todo:
        for target, _, at_top in imports_of(todo.pop()):
            if at_top and target not in top:
                top.add(target)
                todo.append(target)
    tensor_parallel = {
        "minivllm.executor.tensor_parallel",
        "minivllm.executor.driver",
        "minivllm.executor.multiproc_executor",
        "minivllm.distributed.process_group",
        "minivllm.worker.worker_proc",
    }
    assert not (top & tensor_parallel), sorted(top & tensor_parallel)


def test_the_architecture_page_draws_the_rooms_in_the_contract_s_order() -> None:
    """docs/architecture.md's drawing of the rooms (its `L<n>[...]` boxes, highest first) names
    the same rooms, layer by layer, as pyproject.toml's layers contract, so the page cannot rot."""
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = contract["contracts"][0]["layers"]

    def shown(module: str) -> str:
        path = PACKAGE.parent / module.replace(".", "/")
        return path.relative_to(PACKAGE).as_posix() + ("/" if path.is_dir() else ".py")

    expected = [sorted(shown(m.strip()) for m in layer.split("|")) for layer in layers]
    page = (ROOT / "docs" / "architecture.md").read_text()
    drawn = [
        sorted(re.findall(r"<b>([\w/.]+)</b>", box))
        for box in re.findall(r'^\s*L\d+\["(.*)"\]$', page, re.M)
    ]
    assert drawn == expected, f"the page draws {drawn}\nthe contract says {expected}"
