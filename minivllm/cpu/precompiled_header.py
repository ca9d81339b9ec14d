"""A precompiled header for the CPU library's build: torch's headers parsed once per build.

Every source of the library (minivllm/cpu/build.py `SOURCES`) includes torch's headers
(`torch/library.h`, `ATen/core/Tensor.h`, ...), and parsing them is most of what compiling a
source costs; the library is compiled once per instruction-set level, so a machine that builds
three levels parsed them some forty times. GCC can save a parsed header and load it instead: a
`<header>.gch` beside the header, used by every compile that includes the header first with the
same flags (GCC's manual, "Using Precompiled Headers"). torch does the same for
`torch/extension.h` in `load_inline(use_pch=True)`, in torch's own folder; here it is built into
each build folder, from `csrc/torch_headers.h`, before torch's `load` runs ninja there.

A precompiled header changes nothing but speed: where the compiler cannot build it or cannot use
it (flags that differ from the sources', another compiler's format), each source parses
`torch_headers.h` as text, as it would have parsed its own
includes, with a `-Winvalid-pch` warning in the build log. The `.gch` (hundreds of MB) is deleted
once the library is built.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

HEADER = Path(__file__).with_name("csrc") / "torch_headers.h"
# What each source's compile adds to use it: ninja runs in the build folder, and `-include`
# looks there first.
USE_FLAGS = ("-include", HEADER.name, "-Winvalid-pch")
COMMAND_FILE = "torch_headers.cmd"  # the header's compile command, kept beside the library


def torch_cflags(extension_name: str) -> list[str]:
    """The flags torch's `load` puts before the extension's own on each source's compile line
    (torch/utils/cpp_extension.py, `_write_ninja_file_to_build_library`, for a C++ build on
    Linux): a precompiled header is only used by compiles with the same flags."""
    # as build.py's `load`: cpp_extension imports setuptools, which only a build needs
    from torch.utils.cpp_extension import include_paths

    includes = [*include_paths("cpu"), sysconfig.get_path("include", scheme="posix_prefix")]
    return [
        f"-DTORCH_EXTENSION_NAME={extension_name}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(flag for include in includes for flag in ("-isystem", include)),
        "-fPIC",
        "-std=c++20",
    ]


def precompile(build_dir: Path, extension_name: str, cflags: list[str]) -> bool:
    """Copy `HEADER` into `build_dir` and compile it there with the sources' flags (`cflags`:
    the extension's own, without `USE_FLAGS`). Returns whether the `.gch` was built; when not,
    the build goes on parsing the copied header as text."""
    shutil.copyfile(HEADER, build_dir / HEADER.name)
    command = [
        os.environ.get("CXX", "c++"),  # torch's compiler (`get_cxx_compiler`)
        *torch_cflags(extension_name),
        *cflags,
        "-x",
        "c++-header",
        HEADER.name,
        "-o",
        f"{HEADER.name}.gch",
    ]
    (build_dir / COMMAND_FILE).write_text(" ".join(command) + "\n")
    try:
        done = subprocess.run(command, cwd=build_dir, capture_output=True, check=False)
    except OSError:  # no compiler: torch's build says so in its own words
        return False
    return done.returncode == 0


def remove(build_dir: Path) -> None:
    """Delete the `.gch`, which no later process reads: the library is built."""
    (build_dir / f"{HEADER.name}.gch").unlink(missing_ok=True)
