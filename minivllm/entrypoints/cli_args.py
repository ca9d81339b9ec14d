"""The server's own flags of `minivllm serve`, declared once as a table (vLLM's FrontendArgs,
vllm/entrypoints/openai/cli_args.py); the engine's flags come from `EngineArgs`.

Cheap to import (no FastAPI, no torch): `minivllm --help` reads it, and `api_server.build_app` takes
its defaults from the constants here, so a default is written in one place.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from minivllm.entrypoints.tool_parsers import TOOL_PARSER_NAMES

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # 4 MiB: ~1M tokens of text, far past any context
DEFAULT_MAX_WAITING_REQUESTS = 1024  # beyond this, new requests get 503 + Retry-After
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0  # a few seconds for short requests to finish; a long one is cut


@dataclass(frozen=True)
class LoRAModulePath:
    name: str  # the model name requests use for the adapter
    path: str  # its PEFT folder
    base_model_name: str | None = None  # its card's `parent`; unset: the first served name


class LoRAParserAction(argparse.Action):
    """`--lora-modules` as vLLM parses it: each value `name=path`, or a JSON object
    `{"name": ..., "path": ..., "base_model_name": ...}`."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        modules: list[LoRAModulePath] = []
        for item in values or []:
            if not item:
                continue
            if "=" in item and "," not in item and not item.lstrip().startswith("{"):
                name, _, path = item.partition("=")
                if not name or not path:
                    parser.error(f"--lora-modules wants name=path, got {item!r}")
                modules.append(LoRAModulePath(name, path))
                continue
            try:
                fields = json.loads(item)
                modules.append(LoRAModulePath(**fields))
            except json.JSONDecodeError:
                parser.error(f"Invalid JSON format for --lora-modules: {item}")
            except TypeError as exc:
                parser.error(f"Invalid fields for --lora-modules: {item} - {exc}")
        setattr(namespace, self.dest, modules)


# flag -> argparse's keywords, in the order `--help` lists them.
SERVER_FLAGS: dict[str, dict[str, Any]] = {
    "--host": {"default": "127.0.0.1", "help": "address to listen on; 0.0.0.0 for all"},
    "--port": {"type": int, "default": 8000, "help": "port to listen on"},
    "--api-key": {
        "default": None,
        "help": "require 'Authorization: Bearer KEY' on /v1; unset: the VLLM_API_KEY environment "
        "variable's value (the flag wins when both are set, as in vLLM)",
    },
    "--served-model-name": {
        "nargs": "+",
        "default": None,
        "help": "names accepted in a request's model field, the first one reported; unset: the "
        "model",
    },
    "--max-request-body-bytes": {
        "type": int,
        "default": DEFAULT_MAX_BODY_BYTES,
        "help": "larger request bodies are refused with 413",
    },
    "--max-waiting-requests": {
        "type": int,
        "default": DEFAULT_MAX_WAITING_REQUESTS,
        "help": "answer 503 + Retry-After while this many requests wait",
    },
    "--log-stats-interval": {
        "type": float,
        "default": 5.0,
        "help": "seconds between the stats log lines (throughput, queues, KV cache use)",
    },
    "--uvicorn-log-level": {"default": "info", "help": "uvicorn's own log level"},
    "--disable-uvicorn-access-log": {
        "action": "store_true",
        "help": "no access-log line per HTTP request from uvicorn",
    },
    "--uds": {
        "default": None,
        "help": "listen on this unix domain socket instead of --host/--port",
    },
    "--root-path": {
        "default": "",
        "help": "the path prefix a proxy strips before forwarding (FastAPI's root_path)",
    },
    "--enable-request-id-headers": {
        "action": "store_true",
        "help": "answer with an X-Request-Id header: the request's own, or a fresh one",
    },
    "--enable-tokenizer-info-endpoint": {
        "action": "store_true",
        "help": "serve GET /tokenizer_info (the tokenizer's settings and chat template)",
    },
    "--show-hidden-metrics-for-version": {
        "default": None,
        "help": "also serve the metrics vLLM deprecated (e.g. vllm:gpu_cache_usage_perc); vLLM "
        "takes the version they were hidden in, minivllm shows them for any value",
    },
    "--shutdown-timeout": {
        "type": float,
        "default": DEFAULT_SHUTDOWN_TIMEOUT_S,
        "help": "on SIGTERM or SIGINT, seconds the requests in flight may run on (no new ones are "
        "accepted); then the engine aborts them and the server exits (vLLM's flag; 0: abort at "
        "once, vLLM's default)",
    },
    "--lora-modules": {
        "nargs": "+",
        "default": None,
        "action": LoRAParserAction,
        "metavar": "NAME=PATH",
        "help": "LoRA adapters served under their own model names, loaded at start (needs "
        "--enable-lora): name=path, or vLLM's JSON form "
        '\'{"name": "...", "path": "...", "base_model_name": "..."}\'',
    },
    "--return-tokens-as-token-ids": {
        "action": "store_true",
        "help": "in logprobs, name each token 'token_id:N' instead of its text",
    },
}
# One setting, two spellings (vLLM's newer and older flag): a mutually exclusive pair.
LOG_REQUESTS_FLAGS: dict[str, dict[str, Any]] = {
    "--enable-log-requests": {
        "dest": "log_requests",
        "action": "store_true",
        "help": "log one line per request with its parameters (vLLM's default since 0.10: off)",
    },
    "--disable-log-requests": {
        "dest": "log_requests",
        "action": "store_false",
        "help": "no request log lines (the default; vLLM's older flag)",
    },
}
SERVER_FLAGS_AFTER_LOGS: dict[str, dict[str, Any]] = {
    "--enable-dashboard": {
        "action": "store_true",
        "help": "serve a live view of the KV blocks and the scheduler at /dashboard (behind "
        "--api-key when one is set)",
    },
    "--dashboard-max-steps": {
        "type": int,
        "default": 256,
        "help": "the dashboard keeps this many recent engine steps (bounded memory)",
    },
    "--engine-core-process": {
        "action": argparse.BooleanOptionalAction,
        "default": False,
        "help": "run the engine in a process of its own, so the server's host work (HTTP, JSON, "
        "tokenization) never takes the model's core (vLLM's VLLM_ENABLE_V1_MULTIPROCESSING); "
        "off by default: on 2 cores it measured no faster (docs/serving.md)",
    },
    "--engine-core-threads": {
        "type": int,
        "default": None,
        "help": "torch's intra-op threads in the engine-core process, or in each of this host's "
        "--data-parallel-size-local cores (unset: all cores but one, which the server's own work "
        "keeps, shared out between the cores)",
    },
    "--headless": {
        "action": "store_true",
        "help": "run no API server here, only this host's share of the work (vLLM's flag): "
        "with --data-parallel-size > 1, engine cores --data-parallel-start-rank.. (as many as "
        "--data-parallel-size-local) that connect to the API server at "
        "--data-parallel-address:--data-parallel-rpc-port; else node --node-rank > 0 of "
        "--nnodes, meeting node 0 at --master-addr:--master-port",
    },
    "--enable-auto-tool-choice": {
        "action": "store_true",
        "help": 'let the model choose to call tools (tool_choice "auto"); needs --tool-call-parser',
    },
    "--tool-call-parser": {
        "default": None,
        "choices": TOOL_PARSER_NAMES,
        "help": "how to find tool calls in the model's text (its chat template's format)",
    },
}


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags above, in an argument group named "server"."""
    group = parser.add_argument_group("server")
    for flag, how in SERVER_FLAGS.items():
        group.add_argument(flag, **how)
    pair = group.add_mutually_exclusive_group()
    for flag, how in LOG_REQUESTS_FLAGS.items():
        pair.add_argument(flag, **how)
    for flag, how in SERVER_FLAGS_AFTER_LOGS.items():
        group.add_argument(flag, **how)
