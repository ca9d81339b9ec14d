"""A zygote for running scripts as a reader would, minus the imports: one Python process imports
torch, transformers, matplotlib and minivllm's engine once, then forks a child per script, which runs it as
`__main__` (`runpy.run_path`) with the script's folder as `sys.path[0]`, its own argv, cwd, stdout and
stderr, and exits as `python SCRIPT ARGS` would: an uncaught exception prints its traceback and
exits 1, atexit handlers run. The children share nothing but the parent's imported modules, so
a script that forgets an import still fails (its globals are fresh). Scripts that spawn processes
which re-import them (tutorials 08 and 16) run in a fresh interpreter instead: an object of the
script's classes that came back pickled from such a process was looked up in the zygote's own
`__main__` and not found.

The tutorial tests run 16 scripts; each fresh interpreter spent seconds importing the same
libraries before its first line (tests/test_tutorials.py).

Protocol, one JSON object a line: the parent writes {"argv", "cwd", "stdout", "stderr"} (the last
two are file paths); the zygote answers {"pid"} at the fork and {"returncode"} when the child ends
(-N: killed by signal N, as subprocess reports it).

Run as `python tests/utils/zygote.py` (a script, so that `sys.path[0]` is not the checkout)."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

PRELOAD = (
    "torch",
    "transformers",
    "matplotlib.pyplot",
    "tokenizers",
    "gguf",
    "PIL.Image",
    "minivllm.llm",
)


def _run_child(request: dict) -> None:
    """In the forked child: become `python argv...` and never return to the zygote's loop."""
    os.chdir(request["cwd"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.close(devnull)
    script = os.path.abspath(request["argv"][0])
    sys.argv = [script, *request["argv"][1:]]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")
    raise SystemExit(0)


def serve(commands: IO[str], replies: IO[str]) -> None:
    for line in commands:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(request)  # exits through SystemExit or an uncaught exception
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        returncode = os.waitstatus_to_exitcode(status)
        replies.write(json.dumps({"returncode": returncode}) + "\n")
        replies.flush()


class Zygote:
    """The parent's handle: `run(argv, cwd, env, timeout)` -> (returncode, stdout, stderr), as
    `subprocess.run(capture_output=True, text=True)` would give them."""

    def __init__(self, env: dict[str, str], scratch: Path) -> None:
        self.scratch = scratch
        self.process = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        self.count = 0

    def run(self, argv: list[str], cwd: Path, timeout: float) -> tuple[int, str, str]:
        assert self.process.stdin and self.process.stdout
        self.count += 1
        out = self.scratch / f"run{self.count}.stdout"
        err = self.scratch / f"run{self.count}.stderr"
        request = {"argv": argv, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        pid = json.loads(self.process.stdout.readline())["pid"]
        answer: list[str] = []
        reader = threading.Thread(target=lambda: answer.append(self.process.stdout.readline()))  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout)
        if reader.is_alive():
            os.kill(pid, 9)
            reader.join()
            raise subprocess.TimeoutExpired(argv, timeout)
        returncode = json.loads(answer[0])["returncode"]
        return returncode, out.read_text(errors="replace"), err.read_text(errors="replace")

    def close(self) -> None:
        if self.process.stdin:
            self.process.stdin.close()
        self.process.wait(timeout=60)


def main() -> None:
    for name in PRELOAD:
        __import__(name)
    # A fork copies only the forking thread: a Python thread started by a library would leave
    # its child with a lock nobody releases. None of the preloaded ones starts one; this keeps it
    # so. (numpy's OpenBLAS may start native workers when more than one thread is allowed; it
    # stops and restarts them around a fork itself.)
    assert threading.active_count() == 1, threading.enumerate()
    serve(sys.stdin, sys.stdout)


if __name__ == "__main__":
    main()
