"""What the source's prose may say: a docstring or comment states a contract and why a path exists,
never how fast it ran on one machine, and every repository file it names is there.

A measured speed ("2.2x faster than MKL", "~8 ms per layer", "60-90 GB/s") is true of one CPU on
one day; it belongs on the Performance page (docs/performance.md), beside the command that measures
it again. A path in a comment that no longer exists sends a reader nowhere. Both rot silently, so
a test holds them.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_SUFFIXES = (".py", ".cpp", ".h")

# A number (or a range of two), then a unit of time, throughput or bandwidth, or a speed ratio.
# Seconds only where the figure reads as a measurement ("~1 s of start-up", "took 4 s"): "10 s
# later" is a timeout, a design choice.
_NUMBER = r"~?\d[\d,.]*(?:\s*(?:-|–|to)\s*~?\d[\d,.]*)?"
MEASURED_SPEED = re.compile(
    rf"{_NUMBER}\s*(?:ms|µs|us|ns)\b"  # "~8 ms", "10-25 µs"
    rf"|(?:~|\babout |\baround |\broughly |\btook |\btakes |\bmeasured ){_NUMBER}\s*"
    rf"(?:s|seconds?|minutes?)\b"
    rf"|{_NUMBER}\s+(?:s|seconds?)\s+(?:of|per|a)\b"  # "2 s of a 5 s start-up"
    rf"|{_NUMBER}\s*(?:[GMK]i?B|[GT]?FLOP|tok(?:en)?s|req(?:uest)?s)\s*(?:/\s*s|per second)\b"
    rf"|{_NUMBER}\s*[x×]\s*(?:faster|slower|the speed)\b"  # "2.5x faster"
    # a share of the time: "5-14 % of the body's time", "5 % slower", "a mask cost ~10 %"
    rf"|{_NUMBER}\s*%\s*(?:faster|slower|of\s+(?:[\w'’-]+\s+){{0,3}}(?:time|step))"
    rf"|\b(?:cost|costs|took|takes)\s+{_NUMBER}\s*%",
)

# Measured-looking figures that are not a measurement of minivllm on some machine, by file and
# text, each with its reason.
SPEED_ALLOWED: dict[tuple[str, str], str] = {
    ("minivllm/benchmarks/paper.py", "~1.5 s"): "a request's length on the simulated A100: the "
    "simulator's arithmetic from datasheet figures, the same on every machine",
    ("minivllm/benchmarks/paper.py", "~8 s"): "the same, for a ShareGPT request",
}

# A repository path: one of the checkout's top-level folders, then a file with an extension or a
# folder ending in "/". Not preceded by a path character, so "vllm/tests/..." is not ours.
REPO_PATH = re.compile(
    r"(?<![\w./\\-])((?:minivllm|tests|docs|benchmarks|tutorials|scripts)/[\w./-]*)"
)
# vLLM has tests/, docs/ and benchmarks/ folders too, and the source cites them ("vLLM's model
# tests (tests/models/utils.py)"): a path of those folders with vLLM named just before it is
# vLLM's. minivllm/ paths are always ours.
VLLM_NAMED_BEFORE = re.compile(r"(?<!mini)vllm", re.IGNORECASE)
VLLM_CONTEXT_CHARS = 100
# Files whose code lists paths of vLLM's own test tree, which they extract and run.
VLLM_TREE_FILES: dict[str, str] = {
    "benchmarks/vllm_openai_conformance.py": "extracts vLLM's tests/ at a pinned commit",
    "benchmarks/vllm_conformance_classes.py": "classifies vLLM's tests/ by path",
}


def source_files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*") if p.suffix in SOURCE_SUFFIXES)


def python_prose(text: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python source."""
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, doc


def cpp_comments(text: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every // and /* */ comment of a C++ source, skipping string literals."""
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":  # a string or character literal: skip to its unescaped end
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            yield text.count("\n", 0, i) + 1, text[i:j]
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            yield text.count("\n", 0, i) + 1, text[i:j]
            i = j
        else:
            i += 1


def prose(path: Path) -> Iterator[tuple[int, str]]:
    text = path.read_text(encoding="utf-8")
    return python_prose(text) if path.suffix == ".py" else cpp_comments(text)


def speed_offenders(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        for line, chunk in prose(path):
            flat = " ".join(chunk.split())  # a figure may be wrapped across lines
            for m in MEASURED_SPEED.finditer(flat):
                if (str(path.relative_to(ROOT)), m.group(0)) not in SPEED_ALLOWED:
                    found.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)!r}")
    return found


def named_paths(text: str) -> Iterator[tuple[int, str]]:
    """(line, path) of each repository path the text names that is minivllm's, not vLLM's: in a
    comment, a docstring or any other string literal (code names no path outside one)."""
    for m in REPO_PATH.finditer(text):
        name = m.group(1).rstrip(".,")  # a sentence's full stop is not the file's
        if not (name.endswith("/") or re.search(r"\.\w+$", name)):
            continue  # a prefix of a name built at run time ("docs/perf/llama-cpp-*.json")
        before = text[max(0, m.start() - VLLM_CONTEXT_CHARS) : m.start()]
        if not name.startswith("minivllm/") and VLLM_NAMED_BEFORE.search(before):
            continue
        yield text.count("\n", 0, m.start()) + 1, name


def missing_path_offenders(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        rel = str(path.relative_to(ROOT))
        for line, name in named_paths(path.read_text(encoding="utf-8")):
            if rel in VLLM_TREE_FILES and not name.startswith("minivllm/"):
                continue
            if not (ROOT / name).exists():
                found.append(f"{rel}:{line}: {name}")
    return found


def test_no_docstring_or_comment_carries_a_measured_speed():
    offenders = speed_offenders(source_files("minivllm"))
    assert not offenders, (
        "measured speeds belong on docs/performance.md beside their command; say what and why "
        "here instead:\n" + "\n".join(offenders)
    )


def test_every_repository_path_named_in_the_source_exists():
    offenders = missing_path_offenders(source_files("minivllm", "benchmarks", "tests"))
    assert not offenders, "paths named in the source that the checkout lacks:\n" + "\n".join(
        offenders
    )
