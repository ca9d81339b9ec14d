"""`minivllm bench serve`: load-test a running OpenAI-compatible server, as vLLM's
benchmarks/benchmark_serving.py does.

Requests come from the random dataset (prompts of `--random-input-len` random token ids, asked for
exactly `--random-output-len` tokens with `ignore_eos`), sent to /v1/completions as streams. They
arrive as a Poisson process at `--request-rate` per second (exponential gaps; `inf` sends them all
at once), optionally capped at `--max-concurrency` in flight. Per request we record:

- TTFT: send -> first streamed token;  E2E: send -> last byte;
- ITL: the gaps between streamed chunks;  TPOT: (E2E - TTFT) / (output tokens - 1).

and report their mean, median and percentiles, with request and output-token throughput.
Works against vLLM itself too (the same API), which is the point of using its names.

With `--llama-server PATH`, the same prompts then go to llama.cpp's server, started by the bench on
a GGUF file (`--llama-cpp-model`, unset: the bundled SmolLM2's; serve the same file from the server
under test) with one slot per request in flight (llama_cpp.py), after a warm-up of each server; the
two summaries and the ratio of their output throughputs are printed, and kept in the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from minivllm.benchmarks import llama_cpp
from minivllm.benchmarks.workload import Fixed, draw_requests, poisson_arrivals, token_pool


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    status: int = 0  # the HTTP status; 0: no answer came
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server to load")
    parser.add_argument(
        "--model", default=None, help="the model field of the requests; unset: the server's first"
    )
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    parser.add_argument("--random-input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument(
        "--random-output-len", type=int, default=64, help="output tokens asked for (ignore_eos)"
    )
    parser.add_argument(
        "--random-vocab-size",
        type=int,
        default=30000,
        help="prompt token ids are drawn below this (30000 fits Llama's and SmolLM2's vocabularies)",
    )
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s")
    parser.add_argument(
        "--max-concurrency", type=int, default=None, help="most requests in flight; unset: all"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrivals")
    parser.add_argument("--percentiles", default="50,90,99", help="comma-separated")
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    llama_cpp.add_peer_arguments(parser, model_flag=True)


def random_prompts(n: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """The random dataset at a fixed length. The server's tokenizer is not at hand: the lowest ids,
    where special tokens live in most vocabularies, are skipped."""
    pool = token_pool(vocab_size, first_id=100)
    requests = draw_requests(random.Random(seed), n, Fixed(input_len), Fixed(0), pool)
    return [r.prompt_token_ids for r in requests]


async def send_one(
    client: httpx.AsyncClient,
    model: str,
    prompt: list[int],
    output_len: int,
    extra_body: dict[str, Any] | None = None,
) -> RequestResult:
    body: dict[str, Any] = {
        **(extra_body or {}),
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = await _stream(client, body, len(prompt))
    if res.error.startswith("RemoteProtocolError") and res.status == 0:
        # The server closed a kept-alive connection (llama-server does when it has idled) and
        # the request failed before any answer: it never arrived, so it goes once more.
        res = await _stream(client, body, len(prompt))
    return res


async def _stream(
    client: httpx.AsyncClient, body: dict[str, Any], prompt_len: int
) -> RequestResult:
    res = RequestResult(prompt_len=prompt_len)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                # A token whose text is empty (a special or unused token, which llama-server
                # prints as "") still arrived: the first chunk is the first token, as in vLLM's
                # backend_request_func.py. A closing chunk of no text is the finish reason alone.
                choice = chunk["choices"][0]
                now = time.perf_counter()
                if res.ttft == 0.0:
                    res.ttft = now - start
                elif choice.get("text") or choice.get("finish_reason") is None:
                    res.itl.append(now - last)
                else:
                    continue
                last = now
        res.e2e = time.perf_counter() - start
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run(args: argparse.Namespace, extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """The load test of the server at `args.base_url`; `extra_body` goes into every request (a
    server's own fields, such as llama-server's `cache_prompt`)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=headers, timeout=args.timeout, limits=limits
    ) as client:
        models = (await client.get("/v1/models")).raise_for_status().json()["data"]
        model = args.model or models[0]["id"]
        prompts = random_prompts(
            args.num_prompts, args.random_input_len, args.random_vocab_size, args.seed
        )
        gaps = poisson_arrivals(len(prompts), args.request_rate, args.seed)
        gate = asyncio.Semaphore(args.max_concurrency or len(prompts))

        async def limited(prompt: list[int]) -> RequestResult:
            async with gate:
                return await send_one(client, model, prompt, args.random_output_len, extra_body)

        tasks = []
        start = time.perf_counter()
        for prompt, gap in zip(prompts, gaps):
            tasks.append(asyncio.create_task(limited(prompt)))
            if gap:
                await asyncio.sleep(gap)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    summary = summarize(results, duration, [float(p) for p in args.percentiles.split(",")], model)
    summary["owned_by"] = models[0].get("owned_by", "")  # "minivllm", "vllm", "llamacpp"
    return summary


def _stats(values: list[float], percentiles: list[float], name: str) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values) or [0.0]
    out = {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms)}
    for p in percentiles:
        k = min(len(ms) - 1, max(0, round(p / 100 * len(ms) + 0.5) - 1))  # nearest rank
        out[f"p{p:g}_{name}_ms"] = ms[k]
    return out


def summarize(
    results: list[RequestResult], duration: float, percentiles: list[float], model: str
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary: dict[str, Any] = {
        "model": model,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_len for r in ok),
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
    }
    summary |= _stats([r.ttft for r in ok], percentiles, "ttft")
    summary |= _stats(tpot, percentiles, "tpot")
    summary |= _stats([x for r in ok for x in r.itl], percentiles, "itl")
    summary |= _stats([r.e2e for r in ok], percentiles, "e2el")
    return summary


def print_summary(s: dict[str, Any]) -> None:
    print(f"{' Serving Benchmark Result ':=^60}")
    for key, value in s.items():
        if key == "errors":
            for e in value:
                print(f"  error: {e}")
            continue
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{key:<40}{text:>20}")
    print("=" * 60)


def run_llama_cpp(setup: llama_cpp.LlamaCppSetup, args: argparse.Namespace) -> dict[str, Any]:
    """The same load test against llama-server, started for it alone: a slot per request that
    may be in flight, each slot's context the prompt and the output; its peak RSS beside it."""
    parallel = args.max_concurrency or args.num_prompts
    ctx = llama_cpp.ctx_per_slot(args.random_input_len + args.random_output_len)
    with llama_cpp.LlamaServerPeer(setup, parallel=parallel, ctx_per_slot=ctx) as peer:
        peer_args = argparse.Namespace(**{**vars(args), "base_url": peer.url})
        peer_args.model = peer_args.api_key = None
        no_reuse = {"cache_prompt": False}  # as minivllm's random prompts: no prefix to reuse
        asyncio.run(run(warm_up_args(peer_args), no_reuse))
        summary = asyncio.run(run(peer_args, no_reuse))
        summary |= {"peak_rss_bytes": peer.peak_rss_bytes(), "command": " ".join(peer.command())}
    return summary


def warm_up_args(args: argparse.Namespace) -> argparse.Namespace:
    """Two short requests, all at once: a server's first requests are not timed."""
    overrides = {"num_prompts": 2, "random_output_len": 4, "request_rate": float("inf")}
    return argparse.Namespace(**{**vars(args), **overrides})


def print_comparison(summary: dict[str, Any], peer: dict[str, Any]) -> None:
    name = summary["owned_by"] or "server"
    print(
        f"{name} / llama.cpp: {summary['output_throughput_vs_llama_cpp']:.2f}x the output tok/s "
        f"({summary['output_throughput']:.1f} / {peer['output_throughput']:.1f}), median TPOT "
        f"{summary['median_tpot_ms']:.1f} / {peer['median_tpot_ms']:.1f} ms, median TTFT "
        f"{summary['median_ttft_ms']:.0f} / {peer['median_ttft_ms']:.0f} ms"
    )


def main(args: argparse.Namespace) -> int:
    llama = llama_cpp.setup_from_flags(
        args.llama_server, args.llama_cpp_model, args.llama_cpp_threads
    )
    if llama is not None:
        asyncio.run(run(warm_up_args(args)))
    summary = asyncio.run(run(args))
    failed = summary["failed"]
    peer = None
    if llama is not None:  # after the server under test's run: the two never share the cores
        peer = run_llama_cpp(llama, args)
        summary["peers"] = {"llama.cpp": peer}
        summary["output_throughput_vs_llama_cpp"] = (
            summary["output_throughput"] / peer["output_throughput"]
        )
        failed += peer["failed"]
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary({k: v for k, v in summary.items() if k != "peers"})
        if peer is not None:
            print_summary(peer)
            print_comparison(summary, peer)
    return 0 if failed == 0 else 1
