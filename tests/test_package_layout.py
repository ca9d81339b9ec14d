"""The package's layout is its architecture: vLLM v1's rooms as folders, imports one way between
them, every import counted.

The rooms and their order are declared once, in pyproject.toml's `[tool.importlinter]` (the layers
contract that `make lint` runs with `lint-imports`, counting imports at module level, inside
functions and under `TYPE_CHECKING` alike). These tests hold what that contract does not say:
the contract itself can fail, no module-level import circle hides inside a room, the core needs no
torch, the top level stays a handful of modules a user imports, and an import that is deferred
(inside a function, under `TYPE_CHECKING`, or by a qualified name) is a declared plug-in or
optional dependency, declared per (importer, imported) pair, never a way round the layers.
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


# A qualified name in a string: `minivllm.a.b`, `minivllm.a.b.Name`, `minivllm.a.b:Name`, or an
# f-string's `minivllm.a.` prefix. The logger's and cache folder's bare "minivllm" is not one.
QUALIFIED_NAME = re.compile(r"minivllm(\.\w+)+(:\w+)?\.?")


@functools.cache
def loads_by_name(module: str) -> list[tuple[str, int]]:
    """(loaded module, line) for every string literal in `module`'s file that names a module of
    the package, or a name in one: what `resolve_obj_by_qualname`, `importlib.import_module` and the
    tables of qualified names (attention backends, `kv_allocation`'s managers, `decode_loop_cls`,
    the model registry) load. The packages above `module` are left out: they are loaded first."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(FILES[module].read_text())):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        if not QUALIFIED_NAME.fullmatch(node.value):
            continue
        target = resolve(node.value.replace(":", ".").rstrip("."))
        outside = target and target != module and not module.startswith(target + ".")
        if outside and (target, node.lineno) not in found:
            found.append((target, node.lineno))
    return found


def graph(module_level_only: bool = False) -> dict[str, set[str]]:
    """Import edges only: a by-name load is how a lower room reaches a plug-in above it, so it
    is declared in DEFERRED rather than held to the layers and the no-circle rule."""
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


# Every import that is not at module level, and every load by qualified name, declared per
# (importer, imported) pair with its reason. The reason's category comes first:
#   "plug-in": named by the platform, a config, a flag or a table, loaded when chosen (a by-name load
#       is how a lower room reaches a plug-in above it; the layers contract does not see it);
#   "optional dependency": a package heavy to import, loaded at its first use;
#   "light path": the importer must stay cheap (the CLI's parser, a bench without torch);
#   "type only": an annotation of a module that imports torch, named by a core module that does not;
#   "public names (PEP 562)": `minivllm`'s names, loaded when first touched.
# Anything else goes at module level. The test fails on an undeclared pair and on a declared pair
# that no longer exists, so the table is the list of the package's deferred imports.
CATEGORIES = (
    "plug-in: ",
    "optional dependency: ",
    "light path: ",
    "type only: ",
    "public names (PEP 562)",
)
_PUBLIC = "public names (PEP 562): loaded when first touched, so `import minivllm` stays cheap"
_CLI = "light path: the CLI's parser and --help load no torch or server; a command imports what it runs"
_TORCH_FREE_CORE = "type only: the core stays torch-free, and the configs load torch"
_GGUF = "plug-in: the GGUF quantization method, chosen by the checkpoint"
_KV_MANAGER = "plug-in: the KV cache manager that `kv_allocation` and the model's windows name"
_FAMILY = "plug-in: a model family, loaded by name when its architecture is asked (vLLM's registry)"
_CPU_OPS = (
    "plug-in: the CPU kernels and their forwards, loaded when a model asks for the platform's ops"
)
DEFERRED = {
    **{
        ("minivllm", target): _PUBLIC
        for target in (
            "minivllm.core.outputs",
            "minivllm.engine.arg_utils",
            "minivllm.engine.beam_search",
            "minivllm.engine.llm_engine",
            "minivllm.engine.stats",
            "minivllm.llm",
            "minivllm.pooling.outputs",
            "minivllm.pooling.pooling_params",
            "minivllm.sampling_params",
            "minivllm.structured_output.params",
        )
    },
    ("minivllm.benchmarks.llama_cpp", "minivllm.model.resolver"): (
        "light path: the llama.cpp bench loads no torch; the resolver finds the bundled GGUF only "
        "when no model is given"
    ),
    ("minivllm.benchmarks.machine", "minivllm.cpu.op_forwards"): (
        "plug-in: the CPU platform's oneDNN GEMM, on a CPU with oneDNN (importing the forwards "
        "registers them, which the CPU platform does after building its kernels)"
    ),
    ("minivllm.config", "minivllm.core.kv_cache_manager"): _KV_MANAGER,
    ("minivllm.config", "minivllm.core.kv_cache_coordinator"): _KV_MANAGER,
    ("minivllm.config", "minivllm.core.sliding_window_manager"): _KV_MANAGER,
    ("minivllm.config", "minivllm.core.encoder_only_manager"): _KV_MANAGER,
    ("minivllm.config", "minivllm.experiments.reservation"): _KV_MANAGER + " (the Orca baselines)",
    ("minivllm.core.kv_cache_coordinator", "minivllm.config"): _TORCH_FREE_CORE,
    ("minivllm.core.kv_cache_manager", "minivllm.config"): _TORCH_FREE_CORE,
    ("minivllm.core.sliding_window_manager", "minivllm.config"): _TORCH_FREE_CORE,
    ("minivllm.core.encoder_only_manager", "minivllm.config"): _TORCH_FREE_CORE,
    ("minivllm.core.sequence", "minivllm.structured_output.backend"): (
        "type only: the core stays torch-free, and the grammar module loads torch"
    ),
    ("minivllm.engine.llm_engine", "minivllm.engine.speculator"): (
        "plug-in: speculative decoding, loaded by name when `speculative_config` is set"
    ),
    ("minivllm.engine.speculator", "minivllm.spec_decode.draft_model_proposer"): (
        "plug-in: the draft-model proposer, when the speculative config names a draft model"
    ),
    **{
        ("minivllm.entrypoints.cli", target): _CLI
        for target in (
            "minivllm.engine.arg_utils",
            "minivllm.engine.core_client",
            "minivllm.engine.dp_client",
            "minivllm.engine.dp_remote",
            "minivllm.engine.llm_engine",
            "minivllm.executor.abstract",
            "minivllm.executor.multiproc_executor",
            "minivllm.entrypoints.api_server",
            "minivllm.entrypoints.cli_args",
            "minivllm.entrypoints.draining_server",
            "minivllm.entrypoints.metrics",
            "minivllm.llm",
            "minivllm.model.errors",
            "minivllm.sampling_params",
        )
    },
    ("minivllm.entrypoints.cli", "minivllm.benchmarks"): (
        "plug-in: `minivllm bench NAME` loads the bench module NAME"
    ),
    ("minivllm.entrypoints.tool_parsers", "minivllm.entrypoints.tool_parsers.hermes"): (
        "plug-in: the tool-call parser that --tool-call-parser names"
    ),
    ("minivllm.entrypoints.tool_parsers", "minivllm.entrypoints.tool_parsers.llama3_json"): (
        "plug-in: the tool-call parser that --tool-call-parser names"
    ),
    ("minivllm.executor.abstract", "minivllm.executor.tensor_parallel"): (
        "plug-in: tensor parallelism, when its size is above 1"
    ),
    ("minivllm.executor.tensor_parallel", "minivllm.executor.ray_distributed_executor"): (
        "optional dependency: Ray, when distributed_executor_backend is 'ray' (minivllm[ray])"
    ),
    ("minivllm.worker.worker", "minivllm.distributed.process_group"): (
        "plug-in: tensor parallelism's process group, when the worker is one rank of several"
    ),
    ("minivllm.model.loader", "minivllm.model.quantization.gguf.loader"): _GGUF,
    ("minivllm.model.loader", "minivllm.model.quantization.gguf.reader"): _GGUF,
    ("minivllm.model.resolver", "minivllm.model.quantization.gguf.reader"): _GGUF,
    ("minivllm.model.models.registry", "minivllm.model.models.llama"): (
        _FAMILY + "; the base family is named as a type, so reading a config imports no model code"
    ),
    **{
        ("minivllm.model.models.registry", f"minivllm.model.models.{family}"): _FAMILY
        for family in ("qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe", "gemma2", "gemma3", "bert")
    },
    ("minivllm.model.models.registry", "minivllm.model.models.adapters"): (
        _FAMILY + ": a causal LM read as a classifier, which only hf_overrides asks for"
    ),
    ("minivllm.platforms", "minivllm.platforms.cuda"): "plug-in: the one platform of this machine",
    ("minivllm.platforms", "minivllm.platforms.cpu"): "plug-in: the one platform of this machine",
    ("minivllm.platforms.cpu", "minivllm.worker.cpu_decode_loop"): (
        "plug-in: the CPU decode loop (`decode_loop_cls`), which the model runner builds"
    ),
    ("minivllm.platforms.cpu", "minivllm.cpu.build"): _CPU_OPS,
    ("minivllm.platforms.cpu", "minivllm.cpu.op_forwards"): _CPU_OPS,
    ("minivllm.platforms.cpu", "minivllm.cpu.moe"): _CPU_OPS,
    ("minivllm.platforms.cuda", "minivllm.model.quantization.gguf.cuda_forwards"): (
        "plug-in: the CUDA forwards, loaded when a model asks for the platform's ops"
    ),
    ("minivllm.platforms.cuda", "minivllm.model.layers.triton_fused_moe"): (
        "plug-in: the CUDA forwards, loaded when a model asks for the platform's ops"
    ),
    **{
        ("minivllm.platforms.interface", f"minivllm.attention.backends.{backend}"): (
            "plug-in: the attention backend the platform names"
        )
        for backend in ("reference", "cpu", "triton")
    },
    ("minivllm.structured_output.manager", "minivllm.structured_output.xgrammar_backend"): (
        "optional dependency: xgrammar, heavy to import, loaded at the first constrained request"
    ),
    **{
        ("minivllm.lora.punica_selector", target): (
            "optional dependency: Triton, imported when the triton backend runs LoRA adapters"
        )
        for target in ("minivllm.lora", "minivllm.lora.triton_punica")
    },
}


def deferred_edges() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) -> where: every import not at module level, and every by-name load."""
    found: dict[tuple[str, str], list[str]] = {}
    for module in FILES:
        for target, line, top in imports_of(module):
            if not top:
                found.setdefault((module, target), []).append(f"{module}:{line}")
        for target, line in loads_by_name(module):
            found.setdefault((module, target), []).append(f"{module}:{line} (by name)")
    return found


def test_every_deferred_import_and_load_by_name_is_declared() -> None:
    found = deferred_edges()
    undeclared = [
        f"{where[0]} -> {pair[1]}" for pair, where in found.items() if pair not in DEFERRED
    ]
    assert not undeclared, "undeclared deferred imports or by-name loads:\n" + "\n".join(undeclared)
    gone = [f"{a} -> {b}" for a, b in DEFERRED if (a, b) not in found]
    assert not gone, "declared, but no longer deferred or loaded by name:\n" + "\n".join(gone)
    unreasoned = [
        f"{pair}: {why}" for pair, why in DEFERRED.items() if not why.startswith(CATEGORIES)
    ]
    assert not unreasoned, "a reason starts with its category:\n" + "\n".join(unreasoned)


def test_loads_by_name_are_found() -> None:
    """The measure itself: a table of qualified names, a class path a config returns, a
    `module:Class` entry and an f-string's module prefix all count as loads."""
    assert "minivllm.experiments.reservation" in {t for t, _ in loads_by_name("minivllm.config")}
    assert "minivllm.core.sliding_window_manager" in {
        t for t, _ in loads_by_name("minivllm.config")
    }
    assert "minivllm.model.models.gemma3" in {
        t for t, _ in loads_by_name("minivllm.model.models.registry")
    }
    assert "minivllm.benchmarks" in {t for t, _ in loads_by_name("minivllm.entrypoints.cli")}
    assert loads_by_name("minivllm.envs") == []  # its "minivllm" is a folder name, not a module


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
