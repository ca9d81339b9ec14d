"""`minivllm bench paper`: the paper's headline, paged vs reservation under load (§6.2, Figs. 12-13).

Requests arrive as a Poisson process at a swept rate; each is served by the same engine with one
of the four `kv_allocation` policies (minivllm/experiments/reservation.py): `paged`, and the paper's Orca
baselines `orca-max`, `orca-pow2` and `orca-oracle`, which reserve a contiguous range per request.
For each (policy, rate) it reports the paper's metrics:

    normalized latency      the mean over requests of end-to-end latency / output length (s/token)
    batched requests        the mean number of requests in a step (Fig. 13)

and, per policy, the highest rate it sustains while the normalized latency stays under a bound
(linearly interpolated between the last swept rate under it and the first above it).

Workloads are generated, not downloaded: prompt and output lengths are drawn from exponential
distributions with the means of the paper's Fig. 11 (ShareGPT: 161.31 in, 337.99 out; Alpaca:
19.31 in, 58.45 out), times `--length-scale`, at least 1 token each, a request's prompt + output
capped at max_model_len (output cut first). Every request ignores EOS and generates exactly its
drawn output length, as the paper's oracle assumes.

Two modes:
  --simulate a100-40gb/opt-13b   the paper's first column, in simulated time: the real scheduler
                                 and block manager, a roofline cost per step (experiments/simulated_executor.py)
  (no --simulate)                the real engine on this machine (SmolLM2 by default) with a KV
                                 cache small enough that memory, not compute, limits the batch; its
                                 clock is the sum of the steps' measured CPU time (this process's:
                                 other jobs on a shared machine do not count), and idle gaps
                                 between arrivals are skipped, not slept (nothing runs then)
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from minivllm.benchmarks.engine_under_test import add_run_arguments
from minivllm.benchmarks.paper_plots import plot_batch, plot_latency
from minivllm.benchmarks.paper_sweep import (
    PaperRequest,
    num_requests_at,
    serve,
    summarize,
    sweep,
)
from minivllm.benchmarks.report import machine_load, print_table, write_json
from minivllm.benchmarks.sharing import WORKLOADS
from minivllm.config import KV_ALLOCATIONS
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.experiments.simulated_executor import SimulatedSetup, build_simulated_engine

# §6.2: at the same normalized latency, vLLM sustains this many times the request rate (ShareGPT,
# Fig. 12 top row) and batches this many times the requests (Fig. 13a, OPT-13B, ShareGPT 2 req/s).
PAPER_RATE_RATIO = {"orca-oracle": (1.7, 2.7), "orca-max": (2.7, 8.0)}
PAPER_BATCH_RATIO = {"orca-oracle": 2.2, "orca-max": 4.3}
PAPER = {"rate_ratio": PAPER_RATE_RATIO, "batch_ratio": PAPER_BATCH_RATIO}
# Request rates swept by default (req/s), simulated and real.
SIM_RATES = {"sharegpt": "0.5,1,1.5,2,2.5,3,3.5,4,5,6", "alpaca": "5,10,20,30,40,50,60,80,100"}
CPU_RATES = {"sharegpt": "2,4,6,8,12", "alpaca": "4,8,16,24,32"}
# Seconds of arrivals per point: long enough for a queue to build past a policy's knee (an
# Alpaca request lasts ~1.5 s on the simulated A100, a ShareGPT one ~8 s).
SIM_DURATION = {"sharegpt": 150.0, "alpaca": 10.0}
CPU_DURATION = {"sharegpt": 4.0, "alpaca": 2.0}

EPILOG = """\
Paper scale, in simulated time (a few minutes on a CPU):
  minivllm bench paper --simulate a100-40gb/opt-13b --json paper-sim.json --plot-dir img/
For real, on this CPU with SmolLM2 and a 16-block KV cache (a few minutes):
  minivllm bench paper --workloads sharegpt --json paper-cpu.json"""


# ---------------------------------------------------------------------------------- the CLI
# Real mode: a KV cache of 16 blocks x 16 = 256 slots and 128-token requests at most, so that a
# handful of SmolLM2 requests fill it: memory, not this CPU's compute, limits the batch.
CPU_NUM_BLOCKS = 16
CPU_MAX_MODEL_LEN = 128
ENGINE_DEFAULTS = EngineArgs(enable_prefix_caching=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("experiment")
    g.add_argument(
        "--simulate", default=None, metavar="GPU/MODEL",
        help="simulated time on a modelled GPU, e.g. a100-40gb/opt-13b or h200/tinyllama-1.1b; "
        "unset: run the engine for real on this machine",
    )  # fmt: skip
    g.add_argument(
        "--workloads", default="sharegpt,alpaca", help=f"comma-separated, of {sorted(WORKLOADS)}"
    )
    g.add_argument(
        "--policies", default=",".join(KV_ALLOCATIONS), help="comma-separated kv_allocation values"
    )
    for name in WORKLOADS:
        g.add_argument(f"--{name}-rates", default=None, help=f"request rates (req/s) for {name}; "
                       f"default: {SIM_RATES[name]} simulated, {CPU_RATES[name]} real")  # fmt: skip
    g.add_argument("--duration", type=float, default=None,
                   help="seconds of arrivals per point (requests = rate x duration, clamped to "
                   "--min-requests..--max-requests); default: ShareGPT 150 simulated, 4 real; Alpaca 10 "
                   "simulated, 2 real")  # fmt: skip
    g.add_argument("--min-requests", type=int, default=None, help="default 60 simulated, 8 real")
    g.add_argument("--max-requests", type=int, default=None, help="default 600 simulated, 32 real")
    g.add_argument("--length-scale", type=float, default=None,
                   help="times the Fig. 11 mean lengths; default 1 simulated, 1/16 real")  # fmt: skip
    g.add_argument("--latency-bound", type=float, default=None,
                   help="normalized latency (s/token) a sustained rate stays under; default 0.1 "
                   "simulated and real")  # fmt: skip
    g.add_argument("--batch-rates", default=None,
                   help="Fig. 13's rate per workload, e.g. sharegpt=2,alpaca=30 (the paper's); "
                   "default: each workload's highest swept rate, where every policy is "
                   "memory-bound")  # fmt: skip
    g.add_argument("--plot-dir", default=".", help="where the two PNGs go; '' for none")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    EngineArgs.add_cli_args(parser, defaults=ENGINE_DEFAULTS)
    add_run_arguments(parser)
    parser.epilog = EPILOG  # shown by `minivllm bench paper --help`


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


@dataclasses.dataclass
class Setup:
    """How the sweep's engines are made, and what the report says about them."""

    make_engine: Callable[[str], LLMEngine]  # one engine per KV allocation policy
    num_blocks: int
    max_model_len: int
    info: dict[str, Any]
    title: str


def simulated_setup(args: argparse.Namespace, engine_args: EngineArgs) -> Setup:
    """Engines on the simulated-time executor: a named GPU and model, no weights."""
    setup = SimulatedSetup.named(args.simulate)
    max_model_len = engine_args.max_model_len or setup.model.max_model_len
    keep = ("block_size", "max_num_seqs", "max_num_batched_tokens", "seed")
    overrides = {k: getattr(engine_args, k) for k in keep}
    if engine_args.num_gpu_blocks_override is not None:
        overrides["num_gpu_blocks_override"] = engine_args.num_gpu_blocks_override

    def make_engine(policy: str) -> LLMEngine:
        return build_simulated_engine(
            setup, kv_allocation=policy, enable_prefix_caching=False,
            max_model_len=max_model_len, **overrides,
        )  # fmt: skip

    num_blocks = overrides.get(
        "num_gpu_blocks_override", setup.num_kv_blocks(engine_args.block_size)
    )
    info = {
        "gpu": dataclasses.asdict(setup.gpu), "model": dataclasses.asdict(setup.model),
        "kv_cache_bytes": setup.kv_cache_bytes, "step_overhead_s": setup.step_overhead_s,
    }  # fmt: skip
    title = f"simulated {setup.model.name} on {setup.gpu.name}"
    return Setup(make_engine, num_blocks, max_model_len, info, title)


def real_setup(engine_args: EngineArgs) -> Setup:
    """Engines that run the model on this machine."""
    max_model_len = engine_args.max_model_len or CPU_MAX_MODEL_LEN
    num_blocks = engine_args.num_gpu_blocks_override or CPU_NUM_BLOCKS
    real_args = dataclasses.replace(
        engine_args, max_model_len=max_model_len, num_gpu_blocks_override=num_blocks
    )

    def make_engine(policy: str) -> LLMEngine:
        engine = LLMEngine(
            dataclasses.replace(real_args, kv_allocation=policy).create_engine_config()
        )
        serve(
            engine, [PaperRequest(0.0, 8, 4)]
        )  # first-call costs (kernel builds) out of the numbers
        return engine

    info = {
        "model": real_args.model or "SmolLM2-135M-Instruct (bundled)",
        "machine": machine_load(),
    }
    return Setup(
        make_engine, num_blocks, max_model_len, info, f"real run on this CPU: {info['model']}"
    )


def print_summary(results: list[Any], summary: dict[str, dict[str, Any]], bound: float) -> None:
    for workload, rows in summary.items():
        print(f"\n{workload}: normalized latency (s/token) and mean batched requests per point")
        print_table(
            ["policy", "rate", "norm. latency", "batched", "preemptions"],
            [[r.policy, r.rate, r.normalized_latency, r.mean_batched_requests, r.num_preemptions]
             for r in results if r.workload == workload],
        )  # fmt: skip
        print(
            f"\n{workload}: highest rate under {bound:g} s/token; paged's ratio beside the paper's"
        )
        table = []
        for policy, row in rows.items():
            paper_rate = PAPER_RATE_RATIO.get(policy)
            paper_batch = PAPER_BATCH_RATIO.get(policy)
            table.append([
                policy, f"{row['max_rate']:.2f} ({row['found']})", _ratio(row.get("paged_rate_ratio")),
                f"{paper_rate[0]}-{paper_rate[1]}x" if paper_rate else "-",
                row["mean_batched_requests"], _ratio(row.get("paged_batch_ratio")),
                f"{paper_batch}x" if paper_batch else "-",
            ])  # fmt: skip
        print_table(
            ["policy", "max rate", "paged/it", "paper", "batched", "paged/it", "paper"], table
        )


def main(args: argparse.Namespace) -> int:
    sim = args.simulate is not None
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    engine_args = dataclasses.replace(EngineArgs.from_cli_args(args), enable_prefix_caching=False)
    workloads = {
        w: _floats(getattr(args, f"{w}_rates") or (SIM_RATES if sim else CPU_RATES)[w])
        for w in args.workloads.split(",")
    }
    policies = args.policies.split(",")
    durations = {w: args.duration or (SIM_DURATION if sim else CPU_DURATION)[w] for w in workloads}
    lo, hi = args.min_requests or (60 if sim else 8), args.max_requests or (600 if sim else 32)

    def num_requests(workload: str, rate: float) -> int:
        return num_requests_at(rate, durations[workload], lo, hi)

    scale = args.length_scale or (1.0 if sim else 0.0625)
    bound = args.latency_bound or 0.1
    if args.batch_rates:
        batch_rates = {
            k: float(v) for k, v in (kv.split("=") for kv in args.batch_rates.split(","))
        }
    else:
        batch_rates = {w: max(r) for w, r in workloads.items()}
    setup = simulated_setup(args, engine_args) if sim else real_setup(engine_args)
    max_model_len, num_blocks = setup.max_model_len, setup.num_blocks
    title = f"{setup.title}, {num_blocks} KV blocks x {engine_args.block_size}, max_model_len {max_model_len}"
    start = time.perf_counter()
    results = sweep(setup.make_engine, workloads, policies, num_requests, engine_args.seed,
                    max_model_len, scale, progress=not args.no_progress,
                    stop_above=3 * bound, keep_rates=batch_rates)  # fmt: skip
    summary = summarize(results, bound, batch_rates)
    print_summary(results, summary, bound)
    data = {
        "mode": f"simulate {args.simulate}" if sim else "real",
        "setup": setup.info,
        "num_kv_blocks": num_blocks,
        "block_size": engine_args.block_size,
        "max_model_len": max_model_len,
        "workload": {
            "distribution": "Poisson arrivals; exponential prompt and output lengths around the "
            "Fig. 11 means times length_scale, at least 1, prompt + output <= max_model_len",
            "means": {w: WORKLOADS[w] for w in workloads},
            "length_scale": scale,
            "duration": durations,
            "min_requests": lo,
            "max_requests": hi,
            "seed": engine_args.seed,
        },
        "latency_bound": bound,
        "batch_rates": batch_rates,
        "points": [dataclasses.asdict(r) for r in results],
        "summary": summary,
        "paper": PAPER,
        "seconds": time.perf_counter() - start,
    }
    write_json(args.json, data)
    if args.plot_dir:
        tag = "sim" if sim else "cpu"
        plot_latency(results, bound, Path(args.plot_dir) / f"paper-{tag}-latency.png", title)
        plot_batch(summary, Path(args.plot_dir) / f"paper-{tag}-batch.png", title)
        print(f"figures written to {args.plot_dir}/paper-{tag}-{{latency,batch}}.png")
    return 0


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
