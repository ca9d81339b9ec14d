"""Helpers for the tensor-parallel tests: no process outlives a test, pass or fail.

`no_leftover_processes` is the body of an autouse fixture: it lists this process's descendants
before the test and, after it, waits a little for any new one to go, then kills what is left and
fails the test. Processes that a test starts *through a subprocess* (a script's workers, a
server's workers) are no longer our descendants once that subprocess has exited, so such tests
collect their pids while they run and check them with `assert_gone`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from minivllm.distributed.process_group import free_loopback_port
from minivllm.model.pipeline import is_missing

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


def stage_parts(runner) -> dict[str, object]:
    """What this rank's pipeline stage holds of the model: the decoder layers by index, and
    whether it has the embedding, the final norm and the LM head."""
    model = runner.model
    return {
        "layers": [i for i, layer in enumerate(model.model.layers) if not is_missing(layer)],
        "embed": not is_missing(model.model.embed_tokens),
        "norm": not is_missing(model.model.norm),
        "lm_head": not is_missing(model.lm_head),
    }


def torchrun_launches(nnodes: int, nproc: int) -> list[list[str]]:
    """torchrun's flags for each invocation. One node: `--standalone --nproc-per-node NPROC`.
    Several: one `--nnodes N --node-rank R --nproc-per-node 1 --master-addr 127.0.0.1
    --master-port P` invocation per node, as on N machines, meeting at torchrun's static
    rendezvous on loopback; node 0 last, since the others wait for it."""
    if nnodes == 1:
        return [["--standalone", "--nproc-per-node", str(nproc)]]
    port = free_loopback_port()
    return [
        [
            *("--nnodes", str(nnodes), "--node-rank", str(r), "--nproc-per-node", "1"),
            *("--master-addr", "127.0.0.1", "--master-port", str(port)),
        ]
        for r in reversed(range(nnodes))
    ]


def start_torchrun(launch: list[str], argv: list[str], **popen: Any) -> subprocess.Popen[str]:
    """`torchrun LAUNCH ARGV...` in a process group of its own, so that a failure stops torchrun
    and its ranks together."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        [str(TORCHRUN), *launch, *argv], text=True, env=env, start_new_session=True, **popen
    )


def descendants(proc: subprocess.Popen[str]) -> dict[int, psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return {c.pid: c for c in psutil.Process(proc.pid).children(recursive=True)}
    return {}


def torchrun_stdout(script: Path, args: list[str], nnodes: int = 1, nproc: int = 2) -> str:
    """Run `script ARGS...` under torchrun (`torchrun_launches`) and return what node 0 printed;
    every invocation must succeed, and every process they started, ranks included, must be gone
    when they are."""
    argv = [str(script), *args]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    procs = [start_torchrun(launch, argv, **pipes) for launch in torchrun_launches(nnodes, nproc)]
    started: dict[int, psutil.Process] = {}
    outputs: dict[int, tuple[str, str]] = {}
    try:
        deadline = time.monotonic() + 300
        while len(outputs) < len(procs) and time.monotonic() < deadline:
            for i, proc in enumerate(procs):
                if i in outputs:
                    continue
                started |= descendants(proc)
                with contextlib.suppress(subprocess.TimeoutExpired):  # retried: no output lost
                    outputs[i] = proc.communicate(timeout=0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for i, proc in enumerate(procs):
        stdout, stderr = outputs.get(i, ("", "(timed out)"))
        assert proc.returncode == 0, stdout + stderr[-4000:]
    assert_gone(started.values(), "after torchrun")
    return outputs[len(procs) - 1][0]  # node 0's: rank 0 prints


@contextlib.contextmanager
def torchrun_nodes(argv: list[str], nnodes: int, logs: Path) -> Iterator[list[TorchrunNode]]:
    """`torchrun ARGV...` over `nnodes` loopback nodes (`torchrun_launches`), left running for the
    caller (a server on node 0, say) and given node 0 first, each with its one rank's process
    once it has started it; their output goes to `logs`/node{R}.log. At the end, whatever is left
    of each invocation is killed, and every process it started must be gone."""
    launches = torchrun_launches(nnodes, 1)
    files = [(logs / f"node{nnodes - 1 - i}.log").open("w") for i in range(nnodes)]
    procs = [
        start_torchrun(launch, argv, stdout=f, stderr=subprocess.STDOUT)
        for launch, f in zip(launches, files)
    ]
    nodes = [TorchrunNode(p, logs / f"node{nnodes - 1 - i}.log") for i, p in enumerate(procs)]
    try:
        yield nodes[::-1]
    finally:
        started = {pid: p for node in nodes for pid, p in node.started.items()}
        for proc in procs:
            started |= descendants(proc)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for f in files:
            f.close()
        assert_gone(started.values(), "after torchrun")


@dataclass
class TorchrunNode:
    """One `torchrun` invocation of `torchrun_nodes`: the agent and its one rank's process."""

    agent: subprocess.Popen[str]
    log: Path
    started: dict[int, psutil.Process] = field(default_factory=dict)  # every process seen

    def rank_process(self, timeout_s: float = 120.0) -> psutil.Process:
        """The process torchrun started for its rank (waited for)."""
        deadline = time.monotonic() + timeout_s
        while not (children := psutil.Process(self.agent.pid).children()):
            assert self.agent.poll() is None, self.log.read_text()[-4000:]
            assert time.monotonic() < deadline, "torchrun started no rank"
            time.sleep(0.05)
        self.started |= descendants(self.agent)
        return children[0]
