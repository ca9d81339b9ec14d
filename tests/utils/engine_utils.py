"""Helpers for engine tests: building LLMs that are checked for leaked KV blocks, and HF greedy."""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from minivllm.llm import LLM


def assert_no_blocks_held(llm: LLM) -> None:
    """Every block is free again (evictable prefix-cache blocks count as free)."""
    stats = llm.get_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0, stats
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, stats
    assert not llm.llm_engine.requests


@contextmanager
def checked_llm(**kwargs: Any) -> Iterator[LLM]:
    llm = LLM(**kwargs)
    yield llm
    assert_no_blocks_held(llm)


def hf_greedy(
    model: Any, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None
) -> list[int]:
    """transformers' greedy `generate` for one unpadded prompt: the oracle. With
    `eos_token_id=None` it never stops early (the engine's `ignore_eos`)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            min_new_tokens=max_new_tokens if eos_token_id is None else 0,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id if eos_token_id is not None else 0,
        )
    return out[0, len(prompt_ids) :].tolist()


def hf_greedy_batch(
    model: Any, prompts: list[list[int]], max_new_tokens: list[int], eos_token_id: int | None
) -> list[list[int]]:
    """transformers' greedy `generate` for many prompts in one call: left-padded to one length,
    the padding masked out (transformers derives each row's positions from the mask), each row
    cut at its own max_new_tokens and after its first EOS (with `eos_token_id=None`, none: the
    engine's `ignore_eos`, as in `hf_greedy`). A decode step then reads the weights
    once for the whole batch instead of once per prompt. A batched step sums in other orders
    than a one-row one (other GEMM shapes), so a row could differ from `hf_greedy`'s at a
    near-tie: a caller checks its workload equal to `hf_greedy`'s once, when it starts to use
    this."""
    length, longest = max(len(p) for p in prompts), max(max_new_tokens)
    pad = eos_token_id if eos_token_id is not None else 0
    ids = torch.tensor([[pad] * (length - len(p)) + p for p in prompts])  # (B, length)
    mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts])  # (B, length)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=longest,
            do_sample=False,
            min_new_tokens=longest if eos_token_id is None else 0,
            eos_token_id=eos_token_id,
            pad_token_id=pad,
        )
    rows = []
    for row, n in zip(out[:, length:].tolist(), max_new_tokens):
        row = row[:n]
        if eos_token_id in row:
            row = row[: row.index(eos_token_id) + 1]
        rows.append(row)
    return rows


def save_tiny_llama(out: Path, seed: int = 0, **overrides: Any) -> Path:
    """A random 2-layer Llama with SmolLM2's tokenizer, saved with `save_pretrained`: it loads in
    well under a second. Its weights are drawn wider than transformers' default so that its
    next-token distributions are peaked, like a trained model's: greedy comparisons between two
    runs whose batches differ then do not hinge on near-ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from minivllm.model.resolver import resolve_model

    config = LlamaConfig(
        **{
            "vocab_size": 49152,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 1024,
            "tie_word_embeddings": True,
            "initializer_range": 0.2,
            **overrides,
        }
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out)
    bundled = resolve_model(None).path
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(bundled / name, out)
    return out


def parse_bench_args(module: object, argv: list[str]) -> argparse.Namespace:
    """`argv` parsed by a bench module's own parser (its `add_arguments`), as its command does."""
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)  # type: ignore[attr-defined]
    return parser.parse_args(argv)


def import_benchmark(name: str) -> ModuleType:
    """A script of the top-level benchmarks/ folder, which is not installed: loaded from its file."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmarks.{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module
