"""`minivllm bench memory`: where the KV memory goes, minivllm against a naive allocator (paper Fig. 2).

The paper's Fig. 2 splits the KV memory of a serving system into

  token states         slots holding the K/V of tokens computed so far
  reserved             slots set aside for tokens the request will generate but has not yet
  fragmented           slots that will never hold a token: for a system that reserves
                       `max_model_len` per request, the over-reservation beyond the request's final
                       length; for PagedAttention, the unfilled tail of each request's last block

Both systems run the same workload under the same KV budget (`--num-gpu-blocks-override` x
`--block-size` slots). minivllm runs for real, driven one `step()` at a time so that the block manager can be
read after every step. The naive allocator is simulated on the same requests with the same
scheduling rules (FCFS admission, the same token budget and `max_num_seqs`, decodes first, chunked
prompts), except that admitting a request reserves `max_model_len` contiguous slots up front, as
the systems before vLLM did (Orca (Max) in the paper). A PNG shows both runs step by step.
"""

from __future__ import annotations

import argparse
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from minivllm.benchmarks.engine_under_test import (
    GPU_EPILOG,
    add_run_arguments,
    build_llm,
    drive_engine,
    workload_for,
)
from minivllm.benchmarks.isolated import peak_rss_bytes
from minivllm.benchmarks.report import (
    MEMORY_HEADERS,
    machine_load,
    memory_rows,
    print_table,
    write_json,
)
from minivllm.benchmarks.workload import BenchRequest, add_workload_arguments, fixed_params
from minivllm.core.kv_cache_coordinator import HybridKVCacheCoordinator
from minivllm.engine.arg_utils import EngineArgs
from minivllm.llm import LLM
from minivllm.model.weights import weight_bytes

EPILOG = (
    "Default: the throughput workload (64 prompts, 16-256 in/out) under 1024 blocks of 16 slots,\n"
    "with the naive allocator reserving max_model_len=2048 slots per request; ~1-2 minutes on CPU.\n"
    "  minivllm bench memory --plot kv_memory.png --json memory.json\n\n"
    + GPU_EPILOG.format(
        name="memory", extra=" \\\n      --num-prompts 1000 --num-gpu-blocks-override 4096"
    )
)

# A fixed KV budget, and the context limit the naive allocator reserves for every request.
ENGINE_DEFAULTS = EngineArgs(num_gpu_blocks_override=1024, max_model_len=2048)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser, num_prompts=64, input_len="16-256", output_len="16-256")
    EngineArgs.add_cli_args(parser, defaults=ENGINE_DEFAULTS)
    add_run_arguments(parser)
    g = parser.add_argument_group("output")
    g.add_argument(
        "--plot",
        type=lambda text: Path(text) if text else None,  # Path("") would be ".": no file at all
        default=Path("kv_memory.png"),
        help="PNG of both runs; '' for none",
    )
    parser.epilog = EPILOG  # shown by `minivllm bench NAME --help`


# ---------------------------------------------------------------------------------- accounting
@dataclass
class StepUsage:
    """KV slots after one step; used = token_states + reserved + fragmented."""

    used: int  # slots held by running requests
    token_states: int  # slots holding computed K/V
    reserved: int  # slots held for tokens not yet generated
    fragmented: int  # slots that will never hold a token
    running: int  # requests holding memory


def shares(steps: Sequence[StepUsage]) -> dict[str, float]:
    """Shares of used slots, summed over the given steps (one step: that moment)."""
    used = sum(s.used for s in steps) or 1
    return {
        "token_states": sum(s.token_states for s in steps) / used,
        "reserved": sum(s.reserved for s in steps) / used,
        "fragmented": sum(s.fragmented for s in steps) / used,
    }


def peak_step(steps: Sequence[StepUsage]) -> StepUsage:
    """The step with the most used slots (ties: the one with the most token states)."""
    return max(steps, key=lambda s: (s.used, s.token_states))


def summarize(steps: Sequence[StepUsage]) -> dict[str, Any]:
    peak = peak_step(steps)
    return {
        "steps": len(steps),
        "peak_concurrent_requests": max(s.running for s in steps),
        "peak_used_slots": peak.used,
        "at_peak": shares([peak]),
        "over_run": shares(steps),
    }


# ---------------------------------------------------------------------------------- minivllm
def trace_minivllm(args: argparse.Namespace) -> tuple[list[StepUsage], dict[str, Any]]:
    # Fig. 2 is about one request's own memory, not sharing.
    llm = build_llm(args, enable_prefix_caching=False)
    requests = workload_for(llm, args)
    engine = llm.llm_engine
    bm = engine.kv_cache_manager
    steps: list[StepUsage] = []
    # A model whose layers keep their KV in groups (Gemma 2/3: core/kv_cache_coordinator.py):
    # the most blocks each group held at once, to show a windowed group's staying bounded.
    hybrid = bm if isinstance(bm, HybridKVCacheCoordinator) else None
    groups = hybrid.kv_cache_groups if hybrid is not None else ()
    group_peaks = [0] * len(groups)

    def after_step() -> None:
        for g, held in enumerate(hybrid.num_held_blocks() if hybrid is not None else ()):
            group_peaks[g] = max(group_peaks[g], held)
        st = bm.get_stats()
        # The block manager's split of the held slots (`--kv-allocation`): with paged blocks
        # nothing is held ahead of need and the only slack is each last block's unfilled end;
        # a reservation policy (orca-*) also holds slots for future tokens.
        steps.append(
            StepUsage(
                st.num_reserved_slots,
                st.num_filled_slots,
                getattr(st, "num_future_slots", 0),  # reservations only
                st.internal_fragmentation_slots,
                len(engine.scheduler.running),
            )
        )

    params = [fixed_params(r.output_len) for r in requests]
    drive_engine(llm, requests, params, after_step=after_step, desc="minivllm")
    stats = llm.get_stats()
    extra = {
        **process_memory(llm, stats.peak_kv_blocks_used),
        "preemptions": stats.num_preemptions,
        "engine_peak_kv_blocks_used": stats.peak_kv_blocks_used,
        "engine_peak_kv_slot_utilization": stats.peak_kv_slot_utilization,
        "requests": [(len(r.prompt_token_ids), r.output_len) for r in requests],
    }
    if groups:
        extra["kv_cache_groups"] = [
            {"sliding_window": g.sliding_window, "layers": len(g.layer_ids), "peak_blocks": peak}
            for g, peak in zip(groups, group_peaks)
        ]
    return steps, extra


def process_memory(llm: LLM, peak_blocks: int) -> dict[str, Any]:
    """What the process holds: the weights as stored, the KV cache allocated and the part of it
    the run touched (blocks used at the peak), and the peak RSS."""
    engine = llm.llm_engine
    kv = engine.runner.kv_cache  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    per_block = kv.element_size() * kv[:, :, 0].numel()
    return {
        "quantization": engine.config.resolved.quantization,
        "weight_bytes": weight_bytes(engine.model),
        "kv_cache_bytes": kv.numel() * kv.element_size(),
        "kv_bytes_touched": peak_blocks * per_block,
        "peak_rss_bytes": peak_rss_bytes(),
    }


# ---------------------------------------------------------------------------------- the naive twin
@dataclass
class _NaiveSeq:
    prompt_len: int
    final_len: int  # tokens whose K/V is ever computed: prompt + output - 1
    computed: int = 0


def simulate_naive(
    requests: Sequence[BenchRequest],
    num_slots: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> list[StepUsage]:
    """The scheduler's rules with up-front reservation of `max_model_len` slots per request."""
    if max_model_len > num_slots:
        raise ValueError(
            f"the KV budget ({num_slots} slots) cannot hold one max_model_len ({max_model_len}) reservation"
        )
    waiting = deque(
        _NaiveSeq(len(r.prompt_token_ids), len(r.prompt_token_ids) + r.output_len - 1)
        for r in requests
    )
    running: list[_NaiveSeq] = []
    steps: list[StepUsage] = []
    while waiting or running:
        budget = max_num_batched_tokens
        for seq in running:  # decodes and unfinished prompt chunks first, oldest first
            n = min(1 if seq.computed >= seq.prompt_len else seq.prompt_len - seq.computed, budget)
            seq.computed += n
            budget -= n
        while (
            waiting
            and budget > 0
            and len(running) < max_num_seqs
            and (len(running) + 1) * max_model_len <= num_slots
        ):
            seq = waiting.popleft()
            n = min(seq.prompt_len, budget)
            seq.computed += n
            budget -= n
            running.append(seq)
        # A request whose K/V is complete samples its last token this step and leaves.
        done = [s for s in running if s.computed >= s.final_len]
        steps.append(
            StepUsage(
                used=len(running) * max_model_len,
                token_states=sum(s.computed for s in running),
                reserved=sum(s.final_len - s.computed for s in running),
                fragmented=sum(max_model_len - s.final_len for s in running),
                running=len(running),
            )
        )
        running = [s for s in running if s not in done]
    return steps


# ---------------------------------------------------------------------------------- plot, main
def plot(path: Path, traces: dict[str, list[StepUsage]], budget_slots: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(traces), 1, figsize=(9, 3.2 * len(traces)), sharey=True)
    for ax, (name, steps) in zip(axes, traces.items()):
        x = range(1, len(steps) + 1)
        ax.fill_between(x, [s.used for s in steps], step="post", alpha=0.25, label="slots in use")
        ax.plot(
            x, [s.token_states for s in steps], drawstyle="steps-post", label="slots holding tokens"
        )
        ax.axhline(budget_slots, color="grey", linestyle="--", linewidth=1, label="KV budget")
        ax.set_title(
            f"{name}: {shares(steps)['token_states']:.1%} of used slots hold tokens (over the run)"
        )
        ax.set_xlabel("engine step")
        ax.set_ylabel("KV slots")
        ax.legend(loc="upper right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")


def main(args: argparse.Namespace) -> int:
    budget_slots = args.num_gpu_blocks_override * args.block_size
    if args.max_model_len > budget_slots:
        raise SystemExit(
            f"--max-model-len ({args.max_model_len}) must fit in the KV budget "
            f"({args.num_gpu_blocks_override} x {args.block_size} = {budget_slots} slots)"
        )
    mini_steps, extra = trace_minivllm(args)
    requests = [BenchRequest([0] * p, o) for p, o in extra.pop("requests")]
    naive_steps = simulate_naive(
        requests, budget_slots, args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens
    )
    results = {"minivllm": summarize(mini_steps), "naive": summarize(naive_steps)}
    results["minivllm"].update(extra)

    print(
        f"\nKV budget {args.num_gpu_blocks_override} blocks x {args.block_size} = {budget_slots:,} slots; "
        f"{len(requests)} requests; naive reserves {args.max_model_len} slots per request"
    )
    print_table(MEMORY_HEADERS, memory_rows(results))
    mib = {
        k: results["minivllm"][k] / 2**20
        for k in ("weight_bytes", "kv_cache_bytes", "kv_bytes_touched", "peak_rss_bytes")
    }
    print(
        f"minivllm memory: weights {mib['weight_bytes']:.0f} MiB as stored "
        f"(quantization {results['minivllm']['quantization']}), KV cache {mib['kv_cache_bytes']:.0f} MiB "
        f"allocated / {mib['kv_bytes_touched']:.0f} MiB touched at the peak, peak RSS {mib['peak_rss_bytes']:.0f} MiB"
    )
    print(
        f"minivllm engine stats: peak {results['minivllm']['engine_peak_kv_blocks_used']} blocks, "
        f"slot utilization at peak {results['minivllm']['engine_peak_kv_slot_utilization']:.1%}, "
        f"{results['minivllm']['preemptions']} preemptions ({machine_load()})"
    )
    for g, group in enumerate(results["minivllm"].get("kv_cache_groups", [])):
        window = group["sliding_window"]
        kind = "global" if window is None else f"window {window}"
        print(
            f"  KV cache group {g} ({kind}, layers a block: {group['layers']}): "
            f"peak {group['peak_blocks']} blocks held"
        )
    if args.plot is not None:
        plot(
            args.plot,
            {
                f"minivllm ({args.kv_allocation})": mini_steps,
                f"naive (reserve {args.max_model_len})": naive_steps,
            },
            budget_slots,
            f"KV memory over the run, {len(requests)} requests, budget {budget_slots:,} slots",
        )
    write_json(
        args.json,
        {
            "benchmark": "memory",
            "args": vars(args),
            "machine": machine_load(),
            "budget_slots": budget_slots,
            "results": results,
            "per_step": {
                "minivllm": [asdict(s) for s in mini_steps],
                "naive": [asdict(s) for s in naive_steps],
            },
        },
    )
    return 0
