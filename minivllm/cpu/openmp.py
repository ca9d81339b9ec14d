"""One OpenMP team per process: what lets the server's engine thread hand work over in microseconds.

PyTorch's Linux wheels run their parallel loops on GNU OpenMP (libgomp), and the C++ kernels here,
built with `-fopenmp`, share that library. A decode step runs a few hundred parallel regions (a
dozen kernels a layer). Between two of them a worker thread waits at a barrier: libgomp lets it
spin for a while (`GOMP_SPINCOUNT`, 300,000 polls by default) before it sleeps on a futex, so the
next region starts at once. It spins that long only while the threads it manages are no more than
the CPUs the process may use; past that it spins 100 polls (its "throttled" count, libgomp's
`gomp_throttled_spin_count_var`), and every region of the step then starts with a futex wake-up
of a sleeping worker.

Every thread that runs a parallel region keeps a team of workers of its own, for as long as it
lives. The server (`minivllm serve`, the engine in a thread of its process: AsyncLLMEngine)
loads the model in its main thread, which leaves that thread a team of N - 1 workers, and then
steps the engine in another thread, which starts a second one: 2N - 1 managed threads on N CPUs,
so every barrier of every step sleeps. `release_thread_team()`, called by the main thread once the
model is loaded, gives its team back (OpenMP 5.0's `omp_pause_resource`, which libgomp implements
for the host by freeing the calling thread's pool) and holds that thread to one OpenMP thread, so
that the event loop's own rare parallel work cannot start a team again. The engine thread is then
the only one with a team, as the offline `LLM`'s main thread is (docs/performance.md, "the served
one stream").

Only libgomp is touched: LLVM's and Intel's runtimes (`libomp`, `libiomp5`) throttle differently,
and a pause there stops the whole runtime, so under them this does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the runtime may free its threads, keeping device data


@functools.cache
def libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has already loaded (PyTorch's), or None: never loads one."""
    try:
        return ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except (OSError, AttributeError):  # not loaded (another runtime), or no RTLD_NOLOAD here
        return None


def release_thread_team() -> bool:
    """Free the calling thread's OpenMP team and hold the thread to one OpenMP thread from now on
    (the calling thread only: others keep their counts). False where libgomp is not the runtime,
    or the calling thread is inside a parallel region."""
    gomp = libgomp()
    if gomp is None:
        return False
    gomp.omp_set_num_threads(1)
    return int(gomp.omp_pause_resource(OMP_PAUSE_SOFT, gomp.omp_get_initial_device())) == 0
