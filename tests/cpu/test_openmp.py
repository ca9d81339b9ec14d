"""minivllm/cpu/openmp.py: a thread gives its OpenMP team back, so that the engine thread's team
is the process's only one (libgomp spins at its barriers only while its threads fit the CPUs)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from minivllm.cpu.openmp import libgomp, release_thread_team

needs_libgomp = pytest.mark.skipif(libgomp() is None, reason="PyTorch runs on another OpenMP")


def num_os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@needs_libgomp
def test_release_thread_team_frees_the_workers_and_holds_the_thread_to_one() -> None:
    """A thread that ran a parallel region at 2 threads keeps a worker; released, the worker is
    gone, the thread runs its next region alone, and other threads keep their own counts."""
    seen: dict[str, object] = {}

    def owner() -> None:
        torch.set_num_threads(2)  # this thread's count (libgomp's ICVs are per thread)
        x = torch.ones(1 << 22)  # big enough for ATen's parallel_for to use both threads
        (x + 1).sum()
        seen["with team"] = num_os_threads()
        seen["released"] = release_thread_team()
        seen["after"] = num_os_threads()
        (x + 1).sum()
        seen["after a region"] = num_os_threads()
        seen["threads"] = torch.get_num_threads()

    before = torch.get_num_threads()
    t = threading.Thread(target=owner)
    try:
        t.start()
        t.join()
    finally:
        torch.set_num_threads(before)
    assert seen["released"] is True
    assert seen["after"] == seen["with team"] - 1, seen  # the one worker of a 2-thread team
    assert seen["after a region"] == seen["after"], seen  # no team comes back
    assert seen["threads"] == 1
    assert torch.get_num_threads() == before  # the test's own thread was not touched
