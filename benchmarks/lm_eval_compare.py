"""EleutherAI's lm-eval against `minivllm serve` and against its own `hf` model, on the same
weights: the acceptance check of the server's log-likelihood path (prompt logprobs via `echo` +
`logprobs`) and of its greedy generation.

Two small tasks defined from local files (`benchmarks/lm_eval_tasks/`): a 32-question
multiple-choice task scored by log-likelihood (`loglikelihood` requests: each answer's tokens'
logprobs, read from the prompt logprobs of `prompt=context+answer, echo=true, logprobs=1,
max_tokens=1`) and a 20-question generation task scored by exact match (`generate_until`,
greedy). Equal accuracy on both is the check; the script prints them side by side, writes JSON and
exits 1 when they differ.

lm-eval lives in its own virtual environment (never the project's):

    python3 -m venv ~/venvs/lm-eval
    ~/venvs/lm-eval/bin/pip install torch==2.13.0 "lm-eval[api,hf]" gguf
    python -m benchmarks.lm_eval_compare --lm-eval-python ~/venvs/lm-eval/bin/python

The weights: the bundled SmolLM2-135M-Instruct GGUF, dequantized once into a float32 safetensors
folder that both sides load (`--model DIR` takes another Hugging Face folder instead).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.peers.hf_export import export_bundled_model
from minivllm.benchmarks.server_process import wait_until_healthy

TASKS_DIR = Path(__file__).with_name("lm_eval_tasks")
TASKS = ("minivllm_mc", "minivllm_gen")
METRICS = {"minivllm_mc": ("acc,none", "acc_norm,none"), "minivllm_gen": ("exact_match,last_word",)}


def run_lm_eval(python: str, model: str, model_args: str, out: Path, extra: list[str]) -> dict:
    cmd = [python, "-m", "lm_eval", "--model", model, "--model_args", model_args]
    cmd += ["--tasks", ",".join(TASKS), "--include_path", str(TASKS_DIR)]
    cmd += ["--output_path", str(out), *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    # The tasks' data_files are relative to the tasks folder.
    subprocess.run(cmd, check=True, cwd=TASKS_DIR, env=env)
    found = sorted(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(found[-1].read_text())["results"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm-eval-python", required=True, help="a Python with lm-eval[api,hf]")
    parser.add_argument("--model", default=None, help="a HF folder; default: the bundled model")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--out", default="bench-out/lm-eval", help="folder for the results")
    args = parser.parse_args()
    out = Path(args.out).resolve()  # lm-eval runs in the tasks folder: paths must be absolute
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model) if args.model else export_bundled_model(out / "smollm2-f32")
    started = time.monotonic()

    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", str(model_dir)]
    cmd += ["--port", str(args.port), "--served-model-name", "model", "--dtype", "float32"]
    cmd += ["--cpu-kv-cache-space", "1", "--uvicorn-log-level", "warning"]
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)  # noqa: SIM115
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_healthy(url + "/health", server, 300, name="minivllm serve")
        api_args = (
            f"model=model,base_url={url}/v1/completions,tokenizer={model_dir},"
            "num_concurrent=4,max_retries=1,tokenized_requests=True"
        )
        api = run_lm_eval(args.lm_eval_python, "local-completions", api_args, out / "api", [])
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    api_s = time.monotonic() - started
    hf_args = f"pretrained={model_dir},dtype=float32"
    hf = run_lm_eval(
        args.lm_eval_python, "hf", hf_args, out / "hf", ["--device", "cpu", "--batch_size", "8"]
    )
    hf_s = time.monotonic() - started - api_s

    rows, equal = [], True
    for task in TASKS:
        for metric in METRICS[task]:
            a, b = api[task][metric], hf[task][metric]
            equal &= a == b
            rows.append({"task": task, "metric": metric.split(",")[0], "minivllm": a, "hf": b})
    print(f"{'task':<14}{'metric':<13}{'minivllm serve':>15}{'lm-eval hf':>12}")
    for r in rows:
        print(f"{r['task']:<14}{r['metric']:<13}{r['minivllm']:>15.4f}{r['hf']:>12.4f}")
    print(f"minivllm serve: {api_s:.0f} s (with the server's start); hf: {hf_s:.0f} s")
    summary = {"rows": rows, "equal": equal, "seconds": {"minivllm": api_s, "hf": hf_s}}
    (out / "comparison.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("equal" if equal else "DIFFERENT")
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
