"""`minivllm bench throughput`: offline output tokens/s of minivllm on a random workload.

The paper's §6 measure on one machine: vLLM's `random` dataset (random-token prompts, every
request run to its exact output length) through `LLM.generate`, continuous batching over a paged
KV cache (paper §4.5), in a fresh process of its own (its peak resident set is its own), and the
distance to the physical limit: on a few CPU cores the work is compute-bound, so minivllm's useful
model FLOP/s (2 x parameters per computed token) is set against the best dense matmul FLOP/s the
machine reaches in the model's dtype.

With `--llama-server PATH`, llama.cpp's server runs the same workload on the same GGUF file after
minivllm's run (llama_cpp.py), with `-np` slots for minivllm's `--max-num-seqs` (1: the single
stream), and the table shows both speeds and their ratio. The comparison with the other peers
(transformers' static and continuous batching, vLLM's CPU build), the matmul floor, the decode
roofline and the op profile are investigations, not a user's command: `python -m
benchmarks.throughput_vs_peers` in a checkout (benchmarks/README.md), which builds on the
functions here.

With `--enable-lora --lora-path PATH --max-loras N` every request runs under one of N adapters
drawn at random, as vLLM's throughput bench does (lora_workload.py; `--lora-path random:R` for a
random rank-R adapter of every linear). The useful FLOPs stay the base model's: the adapters'
shrink and expand are the cost being measured.

It imports the offline API and the engine's arguments.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from minivllm.benchmarks import llama_cpp
from minivllm.benchmarks.engine_under_test import (
    GPU_EPILOG,
    ModelCost,
    add_run_arguments,
    build_llm,
    prompts_of,
    rank_reports,
    tensor_parallel_rows,
    warm_up,
    workload_for,
)
from minivllm.benchmarks.isolated import current_rss_bytes, peak_rss_bytes, run_isolated
from minivllm.benchmarks.lora_workload import (
    adapter_path,
    add_lora_arguments,
    check_lora_arguments,
    random_lora_requests,
)
from minivllm.benchmarks.machine import measure_matmul_flops, timed
from minivllm.benchmarks.report import (
    SYSTEM_HEADERS,
    machine_load,
    print_rank_rows,
    print_table,
    system_row,
    write_json,
)
from minivllm.benchmarks.workload import BenchRequest, add_workload_arguments, fixed_params
from minivllm.engine.arg_utils import EngineArgs
from minivllm.llm import LLM
from minivllm.lora.request import LoRARequest

EPILOG = (
    "The workload of the Performance page (64 prompts, input and output 16-256):\n"
    "  minivllm bench throughput --json throughput.json\n"
    "A quick look (16 prompts, 16-128 tokens):\n"
    "  minivllm bench throughput --quick\n"
    "Against llama.cpp's llama-server on the same GGUF file: one stream, then 32 at once:\n"
    "  minivllm bench throughput --num-prompts 4 --input-len 128 --output-len 128 \\\n"
    "      --max-num-seqs 1 --llama-server PATH\n"
    "  minivllm bench throughput --num-prompts 32 --llama-server PATH\n"
    "Four rank-16 adapters of every linear, one drawn per request (vLLM's --lora-path):\n"
    "  minivllm bench throughput --quick --enable-lora --max-loras 4 --max-lora-rank 16 \\\n"
    "      --lora-path random:16\n"
    "Against transformers and vLLM's CPU build, in the same run (from a checkout):\n"
    "  python -m benchmarks.throughput_vs_peers --help\n\n"
    + GPU_EPILOG.format(name="throughput", extra=" \\\n      --num-prompts 1000")
)

# What a measuring hook adds to minivllm's process: called after the timed run, on the same
# engine, before it shuts down (benchmarks/throughput_vs_peers.py's floor, roofline, profile).
Measure = Callable[[LLM, Sequence[BenchRequest], argparse.Namespace], dict[str, Any]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser, num_prompts=64, input_len="16-256", output_len="16-256")
    EngineArgs.add_cli_args(parser)
    add_run_arguments(parser)
    add_lora_arguments(parser)
    g = parser.add_argument_group("limits")
    g.add_argument("--quick", action="store_true", help="16 prompts, input and output 16-128")
    g.add_argument(
        "--matmul-size", type=int, default=2048, help="square matmul size for the FLOP/s peak"
    )
    llama_cpp.add_peer_arguments(parser)
    parser.epilog = EPILOG  # shown by `minivllm bench NAME --help`


# ---------------------------------------------------------------------------------- minivllm
def run_minivllm(
    llm: LLM, requests: Sequence[BenchRequest], loras: Sequence[LoRARequest] | None = None
) -> dict[str, Any]:
    params = [fixed_params(r.output_len) for r in requests]
    before = llm.get_stats()
    t: dict[str, float] = {}
    with timed(llm.llm_engine.device, t):
        outputs = llm.generate(prompts_of(requests), params, lora_request=loras)
    after = llm.get_stats()
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = sum(r.output_len for r in requests)
    if tokens != expected:
        raise RuntimeError(f"minivllm generated {tokens} tokens, the workload asks for {expected}")
    return {
        "system": "minivllm",
        "seconds": t["seconds"],
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / t["seconds"],
        "steps": after.num_steps - before.num_steps,
        "preemptions": after.num_preemptions - before.num_preemptions,
        "peak_kv_blocks_used": after.peak_kv_blocks_used,
        "token_ids": token_ids,  # compared with a peer's greedy tokens, then dropped
    }


def minivllm_process(args: argparse.Namespace, measure: Measure | None = None) -> dict[str, Any]:
    """minivllm's side, in a fresh process: the workload (drawn with the engine's tokenizer, for
    any peer too), the timed run and its peak RSS, then the matmul peak and `measure`'s extras
    (after the RSS is read: they are not minivllm's memory)."""
    start_rss = current_rss_bytes()
    llm = build_llm(args)
    engine = llm.llm_engine
    device, dtype = engine.device, engine.dtype
    requests = workload_for(llm, args)
    cost = ModelCost.of(llm)
    config = engine.model.config
    kv_dtype = str(engine.kv_cache_dtype).removeprefix("torch.")
    header = (
        f"model {engine.source.name}, {str(dtype).removeprefix('torch.')}, {device}, "
        f"{engine.attention_backend} attention, {kv_dtype} KV cache of "
        f"{engine.executor.num_blocks} blocks"
    )
    warm_up(llm)
    before = rank_reports(llm)
    with contextlib.ExitStack() as stack:
        loras = None
        if args.lora_path is not None:
            path = stack.enter_context(adapter_path(llm, args.lora_path, args.seed))
            loras = random_lora_requests(path, args.max_loras, len(requests), args.seed)
            header += (
                f", LoRA {args.lora_path} as {len({r.lora_int_id for r in loras})} of "
                f"max_loras={args.max_loras} adapters"
            )
        row = run_minivllm(llm, requests, loras)
    row.update(peak_rss_bytes=peak_rss_bytes(), start_rss_bytes=start_rss)
    ranks = tensor_parallel_rows(before, rank_reports(llm), requests)
    peak_flops = measure_matmul_flops(dtype, device, size=args.matmul_size)
    extra = measure(llm, requests, args) if measure is not None else {}
    llm.shutdown()  # tensor parallelism: the workers end with this process
    return {
        "requests": requests,
        "header": header,
        "dtype": dtype,
        "device": device,
        "row": row,
        "peak_flops": peak_flops,
        "useful_flops": cost.useful_flops(requests),
        "cost": cost,
        "ranks": ranks,
        "layers_hidden": (config.num_hidden_layers, config.hidden_size),
        "extra": extra,
    }


# ---------------------------------------------------------------------------------- report
def apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.num_prompts, args.input_len, args.output_len = 16, (16, 128), (16, 128)


def print_workload(args: argparse.Namespace, mini: dict[str, Any]) -> dict[str, int]:
    requests: list[BenchRequest] = mini["requests"]
    num_in = sum(len(r.prompt_token_ids) for r in requests)
    num_out = sum(r.output_len for r in requests)
    print(
        f"workload: {len(requests)} prompts, {num_in:,} prompt + {num_out:,} output tokens "
        f"(input {args.input_len[0]}-{args.input_len[1]}, output {args.output_len[0]}-"
        f"{args.output_len[1]}, seed {args.seed}); {mini['header']}; {machine_load()}"
    )
    return {"num_prompts": len(requests), "prompt_tokens": num_in, "output_tokens": num_out}


def print_systems(rows: list[dict[str, Any]]) -> None:
    print()
    print_table(SYSTEM_HEADERS, [system_row(r) for r in rows])
    print(
        "(each system in a fresh process of its own, one after the other; peak RSS includes "
        f"python and torch, {rows[0]['start_rss_bytes'] / 2**20:,.0f} MiB before the model loads)"
    )


def flops_report(mini: dict[str, Any], seconds: float, num_out: int) -> dict[str, float]:
    """minivllm's useful FLOP/s against the machine's measured matmul peak, printed and returned."""
    dtype, cost = mini["dtype"], mini["cost"]
    useful = mini["useful_flops"]
    peak_flops = mini["peak_flops"]
    achieved = useful / seconds
    roofline_tps = num_out / (useful / peak_flops)
    flops = {
        "useful_model_flops": useful,
        "minivllm_flops_per_s": achieved,
        "matmul_peak_flops_per_s": peak_flops,
        "fraction_of_matmul_peak": achieved / peak_flops,
        "roofline_output_tokens_per_s": roofline_tps,
    }
    print(
        f"\nuseful work {useful / 1e12:.2f} TFLOP (2 x {cost.body_params / 1e6:.1f}M body params per "
        f"computed token + 2 x {cost.lm_head_params / 1e6:.1f}M LM head per sampled token)\n"
        f"minivllm {achieved / 1e9:.1f} GFLOP/s = {achieved / peak_flops:.1%} of the measured "
        f"{str(dtype).removeprefix('torch.')} matmul peak {peak_flops / 1e9:.1f} GFLOP/s "
        f"(roofline {roofline_tps:.0f} output tok/s)"
    )
    return flops


def print_ranks(mini: dict[str, Any]) -> None:
    dtype = mini["dtype"]
    ranks = mini["ranks"]
    tp = len(ranks)
    elem = torch.empty((), dtype=dtype).element_size()
    cfg_layers, cfg_hidden = mini["layers_hidden"]
    print(
        f"\ntensor_parallel_size {tp}: each rank's share of the model and of the KV cache, and the "
        f"payload it put into collectives (an all-reduce of [tokens, hidden] in the embedding and "
        f"twice per layer: (2 x {cfg_layers} + 1) x {cfg_hidden} x {elem} B = "
        f"{(2 * cfg_layers + 1) * cfg_hidden * elem:,} B per token; a ring all-reduce moves "
        f"2(N-1)/N of it per rank)"
    )
    print_rank_rows(ranks)


def llama_cpp_rows(
    setup: llama_cpp.LlamaCppSetup | None, args: argparse.Namespace, mini: dict[str, Any]
) -> list[dict[str, Any]]:
    """llama.cpp's row (none without `--llama-server`), run after minivllm's process has ended,
    with as many slots as minivllm runs sequences at once; minivllm's tokens leave its row here."""
    mini_tokens = mini["row"].pop("token_ids")
    if setup is None:
        return []
    requests = mini["requests"]
    parallel = min(len(requests), args.max_num_seqs)
    return [llama_cpp.peer_row(setup, requests, parallel, mini_tokens)]


def print_ratios(rows: list[dict[str, Any]]) -> None:
    """minivllm's output tok/s against each peer's, in words (the table's "x faster" column)."""
    mine = rows[0]["output_tokens_per_s"]
    for row in rows[1:]:
        line = (
            f"minivllm / {row['system']}: {row['minivllm_speedup']:.2f}x the output tok/s "
            f"({mine:.1f} / {row['output_tokens_per_s']:.1f})"
        )
        if "decode_ms_per_token" in row:
            line += f"; by llama-server's own clock {row['decode_ms_per_token']:.2f} ms per token"
        print(line)


def main(args: argparse.Namespace) -> int:
    apply_quick(args)
    check_lora_arguments(args)
    if args.lora_path is not None and args.llama_server is not None:
        raise ValueError("--lora-path is not supported with --llama-server (minivllm only)")
    llama = llama_cpp.setup_from_flags(args.llama_server, args.model, args.llama_cpp_threads)
    if args.threads:
        torch.set_num_threads(args.threads)  # as the bench's process does: machine_load says so
    mini = run_isolated(minivllm_process, args)
    workload = print_workload(args, mini)
    row = mini["row"]
    rows = [row, *llama_cpp_rows(llama, args, mini)]
    for r in rows:
        r["minivllm_speedup"] = row["output_tokens_per_s"] / r["output_tokens_per_s"]
    print_systems(rows)
    print_ratios(rows)
    flops = flops_report(mini, row["seconds"], workload["output_tokens"])
    print_ranks(mini)
    print(f"({machine_load()})")
    write_json(
        args.json,
        {
            "benchmark": "throughput",
            "args": vars(args),
            "machine": machine_load(),
            "workload": workload,
            "systems": rows,
            "flops": flops,
            "ranks": mini["ranks"],
        },
    )
    return 0
