"""The torch headers precompiled once per build (minivllm/cpu/precompiled_header.py): built with
the very flags torch compiles each source with (else GCC ignores it), covering every torch
header a source includes, deleted once the library is built, and never needed to build it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from minivllm.cpu.build import SOURCES, kernel_build_dir, loaded_level
from minivllm.cpu.precompiled_header import COMMAND_FILE, HEADER, USE_FLAGS, precompile
from minivllm.exceptions import CpuKernelUnavailable

TORCH_INCLUDE = re.compile(r"^#include <((?:ATen|c10|torch)/[^>]+)>", re.MULTILINE)


def test_the_header_is_compiled_with_the_flags_torch_compiled_every_source_with() -> None:
    """GCC uses a `.gch` only for compiles whose flags match its own: compare this machine's
    real build (torch's build.ninja) with the command that precompiled the header."""
    try:
        build = loaded_level().build
    except CpuKernelUnavailable as exc:
        pytest.skip(f"no compiled CPU kernels here: {exc}")
    assert build is not None
    build_dir = kernel_build_dir(build)
    [line] = [
        line
        for line in (build_dir / "build.ninja").read_text().splitlines()
        if line.startswith("cflags = ")
    ]
    source_flags = shlex.split(line.removeprefix("cflags = "))
    command = shlex.split((build_dir / COMMAND_FILE).read_text())
    assert source_flags == command[1 : command.index("-x")] + list(USE_FLAGS)
    assert not (build_dir / f"{HEADER.name}.gch").exists()  # hundreds of MB, read by no one now


def test_every_torch_header_a_source_includes_is_in_the_precompiled_one() -> None:
    """A torch header outside it is parsed as text by each source that includes it; and
    <ATen/ATen.h> (every op of ATen) has no place in either."""
    precompiled = set(TORCH_INCLUDE.findall(HEADER.read_text()))
    sources = [*SOURCES, *HEADER.parent.glob("*.h")]
    included = {name for path in sources for name in TORCH_INCLUDE.findall(path.read_text())}
    assert included <= precompiled, sorted(included - precompiled)
    assert "ATen/ATen.h" not in precompiled | included


def test_without_a_compiler_the_build_parses_the_header_as_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert precompile(tmp_path, "minivllm_cpu_kernels", ["-O3"]) is False
    assert (tmp_path / HEADER.name).read_text() == HEADER.read_text()  # `-include` finds it
    assert not (tmp_path / f"{HEADER.name}.gch").exists()
