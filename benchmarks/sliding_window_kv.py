"""A sliding window's KV usage on a long generation, and the trace picture of the KV-cache page.

Mistral's idea (vLLM v1's `SlidingWindowManager`): a layer with window W lets a query at position
p see keys p - W < j <= p, so once a request is past W tokens the blocks before its window can go
back to the pool. This script shows it on a real model: the bundled SmolLM2 (dequantized through
transformers' GGUF reader) saved twice, as a Mistral checkpoint with `sliding_window=W` and as the
plain Llama, then run on the same long greedy generation:

- the blocks each run holds, step by step (the windowed run stays at about W / block_size + 1);
- `minivllm bench memory` on both folders (its KV-slot accounting, RSS and weight bytes);
- a trace of the windowed run and a screenshot of its block tables at a step where the window
  freed a block (docs/img/bench/sliding_window.png; `--picture` to write it elsewhere).

    python benchmarks/sliding_window_kv.py --work /tmp/swa [--window 64] [--picture PNG]

Not part of CI: it converts a 135M model (~1 minute) and runs about a thousand decode steps.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, Python puts benchmarks/ first on the path, where benchmarks/kernels.py would
# shadow the `kernels` package transformers imports: this tree's root goes there instead.
sys.path[0] = str(ROOT)

PROMPT = "Write a long story about a lighthouse keeper and the sea."


def save_checkpoints(work: Path, window: int) -> tuple[Path, Path]:
    """(the windowed Mistral folder, the plain Llama folder), both from the bundled GGUF."""
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
    )

    from minivllm.model.resolver import bundled_model_path

    windowed, plain = work / f"smollm2-window{window}", work / "smollm2-plain"
    if (windowed / "config.json").exists() and (plain / "config.json").exists():
        return windowed, plain
    gguf = bundled_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    llama = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    cfg = llama.config.to_dict()
    for key in ("architectures", "model_type", "quantization_config", "transformers_version"):
        cfg.pop(key, None)
    # transformers will not save a model it read from GGUF: copy the weights into fresh models.
    for folder, model in (
        (plain, LlamaForCausalLM(LlamaConfig(**cfg))),
        (windowed, MistralForCausalLM(MistralConfig(**cfg, sliding_window=window))),
    ):
        model.load_state_dict(llama.state_dict())
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return windowed, plain


def blocks_per_step(model: Path, max_tokens: int, trace_dir: Path | None) -> dict[str, object]:
    """One greedy request of `max_tokens` (EOS ignored): the blocks held after every step."""
    from minivllm import LLM, SamplingParams

    llm = LLM(model=str(model), cpu_kv_cache_space=0.25, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with llm.trace() as recorder:
        out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    held = [s["num_blocks"] - s["num_free_blocks"] for s in _steps(recorder)]
    if trace_dir is not None:
        recorder.save(trace_dir)
    return {
        "model": model.name,
        "prompt_tokens": len(out.prompt_token_ids),
        "output_tokens": len(out.outputs[0].token_ids),
        "peak_blocks": max(held),
        "final_blocks": held[-2] if len(held) > 1 else held[-1],  # before the finish frees all
        "text_start": out.outputs[0].text[:160],
    }


def _steps(recorder: object) -> list[dict[str, int]]:
    meta = recorder.meta  # type: ignore[attr-defined]
    return [{"num_blocks": meta["num_blocks"], **s} for s in recorder.steps]  # type: ignore[attr-defined]


def bench_memory(model: Path, output_len: int) -> str:
    """`minivllm bench memory` on `model`: 4 requests of 64 prompt tokens and `output_len` out."""
    cmd = [sys.executable, "-m", "minivllm.entrypoints.cli", "bench", "memory", "--model",
           str(model), "--num-prompts", "4", "--input-len", "64", "--output-len", str(output_len),
           "--enforce-eager", "--max-model-len", "2048",
           "--plot", str(model.parent / f"{model.name}-kv_memory.png")]  # fmt: skip
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def picture(trace_dir: Path, out: Path) -> int:
    """Screenshot the block tables at the first step after the window freed two blocks."""
    from minivllm.trace.screenshot import screenshot

    steps = json.loads((trace_dir / "trace.json").read_text())["steps"]
    step = next(
        s["step"]
        for s in steps
        if any(sum(b is None for b in t) >= 2 for t in s["block_tables"].values())
    )
    screenshot(trace_dir / "index.html", out, step, selector="#tables-section", width=1100)
    return int(step)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for the checkpoints")
    parser.add_argument("--window", type=int, default=64, help="the sliding window, in tokens")
    parser.add_argument("--max-tokens", type=int, default=960, help="tokens to generate")
    parser.add_argument("--picture", type=Path, default=ROOT / "docs/img/bench/sliding_window.png")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    windowed, plain = save_checkpoints(args.work, args.window)
    results = []
    for model in (windowed, plain):
        trace_dir = args.work / "trace" if model == windowed else None
        results.append(blocks_per_step(model, args.max_tokens, trace_dir))
        print(json.dumps(results[-1]))
    print("picture at step", picture(args.work / "trace", args.picture), "->", args.picture)
    for model in (windowed, plain):
        print(f"--- bench memory {model.name}")
        print(bench_memory(model, args.max_tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
