"""The `minivllm` command: `minivllm serve [MODEL] ...`, `minivllm trace [MODEL] --prompt ... --out DIR`
and `minivllm bench {throughput,memory,prefix,sharing,serve} ...`, with vLLM's flag names
(vllm/entrypoints/cli/). The engine's flags come from `EngineArgs` (minivllm/engine/arg_utils.py),
the one declaration of the engine's options; the server's from the table in cli_args.py.

Subcommand modules are imported only when their subcommand runs, so `minivllm serve` never pays
for the benchmarks' imports (matplotlib, ...) and the CLI works while a benchmark is missing. Each
bench module follows one convention: `add_arguments(parser)` and `main(args) -> int`.
`python -m minivllm.entrypoints.openai.api_server` runs the same server as `minivllm serve`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from minivllm.entrypoints.api_key import resolve_api_key  # os only: the CLI stays light

BENCHMARKS = {
    "throughput": "offline generation throughput",
    "memory": "KV cache memory use (the paper's Fig. 2)",
    "prefix": "prefix caching speed-up",
    "serve": "load test a running server: TTFT, TPOT, ITL, throughput",
    "sharing": "KV memory saved by sharing in parallel sampling and beam search (Fig. 15)",
    "paper": "paged vs reservation (Orca) under load: latency vs request rate (Figs. 12-13)",
    "startup": "time to the first text: import, LLM(), first token; warm and cold cache",
}

SERVE_DESCRIPTION = "Serve a model over vLLM's OpenAI-compatible HTTP API (under /v1)."
TRACE_DESCRIPTION = (
    "Run prompts and record every engine step: writes OUT/trace.json and OUT/index.html, a page "
    "that shows the KV block pool, the block tables and the scheduler's batch step by step "
    "(open it from the file system)."
)
# A trace is for looking at: a pool small enough to draw, unless the flags say otherwise.
TRACE_NUM_BLOCKS = 64


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`--help` shows each flag's default after its meaning; descriptions and epilogs keep their
    line breaks (the benches print their commands there)."""


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    # httpx logs every request at INFO: a line per request would bury a load test's report.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def name_flags(parser: argparse.ArgumentParser, message: str) -> str | None:
    """`message` with each option's name (`max_num_seqs`) written as its flag (`--max-num-seqs`),
    or None when it names no option of `parser`."""
    flags = {
        action.dest: next(o for o in action.option_strings if o.startswith("--"))
        for action in parser._actions
        if any(o.startswith("--") for o in action.option_strings)
    }
    names = "|".join(re.escape(d) for d in sorted(flags, key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w-])({names})(?![\w'-])")  # not "the model's"
    if not pattern.search(message):
        return None
    return pattern.sub(lambda m: flags[m.group(1)], message)


@contextmanager
def usage_errors(parser: argparse.ArgumentParser) -> Iterator[None]:
    """Errors in what the command line asked for end as argparse's own do: one line
    (`minivllm trace: error: --max-num-batched-tokens (64) must be ...`) and exit status 2, not
    a traceback. A `ValueError` counts when it names one of the flags (the configs' messages say
    `field must be ..., got value`); a model that cannot be found or read always does."""
    from minivllm.model.errors import ModelLoadError

    try:
        yield
    except ModelLoadError as exc:
        parser.error(str(exc))
    except ValueError as exc:
        message = name_flags(parser, str(exc))
        if message is None:
            raise
        parser.error(message)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's own flags (the table in cli_args.py), then the engine's (from EngineArgs)."""
    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.entrypoints.cli_args import add_server_arguments

    # vLLM's `vllm serve MODEL`; `--model MODEL` (the engine flag) says the same.
    parser.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="the model to serve, as --model"
    )
    add_server_arguments(parser)
    EngineArgs.add_cli_args(parser)


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """What to run and where to write, then the engine's flags (from EngineArgs)."""
    from minivllm.engine.arg_utils import EngineArgs

    parser.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="the model to run, as --model"
    )
    g = parser.add_argument_group("trace")
    g.add_argument(
        "--prompt", action="append", required=True, help="a prompt; repeat the flag for more"
    )
    g.add_argument("--n", type=int, default=1, help="samples per prompt (they share blocks)")
    g.add_argument("--max-tokens", type=int, default=16, help="tokens to generate per sample")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens")
    g.add_argument("--out", required=True, help="folder for trace.json and index.html")
    EngineArgs.add_cli_args(parser, defaults=EngineArgs(num_gpu_blocks_override=TRACE_NUM_BLOCKS))


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
    args.parser = parser  # errors found later are reported as the parser's (`usage_errors`)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error(
                f"the model is given twice, as {args.model_tag!r} and as --model {args.model!r}; "
                "give it once"
            )
        args.model = args.model_tag
    return args


def serve_headless(args: argparse.Namespace) -> int:
    """`minivllm serve ... --headless` (vLLM's `run_headless`), on a host with no API server:
    with --data-parallel-size > 1, this host's engine cores, which dial the API server's host
    (dp_remote.py); else node i > 0 of --nnodes: spawn this node's ranks and wait for them; they
    take the model's config from node 0's engine."""
    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.engine.dp_client import default_dp_core_threads, visible_devices_per_core
    from minivllm.engine.dp_remote import run_headless_cores
    from minivllm.executor.abstract import worker_config
    from minivllm.executor.multiproc_executor import run_headless

    with usage_errors(args.parser):
        config = EngineArgs.from_cli_args(args).create_engine_config()
        parallel = config.parallel
        local = parallel.data_parallel_size_local
        if parallel.data_parallel_size > 1:
            if not local:
                raise ValueError(
                    "--headless with data_parallel_size > 1 runs this host's engine cores: "
                    f"data_parallel_size_local must be at least 1, got {local}"
                )
            devices = visible_devices_per_core(config, local)
            threads = args.engine_core_threads or default_dp_core_threads(local)
    if parallel.data_parallel_size > 1:
        return run_headless_cores(config, threads, devices)
    with usage_errors(args.parser):
        if parallel.nnodes == 1 or parallel.node_rank == 0:
            raise ValueError(
                "--headless runs the ranks of one node of several: it needs --nnodes > 1 and "
                "--node-rank > 0 (node 0 runs the engine), or --data-parallel-size > 1 (this "
                f"host's engine cores), got nnodes={parallel.nnodes}, "
                f"node_rank={parallel.node_rank}"
            )
        if parallel.distributed_executor_backend != "mp":
            raise ValueError(
                "--headless needs distributed_executor_backend='mp' (Ray starts its own "
                f"workers), got {parallel.distributed_executor_backend!r}"
            )
    # The attention backend is node 0's: its WorkerConfig replaces this one at the rendezvous.
    return run_headless(worker_config(config, config.model.attention_backend), parallel)


def serve(args: argparse.Namespace) -> int:
    if args.headless:
        return serve_headless(args)
    import uvicorn

    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.engine.core_client import EngineCoreClient
    from minivllm.engine.dp_client import DPEngineCoreClient
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.entrypoints.api_server import build_app
    from minivllm.entrypoints.draining_server import ABORT_GRACE_S, DrainingServer
    from minivllm.entrypoints.metrics import show_hidden_metrics

    with usage_errors(args.parser):
        if args.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be at least 0, got {args.shutdown_timeout}")
        if args.lora_modules and not args.enable_lora:  # refused before the model loads
            raise ValueError(
                "lora_modules needs enable_lora: the engine serves no adapter without it"
            )
        config = EngineArgs.from_cli_args(args).create_engine_config()
        if args.engine_core_process and args.enable_dashboard:
            raise ValueError(
                "--engine-core-process cannot serve --enable-dashboard (it needs the engine in "
                "the server's process)"
            )
        dp = config.parallel.data_parallel_size
        if config.parallel.data_parallel_start_rank:
            raise ValueError(
                "data_parallel_start_rank is for a --headless host's cores: the API server's "
                "host runs ranks 0..data_parallel_size_local-1, got data_parallel_start_rank="
                f"{config.parallel.data_parallel_start_rank}"
            )
        if dp > 1 and args.enable_dashboard:
            raise ValueError(
                "--enable-dashboard is not supported with --data-parallel-size > 1 (it needs the "
                f"engine in the server's process), got data_parallel_size={dp}"
            )
        engine: LLMEngine | EngineCoreClient | DPEngineCoreClient
        if dp > 1:  # one engine-core process per rank
            engine = DPEngineCoreClient(config, args.engine_core_threads)
        elif args.engine_core_process:
            engine = EngineCoreClient(config, args.engine_core_threads)
        else:
            engine = LLMEngine(config)
    names = args.served_model_name or [args.model or engine.source.name]

    def ready() -> None:  # logged once the engine thread runs, before uvicorn's own line
        where = f"unix:{args.uds}" if args.uds else f"http://{args.host}:{args.port}"
        logging.getLogger("minivllm").info(
            "minivllm server ready: serving %s on %s (OpenAI API under /v1)",
            ", ".join(names),
            where,
        )

    app = build_app(
        engine,
        served_model_names=names,
        api_key=resolve_api_key(args.api_key),
        max_body_bytes=args.max_request_body_bytes,
        max_waiting_requests=args.max_waiting_requests,
        log_stats_interval_s=args.log_stats_interval,
        on_ready=ready,
        enable_dashboard=args.enable_dashboard,
        dashboard_max_steps=args.dashboard_max_steps,
        enable_request_id_headers=args.enable_request_id_headers,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        log_requests=args.log_requests,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        show_hidden_metrics=show_hidden_metrics(args.show_hidden_metrics_for_version),
        model_path=args.model,
        lora_modules=args.lora_modules,
    )
    server_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        uds=args.uds,
        root_path=args.root_path,  # behind a proxy that strips a path prefix (vLLM's --root-path)
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=args.shutdown_timeout + ABORT_GRACE_S,
    )
    DrainingServer(server_config, app.state.engine_client, args.shutdown_timeout).run()
    return 0


def trace(args: argparse.Namespace) -> int:
    import dataclasses

    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.llm import LLM
    from minivllm.sampling_params import SamplingParams

    with usage_errors(args.parser):
        params = SamplingParams(
            n=args.n,
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            ignore_eos=args.ignore_eos,
        )
        llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
    with llm.trace() as recorder:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    page = recorder.save(args.out)
    for out in outputs:
        for sample in out.outputs:
            print(f"request {out.request_id} #{sample.index}: {sample.text!r}")
    stats = llm.get_stats()
    print(
        f"{len(recorder.steps)} steps recorded ({stats.num_preemptions} preemptions) on "
        f"{stats.num_kv_blocks} blocks of {args.block_size} tokens"
    )
    print(f"wrote {page.parent / 'trace.json'} and {page}")
    print(f"open {page.resolve().as_uri()} in a browser")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minivllm", description="the readable vLLM")
    sub = parser.add_subparsers(dest="command", required=True)
    # Each subcommand's own parser is built in main(), once we know which one runs.
    sub.add_parser("serve", help="OpenAI-compatible HTTP server", add_help=False)
    sub.add_parser("trace", help="record a run's steps as trace.json + a page", add_help=False)
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
    if argv[:1] == ["trace"]:
        trace_parser = argparse.ArgumentParser(
            prog="minivllm trace", description=TRACE_DESCRIPTION, formatter_class=HelpFormatter
        )
        add_trace_arguments(trace_parser)
        return trace(parse_serve_args(trace_parser, argv[1:]))
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHMARKS:
        module = importlib.import_module(f"minivllm.benchmarks.{argv[1]}")
        bench_parser = argparse.ArgumentParser(
            prog=f"minivllm bench {argv[1]}", formatter_class=HelpFormatter
        )
        module.add_arguments(bench_parser)
        bench_args = bench_parser.parse_args(argv[2:])
        with usage_errors(bench_parser):
            return int(module.main(bench_args))
    build_parser().parse_args(argv)  # prints usage, or the error for an unknown command
    return 2


if __name__ == "__main__":
    sys.exit(main())
