"""Helpers for the tensor-parallel tests: no process outlives a test, pass or fail.

`no_leftover_processes` is the body of an autouse fixture: it lists this process's descendants
before the test and, after it, waits a little for any new one to go, then kills what is left and
fails the test. Processes that a test starts *through a subprocess* (a script's workers, a
server's workers) are no longer our descendants once that subprocess has exited, so such tests
collect their pids while they run and check them with `assert_gone`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"

GRACE_S = 15.0  # how long a stopped worker may take to disappear (a loaded 2-core machine)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _is_resource_tracker(proc: psutil.Process) -> bool:
    """multiprocessing's resource tracker: one per interpreter that ever spawned, by design."""
    try:
        return "resource_tracker" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def live_descendants() -> dict[int, psutil.Process]:
    me = psutil.Process()
    return {
        p.pid: p for p in me.children(recursive=True) if _alive(p) and not _is_resource_tracker(p)
    }


def assert_gone(procs: Iterable[psutil.Process], what: str) -> None:
    """Every process in `procs` ends within GRACE_S; one that does not is killed, and fails."""
    deadline = time.monotonic() + GRACE_S
    left = [p for p in procs if _alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if _alive(p)]
    for p in left:
        p.kill()
    assert not left, f"{what}: processes left behind: {[p.pid for p in left]}"


def no_leftover_processes() -> Iterator[None]:
    before = set(live_descendants())
    yield
    new = [p for pid, p in live_descendants().items() if pid not in before]
    assert_gone(new, "after the test")


# ---------------------------------------------------------------------------------- rank probes
# `collective_rpc` functions: they run on every rank, so they live in a module a spawned worker
# imports cheaply (by name, from tests/ on its sys.path).
def kv_blocks(runner, blocks: list[int]):  # -> [layers, 2, len(blocks), block_size, kv_heads, D]
    """This rank's K/V of `blocks`."""
    return runner.kv_cache[:, :, blocks].clone()


def lora_ids(runner) -> list[int]:
    """The adapters this rank holds in host memory (its LoRA manager's LRU)."""
    return runner.lora_manager.list_loras()


def fail_on_rank_one(runner) -> int:
    """Raise on rank 1 only: a worker that raises while the driver waits for it."""
    if runner.model.tp.rank == 1:
        raise ValueError("rank one is broken")
    return runner.model.tp.rank


def torchrun_tokens(script: Path, model: Path) -> list[list[int]]:
    """Run `script MODEL` under `torchrun --standalone --nproc-per-node 2` in its own process group
    (so that a failure stops torchrun and its ranks together) and return the token ids of each
    line it prints as `tokens ID ID ...`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(script), str(model)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stdout + stderr[-4000:]
    return [
        [int(t) for t in line.split()[1:]]
        for line in stdout.splitlines()
        if line.startswith("tokens")
    ]
