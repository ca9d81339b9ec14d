"""vLLM's own OpenAI-server tests, run against `minivllm serve`: a conformance check, not CI.

The tests are vLLM's `tests/entrypoints/openai` and `tests/v1/entrypoints/openai` at a pinned
commit, extracted with `git archive` from a vLLM checkout you give it, into a run folder made at
run time (never stored in this repository). Their `tests/utils.py` is replaced by
`benchmarks/vllm_conformance_shim.py`, whose `RemoteOpenAIServer` starts `minivllm serve` with the
bundled model whatever model a test names. They run in a virtual environment outside the project
(`~/.cache/minivllm-conformance/venv`, made once with the project's python; it borrows the project
environment's packages through a `.pth` file and adds the test-only ones; it never has `vllm`).

Getting vLLM's source (the whole repository's history is not needed, only the pinned commit):

    git clone --filter=blob:none https://github.com/vllm-project/vllm ~/src/vllm
    python benchmarks/vllm_openai_conformance.py --vllm ~/src/vllm

`--vllm` takes a checkout or a bare git directory. Every outcome is classified (see `CLASSES`):
pass; missing feature; model-specific expectation; needs another model, a GPU, audio, vision or
LoRA (excluded from the count); a test of vLLM's own Python internals (excluded); harness.
The counts, the classes and their reasons are on docs/serving.md ("vLLM's own server tests").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from benchmarks.vllm_conformance_classes import (
    DESELECTED,
    EXCLUDED_MODULES,
    EXCLUDED_PARAMETERS,
    KNOWN_FAILURES,
)

ROOT = Path(__file__).resolve().parent.parent
PINNED_COMMIT = "505805b6"  # vLLM, 2025-09-18
TEST_PATHS = [
    "tests/__init__.py",
    "tests/entrypoints/__init__.py",
    "tests/entrypoints/conftest.py",
    "tests/entrypoints/openai",
    "tests/v1/__init__.py",
    "tests/v1/entrypoints/__init__.py",
    "tests/v1/entrypoints/conftest.py",
    "tests/v1/entrypoints/openai",
]
# The test side as vLLM's CI had it at the pinned commit (requirements/test.txt; openai, which it
# leaves unpinned, as released that week): the client's models decide which keys a response's
# model_dump() has, and test_openai_schema.py is written against schemathesis 3.
TEST_ONLY_PACKAGES = [
    "pytest-asyncio>=0.24,<1.2",
    "pybase64",
    "openai==1.108.0",
    "schemathesis==3.39.15",
    "hypothesis==6.131.0",
]
CONFTEST = '''"""The conformance run's conftest: the stand-in `vllm` modules, before any test imports."""
import _pytest._code.code

import tests.utils  # noqa: F401

_getsource = _pytest._code.code.TracebackEntry.getsource


def _getsource_or_none(self, astcache=None):
    # CPython 3.11.7's ast.parse can raise "AST constructor recursion depth mismatch" once a
    # library has changed the recursion limit (fixed in 3.11.8); pytest then aborts the whole
    # run while printing one failure. Without the source, that failure is still reported.
    try:
        return _getsource(self, astcache)
    except SystemError:
        return None


_pytest._code.code.TracebackEntry.getsource = _getsource_or_none
'''
PYTEST_INI = """[pytest]
junit_family = xunit1
asyncio_default_fixture_loop_scope = function
markers =
    slow_test
    skip_global_cleanup
    core_model
    hybrid_model
    cpu_model
    split
    distributed
    skip_v1
    optional
"""
CLASSES = {
    "pass": "passes",
    "missing": "missing feature (a behaviour of vLLM's server that minivllm lacks)",
    "model": "model-specific expectation (the test's own model's text, vocabulary or template)",
    "excluded": "needs another model, a GPU, audio, vision or LoRA (excluded from the count)",
    "internals": "tests vLLM's own Python classes, not the server (excluded from the count)",
    "harness": "the harness (the stand-in cannot give what the test needs)",
    "skipped": "skipped by the test itself",
    "unclassified": "a failure not yet classified",
}


def extract(vllm: Path, commit: str, into: Path) -> None:
    git_dir = vllm if (vllm / "objects").is_dir() else vllm / ".git"
    git = ["git", "--git-dir", str(git_dir)]
    subprocess.run([*git, "cat-file", "-e", f"{commit}^{{commit}}"], check=True)
    archive = subprocess.run(
        [*git, "archive", "--format=tar", commit, *TEST_PATHS], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "x", "-C", str(into)], input=archive, check=True)
    shutil.copy(ROOT / "benchmarks" / "vllm_conformance_shim.py", into / "tests" / "utils.py")
    (into / "tests" / "conftest.py").write_text(CONFTEST)
    (into / "pytest.ini").write_text(PYTEST_INI)
    # The LoRA fixture downloads adapters from the hub; minivllm serves no LoRA, so it yields a
    # placeholder path (the --lora-modules flag is dropped; requests naming the adapter are
    # classified as needing LoRA, pass or fail).
    conftest = into / "tests" / "entrypoints" / "conftest.py"
    text = conftest.read_text()
    download = 'return snapshot_download(repo_id="typeof/zephyr-7b-beta-lora")'
    assert download in text, "vLLM's zephyr_lora_files fixture changed: update the harness"
    conftest.write_text(text.replace(download, f"return {str(into / 'no-lora')!r}"))


def ensure_venv(venv: Path) -> Path:
    """The test environment: made once with the project's python, outside the project."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        site = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        # The project's packages (torch, transformers, requests, httpx, jsonschema, ...) come
        # last on the path; what is installed into this venv comes first.
        Path(site, "minivllm_project.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = venv / "minivllm_test_packages.txt"
    wanted = "\n".join(TEST_ONLY_PACKAGES)
    if not installed.exists() or installed.read_text() != wanted:
        subprocess.run([str(python), "-m", "pip", "install", "-q", *TEST_ONLY_PACKAGES], check=True)
        installed.write_text(wanted)
    return python


def prepare_server_side(run: Path, root: Path) -> dict[str, str]:
    """What the shim needs from the project: the bundled tokenizer, minivllm's flags, its version."""
    tokenizer_dir = run / "tokenizer"
    script = f"""
import json
from minivllm.model.loader import load_config, load_tokenizer
from minivllm.model.resolver import bundled_model_path, resolve_model
from minivllm.entrypoints.cli import make_serve_parser
import minivllm
source = resolve_model(None)
load_tokenizer(source).save_pretrained({str(tokenizer_dir)!r})
config = load_config(source)
open({str(tokenizer_dir / "model_config.json")!r}, "w").write(
    json.dumps({{"vocab_size": config.vocab_size,
                "max_position_embeddings": config.max_position_embeddings}}))
flags = {{}}
for action in make_serve_parser("minivllm serve")._actions:
    for option in action.option_strings:
        nargs = action.nargs
        flags[option] = {{"takes_value": nargs != 0 and action.const is None
                          and type(action).__name__ not in ("_StoreTrueAction",
                          "_StoreFalseAction", "BooleanOptionalAction", "_HelpAction"),
                          "nargs": nargs if nargs in ("+", "*") else 1,
                          "choices": list(action.choices) if action.choices else None}}
print(json.dumps({{"flags": flags, "version": minivllm.__version__,
                  "gguf": str(bundled_model_path())}}))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True, cwd=root
    ).stdout
    facts = json.loads(out.strip().splitlines()[-1])
    return {
        "MINIVLLM_PYTHON": sys.executable,
        "MINIVLLM_ROOT": str(root),
        "MINIVLLM_CONFORMANCE_RUN": str(run),
        "MINIVLLM_CONFORMANCE_TOKENIZER": str(tokenizer_dir),
        "MINIVLLM_CONFORMANCE_FLAGS": json.dumps(facts["flags"]),
        "MINIVLLM_CONFORMANCE_VERSION": facts["version"],
        "MINIVLLM_CONFORMANCE_GGUF": facts["gguf"],
    }


def module_of(classname: str, file: str | None) -> str:
    if file and file.endswith("schemathesis/lazy.py"):  # schemathesis names its own file
        return "tests/entrypoints/openai/test_openai_schema.py"
    if file:
        return file
    parts = classname.split(".")
    while parts and not parts[-1].startswith("test_"):
        parts.pop()
    return "/".join(parts) + ".py"


def matches(key: str, node: str) -> bool:
    """A key is a node id, a node id without its parameters, or a pattern where each '*' stands
    for any characters (not fnmatch: node ids hold '[')."""
    if "*" not in key:
        return node == key or node.startswith(key + "[")
    first, *middle, last = key.split("*")
    if not node.startswith(first):
        return False
    at = len(first)
    for part in middle:
        at = node.find(part, at)
        if at < 0:
            return False
        at += len(part)
    return node.endswith(last) and len(node) - len(last) >= at


def classify(junit: Path) -> list[dict[str, str]]:
    rows = []
    for case in ET.parse(junit).iter("testcase"):
        file = module_of(case.get("classname", ""), case.get("file"))
        name = case.get("name", "")
        if name == "test_openapi_stateless":
            continue  # schemathesis' parent item: its operations are the tests, one row each
        node = f"{file}::{name}"
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        skipped = case.find("skipped")
        message = "" if problem is None else (problem.get("message") or "")[:400]
        detail = "" if problem is None else (problem.text or "")
        server_error = any(
            s in detail for s in ("InternalServerError", "Error code: 500", "500 Internal")
        )
        excluded = next((v for k, v in EXCLUDED_MODULES.items() if file.endswith(k)), None)
        if excluded is None and any(marker in name for marker in EXCLUDED_PARAMETERS):
            excluded = next(v for k, v in EXCLUDED_PARAMETERS.items() if k in name)
        known = next((v for k, v in KNOWN_FAILURES.items() if matches(k, node)), None)
        if excluded is not None:
            cls, reason = excluded
        elif problem is None and skipped is not None:
            cls, reason = "skipped", (skipped.get("message") or "")[:200]
        elif problem is None:
            cls, reason = "pass", ""
        elif known is not None:
            cls, reason = known
        else:
            cls, reason = "unclassified", message
        rows.append(
            {
                "node": node,
                "outcome": "pass"
                if problem is None and skipped is None
                else ("skip" if problem is None else "fail"),
                "class": cls,
                "reason": reason,
                "server_error": str(server_error and problem is not None),
                "message": message,
            }
        )
    return rows


def not_run_arguments(tree: Path, run_excluded: bool) -> list[str]:
    """pytest arguments that leave out what is not counted (excluded and internals modules) and the
    tests in `DESELECTED`, which only wait (for a `vllm` subprocess or a GPU) until they time out."""
    out = [f"--deselect={node}" for node in DESELECTED]
    if run_excluded:
        return out
    for suffix in EXCLUDED_MODULES:
        out += [f"--ignore={p.relative_to(tree)}" for p in sorted(tree.glob(f"tests/**/{suffix}"))]
    return out


def not_run_rows() -> list[dict[str, str]]:
    """The deselected tests, as rows of their class (they count, and do not pass)."""
    return [
        {
            "node": node,
            "outcome": "not run",
            "class": cls,
            "reason": reason,
            "server_error": "False",
            "message": "deselected",
        }
        for node, (cls, reason) in DESELECTED.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm", type=Path, required=True, help="vLLM checkout or git dir")
    parser.add_argument("--commit", default=PINNED_COMMIT)
    parser.add_argument(
        "--minivllm",
        type=Path,
        default=ROOT,
        help="the minivllm tree the server runs from (default: this checkout; "
        "for a fixed commit: git archive COMMIT | tar x -C DIR)",
    )
    parser.add_argument(
        "--venv", type=Path, default=Path.home() / ".cache" / "minivllm-conformance" / "venv"
    )
    parser.add_argument("--run-dir", type=Path, default=None, help="default: a fresh temp dir")
    parser.add_argument("--report", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument("--timeout", type=int, default=180, help="seconds per test")
    parser.add_argument(
        "--run-excluded",
        action="store_true",
        help="also run the modules excluded from the count (another model, audio, internals...)",
    )
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (paths, -k)")
    args = parser.parse_args(argv)

    run = args.run_dir or Path(tempfile.mkdtemp(prefix="minivllm-conformance-"))
    run.mkdir(parents=True, exist_ok=True)
    tree = run / "vllm"
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir()
    extract(args.vllm.expanduser(), args.commit, tree)
    python = ensure_venv(args.venv.expanduser())
    env = {**os.environ, **prepare_server_side(run, args.minivllm.resolve())}
    env.pop("VIRTUAL_ENV", None)
    junit = run / "junit.xml"
    targets = args.pytest_args or ["tests/entrypoints/openai", "tests/v1/entrypoints/openai"]
    subprocess.run(
        [
            str(python),
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rN",
            "--continue-on-collection-errors",
            f"--timeout={args.timeout}",
            f"--junitxml={junit}",
            *not_run_arguments(tree, args.run_excluded),
            *targets,
        ],
        cwd=tree,
        env=env,
        check=False,
    )
    rows = classify(junit) + not_run_rows()
    counts = Counter(r["class"] for r in rows)
    counted = [r for r in rows if r["class"] not in ("excluded", "internals", "skipped")]
    print(f"\nrun folder: {run}")
    if not args.run_excluded:
        print(f"not run: {len(EXCLUDED_MODULES)} modules excluded from the count (--run-excluded)")
    for cls, text in CLASSES.items():
        print(f"{counts.get(cls, 0):5d}  {cls:13s} {text}")
    print(
        f"passing {counts.get('pass', 0)} of {len(counted)} counted tests;"
        f" server errors (5xx) among failures: {sum(r['server_error'] == 'True' for r in rows)}"
    )
    for r in rows:
        if r["class"] == "unclassified" or r["server_error"] == "True":
            print(f"  {r['class']}: {r['node']}: {r['message'][:200]}")
    if args.report:
        args.report.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
