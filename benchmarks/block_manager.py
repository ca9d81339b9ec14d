"""Micro-benchmark of the KV cache manager's bookkeeping (minivllm/core/): microseconds per operation.

    python benchmarks/block_manager.py [--num-blocks 100000] [--block-size 16]

Every operation should cost O(blocks it touches), not O(pool): the numbers below are taken on a
large pool that is already full of evictable prefix-cache blocks, the steady state of a busy server,
so allocation also evicts. Run with prefix caching on (hashing included) and off. Not a test: timing
on shared CPUs is noisy; read the numbers, don't assert them.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Hashable
from typing import NamedTuple

from minivllm.benchmarks.report import print_table
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.entrypoints.cli import HelpFormatter


class _Seq(NamedTuple):  # what the manager reads of a sequence it admits
    seq_id: Hashable
    token_ids: list[int]


def _admit(bm: KVCacheManager, seq_id: Hashable, tokens: list[int], num_new: int) -> int:
    """One admission as the scheduler makes it: one prefix lookup, then allocation with its hit."""
    return bm.allocate_slots(_Seq(seq_id, tokens), num_new, bm.get_computed_blocks(tokens))


def _per_call_us(calls: list[Callable[[], object]]) -> float:
    start = time.perf_counter()
    for call in calls:
        call()
    return (time.perf_counter() - start) / len(calls) * 1e6


def bench(num_blocks: int, block_size: int, prompt_len: int, caching: bool) -> dict[str, float]:
    bm = KVCacheManager(num_blocks, block_size=block_size, enable_prefix_caching=caching)
    blocks_per_seq = -(-prompt_len // block_size) + 1
    num_seqs = max(1, num_blocks // (4 * blocks_per_seq))  # leave room for forks and decodes
    prompts = [list(range(i * prompt_len, (i + 1) * prompt_len)) for i in range(2 * num_seqs)]

    # Warm up: fill the whole pool with cached blocks, then free them all (evictable, LRU order).
    warm = [[-1 - i] * block_size * 8 for i in range(num_blocks // 8)]
    for i, warm_tokens in enumerate(warm):
        _admit(bm, ("warm", i), warm_tokens, len(warm_tokens))
    for i in range(len(warm)):
        bm.free(("warm", i))

    ids = list(range(num_seqs))
    results = {
        "allocate": _per_call_us(
            [lambda i=i: _admit(bm, i, prompts[i], prompt_len) for i in ids]  # type: ignore[misc]
        )
    }
    tokens = {i: list(prompts[i]) for i in ids}
    decode: list[Callable[[], object]] = []
    for _ in range(block_size):  # one block's worth of decode steps: crosses one boundary each
        for i in ids:

            def step(i: int = i) -> None:
                tokens[i].append(7)
                bm.append_slots(i, tokens[i], 1)

            decode.append(step)
    results["append (decode)"] = _per_call_us(decode)
    results["fork"] = _per_call_us([lambda i=i: bm.fork(i, ("child", i)) for i in ids])  # type: ignore[misc]
    results["free"] = _per_call_us(
        [lambda s=s: bm.free(s) for i in ids for s in (("child", i), i)]  # type: ignore[misc]
    )
    if (
        caching
    ):  # every prompt now fully cached: admission is all hits (+ the recomputed last block)
        results["allocate (prefix hit)"] = _per_call_us(
            [lambda i=i: _admit(bm, i, prompts[i], block_size) for i in ids]  # type: ignore[misc]
        )
    results["blocks touched per allocate"] = blocks_per_seq - 1
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None, formatter_class=HelpFormatter
    )
    parser.add_argument("--num-blocks", type=int, default=100_000, help="blocks in the pool")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--prompt-len", type=int, default=512, help="tokens per allocated prompt")
    args = parser.parse_args()
    print(
        f"block manager, {args.num_blocks:,} blocks of {args.block_size}, "
        f"{args.prompt_len}-token prompts (µs per call)"
    )
    rows = {
        caching: bench(args.num_blocks, args.block_size, args.prompt_len, caching)
        for caching in (True, False)
    }

    def cell(name: str, v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}" if name.startswith("blocks") else f"{v:.2f}"

    print_table(
        ["operation", "caching on", "caching off"],
        [[name, cell(name, rows[True].get(name)), cell(name, rows[False].get(name))]
         for name in rows[True]],
    )  # fmt: skip


if __name__ == "__main__":
    main()
