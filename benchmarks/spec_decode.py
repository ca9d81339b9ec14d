"""Speculative decoding on the bundled SmolLM2 GGUF: one user copying a text, and a busy batch.

Two measures of the Performance page, each an A/B in the same process, alternating the engines
(plain, n-gram, plain, n-gram, ...) so that a shared machine's load falls on both alike:

1. batch 1, greedy, a chat prompt that asks for a paragraph to be repeated: the n-gram proposer
   finds what follows in the prompt, so most drafts are kept;
2. 32 requests of the random workload (`bench throughput`'s, input and output 16-128 tokens): the
   drafts seldom match random tokens, and a verification step costs more than a decode step.

    python -m benchmarks.spec_decode [--rounds 2] [--k 4] [--threads 1] [--json out.json]

`--draft-model PATH` measures the draft-model proposer instead, on a float32 target (the bundled
file dequantized, `quantization="none"`) drafted by PATH (e.g. the bundled .gguf file itself, run
on its own Q4_1 blocks), and `--prompt open` asks an open question instead of the copy task.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from minivllm import LLM, SamplingParams
from minivllm.benchmarks.report import machine_load
from minivllm.benchmarks.workload import fixed_params, random_requests

TEXT = (
    "The paged KV cache splits each request's keys and values into fixed-size blocks, so that "
    "memory is allocated on demand and shared between requests with a common prefix. A block "
    "table maps each logical block of a sequence to a physical block of the cache, much as an "
    "operating system maps virtual pages to physical frames. When a request finishes, its blocks "
    "return to the pool and another request can use them at once."
)
PROMPTS = {
    "copy": [
        {"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{TEXT}"}
    ],
    "open": [{"role": "user", "content": "Explain how a paged KV cache works, in detail."}],
}
PROMPT = PROMPTS["copy"]


OUTPUTS: dict[str, list[int]] = {}  # engine -> its one-user greedy tokens: they must agree


def one_user(llm: LLM, max_tokens: int, key: str = "") -> tuple[float, int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    out = llm.chat(PROMPT, params, use_tqdm=False)[0].outputs[0]
    seconds = time.perf_counter() - start
    OUTPUTS[key] = list(out.token_ids)
    return seconds, len(out.token_ids)


def busy_batch(llm: LLM, num: int) -> tuple[float, int]:
    reqs = random_requests(num, (16, 128), (16, 128), llm.llm_engine.vocab_size, 0, range(17))
    params = [fixed_params(r.output_len) for r in reqs]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--disable-by-batch-size", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-batch", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--draft-model", default=None, help="a draft model instead of n-grams")
    parser.add_argument("--prompt", choices=sorted(PROMPTS), default="copy")
    args = parser.parse_args()
    global PROMPT
    PROMPT = PROMPTS[args.prompt]
    if args.threads:
        torch.set_num_threads(args.threads)
    spec: dict[str, Any] = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_max": args.lookup_max,
        "prompt_lookup_min": args.lookup_min,
    }
    engine: dict[str, Any] = {"cpu_kv_cache_space": 1.0}
    if args.draft_model is not None:  # a float32 target, drafted by the model named
        spec = {"model": args.draft_model, "num_speculative_tokens": args.k}
        engine["quantization"] = "none"
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    key = "draft" if args.draft_model is not None else "ngram"  # the speculating engine's name
    engines = {"plain": LLM(**engine), key: LLM(**engine, speculative_config=spec)}
    for llm in engines.values():  # warm-up: first-call allocations and kernel choices
        one_user(llm, 8)
    results: dict[str, Any] = {
        "benchmark": "spec_decode",
        "machine": f"SmolLM2-135M {'float32' if key == 'draft' else 'Q4_1 GGUF'}, CPU, "
        f"{machine_load()} at the start",
        "command": "python -m benchmarks.spec_decode " + " ".join(sys.argv[1:]),
        "speculative_config": spec,
    }
    measures = [("one_user", lambda llm, key: one_user(llm, args.max_tokens, key))]
    if not args.skip_batch:
        measures.append(("busy_batch", lambda llm, key: busy_batch(llm, args.num_prompts)))
    for name, measure in measures:
        runs: dict[str, list[float]] = {k: [] for k in engines}
        for _ in range(args.rounds):
            for key, llm in engines.items():
                seconds, tokens = measure(llm, key)
                runs[key].append(tokens / seconds)
                print(
                    f"{name} {key}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s",
                    flush=True,
                )
        best = {k: max(v) for k, v in runs.items()}
        results[name] = {"tok_s": runs, "ratio_of_best": best[key] / best["plain"]}
        for key, value in best.items():  # the flat scalars the Performance page tabulates
            results[f"{name} {key}: best tok/s"] = round(value, 1)
        label = "n-gram" if key == "ngram" else "draft model"
        results[f"{name}: {label} / plain (best of {args.rounds})"] = round(
            best[key] / best["plain"], 2
        )
        print(f"{name}: {label} / plain = {best[key] / best['plain']:.2f}x (best of {args.rounds})")
    assert OUTPUTS["plain"] == OUTPUTS[key], "greedy outputs differ"
    results["one_user_text"] = engines["plain"].get_tokenizer().decode(OUTPUTS["plain"])
    stats = engines[key].llm_engine.speculator.stats  # type: ignore[union-attr]
    results["spec_stats"] = vars(stats)
    results["load at the end"] = machine_load()
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
