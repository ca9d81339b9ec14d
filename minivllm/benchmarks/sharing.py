"""`minivllm bench sharing`: the KV memory that sharing blocks saves (the paper's §6.3, Fig. 15).

Parallel sampling (`n` samples of one prompt) and beam search (`beam_width` beams) both run many
sequences with a common history. With PagedAttention they share that history's blocks: forked
sequences point at the same physical blocks (reference counts), and only a diverging, partly
filled block is copied (copy-on-write, §4.4). The paper measures the saving against a system where
every sequence holds its own copy: 6.1-30.5% for parallel sampling, 37.6-66.3% for beam search.

The baseline needs no second run: after every step of the real run, each sequence's block table
says how many blocks it would hold on its own (`KVCacheManager.num_blocks_without_sharing`); the
blocks actually held are the ones with a reference count above zero. Prefix caching is off, so
only the sharing inside a request counts, as in the paper. The workloads are synthetic, with the
mean lengths of the paper's Fig. 11 (lengths drawn from an exponential distribution around them):

    alpaca     prompts ~19 tokens, outputs ~58   (short instructions)
    sharegpt   prompts ~161 tokens, outputs ~338 (long conversations)
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from minivllm.benchmarks.engine_under_test import (
    add_run_arguments,
    build_llm,
    drive_engine,
)
from minivllm.benchmarks.report import (
    SHARING_HEADERS,
    machine_load,
    print_table,
    sharing_row,
    write_json,
)
from minivllm.benchmarks.workload import BenchRequest, Exponential, draw_requests, token_pool
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.beam_search import BeamSearchParams
from minivllm.sampling_params import SamplingParams

# Mean (prompt, output) lengths of the paper's Fig. 11 datasets.
WORKLOADS = {"alpaca": (19.31, 58.45), "sharegpt": (161.31, 337.99)}
# Length profiles, not the datasets: random tokens with the datasets' mean lengths.
WORKLOAD_LABELS = {"alpaca": "Alpaca-like lengths", "sharegpt": "ShareGPT-like lengths"}
PAPER_RANGES = {"parallel": (6.1, 30.5), "beam": (37.6, 66.3)}  # % saved, §6.3

EPILOG = (
    "Default: SmolLM2, 4 prompts per workload, n and beam_width 2/4/6; several minutes on a CPU.\n"
    "  minivllm bench sharing --json sharing.json --plot sharing.png\n"
    "  minivllm bench sharing --workloads alpaca --widths 2 --num-prompts 2   # a quick look"
)
ENGINE_DEFAULTS = EngineArgs(num_gpu_blocks_override=4096)  # room for every beam: no preemption


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=4, help="prompts per workload")
    g.add_argument(
        "--workloads", default="alpaca,sharegpt", help=f"comma-separated, of {sorted(WORKLOADS)}"
    )
    g.add_argument(
        "--widths", default="2,4,6", help="comma-separated n (parallel) and beam_width values"
    )
    g.add_argument(
        "--max-len", type=int, default=512, help="cap on any drawn prompt or output length"
    )
    EngineArgs.add_cli_args(parser, defaults=ENGINE_DEFAULTS)
    add_run_arguments(parser)
    parser.add_argument(
        "--plot", type=Path, default=Path("sharing.png"), help="PNG like Fig. 15; '' for none"
    )
    parser.epilog = EPILOG  # shown by `minivllm bench NAME --help`


def synthetic_requests(
    workload: str, num: int, vocab_size: int, seed: int, max_len: int
) -> list[BenchRequest]:
    """Random token prompts whose lengths follow exponential distributions with the workload's
    mean prompt and output lengths (at least 1, at most max_len)."""
    mean_in, mean_out = WORKLOADS[workload]
    return draw_requests(
        random.Random(f"{workload}-{seed}"),
        num,
        Exponential(mean_in, max_len),
        Exponential(mean_out, max_len),
        token_pool(vocab_size, first_id=3),  # clear of <unk>, <s>, </s> at Llama's start
    )


@dataclass
class SharingResult:
    workload: str
    method: str  # "parallel" or "beam"
    width: int  # n or beam_width
    steps: int
    peak_blocks_shared: int
    peak_blocks_private: int
    mean_blocks_shared: float
    mean_blocks_private: float

    @property
    def saving(self) -> float:
        """Of the blocks every sequence would hold on its own, the share sharing saved (averaged
        over the run's steps, as blocks x steps)."""
        return 1 - self.mean_blocks_shared / self.mean_blocks_private

    @property
    def peak_saving(self) -> float:
        return 1 - self.peak_blocks_shared / self.peak_blocks_private

    def row(self) -> dict[str, Any]:
        return {**self.__dict__, "saving": self.saving, "peak_saving": self.peak_saving}


def measure(args: argparse.Namespace, workload: str, method: str, width: int) -> SharingResult:
    llm = build_llm(args, enable_prefix_caching=False)  # only the sharing inside a request
    vocab = llm.llm_engine.vocab_size
    requests = synthetic_requests(workload, args.num_prompts, vocab, args.seed, args.max_len)
    bm = llm.llm_engine.kv_cache_manager
    shared: list[int] = []
    private: list[int] = []

    def after_step() -> None:
        shared.append(bm.num_blocks - bm.num_free_blocks)
        private.append(bm.num_blocks_without_sharing())

    params: list[SamplingParams | BeamSearchParams] = [
        BeamSearchParams(width, max_tokens=r.output_len, ignore_eos=True)
        if method == "beam"
        else SamplingParams(
            n=width, temperature=1.0, seed=args.seed + i, max_tokens=r.output_len, ignore_eos=True
        )
        for i, r in enumerate(requests)
    ]
    drive_engine(llm, requests, params, after_step=after_step, desc=f"{workload} {method} {width}")
    steps = [(s, p) for s, p in zip(shared, private) if p]
    return SharingResult(
        workload=workload,
        method=method,
        width=width,
        steps=len(steps),
        peak_blocks_shared=max(s for s, _ in steps),
        peak_blocks_private=max(p for _, p in steps),
        mean_blocks_shared=sum(s for s, _ in steps) / len(steps),
        mean_blocks_private=sum(p for _, p in steps) / len(steps),
    )


def plot(results: list[SharingResult], path: Path) -> None:
    """Fig. 15's shape: memory saving against n / beam width, one panel per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for ax, method, title in zip(axes, ("parallel", "beam"), ("Parallel sampling", "Beam search")):
        rows = [r for r in results if r.method == method]
        workloads = sorted({r.workload for r in rows})
        widths = sorted({r.width for r in rows})
        bar = 0.8 / max(1, len(workloads))
        for k, workload in enumerate(workloads):
            mine = {r.width: r.saving * 100 for r in rows if r.workload == workload}
            xs = [i + k * bar for i, w in enumerate(widths) if w in mine]
            ax.bar(
                xs,
                [mine[w] for w in widths if w in mine],
                bar,
                label=WORKLOAD_LABELS.get(workload, workload),
            )
        lo, hi = PAPER_RANGES[method]
        ax.axhspan(lo, hi, color="grey", alpha=0.15, label="paper's range")
        ax.set_xticks([i + bar * (len(workloads) - 1) / 2 for i in range(len(widths))])
        ax.set_xticklabels([str(w) for w in widths])
        ax.set_xlabel("n" if method == "parallel" else "beam width")
        ax.set_title(title)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("KV memory saved by sharing (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")


def main(args: argparse.Namespace) -> int:
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"--workloads: unknown {unknown}; choose from {sorted(WORKLOADS)}")
    widths = [int(w) for w in args.widths.split(",")]
    if not workloads or not widths or min(widths) < 1:
        raise SystemExit("--workloads and --widths need at least one entry; widths are >= 1")
    results: list[SharingResult] = []
    configs = [(w, m, k) for w in workloads for m in ("parallel", "beam") for k in widths]
    for workload, method, width in tqdm(configs, desc="bench sharing", unit="run"):
        results.append(measure(args, workload, method, width))
    print_table(SHARING_HEADERS, [sharing_row(r.row(), PAPER_RANGES) for r in results])
    write_json(
        args.json,
        {
            "benchmark": "sharing",
            "machine": machine_load(),
            "args": {k: v for k, v in vars(args).items() if k not in ("func", "json", "plot")},
            "paper_ranges": PAPER_RANGES,
            "results": [r.row() for r in results],
        },
    )
    if args.plot and str(args.plot):
        plot(results, args.plot)
    return 0
