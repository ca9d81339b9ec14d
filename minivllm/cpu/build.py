"""Building the CPU kernels (`SOURCES`) into one library once per machine, quietly and safely.

The C++ files of this package make the library: the paged attention kernel (`cpu_attention.cpp`,
with its float32 loops for AVX-512 and AVX2 in `cpu_attention_avx512.cpp` and
`cpu_attention_avx2.cpp`), the encoder-only attention of a step's prompts
(`cpu_encoder_attention.cpp`), the fused layer ops (`cpu_layernorm.cpp`: RMSNorm;
`cpu_activation_rope.cpp`: SiLU-and-mul, RoPE), the skinny GEMM of decode's linears
(`cpu_skinny_gemm.cpp`), the linears on GGUF's quantized blocks and their dequantization
(`cpu_gguf_gemm*.cpp`; the K-quants' prefill on AMX tiles, `cpu_gguf_amx.cpp`), float16 linears
on AMX-BF16 tiles (`cpu_f16_amx_gemm.cpp`), Punica's LoRA shrink and expand (`cpu_lora_punica.cpp`) and the loop that runs a decode step's layers in one call
(`cpu_decode_layers.cpp`); all register under `torch.ops.minivllm_cpu`, so one build and one load
serve them all.
The library is built once per instruction-set level it has code for (minivllm/cpu/isa.py: a
generic build, AVX2+FMA, AVX-512), each with that level's flags and never the build machine's
(`-march=native`), and a process loads the one of its level, so that an AVX-512 machine never
hands its build to an AVX2 CPU and can build and test the AVX2 one itself.
`torch.utils.cpp_extension.load` compiles them with the system compiler and `ninja`, the way vLLM
builds its CPU kernels ahead of time. Doing it at first use keeps `pip install` free of a compiler
step, at the price of three things this module takes care of:

- **A user sees what happens.** One line when a compile really starts (it takes about a minute on
  2 idle cores), and on failure one line saying why; `get_attention_backend("auto")` then adds that the pure-PyTorch
  reference backend is used instead. Later processes load the built library directly: no
  compiler, no ninja, no lock.
- **A failure is remembered.** The reason and the compiler's whole output go to a marker file in
  the build folder, keyed by the compiler and ninja found (torch's version and a digest of the
  sources are in the folder's name). Later processes read the marker instead of failing again at
  length; deleting it retries, and so does a new compiler.
- **A killed build holds nothing.** torch's own lock is a plain `lock` file it waits on forever, so
  a build killed half-way (SIGKILL, the OOM killer) would make every later process hang. Builds
  here run under an `flock`, which the kernel releases when its process dies: whoever holds it
  knows any `lock` file left in the folder is stale, and removes it. Waiting for a live build is
  bounded by `LOCK_TIMEOUT_S`.

Where it all lives: `$MINIVLLM_CACHE/torch_extensions/` (see `minivllm/envs.py`). Every op's Python
wrapper is in `ops.py`; docs/concepts/attention-kernels.md explains the build.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import itertools
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from minivllm.cpu import precompiled_header
from minivllm.cpu.isa import (
    ENV_VAR,
    Build,
    CpuIsaUnsupported,
    IsaLevel,
    level_named,
    lower_builds,
    selected_level,
)
from minivllm.envs import cache_root
from minivllm.exceptions import CpuKernelUnavailable

logger = logging.getLogger("minivllm")

EXTENSION_NAME = "minivllm_cpu_kernels"  # the library; its ops register as torch.ops.minivllm_cpu
# The library's sources: cpu_attention.cpp defines the op namespace (TORCH_LIBRARY), the layer ops
# add to it (TORCH_LIBRARY_FRAGMENT).
SOURCES = tuple(
    Path(__file__).with_name("csrc") / name
    for name in (
        "cpu_attention.cpp",
        "cpu_attention_avx512.cpp",
        "cpu_attention_avx2.cpp",
        "cpu_encoder_attention.cpp",
        "cpu_layernorm.cpp",
        "cpu_activation_rope.cpp",
        "cpu_skinny_gemm.cpp",
        "cpu_gguf_gemm.cpp",
        "cpu_gguf_gemm_avx2.cpp",
        "cpu_gguf_gemm_bf16.cpp",
        "cpu_gguf_amx.cpp",
        "cpu_f16_amx_gemm.cpp",
        "cpu_decode_layers.cpp",
        "cpu_lora_punica.cpp",
    )
)
# included by the sources (the attention loops, the GGUF linears)
HEADERS = tuple(
    Path(__file__).with_name("csrc") / name
    for name in (
        "cpu_amx_tiles.h",
        "cpu_attention_prefetch.h",
        "cpu_attention_entry.h",
        "cpu_gguf_blocks.h",
        "cpu_gguf_sum16.h",
        "cpu_gguf_kquant_avx2.h",
        "cpu_gguf_kfloat_avx2.h",
        "cpu_gguf_krows_avx2.h",
        "cpu_gguf_xq_avx2.h",
        "cpu_gguf_tile_avx2.h",
        "cpu_gguf_block32_avx2.h",
        "cpu_gguf_rows32_avx2.h",
        "cpu_gguf_amx32.h",
        "cpu_gguf_q8_0_vnni.h",
        "torch_headers.h",  # precompiled once per build (precompiled_header.py)
    )
)
LDFLAGS = ("-lm", "-fopenmp")
# How long a process waits for another one to finish compiling (a build takes about a minute on 2
# idle cores, several on a loaded machine). A process that died while building holds nothing to wait for.
LOCK_TIMEOUT_S = 600.0
BUILT_STAMP = "built.txt"  # holds the library's file name; written once it has built and loaded


def code_cflags(build: Build) -> list[str]:
    """The flags that make one build's code: its instruction sets, never `-march=native`, so that
    a library built here runs on any CPU of its level (a cache folder may be shared by machines)."""
    return ["-O3", "-ffast-math", "-fopenmp", *build.cflags]


def cflags(build: Build) -> list[str]:
    """Each source's flags: the build's code flags, then the precompiled torch headers'."""
    return [*code_cflags(build), *precompiled_header.USE_FLAGS]


def kernel_build_dir(build: Build) -> Path:
    """The build folder: one per build (instruction-set level), torch version, and set of sources
    with their flags.

    A home folder shared by several machines never hands an AVX-512 build to an AVX2 CPU, and a
    new minivllm (a change to any of `SOURCES`) builds into a folder of its own, with no
    remembered failure of the old sources.
    """
    digest = hashlib.sha256()
    # each file's name too: moving code between files is a change
    for source in (*SOURCES, *HEADERS):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    digest.update(repr((cflags(build), LDFLAGS)).encode())
    name = f"cpu_kernels-{build.name}-torch{torch.__version__}-{digest.hexdigest()[:10]}"
    return cache_root() / "torch_extensions" / name


# ---------------------------------------------------------------------------------- toolchain
def _ninja_wheel_dir() -> str | None:
    """The ninja wheel's binary folder when `ninja` is not on PATH: the wheel installs it next to
    the interpreter, which is not on PATH when a virtual environment is used without activating it."""
    if shutil.which("ninja") is not None:
        return None
    try:
        import ninja
    except ImportError:
        return None
    return str(ninja.BIN_DIR)


@contextlib.contextmanager
def ninja_on_path() -> Iterator[None]:
    """torch runs `ninja` from PATH: put the wheel's binary there for the build only, and give the
    process its PATH back afterwards, whatever happens."""
    extra = _ninja_wheel_dir()
    if extra is None:
        yield
        return
    saved = os.environ.get("PATH")
    os.environ["PATH"] = extra + os.pathsep + (saved or "")
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = saved


def toolchain_key() -> str:
    """Which C++ compiler and ninja a build would run (torch's choice: `$CXX`, else `c++`), as
    path, size and mtime of each: a remembered failure holds for this toolchain only, so
    installing or upgrading either one retries the build."""
    found = []
    for tool, search_path in ((os.environ.get("CXX", "c++"), None), ("ninja", _ninja_wheel_dir())):
        where = shutil.which(tool, path=search_path)
        if where is None:
            found.append(f"{tool}: missing")
        else:
            real = os.path.realpath(where)
            st = os.stat(real)
            found.append(f"{real}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(found).encode()).hexdigest()[:10]


def failure_marker(build_dir: Path) -> Path:
    return build_dir / f"build-failed-{toolchain_key()}.txt"


# ---------------------------------------------------------------------------------- building
def _write_atomically(path: Path, text: str) -> None:
    """A reader sees the old file or the whole new one, even if this process dies meanwhile."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _summary(exc: BaseException) -> str:
    """One line out of torch's build error, which carries ninja's whole log: the compiler's first
    error line where there is one (the marker file keeps everything)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    # torch's first line runs on into ninja's: "Error building extension 'x': [1/2] c++ -MMD ..."
    head = lines[0].split(": [", 1)[0] if lines else ""
    errors = [
        line
        for line in lines[1:]
        if re.search(r"\berror\b|not found|no such file", line, re.IGNORECASE)
        and not line.startswith(("[", "FAILED"))
    ]
    text = f"{head}: {errors[0]}" if errors else head
    return (text or type(exc).__name__)[:300]


def _remembered_failure(marker: Path) -> CpuKernelUnavailable | None:
    if not marker.is_file():
        return None
    reason = marker.read_text().partition("\n")[0]
    return CpuKernelUnavailable(
        f"the CPU kernels failed to build before with this compiler and torch ({reason}); "
        f"not retrying: delete {marker} to retry"
    )


@contextlib.contextmanager
def build_lock(build_dir: Path, timeout_s: float) -> Iterator[None]:
    """Hold `build.lock` in `build_dir` while building: one process compiles, the others wait.

    An `flock` belongs to the open file, so the operating system drops it when the process dies,
    however it dies. A process that holds it therefore knows that torch's own baton (`lock`, a
    plain file that outlives its process and that torch would wait on forever) is stale.
    """
    try:  # POSIX only; imported here so that importing this module works everywhere
        import fcntl
    except ImportError as exc:  # Windows: the kernels' flags are GCC/Clang ones anyway
        raise CpuKernelUnavailable("the CPU kernels build on Linux and macOS") from exc

    with open(build_dir / "build.lock", "a") as handle:  # closing it releases the lock
        deadline = time.monotonic() + timeout_s
        for attempt in itertools.count():
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise CpuKernelUnavailable(
                        f"another process has been compiling the CPU kernels for over "
                        f"{timeout_s:.0f} s (it holds {handle.name}); not waiting longer"
                    ) from None
            if attempt == 0:
                logger.warning(
                    "another process is compiling the CPU kernels; waiting for it (at most %.0f s)",
                    timeout_s,
                )
            time.sleep(0.25)
        (build_dir / "lock").unlink(missing_ok=True)  # torch's baton, left by a killed build
        yield


class _LinesHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} (torch): {record.getMessage()}")


@contextlib.contextmanager
def torch_build_log() -> Iterator[list[str]]:
    """Collect torch's build log lines (compiler warnings) for the failure marker instead of
    printing them: the user gets one line, the marker gets everything."""
    torch_logger = logging.getLogger("torch.utils.cpp_extension")
    handler, propagate = _LinesHandler(), torch_logger.propagate
    torch_logger.addHandler(handler)
    torch_logger.propagate = False
    try:
        yield handler.lines
    finally:
        torch_logger.removeHandler(handler)
        torch_logger.propagate = propagate


def compile_kernel(build_dir: Path, build: Build) -> str:
    """Precompile torch's headers into `build_dir`, then run torch's build (`ninja`, then the C++
    compiler) there and load the library; returns the library's file name."""
    from torch.utils.cpp_extension import load

    precompiled_header.precompile(build_dir, EXTENSION_NAME, code_cflags(build))
    try:
        with ninja_on_path():
            library = load(
                name=EXTENSION_NAME,
                sources=[str(source) for source in SOURCES],
                extra_cflags=cflags(build),
                extra_ldflags=list(LDFLAGS),  # a copy: torch appends its own libraries to it
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
    finally:
        precompiled_header.remove(build_dir)
    return Path(str(library)).name


def _build(build_dir: Path, build: Build) -> None:
    """Compile the library into `build_dir` unless it is built or failed before; at most one
    process of the machine compiles at a time."""
    marker = failure_marker(build_dir)
    if failure := _remembered_failure(marker):
        raise failure
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CpuKernelUnavailable(
            f"cannot create {build_dir} to build the CPU kernels ({exc}); "
            "set MINIVLLM_CACHE to a writable folder"
        ) from exc
    with build_lock(build_dir, LOCK_TIMEOUT_S):
        if (build_dir / BUILT_STAMP).is_file():  # built by the process this one waited for
            return
        if failure := _remembered_failure(marker):
            raise failure
        logger.warning(
            "compiling minivllm's CPU kernels for %s (once per machine, about a minute) into %s",
            build.name,
            build_dir,
        )
        try:
            with torch_build_log() as torch_lines:
                library = compile_kernel(build_dir, build)
        except Exception as exc:  # a missing compiler or ninja, a compile error, a bad library
            reason = _summary(exc)
            _write_atomically(marker, "\n\n".join([reason, str(exc), *torch_lines]) + "\n")
            raise CpuKernelUnavailable(
                f"could not build the CPU kernels ({reason}); it needs a C++ compiler "
                f"and ninja. Full compiler output: {marker} (delete it to retry)"
            ) from exc
        _write_atomically(build_dir / BUILT_STAMP, library)


def _load_library(path: Path) -> None:
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as exc:
        raise CpuKernelUnavailable(
            f"cannot load the compiled CPU kernels {path} ({exc}); delete {path.parent} "
            "to rebuild it"
        ) from exc


_loaded: list[IsaLevel] = []  # the level whose library this process loaded (at most one)


@functools.cache
def load_cpu_kernels() -> None:
    """Load the library of `SOURCES` for this process's instruction-set level (`selected_level`:
    `MINIVLLM_CPU_ISA`, else the best the CPU has), building it first if this machine never has;
    registers `torch.ops.minivllm_cpu` (paged_decode and the layer ops). Raises
    `CpuKernelUnavailable` (one line) where it cannot, or where the level is `reference`, and
    `CpuIsaUnsupported` where `MINIVLLM_CPU_ISA` names a level this CPU cannot execute.

    One library a process: every build registers the same ops, so the level is fixed by the first
    load, and a later change of `MINIVLLM_CPU_ISA` is refused rather than silently ignored."""
    level = selected_level()
    if level.build is None:
        raise CpuKernelUnavailable(
            f"{ENV_VAR}=reference: the compiled CPU kernels are off, the plain-PyTorch "
            "reference runs everywhere"
        )
    build_dir = kernel_build_dir(level.build)
    stamp = build_dir / BUILT_STAMP
    if not stamp.is_file():
        _build(build_dir, level.build)
    _load_library(build_dir / stamp.read_text().strip())
    _loaded.append(level)


def loaded_level() -> IsaLevel:
    """The instruction-set level of the library this process runs (loading it if needed)."""
    load_cpu_kernels()
    level = selected_level()
    if level.build != _loaded[0].build:
        raise CpuIsaUnsupported(
            f"{ENV_VAR}={level.name}, but this process already runs the {_loaded[0].name} "
            "library; the level is chosen once per process, before the first model loads"
        )
    return level


def main(argv: list[str] | None = None) -> None:
    """`python -m minivllm.cpu.build [LEVEL ...]`: compile the library of each level now (default:
    the level this process would run and every lower one `make test` runs the kernel tests at),
    each in a process of its own, since a process loads one library, and all at once: a build's
    compiles wait on its precompiled header and its longest source, and the others' fill the
    cores meanwhile. `make install` compiles the selected level while pip installs the rest, and
    under `make test` every level, so that no test waits for a compiler."""
    parser = argparse.ArgumentParser(prog="python -m minivllm.cpu.build", description=main.__doc__)
    parser.add_argument("levels", nargs="*", help="level names (minivllm/cpu/isa.py)")
    parser.add_argument(
        "--selected-only", action="store_true", help="only the level this process would run"
    )
    args = parser.parse_args(argv)
    levels = [level_named(n) for n in args.levels] or [selected_level()]
    if not args.levels and not args.selected_only:
        levels += lower_builds()
    code = "from minivllm.cpu.build import load_cpu_kernels; load_cpu_kernels()"
    builds = {
        level.name: subprocess.Popen(
            [sys.executable, "-c", code], env={**os.environ, ENV_VAR: level.name}
        )
        for level in levels
        if level.build is not None
    }
    for name, process in builds.items():
        if process.wait() != 0:  # the failure is remembered; the tests fall back and say why
            print(f"the CPU kernels for {name} did not build; see the lines above")


if __name__ == "__main__":
    main()
