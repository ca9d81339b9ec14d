"""A server a bench starts, loads and stops: llama.cpp's `llama-server` (llama_cpp.py) or minivllm's
own `minivllm serve` (benchmarks/llama_cpp_1b.py), each a process on a free loopback port.

`with Server(...) as s:` starts the command in a process group of its own (so that Ctrl-C reaches
the bench, which stops it), waits until its health route answers 200, and on the way out of the
block (return, error or Ctrl-C alike) stops the group: SIGTERM, then SIGKILL 10 s later, reaped
either way. On Linux the server also dies with the bench (`PR_SET_PDEATHSIG`), should the bench
itself be killed. A server that exits before it is healthy is an error that quotes the end of its
log; its peak resident set (VmHWM) can be read while it runs. `wait_until_healthy` is that wait on
its own, for a bench or test that starts its server another way.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from minivllm.benchmarks.isolated import peak_rss_bytes_of, rss_bytes_of


def _die_with_parent() -> None:
    """Run in the child before exec (Linux): SIGTERM it when the bench's process ends, so that a
    killed bench leaves no server behind."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def wait_until_healthy(
    url: str,
    process: subprocess.Popen[bytes],
    timeout_s: float,
    *,
    name: str = "the server",
    details: str | Callable[[], str] = "",
) -> float:
    """Seconds until `url` (a health route) answers 200 (llama-server's: 503 while the model loads).
    A RuntimeError if `process` exits first or `timeout_s` passes; its message ends with `details`
    (where the server's log is), or what `details()` gives then (the log's end)."""

    def error(what: str) -> RuntimeError:
        return RuntimeError(f"{name} {what}{details() if callable(details) else details}")

    began = time.perf_counter()
    while time.perf_counter() - began < timeout_s:
        if process.poll() is not None:
            raise error(f"exited ({process.returncode}) before it was ready")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return time.perf_counter() - began
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.1)
    raise error(f"not healthy after {timeout_s:.0f} s")


@dataclass(kw_only=True)
class ServerProcess:
    """One server process; a subclass says how to start it (`command`, `env`)."""

    name: str = "server"  # in errors and file names
    health_path: str = "/health"
    startup_timeout_s: float = 300.0
    log_path: Path | None = None  # the server's output; unset: a file in the temp folder
    port: int = field(default=0, init=False)
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str] | None:
        """The server's environment; None: the bench's own."""
        return None

    def cwd(self) -> Path | None:
        """The server's working folder; None: the bench's own."""
        return None

    def __enter__(self) -> ServerProcess:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        with socket.socket() as s:  # a free port; the server binds it a moment later
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        if self.log_path is None:
            self.log_path = Path(tempfile.gettempdir()) / f"{self.name}-{self.port}.log"
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(),
                cwd=self.cwd(),
                start_new_session=True,  # its own group: Ctrl-C reaches the bench, which stops it
                preexec_fn=_die_with_parent,
            )

    def wait_healthy(self) -> float:
        """Seconds until the health route answers 200."""
        assert self.process is not None
        return wait_until_healthy(
            self.url + self.health_path,
            self.process,
            self.startup_timeout_s,
            name=self.name,
            details=lambda: f"; the end of its log ({self.log_path}):\n{self.log_tail()}",
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL if it has not ended 10 s later; reaped either
        way, so no process (not even a zombie) is left."""
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            proc.wait()

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def peak_rss_bytes(self) -> int | None:
        return None if self.process is None else peak_rss_bytes_of(self.process.pid)

    def rss_bytes(self) -> int | None:
        """The resident set now (after loading, the peak may hold what loading alone needed)."""
        return None if self.process is None else rss_bytes_of(self.process.pid)
