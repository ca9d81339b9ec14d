"""`minivllm bench prefix`: what sharing KV blocks saves, with and without it (paper §4.4, §6.4).

Two scenarios, each run twice on fresh engines:

  shared system prompt   many requests = one long common prefix (>= 8 blocks) + a short unique
                         suffix; with prefix caching (vLLM v1's automatic prefix caching) the
                         prefix's K/V is computed once and its blocks are shared
  parallel sampling      `n = 4` samples per prompt: the prompt is computed once and its blocks are
                         shared by the four samples (copy-on-write on the last, partial block),
                         against 4 independent requests with prefix caching off

For each run: prompt tokens whose K/V was computed, the peak KV blocks in use
(`EngineStats.peak_kv_blocks_used`) and output tokens/s.
"""

from __future__ import annotations

import argparse
import gc
import random
from typing import Any

from minivllm.benchmarks.engine_under_test import (
    GPU_EPILOG,
    add_run_arguments,
    build_llm,
    prompts_of,
    warm_up,
)
from minivllm.benchmarks.machine import timed
from minivllm.benchmarks.report import (
    PREFIX_HEADERS,
    machine_load,
    prefix_row,
    print_table,
    write_json,
)
from minivllm.benchmarks.workload import (
    BenchRequest,
    Fixed,
    Uniform,
    draw_requests,
    fixed_params,
    length_range,
    random_token_ids,
    token_pool,
)
from minivllm.engine.arg_utils import EngineArgs
from minivllm.model.loader import load_config
from minivllm.model.resolver import resolve_model
from minivllm.sampling_params import SamplingParams

EPILOG = (
    "Default: 32 requests sharing a 256-token system prompt (16 blocks) + 16-64 own tokens, 32\n"
    "output tokens; and 8 prompts of 256 tokens x n=4 samples of 64 tokens. ~2 minutes on CPU.\n"
    "  minivllm bench prefix --json prefix.json\n\n"
    + GPU_EPILOG.format(
        name="prefix", extra=" \\\n      --num-prompts 256 --system-prompt-len 1024 --n-prompts 64"
    )
)

# No tokenizer is loaded: prompt ids start clear of the special tokens at the vocabulary's start.
FIRST_ID = 100
# A KV budget sized for the default workloads; the peaks in use are what the report shows.
ENGINE_DEFAULTS = EngineArgs(num_gpu_blocks_override=2048)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("shared system prompt")
    g.add_argument("--num-prompts", type=int, default=32, help="requests sharing the prefix")
    g.add_argument(
        "--system-prompt-len", type=int, default=256, help="the shared prefix, in tokens"
    )
    g.add_argument(
        "--suffix-len",
        type=length_range,
        default="16-64",
        help="each request's own tokens after the prefix: N, or MIN-MAX drawn uniformly",
    )
    g.add_argument("--output-len", type=int, default=32, help="output tokens per request")
    g = parser.add_argument_group("parallel sampling", "prompts drawn with the engine's --seed")
    g.add_argument("--n", type=int, default=4, help="samples per prompt")
    g.add_argument("--n-prompts", type=int, default=8, help="prompts, each sampled n times")
    g.add_argument("--n-prompt-len", type=int, default=256, help="tokens per prompt")
    g.add_argument("--n-output-len", type=int, default=64, help="output tokens per sample")
    EngineArgs.add_cli_args(parser, defaults=ENGINE_DEFAULTS)
    add_run_arguments(parser)
    parser.epilog = EPILOG  # shown by `minivllm bench NAME --help`


def run_once(
    args: argparse.Namespace,
    name: str,
    caching: bool,
    requests: list[BenchRequest],
    params: list[SamplingParams],
) -> dict[str, Any]:
    """One fresh engine, one `generate`; counters are read as differences around it."""
    llm = build_llm(args, enable_prefix_caching=caching)
    warm_up(llm)  # its prompts share nothing with the workload's
    before = llm.get_stats()
    t: dict[str, float] = {}
    with timed(llm.llm_engine.device, t):
        outputs = llm.generate(prompts_of(requests), params)
    after = llm.get_stats()
    out_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    del llm
    gc.collect()
    return {
        "run": name,
        "prefix_caching": caching,
        "requests": len(requests),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "prompt_tokens_computed": after.num_prompt_tokens_computed
        - before.num_prompt_tokens_computed,
        "prefix_cache_hit_tokens": after.num_prefix_cache_hit_tokens
        - before.num_prefix_cache_hit_tokens,
        "peak_kv_blocks_used": after.peak_kv_blocks_used,
        "output_tokens": out_tokens,
        "seconds": t["seconds"],
        "output_tokens_per_s": out_tokens / t["seconds"],
    }


def shared_prefix_runs(args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    pool = token_pool(vocab, first_id=FIRST_ID)
    system = random_token_ids(rng, args.system_prompt_len, pool)
    requests = draw_requests(
        rng, args.num_prompts, Uniform(*args.suffix_len), Fixed(args.output_len), pool, system
    )
    params = [fixed_params(r.output_len) for r in requests]
    return [
        run_once(args, "system prompt, no caching", False, requests, params),
        run_once(args, "system prompt, prefix caching", True, requests, params),
    ]


def parallel_sampling_runs(args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    rng = random.Random(args.seed + 1)
    pool = token_pool(vocab, first_id=FIRST_ID)
    prompts = draw_requests(
        rng, args.n_prompts, Fixed(args.n_prompt_len), Fixed(args.n_output_len), pool
    )
    # Sampled (temperature 1) so that the n samples diverge and copy-on-write really happens.
    shared = [
        fixed_params(r.output_len, n=args.n, temperature=1.0, seed=i) for i, r in enumerate(prompts)
    ]
    independent = [r for r in prompts for _ in range(args.n)]
    indep_params = [
        fixed_params(r.output_len, temperature=1.0, seed=i) for i, r in enumerate(independent)
    ]
    return [
        run_once(args, f"{args.n} independent requests", False, independent, indep_params),
        run_once(args, f"n={args.n} (shared prompt blocks)", False, prompts, shared),
    ]


def main(args: argparse.Namespace) -> int:
    if args.system_prompt_len < 8 * args.block_size:
        print(
            f"note: the shared prefix ({args.system_prompt_len} tokens) is under 8 blocks of "
            f"{args.block_size}; the issue asks for at least 8"
        )
    vocab = load_config(resolve_model(args.model)).vocab_size
    rows = shared_prefix_runs(args, vocab) + parallel_sampling_runs(args, vocab)
    for base, shared in ((rows[0], rows[1]), (rows[2], rows[3])):
        shared["prompt_tokens_saved"] = 1 - shared["prompt_tokens_computed"] / max(
            base["prompt_tokens_computed"], 1
        )
        shared["peak_blocks_saved"] = 1 - shared["peak_kv_blocks_used"] / max(
            base["peak_kv_blocks_used"], 1
        )
        shared["speedup"] = shared["output_tokens_per_s"] / base["output_tokens_per_s"]
    print()
    print_table(PREFIX_HEADERS, [prefix_row(r) for r in rows])
    share = args.system_prompt_len / (rows[0]["prompt_tokens"] / rows[0]["requests"])
    print(
        f"\nsystem prompt: {share:.1%} of each prompt is shared; prefix caching computed "
        f"{rows[1]['prompt_tokens_saved']:.1%} fewer prompt tokens, used "
        f"{rows[1]['peak_blocks_saved']:.1%} fewer peak blocks, ran {rows[1]['speedup']:.2f}x faster\n"
        f"n={args.n}: {rows[3]['prompt_tokens_saved']:.1%} fewer prompt tokens, "
        f"{rows[3]['peak_blocks_saved']:.1%} fewer peak blocks, {rows[3]['speedup']:.2f}x faster "
        f"({machine_load()})"
    )
    write_json(
        args.json,
        {"benchmark": "prefix", "args": vars(args), "machine": machine_load(), "runs": rows},
    )
    return 0
