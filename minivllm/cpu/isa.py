"""Instruction-set levels of the CPU library, and the one this process runs.

The compiled kernels (minivllm/cpu/*.cpp) have loops for several x86 instruction sets. Which ones
a CPU may execute is a fact of the user's machine, not of the machine that wrote the code: an AMD
EPYC before Zen 4, and most Intel laptops, have AVX2 and FMA but no AVX-512. So, as llama.cpp's
CPU backend builds one variant per level and loads the best the running CPU has (its `score`), and
as PyTorch compiles its own kernels per level and dispatches on CPUID, the library here is built
once per *build* it has code for (`Build`), and each process picks a *level* (`IsaLevel`) at load:

| level | build | the CPU needs | what runs |
|---|---|---|---|
| `reference` | none | nothing | no compiled code: the plain-PyTorch specification everywhere |
| `generic` | `generic` | nothing | the portable C++ loops, the compiler's baseline (NEON on aarch64) |
| `avx2` | `avx2` | AVX2, FMA, F16C (x86-64-v3) | AVX2 loops; GGUF products on int8 dots |
| `avx512` | `avx512` | AVX-512 F/BW/VL/DQ (x86-64-v4) | AVX-512 loops |
| `avx512_bf16` | `avx512` | and AVX512-BF16 | the same build, with the bf16 GGUF dot allowed |

The best level the CPU has is the default. `MINIVLLM_CPU_ISA=<level>` forces one: a lower level is
how an AVX-512 machine runs, and tests, the code an AVX2 machine runs; a level the CPU lacks is
refused by name (`CpuIsaUnsupported`), never a crash on an illegal instruction. Only the chosen
build is compiled, on first use (minivllm/cpu/build.py).

To run as an AVX2 machine would in every respect, PyTorch's own kernels and oneDNN's can be held
to the same level: `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` (read by PyTorch and oneDNN
when they start, so they go in the environment, not here); `make test` does so for its AVX2 pass.

It imports no other module of the package.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

ENV_VAR = "MINIVLLM_CPU_ISA"


class CpuIsaUnsupported(ValueError):
    """`MINIVLLM_CPU_ISA` names an unknown level, or one this CPU cannot execute."""


@dataclass(frozen=True)
class Build:
    """One way of compiling the library: its name (in the build folder's) and compiler flags."""

    name: str
    cflags: tuple[str, ...]  # instruction-set flags only; build.py adds -O3 and the rest


GENERIC = Build("generic", ())
AVX2 = Build("avx2", ("-mavx2", "-mfma", "-mf16c", "-mbmi2"))
AVX512 = Build(
    "avx512",
    (*AVX2.cflags, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
)


@dataclass(frozen=True)
class IsaLevel:
    name: str
    build: Build | None  # None: no compiled library (the reference level)
    requires: tuple[str, ...]  # CPU feature flags, as Linux's /proc/cpuinfo names them
    bf16_dot: bool = False  # whether the GGUF linears may use AVX512-BF16 dot products
    # PyTorch's and oneDNN's own names for the level, to hold their kernels to it too
    # (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA); None: leave them at the CPU's best
    aten_capability: str | None = None
    onednn_isa: str | None = None

    def environment(self) -> dict[str, str]:
        """The variables that make a process run at this level, PyTorch and oneDNN included."""
        env = {ENV_VAR: self.name}
        if self.aten_capability:
            env["ATEN_CPU_CAPABILITY"] = self.aten_capability
        if self.onednn_isa:
            env["ONEDNN_MAX_CPU_ISA"] = self.onednn_isa
        return env


# Lowest first: a level's `requires` include every lower x86 level's.
LEVELS: tuple[IsaLevel, ...] = (
    IsaLevel("reference", None, ()),
    IsaLevel("generic", GENERIC, (), aten_capability="default", onednn_isa="SSE41"),
    IsaLevel("avx2", AVX2, ("avx2", "fma", "f16c"), aten_capability="avx2", onednn_isa="AVX2"),
    IsaLevel(
        "avx512",
        AVX512,
        ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
        aten_capability="avx512",
        onednn_isa="AVX512_CORE",
    ),
    IsaLevel(
        "avx512_bf16",
        AVX512,
        ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
        bf16_dot=True,
    ),
)
LEVEL_NAMES = tuple(level.name for level in LEVELS)


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@functools.cache
def cpu_features() -> frozenset[str]:
    """The running CPU's feature flags that the levels ask about (CPUID, as the kernel reports
    it in /proc/cpuinfo; elsewhere PyTorch's own cpuinfo checks, which name fewer of them)."""
    if not is_x86():
        return frozenset()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    found = set()
    if torch.cpu._is_avx2_supported():
        found |= {"avx2", "fma", "f16c"}
    if torch.cpu._is_avx512_supported():
        found |= {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    if torch.cpu._is_avx512_bf16_supported():
        found.add("avx512_bf16")
    return frozenset(found)


def level_named(name: str) -> IsaLevel:
    for level in LEVELS:
        if level.name == name:
            return level
    raise CpuIsaUnsupported(f"{ENV_VAR} must be one of {', '.join(LEVEL_NAMES)}, got {name!r}")


def supported_levels() -> tuple[IsaLevel, ...]:
    """The levels this CPU can execute, lowest first (reference and generic everywhere)."""
    have = cpu_features()
    return tuple(level for level in LEVELS if all(flag in have for flag in level.requires))


def best_level() -> IsaLevel:
    return supported_levels()[-1]


def selected_level() -> IsaLevel:
    """`$MINIVLLM_CPU_ISA` if set (refused when unknown or beyond this CPU), else the best level.
    Read on every call; the library a process has loaded stays the one it loaded first."""
    name = os.environ.get(ENV_VAR, "").strip().lower()
    if not name or name == "auto":
        return best_level()
    level = level_named(name)
    if level not in supported_levels():
        missing = [flag for flag in level.requires if flag not in cpu_features()]
        raise CpuIsaUnsupported(
            f"{ENV_VAR}={name}, but this CPU lacks {', '.join(missing)}; it can run "
            f"{', '.join(level.name for level in supported_levels())}"
        )
    return level


def lower_builds() -> tuple[IsaLevel, ...]:
    """The levels below the best one that run a build of their own on this CPU (the reference
    level excepted): what `make test` runs the `cpu_isa` tests at again."""
    best = best_level()
    seen = {best.build}
    lower = []
    for level in reversed(supported_levels()):
        if level.build is not None and level.build not in seen:
            seen.add(level.build)
            lower.append(level)
    return tuple(lower)


def main(argv: list[str] | None = None) -> None:
    """`python -m minivllm.cpu.isa`: this CPU's levels and the one a process would run;
    `--test-passes`: one line of environment assignments per lower build (for `make test`)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m minivllm.cpu.isa", description=main.__doc__)
    parser.add_argument("--test-passes", action="store_true")
    args = parser.parse_args(argv)
    if args.test_passes:
        for level in lower_builds():
            print(" ".join(f"{k}={v}" for k, v in level.environment().items()))
        return
    supported = supported_levels()
    chosen = selected_level()
    for level in LEVELS:
        mark = "*" if level == chosen else " "
        state = "yes" if level in supported else "no "
        build = level.build.name if level.build else "(no library)"
        print(f"{mark} {level.name:<12} {state}  build: {build}")
    print(f"{ENV_VAR}={os.environ.get(ENV_VAR, '')!s} -> {chosen.name}")


if __name__ == "__main__":
    main()
