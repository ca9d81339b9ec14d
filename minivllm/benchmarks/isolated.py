"""Each system of a comparison in its own fresh process, so that its peak memory is its own.

Within one process the resident set (RSS) hardly ever goes down: freed tensors stay in the
allocator's arenas, so a system run after another inherits its predecessor's peak. `run_isolated`
therefore runs one system per process, started with `spawn` (a fresh interpreter, nothing
inherited from the bench's own memory), and the process reports its own peak RSS: Linux's VmHWM,
the high-water mark of the process's address space, which starts anew at `exec` (unlike
`getrusage`'s `ru_maxrss`, which may carry the parent's peak across fork + exec).

Every system gets the same conditions: a fresh process, the same torch thread count, its model
loaded and warmed up before its timed run; the bench waits for one to end before starting the
next, so no two compete for the cores.
"""

from __future__ import annotations

import multiprocessing
import resource
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def run_isolated(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a new spawned process; its return value (or its exception) comes back."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _status_kib(field: str, pid: int | str = "self") -> int | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # no /proc (macOS), or the process has ended
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])  # "VmHWM:   123456 kB"
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set so far, in bytes."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux KiB


def peak_rss_bytes_of(pid: int) -> int | None:
    """Another process's peak resident set (a peer server's, read before it stops), in bytes;
    None where /proc is not there to read it from."""
    kib = _status_kib("VmHWM", pid)
    return None if kib is None else kib * 1024


def rss_bytes_of(pid: int) -> int | None:
    """Another process's resident set now, in bytes; None where /proc is not there."""
    kib = _status_kib("VmRSS", pid)
    return None if kib is None else kib * 1024


def current_rss_bytes() -> int:
    """This process's resident set now, in bytes (its peak where the current value is unknown)."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else peak_rss_bytes()
