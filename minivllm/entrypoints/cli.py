"""The `minivllm` command: `minivllm serve [MODEL] ...` and `minivllm bench {throughput,memory,
prefix,serve} ...`, with vLLM's flag names (vllm/engine/arg_utils.py, vllm/entrypoints/cli/).

Subcommand modules are imported only when their subcommand runs, so `minivllm serve` never pays
for the benchmarks' imports (matplotlib, ...) and the CLI works while a benchmark is missing. Each
bench module follows one convention: `add_arguments(parser)` and `main(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minivllm.config import EngineConfig

BENCHMARKS = {
    "throughput": "offline generation throughput",
    "memory": "KV cache memory use (the paper's Fig. 2)",
    "prefix": "prefix caching speed-up",
    "serve": "load test a running server: TTFT, TPOT, ITL, throughput",
}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's engine arguments; the defaults are minivllm.config's."""
    g = parser.add_argument_group("engine")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder or hub id")
    g.add_argument("--dtype", default="auto", help="auto, float32, float16, bfloat16")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda[:N]")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--attention-backend", default="auto", help="auto, reference, triton")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--cpu-kv-cache-space", type=float, default=4.0, help="GiB of KV cache on CPU")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    from minivllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    return EngineConfig(
        model=ModelConfig(
            model=args.model,
            tokenizer=args.tokenizer,
            dtype=args.dtype,
            device=args.device,
            seed=args.seed,
            max_model_len=args.max_model_len,
            attention_backend=args.attention_backend,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            gpu_memory_utilization=args.gpu_memory_utilization,
            cpu_kv_cache_space=args.cpu_kv_cache_space,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
        ),
    )


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from minivllm.entrypoints.api_server import (
        DEFAULT_MAX_BODY_BYTES,
        DEFAULT_MAX_WAITING_REQUESTS,
    )

    parser.add_argument("model", nargs="?", default=None, help="default: the bundled SmolLM2")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="default: loopback only")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    g.add_argument("--served-model-name", nargs="+", default=None)
    g.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=DEFAULT_MAX_WAITING_REQUESTS,
        help="answer 503 + Retry-After while this many requests wait",
    )
    g.add_argument("--log-stats-interval", type=float, default=5.0, help="seconds")
    g.add_argument("--uvicorn-log-level", default="info")
    add_engine_arguments(parser)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from minivllm.engine import LLMEngine
    from minivllm.entrypoints.api_server import build_app

    engine = LLMEngine(engine_config_from_args(args))
    names = args.served_model_name or [args.model or engine.source.name]

    def ready() -> None:  # logged once the engine thread runs, before uvicorn's own line
        logging.getLogger("minivllm").info(
            "minivllm server ready: serving %s on http://%s:%d (OpenAI API under /v1)",
            ", ".join(names),
            args.host,
            args.port,
        )

    app = build_app(
        engine,
        served_model_names=names,
        api_key=args.api_key,
        max_body_bytes=args.max_request_body_bytes,
        max_waiting_requests=args.max_waiting_requests,
        log_stats_interval_s=args.log_stats_interval,
        on_ready=ready,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minivllm", description="the readable vLLM")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(sub.add_parser("serve", help="OpenAI-compatible HTTP server"))
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    for name, help_text in BENCHMARKS.items():
        # The module's own arguments are added in main(), once we know which one runs.
        bench_sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    parser = build_parser()
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHMARKS:
        module = importlib.import_module(f"minivllm.benchmarks.{argv[1]}")
        bench_parser = argparse.ArgumentParser(prog=f"minivllm bench {argv[1]}")
        module.add_arguments(bench_parser)
        return int(module.main(bench_parser.parse_args(argv[2:])))
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
