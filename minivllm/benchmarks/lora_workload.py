"""LoRA in the offline benches: vLLM's `--lora-path`, one adapter of `--max-loras` per request.

vLLM's throughput bench (vllm/benchmarks/throughput.py with `--enable-lora --lora-path PATH
--max-loras N`) gives each request `LoRARequest(str(i), i, PATH)` with `i` drawn uniformly from
1..N (its datasets' `get_random_lora_request`): N adapters with the same weights, so the run pays
for N distinct adapters in a batch (N slots' shrink and expand, and the scheduler's slot limit)
without N files. The same here, from the bench's `--seed`.

`--lora-path random:R` measures that cost with no adapter at hand: a rank-R adapter of every
linear the engine can adapt (its LoRA manager's targets: q/k/v/o and gate/up/down of each
decoder layer, whatever the base: a folder, a hub id or the bundled SmolLM2 GGUF), with random
A and B, written as a PEFT folder into a temporary directory that lives as long as the run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from minivllm.llm import LLM
from minivllm.lora.request import LoRARequest

RANDOM_PREFIX = "random:"


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """`--lora-path` (the engine's `--enable-lora`, `--max-loras`, `--max-lora-rank` are its own)."""
    g = parser.add_argument_group("LoRA (with --enable-lora)")
    g.add_argument(
        "--lora-path",
        default=None,
        help="the adapter every request runs under, as one of --max-loras ids drawn at random per "
        "request (vLLM's): a PEFT folder, a llama.cpp GGUF adapter (GGUF base), or random:R for "
        "a random rank-R adapter of every linear of the model",
    )


def check_lora_arguments(args: argparse.Namespace) -> None:
    """`--lora-path` and `--enable-lora` go together (vLLM asserts the same)."""
    path = getattr(args, "lora_path", None)
    if path is not None and not args.enable_lora:
        raise ValueError("--lora-path needs --enable-lora")
    if args.enable_lora and path is None:
        raise ValueError("--enable-lora needs --lora-path (an adapter, or random:R)")
    if path is not None and path.startswith(RANDOM_PREFIX):
        random_rank(path)  # refuses a bad R before the model loads


def random_rank(path: str) -> int:
    text = path.removeprefix(RANDOM_PREFIX)
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--lora-path {path}: R in random:R must be a positive integer")
    return int(text)


def write_random_adapter(
    targets: Mapping[str, tuple[int, int]],  # transformers module name -> (in, out)
    rank: int,
    folder: Path,
    seed: int = 0,
    lora_alpha: float | None = None,
) -> Path:
    """A PEFT folder of a rank-`rank` adapter of every module of `targets`: A ~ N(0, 1/in) and B ~
    N(0, 1/r) scaled by 1/16, so the delta is small next to the base weight at the default
    `lora_alpha = r` (scale 1); a larger alpha makes it larger."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for module, (size_in, size_out) in sorted(targets.items()):
        a = torch.randn(rank, size_in, generator=gen) / size_in**0.5  # [r, in]
        b = torch.randn(size_out, rank, generator=gen) / (16 * rank**0.5)  # [out, r]
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": rank if lora_alpha is None else lora_alpha,
        "target_modules": sorted({m.rpartition(".")[2] for m in targets}),
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder


@contextlib.contextmanager
def adapter_path(llm: LLM, path: str, seed: int) -> Iterator[str]:
    """`path` as given, or (random:R) a random adapter of `llm`'s model, for the run's length."""
    if not path.startswith(RANDOM_PREFIX):
        yield path
        return
    manager = llm.llm_engine.runner.lora_manager
    if manager is None:
        raise ValueError("--lora-path random:R needs --enable-lora")
    with tempfile.TemporaryDirectory(prefix="minivllm-lora-") as tmp:
        yield str(write_random_adapter(manager.targets, random_rank(path), Path(tmp), seed))


def random_lora_requests(path: str, max_loras: int, num: int, seed: int) -> list[LoRARequest]:
    """One request's adapter each: id i drawn from 1..max_loras, all of the same weights."""
    rng = random.Random(seed)
    ids = [rng.randint(1, max_loras) for _ in range(num)]
    return [LoRARequest(str(i), i, path) for i in ids]
