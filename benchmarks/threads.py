"""Why one thread can beat two on a shared CPU: a decoder layer's work, idle and with a busy core.

torch runs each op on an OpenMP team and ends it at a barrier where the team waits for its slowest
thread. When another job holds a core, the operating system gives one thread only time slices, and
every op that meets a gap waits for it: the median op is as fast as on an idle machine, the mean is
not. This times one SmolLM2-sized decoder layer's matmuls and SwiGLU at 32 rows (`linear` as the
model calls it) in fresh processes: with torch's threads, one thread, and two threads with
`OMP_WAIT_POLICY=PASSIVE` (sleep at barriers instead of spinning), each on an idle machine and
with a busy-looping process beside it. The Performance page's "threads" section reads its JSON.

    python benchmarks/threads.py --json docs/perf/threads.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# (hidden rows, input columns) of SmolLM2's qkv, o, gate_up and down projections
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
SETTINGS = {  # name -> environment of the timing process
    "torch's threads": {},
    "1 thread": {"OMP_NUM_THREADS": "1"},
    "torch's threads, OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
}


def time_layer(rows: int, repeats: int) -> dict[str, float]:
    """Median and mean milliseconds of one layer's matmuls + SwiGLU, in this process."""
    import torch
    import torch.nn.functional as F

    from minivllm.cpu.op_forwards import linear

    torch.manual_seed(0)
    weights = [torch.randn(n, k) for n, k in SHAPES]
    inputs = [torch.randn(rows, k) for _, k in SHAPES]

    def layer() -> None:
        for w, x in zip(weights, inputs):
            y = linear(x, w)
            _ = F.silu(y) * y

    for _ in range(20):
        layer()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        layer()
        seconds.append(time.perf_counter() - start)
    return {
        "median_ms": statistics.median(seconds) * 1e3,
        "mean_ms": statistics.mean(seconds) * 1e3,
        "threads": torch.get_num_threads(),
    }


def _busy(stop: float) -> None:
    while time.time() < stop:
        pass


def measure(setting: dict[str, str], rows: int, repeats: int) -> dict[str, float]:
    # This file's own `time_layer`, however the script was started (its __main__ block does not
    # run under `runpy.run_path`).
    code = (
        f"import json, runpy; time_layer = runpy.run_path({__file__!r})['time_layer']; "
        f"print(json.dumps(time_layer({rows}, {repeats})))"
    )
    env = os.environ | setting
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=32, help="rows per matmul (decode batch)")
    parser.add_argument("--repeats", type=int, default=300, help="timed layers per setting")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    from minivllm.benchmarks.report import machine_load

    results: dict[str, float | str] = {"machine": machine_load(), "rows": args.rows}
    for machine in ("idle", "one core busy"):
        busy = None
        if machine != "idle":  # a competing job: one process spinning for the whole measurement
            busy = mp.get_context("spawn").Process(target=_busy, args=(time.time() + 600,))
            busy.start()
        try:
            for name, env in SETTINGS.items():
                r = measure(env, args.rows, args.repeats)
                print(
                    f"{machine:14s} {name:42s} ({r['threads']:.0f} threads): median "
                    f"{r['median_ms']:6.2f} ms, mean {r['mean_ms']:6.2f} ms per layer"
                )
                for stat in ("median_ms", "mean_ms"):
                    results[f"{machine}, {name}: {stat.replace('_ms', '')} ms"] = r[stat]
        finally:
            if busy is not None:
                busy.terminate()
                busy.join()
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "threads", **results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
