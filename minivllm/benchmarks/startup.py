"""`minivllm bench startup`: how long a learner waits for the first text, phase by phase.

A learner's first program is `from minivllm import LLM; LLM().generate(...)`. Each run here is that
program in a fresh Python process (an import is only slow once per process), timed in three
phases:

  import        `import minivllm` (torch comes with it)
  LLM()         find and load the model and its tokenizer, build the runner, size the KV cache
  first token   `generate` of one short prompt, one greedy token, detokenized

Warm runs reuse minivllm's cache folder (`MINIVLLM_CACHE`: the GGUF model converted to safetensors
and the compiled CPU kernels). `--cold` also runs once with an empty cache folder, what the very
first run on a machine pays: the GGUF conversion and the C++ compilation.

Each phase is reported as wall time and as the process's CPU time. On a shared machine the wall
time grows with the load while the CPU time barely does, so the load average is printed beside
them; on quiet cores, wall is close to CPU for these mostly single-threaded phases.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

EPILOG = (
    "Default: three warm runs of the bundled SmolLM2-135M-Instruct, two torch threads; ~1 minute.\n"
    "  minivllm bench startup --cold --json startup.json"
)

# The learner's first program, instrumented; it prints one JSON line.
CHILD = """
import json, sys, time
w0, c0 = time.perf_counter(), time.process_time()
import minivllm
w1, c1 = time.perf_counter(), time.process_time()
llm = minivllm.LLM(sys.argv[1] or None)
w2, c2 = time.perf_counter(), time.process_time()
params = minivllm.SamplingParams(temperature=0.0, max_tokens=1)
text = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].text
w3, c3 = time.perf_counter(), time.process_time()
print(json.dumps({"import": [w1 - w0, c1 - c0], "LLM()": [w2 - w1, c2 - c1],
                  "first token": [w3 - w2, c3 - c2], "total": [w3 - w0, c3 - c0], "text": text}))
"""
PHASES = ("import", "LLM()", "first token", "total")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0] if __doc__ else None
    parser.epilog = EPILOG
    parser.add_argument("--model", default="", help="model to load (default: the bundled one)")
    parser.add_argument("--repeat", type=int, default=3, help="warm runs (the median is shown)")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run")
    parser.add_argument(
        "--cold", action="store_true", help="also one run with an empty MINIVLLM_CACHE folder"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def run_once(model: str, threads: int, cache: str | None = None) -> dict[str, Any]:
    """One fresh process running the learner's first program; its phases in seconds."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if cache is not None:
        env["MINIVLLM_CACHE"] = cache
    done = subprocess.run(
        [sys.executable, "-c", CHILD, model], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"the start-up run failed:\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["load"] = load_average()
    return result


def summarize(label: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median wall and CPU seconds of each phase over `runs`."""
    row: dict[str, Any] = {"runs": label, "n": len(runs), "load": [r["load"] for r in runs]}
    for phase in PHASES:
        row[phase] = {
            "wall_s": statistics.median(r[phase][0] for r in runs),
            "cpu_s": statistics.median(r[phase][1] for r in runs),
        }
    return row


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'runs':<10}" + "".join(f"{p + ' wall/cpu s':>24}" for p in PHASES) + "   load")
    for row in rows:
        cells = "".join(f"{row[p]['wall_s']:>15.2f} / {row[p]['cpu_s']:<6.2f}" for p in PHASES)
        loads = ", ".join(f"{x:.1f}" for x in row["load"] if x is not None)
        print(f"{row['runs'] + ' x' + str(row['n']):<10}{cells}   {loads}")


def main(args: argparse.Namespace) -> int:
    if args.repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {args.repeat}")  # the CLI names --repeat
    rows = []
    if args.cold:
        with tempfile.TemporaryDirectory(prefix="minivllm-cold-") as cache:
            cold = run_once(args.model, args.threads, cache)
        rows.append(summarize("cold", [cold]))
    run_once(args.model, args.threads)  # fills the cache if it is empty; not counted
    warm = [run_once(args.model, args.threads) for _ in range(args.repeat)]
    rows.append(summarize("warm", warm))
    print(
        f"first text: {warm[-1]['text']!r}; {os.cpu_count()} cores, OMP_NUM_THREADS={args.threads}"
    )
    print_rows(rows)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        load = load_average()
        report = {
            "benchmark": "startup",
            "machine": f"load {load:.2f} on {os.cpu_count()} cores after the runs"
            if load is not None
            else f"{os.cpu_count()} cores",
            "args": {"model": args.model, "repeat": args.repeat, "threads": args.threads},
            "text": warm[-1]["text"],
            "rows": rows,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"results written to {args.json}")
    return 0
