"""`python -m minivllm.entrypoints.openai.api_server --model NAME --port N`: the same server as
`minivllm serve`, with the same flags, under the module path of vLLM's getting-started guides
(vllm/entrypoints/openai/api_server.py), so their commands run with `vllm` replaced by `minivllm`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from minivllm.entrypoints.cli import make_serve_parser, parse_serve_args, serve, setup_logging

PROG = "python -m minivllm.entrypoints.openai.api_server"


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging()
    return serve(parse_serve_args(make_serve_parser(PROG), argv))


if __name__ == "__main__":
    sys.exit(main())
