"""The one workload generator of the `minivllm bench` commands: random-token prompts with lengths
drawn from a length profile, and Poisson arrival times.

The workload is vLLM's `random` dataset (vllm/benchmarks/datasets.py, `RandomDataset`): prompts of
random token ids, each run to exactly its drawn output length (`ignore_eos=True`), so that every
system computes the same tokens and no stray EOS ends a request early. What varies between the
benches is only the length profile:

  Fixed(n)                 every request n tokens (prefix's shared system prompt, serve)
  Uniform(lo, hi)          drawn uniformly, inclusive (vLLM's random dataset; throughput, memory)
  Exponential(mean, cap)   exponential around a dataset's mean length, in [1, cap] (sharing's
                           stand-ins for Alpaca and ShareGPT, the paper's Fig. 11)

Everything is drawn from one `random.Random`, so a seed gives the same workload on every run and
machine. Token ids come from a `token_pool`: the vocabulary without the special tokens (or without
its lowest ids, where special tokens live in most vocabularies, when no tokenizer is at hand).
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from minivllm.sampling_params import SamplingParams


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]  # (input_len,)
    output_len: int  # exact number of tokens to generate (EOS is ignored)


# ---------------------------------------------------------------------------------- length profiles
@dataclass(frozen=True)
class Fixed:
    """Always `n` tokens; draws nothing from the generator."""

    n: int

    def draw(self, rng: random.Random) -> int:
        return self.n


@dataclass(frozen=True)
class Uniform:
    """Uniform in [lo, hi], inclusive (one draw even when lo == hi, like vLLM's random dataset)."""

    lo: int
    hi: int

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)


@dataclass(frozen=True)
class Exponential:
    """Exponential with the given mean, rounded and clipped to [1, cap]."""

    mean: float
    cap: int

    def draw(self, rng: random.Random) -> int:
        return max(1, min(self.cap, round(rng.expovariate(1 / self.mean))))


LengthProfile = Fixed | Uniform | Exponential


def length_range(text: str) -> tuple[int, int]:
    """argparse type: "128" (fixed) or "16-256" / "16:256" (uniform, inclusive)."""
    parts = text.replace(":", "-").split("-")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(
            f"expected N or MIN-MAX with 1 <= MIN <= MAX, got {text!r}"
        )
    return lo, hi


# ---------------------------------------------------------------------------------- prompts
def token_pool(vocab_size: int, special_ids: Sequence[int] = (), first_id: int = 0) -> list[int]:
    """The token ids prompts are drawn from: [first_id, vocab_size) without `special_ids`, so that
    no prompt carries a stray BOS/EOS."""
    special = set(special_ids)
    return [t for t in range(first_id, vocab_size) if t not in special]


def random_token_ids(rng: random.Random, n: int, pool: Sequence[int]) -> list[int]:
    """`n` ids drawn uniformly from the pool (one `rng.choice` each)."""
    return [rng.choice(pool) for _ in range(n)]


def draw_requests(
    rng: random.Random,
    num: int,
    input_len: LengthProfile,
    output_len: LengthProfile,
    pool: Sequence[int],
    prefix: Sequence[int] = (),
) -> list[BenchRequest]:
    """`num` requests: `prefix` (shared by all, e.g. a system prompt) + an own random part of
    `input_len` tokens, each run to `output_len` tokens. Per request the draws are: the own part's
    length, its tokens, the output length."""
    requests = []
    for _ in range(num):
        own = random_token_ids(rng, input_len.draw(rng), pool)
        requests.append(BenchRequest([*prefix, *own], output_len.draw(rng)))
    return requests


def random_requests(
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int,
    special_ids: Sequence[int] = (),
) -> list[BenchRequest]:
    """vLLM's random dataset: uniform lengths in the given (min, max) ranges, uniform token ids."""
    pool = token_pool(vocab_size, special_ids)
    return draw_requests(
        random.Random(seed), num_prompts, Uniform(*input_len), Uniform(*output_len), pool
    )


def fixed_params(output_len: int, **kwargs: Any) -> SamplingParams:
    """Exactly `output_len` tokens, greedy unless told otherwise."""
    kwargs.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=output_len, ignore_eos=True, **kwargs)


# ---------------------------------------------------------------------------------- arrivals
def poisson_arrivals(num: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait after sending each of `num` requests: a Poisson process of `rate` requests
    per second has exponential gaps (vLLM's benchmark_serving); `inf` sends them all at once."""
    if rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(num)]


# ---------------------------------------------------------------------------------- CLI
def add_workload_arguments(
    parser: argparse.ArgumentParser, num_prompts: int, input_len: str, output_len: str
) -> None:
    """`--num-prompts`, `--input-len`, `--output-len` of vLLM's random dataset (uniform ranges)."""
    g = parser.add_argument_group(
        "workload (vLLM's random dataset)", "drawn with the engine's --seed"
    )
    g.add_argument("--num-prompts", type=int, default=num_prompts, help="requests in the workload")
    g.add_argument(
        "--input-len",
        type=length_range,
        default=input_len,  # argparse passes a string default through `type`
        help="prompt tokens: N, or MIN-MAX drawn uniformly",
    )
    g.add_argument(
        "--output-len",
        type=length_range,
        default=output_len,
        help="output tokens, each request run to exactly its own: N, or MIN-MAX",
    )
