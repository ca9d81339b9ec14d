"""Building the CPU kernel: one line when it compiles, one when it fails, a failure remembered,
no wait on a lock a killed build left behind, and no lasting change to the process's PATH.

No test here runs the compiler (a real build takes ~20 s): `compile_kernel`, or torch's `load`
under it, is replaced by a recorder, and every test builds into a cache folder of its own, so the
shared cache (and the real kernel in it) is never touched. Each call of
`load_cpu_kernels.__wrapped__` behaves as a new process's first call (the cached wrapper is what
makes a process build once).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from minivllm.attention.backends import cpu as cpu_module
from minivllm.attention.selector import get_attention_backend
from minivllm.cpu import build as cpu_build
from minivllm.cpu import isa, precompiled_header
from minivllm.cpu.build import CpuKernelUnavailable
from minivllm.cpu.isa import Build, selected_level

LIBRARY = "minivllm_cpu_kernels.so"
# What torch raises when the compiler fails: its first line runs on into ninja's log.
COMPILE_ERROR = (
    "Error building extension 'minivllm_cpu_kernels': [1/2] c++ -MMD -c cpu_attention.cpp -o x.o\n"
    "FAILED: x.o\n"
    "c++ -MMD -c cpu_attention.cpp -o x.o\n"
    "cpu_attention.cpp:12:3: error: expected ';' before '}' token\n"
    "ninja: build stopped: subcommand failed.\n"
)


class FakeBuild:
    """Stands in for the compiler and the library loader; records what they were asked."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, error: Exception | None = None) -> None:
        self.error = error
        self.compiled: list[Path] = []
        self.loaded: list[Path] = []
        monkeypatch.setattr(cpu_build, "compile_kernel", self.compile)
        monkeypatch.setattr(cpu_build, "_load_library", self.loaded.append)

    def compile(self, build_dir: Path, build: Build) -> str:
        # torch waits forever for this file: it must be gone before torch is called.
        assert not (build_dir / "lock").exists()
        self.compiled.append(build_dir)
        if self.error is not None:
            raise self.error
        return LIBRARY


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    # the torch headers' precompile runs the real compiler (tests/cpu/test_precompiled_header.py)
    monkeypatch.setattr(precompiled_header, "precompile", lambda *args: False)
    return tmp_path


def current_build_dir() -> Path:
    """The build folder of this process's instruction-set level."""
    build = selected_level().build
    assert build is not None
    return cpu_build.kernel_build_dir(build)


def load_in_a_new_process() -> None:
    cpu_build.load_cpu_kernels.__wrapped__()


def messages(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_the_compile_line_is_logged_once_and_later_processes_load_the_library(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeBuild(monkeypatch)
    with caplog.at_level(logging.INFO, logger="minivllm"):
        load_in_a_new_process()
        load_in_a_new_process()
        load_in_a_new_process()
    build_dir = current_build_dir()
    assert fake.compiled == [build_dir]
    assert fake.loaded == [build_dir / LIBRARY] * 3
    [line] = messages(caplog, "compiling")
    assert "\n" not in line and str(build_dir) in line
    # WARNING, because Python prints WARNING and above when the application configured no
    # logging: a user who never heard of `logging` still sees why the first start is slow.
    assert all(r.levelno == logging.WARNING for r in caplog.records)


def test_a_failed_build_is_remembered_and_not_retried(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeBuild(monkeypatch, RuntimeError(COMPILE_ERROR))
    with pytest.raises(CpuKernelUnavailable) as first:
        load_in_a_new_process()
    [marker] = current_build_dir().glob("build-failed-*.txt")
    message = str(first.value)
    assert "\n" not in message
    assert "cpu_attention.cpp:12:3: error: expected ';'" in message and str(marker) in message
    assert "ninja: build stopped" in marker.read_text()  # the whole log is kept, for the curious

    caplog.clear()
    with pytest.raises(CpuKernelUnavailable) as again:
        load_in_a_new_process()
    assert len(fake.compiled) == 1
    assert "\n" not in str(again.value)
    assert "expected ';'" in str(again.value) and f"delete {marker} to retry" in str(again.value)
    assert not messages(caplog, "compiling")


def test_auto_says_in_one_line_that_the_reference_is_used_when_the_build_failed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    FakeBuild(monkeypatch, RuntimeError(COMPILE_ERROR))
    monkeypatch.setattr(cpu_module, "load_cpu_kernels", cpu_build.load_cpu_kernels.__wrapped__)
    for _ in range(2):  # the failing build, then the remembered failure
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="minivllm"):
            assert get_attention_backend("auto").name == "reference"
        [line] = messages(caplog, "reference backend")
        assert "\n" not in line and "expected ';'" in line


def test_deleting_the_marker_or_changing_the_compiler_retries_the_build(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = FakeBuild(monkeypatch, RuntimeError(COMPILE_ERROR))
    with pytest.raises(CpuKernelUnavailable):
        load_in_a_new_process()
    [marker] = current_build_dir().glob("build-failed-*.txt")
    marker.unlink()
    with pytest.raises(CpuKernelUnavailable):
        load_in_a_new_process()
    assert len(fake.compiled) == 2

    other_compiler = tmp_path / "bin" / "c++"
    other_compiler.parent.mkdir()
    other_compiler.write_text("#!/bin/sh\n")
    other_compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(other_compiler))
    fake.error = None
    load_in_a_new_process()
    assert len(fake.compiled) == 3


@contextlib.contextmanager
def another_builder(build_dir: Path, then: str) -> Iterator[subprocess.Popen[str]]:
    """Another process that takes the build lock, creates torch's `lock` file, then runs `then`
    (Python) while holding both. Yields once it holds them; SIGKILLed at the end if still alive."""
    script = (
        "import fcntl, pathlib, sys, time\n"
        "build_dir = pathlib.Path(sys.argv[1])\n"
        "held = open(build_dir / 'build.lock', 'a'); fcntl.flock(held, fcntl.LOCK_EX)\n"
        "(build_dir / 'lock').touch(); print('building', flush=True)\n" + then
    )
    with subprocess.Popen(
        [sys.executable, "-c", script, str(build_dir)], stdout=subprocess.PIPE, text=True
    ) as builder:
        try:
            assert builder.stdout is not None and builder.stdout.readline() == "building\n"
            yield builder
        finally:
            builder.kill()
            builder.wait()


def test_a_process_that_waited_for_another_s_build_loads_it_without_compiling(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeBuild(monkeypatch)
    build_dir = current_build_dir()
    build_dir.mkdir(parents=True)
    finish_the_build = (
        "time.sleep(0.5); (build_dir / 'lock').unlink()\n"
        f"(build_dir / {cpu_build.BUILT_STAMP!r}).write_text({LIBRARY!r})"
    )
    with (
        another_builder(build_dir, then=finish_the_build),
        caplog.at_level(logging.WARNING, logger="minivllm"),
    ):
        load_in_a_new_process()
    assert fake.compiled == [] and fake.loaded == [build_dir / LIBRARY]
    assert len(messages(caplog, "waiting for it")) == 1
    assert not messages(caplog, "compiling minivllm")


def test_a_lock_left_by_a_killed_build_does_not_block_the_next_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process takes the build lock, starts torch's build (its `lock` file), and is SIGKILLed."""
    fake = FakeBuild(monkeypatch)
    build_dir = current_build_dir()
    build_dir.mkdir(parents=True)
    with another_builder(build_dir, then="time.sleep(600)") as builder:
        builder.kill()  # SIGKILL: no clean-up code of the builder runs
        builder.wait()
    assert (build_dir / "lock").exists()
    load_in_a_new_process()
    assert fake.compiled == [build_dir]


def test_waiting_for_a_live_build_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import fcntl

    fake = FakeBuild(monkeypatch)
    monkeypatch.setattr(cpu_build, "LOCK_TIMEOUT_S", 0.5)
    build_dir = current_build_dir()
    build_dir.mkdir(parents=True)
    with open(build_dir / "build.lock", "a") as other_builder:
        fcntl.flock(other_builder, fcntl.LOCK_EX)
        with pytest.raises(CpuKernelUnavailable, match="not waiting longer"):
            load_in_a_new_process()
    assert fake.compiled == []
    assert not list(build_dir.glob("build-failed-*"))  # a slow neighbour is not a failed build


@pytest.mark.parametrize("fails", [False, True], ids=["build-ok", "build-fails"])
def test_ninja_from_the_wheel_is_on_path_during_the_build_only(
    monkeypatch: pytest.MonkeyPatch, fails: bool
) -> None:
    """torch runs `ninja` from PATH; an unactivated venv's PATH lacks the wheel's binary."""
    import ninja

    monkeypatch.setenv("PATH", "/nowhere")
    seen: list[str] = []

    def torch_load(build_directory: str, **kwargs: object) -> str:
        seen.append(os.environ["PATH"])
        if fails:
            raise RuntimeError("Ninja is required to load C++ extensions")
        return str(Path(build_directory) / LIBRARY)

    monkeypatch.setattr("torch.utils.cpp_extension.load", torch_load)
    monkeypatch.setattr(cpu_build, "_load_library", lambda path: None)
    if fails:
        with pytest.raises(
            CpuKernelUnavailable, match=r"Ninja is required.*C\+\+ compiler and ninja"
        ):
            load_in_a_new_process()
    else:
        load_in_a_new_process()
    assert seen[0].split(os.pathsep)[0] == ninja.BIN_DIR
    assert os.environ["PATH"] == "/nowhere"


def test_torch_s_build_log_goes_to_the_marker_not_the_terminal(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def torch_load(**kwargs: object) -> str:
        logging.getLogger("torch.utils.cpp_extension").warning("Your compiler is not compatible")
        raise RuntimeError(COMPILE_ERROR)

    monkeypatch.setattr("torch.utils.cpp_extension.load", torch_load)
    with caplog.at_level(logging.INFO), pytest.raises(CpuKernelUnavailable):
        load_in_a_new_process()
    assert not messages(caplog, "not compatible")
    [marker] = current_build_dir().glob("build-failed-*.txt")
    assert "Your compiler is not compatible" in marker.read_text()
    assert logging.getLogger("torch.utils.cpp_extension").propagate  # given back


def test_every_source_is_compiled_and_a_change_to_any_moves_the_build_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The attention kernel and the layer ops are one library: an edit to either file must
    rebuild it, not load a library built from the old source."""
    sources = (tmp_path / "a.cpp", tmp_path / "b.cpp")
    for source in sources:
        source.write_text("// v1\n")
    monkeypatch.setattr(cpu_build, "SOURCES", sources)
    compiled: list[list[str]] = []

    def torch_load(build_directory: str, sources: list[str], **kwargs: object) -> str:
        compiled.append(sources)
        return str(Path(build_directory) / LIBRARY)

    monkeypatch.setattr("torch.utils.cpp_extension.load", torch_load)
    monkeypatch.setattr(cpu_build, "_load_library", lambda path: None)
    load_in_a_new_process()
    assert compiled == [[str(source) for source in sources]]
    folders = {current_build_dir()}
    for source in sources:
        source.write_text(source.read_text() + "// v2\n")
        folders.add(current_build_dir())
    assert len(folders) == 3


def test_torch_s_build_leaves_the_build_folder_s_name_unchanged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch appends its own libraries to the `extra_ldflags` list it is given: were that the
    module's list, the folder's digest would change once a process has built."""

    def torch_load(build_directory: str, extra_ldflags: list[str], **kwargs: object) -> str:
        extra_ldflags.append("-ltorch")
        return str(Path(build_directory) / LIBRARY)

    monkeypatch.setattr("torch.utils.cpp_extension.load", torch_load)
    monkeypatch.setattr(cpu_build, "_load_library", lambda path: None)
    before = current_build_dir()
    load_in_a_new_process()
    assert current_build_dir() == before


# ---------------------------------------------------------------------- instruction-set levels
AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})  # AMD Zen 2, say


def as_cpu(monkeypatch: pytest.MonkeyPatch, features: frozenset[str]) -> None:
    monkeypatch.setattr(isa, "cpu_features", lambda: features)


def test_an_avx2_cpu_runs_the_avx2_build_and_is_refused_avx512_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    as_cpu(monkeypatch, AVX2_ONLY)
    monkeypatch.delenv(isa.ENV_VAR, raising=False)
    assert isa.selected_level().name == "avx2"
    assert [level.name for level in isa.supported_levels()] == ["reference", "generic", "avx2"]
    monkeypatch.setenv(isa.ENV_VAR, "avx512")
    with pytest.raises(
        isa.CpuIsaUnsupported, match=r"lacks avx512f.*can run reference, generic, avx2"
    ):
        isa.selected_level()
    monkeypatch.setenv(isa.ENV_VAR, "sse9")
    with pytest.raises(isa.CpuIsaUnsupported, match="must be one of reference, generic, avx2"):
        isa.selected_level()


def test_a_cpu_without_x86_levels_runs_the_generic_build(monkeypatch: pytest.MonkeyPatch) -> None:
    as_cpu(monkeypatch, frozenset())  # aarch64, say: no x86 flags at all
    monkeypatch.delenv(isa.ENV_VAR, raising=False)
    assert isa.selected_level().name == "generic"
    assert isa.selected_level().build == isa.GENERIC


@pytest.mark.parametrize("level", ["generic", "avx2", "avx512"])
def test_each_level_builds_with_its_own_flags_in_its_own_folder(
    level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build never takes the build machine's instructions (-march=native) or a higher level's:
    the AVX2 library must run on an AVX2 CPU whatever CPU compiled it."""
    as_cpu(monkeypatch, AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512dq"})
    monkeypatch.setenv(isa.ENV_VAR, level)
    seen: list[dict[str, object]] = []

    def torch_load(build_directory: str, **kwargs: object) -> str:
        seen.append({"dir": build_directory, **kwargs})
        return str(Path(build_directory) / LIBRARY)

    monkeypatch.setattr("torch.utils.cpp_extension.load", torch_load)
    monkeypatch.setattr(cpu_build, "_load_library", lambda path: None)
    load_in_a_new_process()
    [call] = seen
    flags = call["extra_cflags"]
    assert isinstance(flags, list)
    assert not any("native" in flag for flag in flags)
    assert any(flag.startswith("-mavx512") for flag in flags) == (level == "avx512")
    assert ("-mavx2" in flags) == (level != "generic")
    assert flags[-len(precompiled_header.USE_FLAGS) :] == list(precompiled_header.USE_FLAGS)
    assert f"cpu_kernels-{level}-" in str(call["dir"])


def test_the_reference_level_loads_no_library_and_auto_attention_falls_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeBuild(monkeypatch)
    monkeypatch.setenv(isa.ENV_VAR, "reference")
    with pytest.raises(CpuKernelUnavailable, match="MINIVLLM_CPU_ISA=reference"):
        load_in_a_new_process()
    assert fake.compiled == [] and fake.loaded == []
    monkeypatch.setattr(cpu_module, "load_cpu_kernels", load_in_a_new_process)
    assert get_attention_backend("auto").name == "reference"


# ------------------------------------------------------------- what a parallel region may touch
def parallel_bodies(source: str) -> list[str]:
    """The bodies of the lambdas given to `at::parallel_for` in a C++ source, comments removed."""
    import re

    code = re.sub(r"//[^\n]*|/\*.*?\*/", "", source, flags=re.DOTALL)
    bodies = []
    for match in re.finditer(r"parallel_for\s*\(", code):
        start = code.index("{", match.end())
        depth, end = 0, start
        for end in range(start, len(code)):
            depth += {"{": 1, "}": -1}.get(code[end], 0)
            if depth == 0:
                break
        bodies.append(code[start : end + 1])
    return bodies


def test_no_parallel_region_calls_aten() -> None:
    """PyTorch's worker threads do not carry the caller's thread-local state (InferenceMode,
    grad mode): an ATen call in a parallel region made on an inference tensor is refused there,
    and only when a second thread runs it. Every region touches raw pointers only, or carries the
    state in with at::ThreadLocalStateGuard."""
    import re

    aten = re.compile(
        r"\bat::(?!parallel_for|get_num_threads|get_thread_num)\w+|\bTensor\b|\.data_ptr|TORCH_CHECK"
    )
    offenders = []
    for source in (*cpu_build.SOURCES, *cpu_build.HEADERS):
        for body in parallel_bodies(source.read_text()):
            if "ThreadLocalStateGuard" not in body and (found := aten.search(body)):
                offenders.append(f"{source.name}: {found.group(0)}")
    assert offenders == []
    assert len(parallel_bodies(cpu_build.SOURCES[0].read_text())) >= 2  # the parser finds regions
