"""minivllm's server against llama.cpp's `llama-server` on one GGUF file, both loaded by the same
client, each alone: decode at batch 1 and at batch 8, the prefill of a long prompt, peak memory,
and each decode run against its memory-bandwidth floor.

The model is by default the 1B-class Q4_K_M file `make_llama_1b_gguf.py` writes (Llama-3.2-1B's
shape, random weights); `--model smollm2` is the bundled SmolLM2-135M-Instruct Q4_1 file (with
`--batches 1,32` the workloads of docs/performance.md). Each system runs as a server started by
this script (`ServerProcess`, minivllm/benchmarks/server_process.py), one after the other, never
together, with the same threads (`-t N` for llama-server, `OMP_NUM_THREADS=N` for minivllm) and KV
pools of the same number of tokens (llama-server `-np max(batches) -c ... -cb -kvu`, one pool; with
`-kvu` a slot may use the whole pool, src/llama-context.cpp, so the 1,024-token prompt fits). Every
request goes through `minivllm bench serve`'s client (minivllm/benchmarks/serve.py): streamed
/v1/completions, prompts of random token ids, `ignore_eos`, greedy; llama-server's get
`cache_prompt: false`, and minivllm's random prompts share no prefix its cache could reuse.

Phases, per server, after two untimed warm-up requests (a warm-up that fails ends that system's
run and the error is reported, as does any phase with a failed request: the harness never waits
longer than `--timeout` a request):

- decode at batch B (each of `--batches`): B x `--rounds` requests of `--prompt-len` prompt and
  `--output-len` output tokens, B in flight. Output tok/s over the phase's wall time (prefills
  included), and the decode rate B / median TPOT (TPOT: a request's time after its first token,
  per further token), which is the one held to the floor;
- prefill: `--prefill-repeats` requests of `--prefill-len` prompt tokens and one output token, one
  at a time: median time to first token, and prompt tokens/s from it;
- the server's peak resident set (VmHWM) at the end.

The floor of a decode step is the bytes it must read at least: every tensor of the GGUF file once
(the tied head reads the whole embedding table) plus each sequence's KV cache at the phase's mean
context (prompt + output / 2, in the system's KV dtype: llama-server f16, minivllm its
`--kv-cache-dtype`), divided by the copy bandwidth measured in this run (a 1 GiB torch copy with
`--threads` threads, read + written bytes, before and after the servers; the higher is used). The
floor rate is B x bandwidth / bytes; each system's decode rate is reported as a fraction of it.

`--minivllm-isa avx2` runs minivllm's server with `MINIVLLM_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2` (its kernels, ATen's and oneDNN's held to AVX2: `IsaLevel.environment`,
minivllm/cpu/isa.py); pass llama.cpp's AVX2 build's llama-server beside it. The JSON records the CPU model and SIMD flags, `uptime` before and
after, minivllm's git commit, llama-server's build, every command and environment override.

    python benchmarks/llama_cpp_1b.py --llama-server ~/llama.cpp-peer/build/bin/llama-server \\
        --json docs/perf/llama-cpp-1b-native.json
    python benchmarks/llama_cpp_1b.py --quick ...   # a few tokens: checks the harness, times nothing
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import torch

from minivllm.benchmarks import llama_cpp, serve
from minivllm.benchmarks.machine import measure_copy_bandwidth
from minivllm.benchmarks.report import cpu_description, print_table, write_json
from minivllm.benchmarks.server_process import ServerProcess
from minivllm.cpu import isa

DEFAULT_MODEL = Path("~/.cache/minivllm-bench/llama-1b-random-Q4_K_M.gguf").expanduser()
SIMD_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16",
              "amx_int8")  # fmt: skip
KV_BYTES = {"auto": 4, "float32": 4, "bfloat16": 2, "float16": 2}  # minivllm's auto on CPU: float32


# ---------------------------------------------------------------------------------- the model file
@dataclass(frozen=True)
class GgufFacts:
    """What the floor needs from the file: its tensor bytes and the KV cache's shape."""

    path: Path
    tensor_bytes: int  # every tensor's data, summed: what one decode step reads at least
    layers: int
    kv_heads: int
    head_dim: int

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * element_bytes  # K and V

    @staticmethod
    def read(path: Path) -> GgufFacts:
        r = gguf.GGUFReader(path)
        arch = r.fields["general.architecture"].contents()

        def field_(key: str) -> int:
            return int(r.fields[f"{arch}.{key}"].contents())

        heads = field_("attention.head_count")
        head_dim = (
            field_("attention.key_length")
            if f"{arch}.attention.key_length" in r.fields
            else field_("embedding_length") // heads
        )
        return GgufFacts(
            path=path,
            tensor_bytes=sum(int(t.n_bytes) for t in r.tensors),
            layers=field_("block_count"),
            kv_heads=field_("attention.head_count_kv"),
            head_dim=head_dim,
        )


def resolve_model(name: str | None) -> Path:
    if name in (None, "smollm2"):
        if name is None and DEFAULT_MODEL.is_file():
            return DEFAULT_MODEL
        if name is None:
            raise SystemExit(
                f"no {DEFAULT_MODEL}: write it with benchmarks/make_llama_1b_gguf.py, or pass "
                "--model FILE.gguf or --model smollm2"
            )
        return llama_cpp.gguf_file(None)
    return llama_cpp.gguf_file(name)


# ---------------------------------------------------------------------------------- minivllm's server
@dataclass(kw_only=True)
class MinivllmServer(ServerProcess):
    """`minivllm serve FILE` in this interpreter (so PYTHONPATH picks the checkout), `threads`
    OpenMP threads, `env_overrides` on top of the bench's environment."""

    model: Path
    threads: int
    max_num_seqs: int
    max_model_len: int
    kv_cache_space_gib: float
    kv_cache_dtype: str = "auto"
    extra_args: list[str] = field(default_factory=list)
    env_overrides: dict[str, str] = field(default_factory=dict)
    src: Path | None = None  # the minivllm tree to run; None: the one PYTHONPATH names
    name: str = "minivllm-serve"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "minivllm.entrypoints.cli", "serve", str(self.model),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--max-num-seqs", str(self.max_num_seqs), "--max-model-len", str(self.max_model_len),
            "--cpu-kv-cache-space", f"{self.kv_cache_space_gib:.3f}",
            "--kv-cache-dtype", self.kv_cache_dtype, "--disable-uvicorn-access-log",
            *self.extra_args,
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), **self.env_overrides}
        if self.src is not None:
            env["PYTHONPATH"] = str(self.src.resolve())
        return env

    def cwd(self) -> Path | None:
        # `python -m` puts the working folder first on sys.path: a checkout's own minivllm there
        # would win over PYTHONPATH's
        return self.src


# ---------------------------------------------------------------------------------- the phases
def client_args(args: argparse.Namespace, url: str, **overrides: Any) -> argparse.Namespace:
    """`bench serve`'s namespace for one phase against the server at `url`."""
    base = {
        "base_url": url, "model": None, "api_key": None, "random_vocab_size": 30000,
        "request_rate": float("inf"), "percentiles": "50,90,99", "timeout": args.timeout,
        "random_input_len": args.prompt_len, "random_output_len": args.output_len,
    }  # fmt: skip
    return argparse.Namespace(**(base | overrides))


def run_phase(
    server: ServerProcess, args: argparse.Namespace, extra: dict[str, Any], **phase: Any
) -> dict[str, Any]:
    summary = asyncio.run(serve.run(client_args(args, server.url, **phase), extra))
    summary.pop("owned_by", None)
    if summary["failed"] and not server.alive():
        summary["errors"].append(f"the server exited; the end of its log:\n{server.log_tail()}")
    return summary


def decode_floor(
    facts: GgufFacts, batch: int, context: float, kv_element_bytes: int, bandwidth: float
) -> dict[str, float]:
    """Bytes one step of `batch` sequences at mean `context` reads, and the tokens/s that bytes at
    `bandwidth` (bytes/s) allow."""
    step_bytes = facts.tensor_bytes + batch * context * facts.kv_bytes_per_token(kv_element_bytes)
    return {"step_bytes": step_bytes, "floor_tok_s": batch * bandwidth / step_bytes}


def run_phases(
    server: ServerProcess, args: argparse.Namespace, extra: dict[str, Any], out: dict[str, Any]
) -> None:
    """The warm-up, each decode batch, the prefill, into `out`; the first failure ends the run
    with `out["error"]` saying where and why."""
    warm = run_phase(server, args, extra, num_prompts=2, random_output_len=4, max_concurrency=2,
                     seed=1000)  # fmt: skip
    if warm["failed"]:
        out["error"] = "the warm-up failed: " + " | ".join(warm["errors"])
        return
    for i, batch in enumerate(args.batches):
        s = run_phase(server, args, extra, num_prompts=batch * args.rounds,
                      max_concurrency=batch, seed=i)  # fmt: skip
        if s["median_tpot_ms"] > 0:
            s["decode_tok_s"] = batch / (s["median_tpot_ms"] / 1000)
        s["mean_context"] = args.prompt_len + args.output_len / 2
        out["phases"][f"decode_b{batch}"] = s
        if s["failed"]:
            out["error"] = f"decode at batch {batch}: " + " | ".join(s["errors"])
            return
    s = run_phase(server, args, extra, num_prompts=args.prefill_repeats,
                  random_input_len=args.prefill_len, random_output_len=1, max_concurrency=1,
                  seed=100)  # fmt: skip
    if s["median_ttft_ms"] > 0:
        s["prefill_tok_s"] = args.prefill_len / (s["median_ttft_ms"] / 1000)
    out["phases"][f"prefill_{args.prefill_len}"] = s
    if s["failed"]:
        out["error"] = "prefill: " + " | ".join(s["errors"])


def run_system(
    server: ServerProcess,
    args: argparse.Namespace,
    kv_element_bytes: int,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """Every phase against one server, started for them and stopped after; its peak RSS is read
    before it stops, a failed run's too."""
    out: dict[str, Any] = {"kv_element_bytes": kv_element_bytes, "phases": {}}
    began = time.perf_counter()
    try:
        with server:
            out["startup_s"] = time.perf_counter() - began
            out["command"] = " ".join(server.command())  # with the port it was given
            if isinstance(server, llama_cpp.LlamaServerPeer):
                out["llama_cpp_build"] = server.build_info()
            try:
                run_phases(server, args, extra, out)
            finally:
                out["peak_rss_bytes"] = server.peak_rss_bytes()
                out["rss_bytes_at_end"] = server.rss_bytes()
    except RuntimeError as exc:  # did not start, or died starting: its log is in the message
        out["error"] = str(exc)
    return out


def add_floors(result: dict[str, Any], facts: GgufFacts, bandwidth: float) -> None:
    for name, phase in result["phases"].items():
        if not name.startswith("decode_b"):
            continue
        batch = int(name.removeprefix("decode_b"))
        phase |= decode_floor(
            facts, batch, phase["mean_context"], result["kv_element_bytes"], bandwidth
        )
        if "decode_tok_s" in phase:
            phase["fraction_of_floor"] = phase["decode_tok_s"] / phase["floor_tok_s"]


# ---------------------------------------------------------------------------------- the machine
def cpu_facts() -> dict[str, Any]:
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {
        "model_name": model,
        "simd_flags": [f for f in SIMD_FLAGS if f in flags],
        "description": cpu_description(),
    }


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return f"load {os.getloadavg()}"


def minivllm_commit(src: Path | None) -> str:
    """The commit of the minivllm the server runs: `src`'s (a checkout, or an exported tree with
    the commit in a file named .git-commit), else the one this script imports."""
    if src is None:
        import minivllm

        src = Path(minivllm.__file__).resolve().parent.parent
    if (src / ".git-commit").is_file():
        return f"{(src / '.git-commit').read_text().strip()} at {src}"
    root = src
    git = ["git", "-C", str(root)]
    try:
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run([*git, "status", "--porcelain", "minivllm"], capture_output=True,
                               text=True).stdout.strip()  # fmt: skip
    except OSError:
        return "unknown"
    return f"{head.stdout.strip()}{' (modified)' if dirty else ''} at {root}"


def copy_bandwidth(threads: int) -> float:
    torch.set_num_threads(threads)
    return measure_copy_bandwidth(torch.device("cpu"), nbytes=2**30, repeats=3)


# ---------------------------------------------------------------------------------- the report
REPORT_ROWS = [  # label, phase (None: the system itself), field, a ratio of the two systems
    ("b{b} output tok/s (with prefills)", "decode_b{b}", "output_throughput", True),
    ("b{b} decode tok/s (B / median TPOT)", "decode_b{b}", "decode_tok_s", True),
    ("b{b} floor tok/s", "decode_b{b}", "floor_tok_s", True),
    ("b{b} fraction of floor", "decode_b{b}", "fraction_of_floor", False),
]
PREFILL_ROWS = [
    ("prefill {p}: median TTFT ms", "prefill_{p}", "median_ttft_ms", True),
    ("prefill {p}: prompt tok/s", "prefill_{p}", "prefill_tok_s", True),
]


def print_report(report: dict[str, Any]) -> None:
    """One row a metric, one column a system, and minivllm ÷ llama.cpp where both ran."""
    systems = report["systems"]
    names = list(systems)
    specs: list[tuple[str, str | None, str, bool]] = [(lbl.format(b=b), ph.format(b=b), f, r) for b in report["args"]["batches"]
             for lbl, ph, f, r in REPORT_ROWS]  # fmt: skip
    p = report["args"]["prefill_len"]
    specs += [(lbl.format(p=p), ph.format(p=p), f, r) for lbl, ph, f, r in PREFILL_ROWS]
    specs.append(("peak RSS MiB", None, "peak_rss_bytes", True))
    specs.append(("RSS at the end MiB", None, "rss_bytes_at_end", True))
    rows: list[list[Any]] = []
    for label, phase, name, ratio in specs:
        values = [(s if phase is None else s["phases"].get(phase, {})).get(name)
                  for s in systems.values()]  # fmt: skip
        if "rss_bytes" in name:
            values = [None if v is None else v / 2**20 for v in values]
        cells: list[Any] = [
            "" if v is None else f"{v:.1%}" if name == "fraction_of_floor" else v for v in values
        ]
        if len(values) == 2:
            a, b = values
            cells.append(f"{a / b:.2f}x" if ratio and a and b else "")
        rows.append([label, *cells])
    headers = ["metric", *names]
    if len(names) == 2:
        headers.append(f"{names[0]} ÷ {names[1]}")
    print_table(headers, rows)
    for n in names:
        if "error" in systems[n]:
            print(f"\n{n} FAILED: {systems[n]['error']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help=f"a GGUF file, or smollm2; unset: {DEFAULT_MODEL}")
    p.add_argument(
        "--llama-server", type=Path, default=None, help="llama-server; unset: minivllm only"
    )
    p.add_argument("--systems", default="minivllm,llama.cpp", help="which to run, in this order")
    p.add_argument("--minivllm-isa", choices=["native", *isa.LEVEL_NAMES], default="native",
                   help="the level minivllm's server runs at, PyTorch's and oneDNN's kernels "
                   "held to it too (minivllm/cpu/isa.py); native: the CPU's best")  # fmt: skip
    p.add_argument("--kv-cache-dtype", default="auto", choices=sorted(KV_BYTES), help="minivllm's")
    p.add_argument("--minivllm-src", type=Path, default=None,
                   help="run the server from this minivllm tree (its PYTHONPATH), e.g. another "
                   "branch's; unset: the minivllm this script imports")  # fmt: skip
    p.add_argument(
        "--minivllm-arg", action="append", default=[], help="more `minivllm serve` flags"
    )
    p.add_argument("--llama-server-arg", action="append", default=[],
                   help="more llama-server flags, e.g. --llama-server-arg=--no-repack (llama.cpp's "
                   "AMX matmul segfaults on Q4_K_M files, llama.cpp issue 20824; --no-repack turns "
                   "AMX off, with the CPU repacking)")  # fmt: skip
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="1,8", help="decode batches, comma-separated")
    p.add_argument("--rounds", type=int, default=2, help="requests per decode phase: B x rounds")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument("--prefill-repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take")
    p.add_argument("--startup-timeout", type=float, default=1200.0,
                   help="seconds a server may take to start (minivllm may compile its kernels)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="a few tokens: checks the harness only")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.systems = args.systems.split(",")
    if args.quick:
        args.output_len, args.prefill_len, args.prefill_repeats, args.rounds = 8, 128, 1, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = resolve_model(args.model)
    facts = GgufFacts.read(model)
    llama = None
    if "llama.cpp" in args.systems:
        llama = llama_cpp.setup_from_flags(args.llama_server, model, args.threads)
        if llama is None:
            args.systems.remove("llama.cpp")
    parallel = max(args.batches)
    # The largest batch's tokens and the long prompt's besides: llama-server keeps a finished
    # slot's KV until it needs the room, and a pool the batch had filled made the prompt's first
    # decode fail and retry in smaller pieces, purging slots ("failed to find free space")
    pool_tokens = parallel * (args.prompt_len + args.output_len) + args.prefill_len + 1
    per_slot = -(-pool_tokens // (parallel * 256)) * 256  # llama-server's -c is -np x this
    report: dict[str, Any] = {
        "benchmark": "llama_cpp_1b",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": str(model),
        "gguf_tensor_bytes": facts.tensor_bytes,
        "cpu": cpu_facts(),
        "uptime_before": uptime(),
        "minivllm_commit": minivllm_commit(args.minivllm_src),
        "kv_pool_tokens": parallel * per_slot,
        "systems": {},
    }
    print(f"{model.name}: {facts.tensor_bytes / 1e6:.1f} MB of tensors; {report['cpu']}")
    print(f"before: {report['uptime_before']}")
    bw = [copy_bandwidth(args.threads)]
    print(f"copy bandwidth ({args.threads} threads): {bw[0] / 1e9:.1f} GB/s")
    for name in args.systems:
        print(f"--- {name}", flush=True)
        if name == "minivllm":
            kv_bytes = KV_BYTES[args.kv_cache_dtype]
            native = args.minivllm_isa == "native"
            level = isa.best_level() if native else isa.level_named(args.minivllm_isa)
            env = {} if native else level.environment()
            server: ServerProcess = MinivllmServer(
                model=model, threads=args.threads, max_num_seqs=parallel,
                max_model_len=max(args.prefill_len + 1, args.prompt_len + args.output_len),
                kv_cache_space_gib=parallel * per_slot * facts.kv_bytes_per_token(kv_bytes) / 2**30,
                kv_cache_dtype=args.kv_cache_dtype, extra_args=args.minivllm_arg,
                env_overrides=env, src=args.minivllm_src, startup_timeout_s=args.startup_timeout,
            )  # fmt: skip
            result = run_system(server, args, kv_bytes, {})
            result |= {"isa_level": level.name, "env_overrides": env,
                       "src": str(args.minivllm_src or "")}  # fmt: skip
        elif name == "llama.cpp" and llama is not None:
            server = llama_cpp.LlamaServerPeer(
                llama, parallel=parallel, ctx_per_slot=per_slot,
                extra_args=args.llama_server_arg, startup_timeout_s=args.startup_timeout,
            )  # fmt: skip
            result = run_system(server, args, 2, {"cache_prompt": False})  # f16 KV
        else:
            raise SystemExit(f"unknown system {name!r}: minivllm or llama.cpp")
        report["systems"][name] = result
        if "error" in result:
            print(f"{name} FAILED: {result['error']}", flush=True)
    bw.append(copy_bandwidth(args.threads))
    report["copy_bandwidth_bytes_per_s"] = bw
    report["uptime_after"] = uptime()
    for result in report["systems"].values():
        add_floors(result, facts, max(bw))
    print(f"after: {report['uptime_after']}; copy bandwidth {bw[1] / 1e9:.1f} GB/s")
    print_report(report)
    write_json(args.json, report)
    return 1 if any("error" in r for r in report["systems"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
