"""The `minivllm` command: `minivllm serve [MODEL] ...` and `minivllm bench {throughput,memory,
prefix,serve} ...`, with vLLM's flag names (vllm/entrypoints/cli/). The engine's flags come from
`EngineArgs` (minivllm/engine_args.py), the one declaration of the engine's options.

Subcommand modules are imported only when their subcommand runs, so `minivllm serve` never pays
for the benchmarks' imports (matplotlib, ...) and the CLI works while a benchmark is missing. Each
bench module follows one convention: `add_arguments(parser)` and `main(args) -> int`.
`python -m minivllm.entrypoints.openai.api_server` runs the same server as `minivllm serve`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

BENCHMARKS = {
    "throughput": "offline generation throughput",
    "memory": "KV cache memory use (the paper's Fig. 2)",
    "prefix": "prefix caching speed-up",
    "serve": "load test a running server: TTFT, TPOT, ITL, throughput",
    "sharing": "KV memory saved by sharing in parallel sampling and beam search (Fig. 15)",
}

SERVE_DESCRIPTION = "Serve a model over vLLM's OpenAI-compatible HTTP API (under /v1)."


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`--help` shows each flag's default after its meaning; descriptions and epilogs keep their
    line breaks (the benches print their commands there)."""


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's own flags, then the engine's (from EngineArgs)."""
    from minivllm.engine_args import EngineArgs
    from minivllm.entrypoints.api_server import (
        DEFAULT_MAX_BODY_BYTES,
        DEFAULT_MAX_WAITING_REQUESTS,
    )

    # vLLM's `vllm serve MODEL`; `--model MODEL` (the engine flag) says the same.
    parser.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="the model to serve, as --model"
    )
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 for all")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names accepted in a request's model field, the first one reported; unset: the model",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are refused with 413",
    )
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=DEFAULT_MAX_WAITING_REQUESTS,
        help="answer 503 + Retry-After while this many requests wait",
    )
    g.add_argument(
        "--log-stats-interval",
        type=float,
        default=5.0,
        help="seconds between the stats log lines (throughput, queues, KV cache use)",
    )
    g.add_argument("--uvicorn-log-level", default="info", help="uvicorn's own log level")
    EngineArgs.add_cli_args(parser)


def make_serve_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=SERVE_DESCRIPTION, formatter_class=HelpFormatter
    )
    add_serve_arguments(parser)
    return parser


def parse_serve_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """Parse, then merge the positional MODEL into `args.model` (an error if both differ)."""
    args = parser.parse_args(argv)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error(
                f"the model is given twice, as {args.model_tag!r} and as --model {args.model!r}; "
                "give it once"
            )
        args.model = args.model_tag
    return args


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from minivllm.engine import LLMEngine
    from minivllm.engine_args import EngineArgs
    from minivllm.entrypoints.api_server import build_app

    engine = LLMEngine(EngineArgs.from_cli_args(args).create_engine_config())
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
    # Each subcommand's own parser is built in main(), once we know which one runs.
    sub.add_parser("serve", help="OpenAI-compatible HTTP server", add_help=False)
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    for name, help_text in BENCHMARKS.items():
        bench_sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging()
    if argv[:1] == ["serve"]:
        return serve(parse_serve_args(make_serve_parser("minivllm serve"), argv[1:]))
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHMARKS:
        module = importlib.import_module(f"minivllm.benchmarks.{argv[1]}")
        bench_parser = argparse.ArgumentParser(
            prog=f"minivllm bench {argv[1]}", formatter_class=HelpFormatter
        )
        module.add_arguments(bench_parser)
        return int(module.main(bench_parser.parse_args(argv[2:])))
    build_parser().parse_args(argv)  # prints usage, or the error for an unknown command
    return 2


if __name__ == "__main__":
    sys.exit(main())
